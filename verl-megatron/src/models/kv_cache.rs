//! Key/value caches for generation.
//!
//! - [`KvCache`]: one growing cache for a batch that decodes in lock step (simple, used by
//!   [`super::CausalLm::forward_cached`]).
//! - [`SlotKvCache`]: a preallocated cache of `slots × capacity` positions per layer, where every
//!   slot holds one sequence starting at position 0 and advancing at its own pace. This is what
//!   continuous batching needs: a finished sequence's slot is refilled by the next request
//!   without touching the others, and the memory is fixed up front.

use burn::prelude::*;
use burn::tensor::{Bool, TensorData};

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

/// A fixed-size cache of `slots` sequences of up to `capacity` positions each.
///
/// ```
/// use burn::backend::Flex;
/// use verl_megatron::models::SlotKvCache;
/// let cache = SlotKvCache::<Flex>::new(2, 2, 8, 4, 16, &Default::default());
/// assert_eq!(cache.slots(), 4);
/// // 2 layers × (k + v) × 2 kv heads × 8 dims × 4 bytes per position.
/// assert_eq!(SlotKvCache::<Flex>::bytes_per_position(2, 2, 8), 256);
/// assert_eq!(cache.bytes(), 256 * 4 * 16);
/// ```
#[derive(Debug, Clone)]
pub struct SlotKvCache<B: Backend> {
    /// Per layer: keys and values `[slots, kv_heads, capacity, head_dim]`.
    pub(crate) layers: Vec<(Tensor<B, 4>, Tensor<B, 4>)>,
    kv_heads: usize,
    head_dim: usize,
    capacity: usize,
}

impl<B: Backend> SlotKvCache<B> {
    /// Allocates (zeroed) the cache for `num_layers` layers.
    pub fn new(
        num_layers: usize,
        kv_heads: usize,
        head_dim: usize,
        slots: usize,
        capacity: usize,
        device: &B::Device,
    ) -> Self {
        let shape = [slots, kv_heads, capacity, head_dim];
        let layers = (0..num_layers)
            .map(|_| (Tensor::zeros(shape, device), Tensor::zeros(shape, device)))
            .collect();
        Self {
            layers,
            kv_heads,
            head_dim,
            capacity,
        }
    }

    /// Bytes one cached position (one token of one sequence) takes across all layers, in f32.
    pub fn bytes_per_position(num_layers: usize, kv_heads: usize, head_dim: usize) -> usize {
        num_layers * 2 * kv_heads * head_dim * std::mem::size_of::<f32>()
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
        Self::bytes_per_position(self.layers.len(), self.kv_heads, self.head_dim)
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

    /// Writes keys / values `[1, kv_heads, len, head_dim]` of layer `layer` into `slot` at
    /// positions `0..len` (a prefilled prompt).
    pub(crate) fn write_prefix(
        &mut self,
        layer: usize,
        slot: usize,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
    ) {
        let len = k.dims()[2];
        let (kh, hd) = (self.kv_heads, self.head_dim);
        let ranges = [slot..slot + 1, 0..kh, 0..len, 0..hd];
        let (ck, cv) = &mut self.layers[layer];
        *ck = ck.clone().slice_assign(ranges.clone(), k);
        *cv = cv.clone().slice_assign(ranges, v);
    }

    /// Writes each slot's new key / value `[slots, kv_heads, 1, head_dim]` at its own position
    /// and returns the first `window` positions of keys and values, which attention reads.
    /// `at` `[slots, 1, window, 1]` is true at each slot's write position.
    pub(crate) fn write_step(
        &mut self,
        layer: usize,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        at: &Tensor<B, 4, Bool>,
        window: usize,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let (kh, hd) = (self.kv_heads, self.head_dim);
        let slots = self.slots();
        let shape = [slots, kh, window, hd];
        let at = at.clone().expand(shape);
        let ranges = [0..slots, 0..kh, 0..window, 0..hd];
        let (ck, cv) = &mut self.layers[layer];
        let wk = ck
            .clone()
            .slice(ranges.clone())
            .mask_where(at.clone(), k.expand(shape));
        let wv = cv
            .clone()
            .slice(ranges.clone())
            .mask_where(at, v.expand(shape));
        *ck = ck.clone().slice_assign(ranges.clone(), wk.clone());
        *cv = cv.clone().slice_assign(ranges, wv.clone());
        (wk, wv)
    }
}
