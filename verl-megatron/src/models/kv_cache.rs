//! Key/value caches for generation.
//!
//! - [`KvCache`]: one growing cache for a batch that decodes in lock step (simple, used by
//!   [`super::CausalLm::forward_cached`]).
//! - [`SlotKvCache`]: a preallocated cache of `slots × capacity` positions per layer, where every
//!   slot holds one sequence starting at position 0 and advancing at its own pace. This is what
//!   continuous batching needs: a finished sequence's slot is refilled by the next request
//!   without touching the others, and the memory is fixed up front.

use burn::prelude::*;
use burn::tensor::{DType, FloatDType, IndexingUpdateOp, Int, TensorData};

use crate::ops::FusedOps;

/// One layer's cached keys and values `[batch, kv_heads, cached_len, head_dim]` (after RoPE).
pub type LayerKv<B> = Option<(Tensor<B, 4>, Tensor<B, 4>)>;

/// Cached keys and values of every layer, and how many positions they hold.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    pub layers: Vec<LayerKv<B>>,
    pub len: usize,
}

impl<B: Backend> Default for KvCache<B> {
    fn default() -> Self {
        Self {
            layers: Vec::new(),
            len: 0,
        }
    }
}

impl<B: Backend> KvCache<B> {
    /// Drops everything cached.
    pub fn clear(&mut self) {
        self.layers.clear();
        self.len = 0;
    }
}

/// A fixed-size cache of `slots` sequences of up to `capacity` positions each, in f32 or bf16
/// (a model with bf16 products rounds keys and values to bf16 before every product, so a bf16
/// cache changes no result and takes half the memory; readers get f32 back).
///
/// ```
/// use burn::backend::Flex;
/// use burn::tensor::FloatDType;
/// use verl_megatron::models::SlotKvCache;
/// let cache = SlotKvCache::<Flex>::new(2, 2, 8, 4, 16, &Default::default());
/// assert_eq!(cache.slots(), 4);
/// // 2 layers × (k + v) × 2 kv heads × 8 dims × 4 bytes per position.
/// assert_eq!(SlotKvCache::<Flex>::bytes_per_position(2, 2, 8, FloatDType::F32), 256);
/// assert_eq!(cache.bytes(), 256 * 4 * 16);
/// let half = SlotKvCache::<Flex>::new_with_dtype(2, 2, 8, 4, 16, FloatDType::BF16, &Default::default());
/// assert_eq!(half.bytes(), 128 * 4 * 16);
/// ```
#[derive(Debug, Clone)]
pub struct SlotKvCache<B: Backend> {
    /// Per layer: keys and values `[slots, kv_heads, capacity, head_dim]`.
    pub(crate) layers: Vec<(Tensor<B, 4>, Tensor<B, 4>)>,
    kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    /// What the keys and values are stored as (f32 or bf16).
    dtype: FloatDType,
}

impl<B: FusedOps> SlotKvCache<B> {
    /// Allocates (zeroed) an f32 cache for `num_layers` layers.
    pub fn new(
        num_layers: usize,
        kv_heads: usize,
        head_dim: usize,
        slots: usize,
        capacity: usize,
        device: &B::Device,
    ) -> Self {
        Self::new_with_dtype(
            num_layers,
            kv_heads,
            head_dim,
            slots,
            capacity,
            FloatDType::F32,
            device,
        )
    }

    /// Allocates (zeroed) the cache for `num_layers` layers, stored as `dtype` (f32 or bf16).
    pub fn new_with_dtype(
        num_layers: usize,
        kv_heads: usize,
        head_dim: usize,
        slots: usize,
        capacity: usize,
        dtype: FloatDType,
        device: &B::Device,
    ) -> Self {
        let shape = [slots, kv_heads, capacity, head_dim];
        let zeros = || Tensor::zeros(shape, (device, DType::from(dtype)));
        let layers = (0..num_layers).map(|_| (zeros(), zeros())).collect();
        Self {
            layers,
            kv_heads,
            head_dim,
            capacity,
            dtype,
        }
    }

    /// Bytes one cached position (one token of one sequence) takes across all layers, stored
    /// as `dtype`.
    pub fn bytes_per_position(
        num_layers: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: FloatDType,
    ) -> usize {
        num_layers * 2 * kv_heads * head_dim * DType::from(dtype).size()
    }

    /// What the keys and values are stored as.
    pub fn dtype(&self) -> FloatDType {
        self.dtype
    }

    /// Number of sequences the cache holds at once.
    pub fn slots(&self) -> usize {
        self.layers.first().map_or(0, |(k, _)| k.dims()[0])
    }

    /// Positions per slot.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Total bytes held.
    pub fn bytes(&self) -> usize {
        Self::bytes_per_position(self.layers.len(), self.kv_heads, self.head_dim, self.dtype)
            * self.slots()
            * self.capacity
    }

    /// Keeps only the given slots, in that order (slot `rows[i]` becomes slot `i`): shrinking
    /// the decode batch once few sequences are left.
    pub fn retain(&mut self, rows: &[usize]) {
        let Some((k0, _)) = self.layers.first() else {
            return;
        };
        let device = k0.device();
        let idx = Tensor::<B, 1, Int>::from_data(
            TensorData::new(rows.iter().map(|&r| r as i64).collect(), [rows.len()]),
            &device,
        );
        for (k, v) in &mut self.layers {
            *k = k.clone().select(0, idx.clone());
            *v = v.clone().select(0, idx.clone());
        }
    }

    /// Writes rows `[rows, head_dim]` of keys and values of layer `layer` at `(slot, kv_head,
    /// position)` triples, in one scatter per tensor (burn's CPU backend copies the destination
    /// on every write, so one write per step rather than one per slot).
    fn scatter(&mut self, layer: usize, at: Vec<i64>, k: Tensor<B, 2>, v: Tensor<B, 2>) {
        let rows = at.len() / 3;
        let device = k.device();
        let idx = Tensor::<B, 2, Int>::from_data(TensorData::new(at, [rows, 3]), &device);
        let (k, v) = (k.cast(self.dtype), v.cast(self.dtype));
        let (ck, cv) = &mut self.layers[layer];
        *ck = ck
            .clone()
            .scatter_nd(idx.clone(), k, IndexingUpdateOp::Assign);
        *cv = cv.clone().scatter_nd(idx, v, IndexingUpdateOp::Assign);
    }

    /// Writes prefilled keys / values `[prompts, kv_heads, len, head_dim]` of layer `layer`:
    /// target `i` copies the first `lens[i]` positions of prompt `sources[i]` into slot
    /// `slots[i]` at positions `starts[i]..starts[i] + lens[i]`. A prompt may fill several
    /// slots (its samples share a prefill); a chunk of a long prompt starts where the cached
    /// part ends.
    pub(crate) fn write_prefix(
        &mut self,
        layer: usize,
        targets: PrefixTargets<'_>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
    ) {
        // On burn-cuda, one kernel writes the rows in place (a scatter copies the whole layer).
        let (k, v) = {
            let (ck, cv) = &self.layers[layer];
            match B::write_prefix(k, v, targets, (ck, cv)) {
                Ok(()) => return,
                Err(kv) => kv,
            }
        };
        let (sources, slots, lens, starts) = targets;
        let [n, kh, t, hd] = k.dims();
        let mut at = Vec::new();
        let mut rows = Vec::new();
        for (((&i, &slot), &len), &start) in sources.iter().zip(slots).zip(lens).zip(starts) {
            for h in 0..kh {
                for p in 0..len {
                    at.extend([slot as i64, h as i64, (start + p) as i64]);
                    rows.push(((i * kh + h) * t + p) as i64);
                }
            }
        }
        let device = k.device();
        let count = rows.len();
        let rows = Tensor::<B, 1, Int>::from_data(TensorData::new(rows, [count]), &device);
        let pick = |x: Tensor<B, 4>| x.reshape([n * kh * t, hd]).select(0, rows.clone());
        self.scatter(layer, at, pick(k), pick(v));
    }

    /// A decode step's positions (one per slot) as the u32 words the decode-attention kernel
    /// reads, uploaded once per step for every layer.
    pub fn step_positions(positions: &[usize], device: &B::Device) -> Tensor<B, 1> {
        crate::ops::reference::step_positions(positions, device)
    }

    /// This layer's keys and values `[slots, kv_heads, capacity, head_dim]` (kernels that
    /// write the cache in place take them from here).
    pub(crate) fn layer(&self, layer: usize) -> (&Tensor<B, 4>, &Tensor<B, 4>) {
        let (k, v) = &self.layers[layer];
        (k, v)
    }

    /// Writes each slot's new key / value `[slots, kv_heads, 1, head_dim]` at its own position
    /// and returns the first `window` positions of keys and values (f32), which attention
    /// reads.
    pub(crate) fn write_step(
        &mut self,
        layer: usize,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        positions: &[usize],
        window: usize,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let (kh, hd) = (self.kv_heads, self.head_dim);
        let s = positions.len();
        let mut at = Vec::with_capacity(s * kh * 3);
        for (slot, &p) in positions.iter().enumerate() {
            for h in 0..kh {
                at.extend([slot as i64, h as i64, p as i64]);
            }
        }
        self.scatter(layer, at, k.reshape([s * kh, hd]), v.reshape([s * kh, hd]));
        let ranges = [0..s, 0..kh, 0..window, 0..hd];
        let (ck, cv) = &self.layers[layer];
        (
            ck.clone().slice(ranges.clone()).cast(FloatDType::F32),
            cv.clone().slice(ranges).cast(FloatDType::F32),
        )
    }
}

pub(crate) use crate::ops::PrefixTargets;

/// Where the chunks of a chunked prefill go: chunk `i` of `lens[i]` tokens continues slot
/// `slots[i]` from position `starts[i]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkLayout {
    pub slots: Vec<usize>,
    pub starts: Vec<usize>,
    pub lens: Vec<usize>,
}

impl ChunkLayout {
    /// Positions the chunks' attention reads: up to the furthest chunk's end.
    pub fn window(&self) -> usize {
        self.starts
            .iter()
            .zip(&self.lens)
            .map(|(s, l)| s + l)
            .max()
            .unwrap_or(0)
    }

    /// The additive bias `[chunks, 1, t, window]` (flattened): chunk `i`'s token `q` sees
    /// positions `0..=starts[i] + q`; a padded token (`q >= lens[i]`) sees position 0 only,
    /// so its softmax stays finite.
    pub fn bias(&self, t: usize) -> Vec<f32> {
        keys_up_to(self.query_positions(t), self.window())
    }

    /// Each chunk's `t` query positions, `[chunks · t]` (0 for a padded query, which attends
    /// to that position alone).
    pub fn query_positions(&self, t: usize) -> Vec<usize> {
        self.starts
            .iter()
            .zip(&self.lens)
            .flat_map(|(&start, &len)| (0..t).map(move |q| if q < len { start + q } else { 0 }))
            .collect()
    }
}

impl<B: FusedOps> SlotKvCache<B> {
    /// Writes a chunked prefill's keys and values `[chunks, kv_heads, t, head_dim]` of layer
    /// `layer` where `chunks` says, and returns the chunks' slots' first `window()` positions of
    /// keys and values `[chunks, kv_heads, window, head_dim]` (f32), which their attention
    /// reads.
    pub(crate) fn write_chunks(
        &mut self,
        layer: usize,
        chunks: &ChunkLayout,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let sources: Vec<usize> = (0..chunks.slots.len()).collect();
        self.write_prefix(
            layer,
            (&sources, &chunks.slots, &chunks.lens, &chunks.starts),
            k,
            v,
        );
        let (ck, cv) = &self.layers[layer];
        let device = ck.device();
        let n = chunks.slots.len();
        let idx = Tensor::<B, 1, Int>::from_data(
            TensorData::new(chunks.slots.iter().map(|&s| s as i64).collect(), [n]),
            &device,
        );
        let window = chunks.window();
        (
            ck.clone()
                .select(0, idx.clone())
                .narrow(2, 0, window)
                .cast(FloatDType::F32),
            cv.clone()
                .select(0, idx)
                .narrow(2, 0, window)
                .cast(FloatDType::F32),
        )
    }
}

/// Additive bias rows over `keys` keys, one per entry of `lasts`: 0 for keys `0..=last`, −∞
/// after (every causal mask here is this, row by row).
pub(crate) fn keys_up_to(lasts: impl IntoIterator<Item = usize>, keys: usize) -> Vec<f32> {
    lasts
        .into_iter()
        .flat_map(|last| (0..keys).map(move |j| if j <= last { 0.0 } else { f32::NEG_INFINITY }))
        .collect()
}
