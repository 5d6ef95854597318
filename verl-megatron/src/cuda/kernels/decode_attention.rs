//! The rollout engine's KV cache written in place and read by one attention kernel per layer
//! (`decode_attention.cu`): a decode step's RoPE on q and k, the cache write and grouped-query
//! attention over each slot's positions are one launch, where the plain path takes two
//! scatters (each copying the cache layer), a slice, a mask and a dozen attention operations.
//!
//! It applies on plain burn-cuda (generation has no autodiff) to f32 operands and contiguous
//! caches. The fallback, and every other backend, is the slot cache's own write with the
//! model's decomposed attention, which `verl bench kernels` compares this against.

use burn::prelude::*;
use burn::tensor::{DType, TensorPrimitive};
use burn_cubecl::kernel::into_contiguous;
use verl_core::backend::CudaBackend;

use super::source::{pack_words, CudaSource};
use super::{CudaPrimitive, KernelSwitch};
use crate::ops::{reference, DecodeProjections as Projections, DecodeScores, PrefixTargets};

/// The kernels after the shared bf16 rounding (`bf16_round.cuh`).
const SOURCE: &str = concat!(
    include_str!("bf16_round.cuh"),
    include_str!("decode_attention.cu")
);
/// Threads per block, as in `decode_attention.cu`.
const THREADS: usize = 128;

/// Whether the kernels are used where they apply: on unless `VERL_DECODE_ATTENTION=decomposed`.
pub static SWITCH: KernelSwitch = KernelSwitch::new("VERL_DECODE_ATTENTION");

/// Whether long contexts split their keys over several blocks ([`split_len`]): on unless
/// `VERL_DECODE_SPLIT=decomposed` (then one block per (kv head, slot), as before).
pub static SPLIT: KernelSwitch = KernelSwitch::new("VERL_DECODE_SPLIT");

/// Whether a bf16 cache with bf16 products is attended on tensor cores (`attend_mma` in
/// `decode_attention.cu`, [`uses_mma`]): on unless `VERL_DECODE_MMA=decomposed`.
pub static MMA: KernelSwitch = KernelSwitch::new("VERL_DECODE_MMA");

/// Whether the tensor-core path runs for this layer: a bf16 cache and bf16 products (its
/// products take bf16 operands, and the softmax's weights rounded to bf16 as the plain bf16
/// path's product sees them), at most 8 query heads a group (one MMA's columns) and heads of
/// at most 64 or of 128 (a 7B's). At 64 it takes a 0.5B layer's attention from 13-61 to
/// 9-34 µs, at 128 a 7B layer's from 17-98 to 16-59 µs (H200, 1-64 slots, 100-1 000 keys).
pub fn uses_mma(cache_bf16: bool, round_bf16: bool, rep: usize, head_dim: usize) -> bool {
    MMA.enabled() && cache_bf16 && round_bf16 && rep <= 8 && matches!(head_dim, 32 | 64 | 128)
}

/// The tensor-core path's threads: 8 warps at heads of 64 (each warp takes chunks of 16 keys,
/// so 8 of them cover a short context's keys in one round of loads), 4 at 128 (a warp holds
/// twice the registers a key chunk, and 8 warps were slower at 64 slots of 100 keys).
fn mma_threads(head_dim: usize) -> usize {
    if head_dim <= 64 {
        2 * THREADS
    } else {
        THREADS
    }
}

/// Whether the kernel takes `heads` query heads over `kv_heads` of size `head_dim`: whole
/// groups, a head a multiple of one warp's lanes, the group's accumulators in registers.
pub fn applies(heads: usize, kv_heads: usize, head_dim: usize) -> bool {
    SWITCH.enabled() && shape_fits(heads, kv_heads, head_dim)
}

fn shape_fits(heads: usize, kv_heads: usize, head_dim: usize) -> bool {
    kv_heads > 0
        && heads.is_multiple_of(kv_heads)
        && head_dim.is_multiple_of(32)
        && head_dim <= 256
        && (heads / kv_heads) * head_dim <= 1024
}

/// Whether `t` is an f32 tensor laid out contiguously (the kernels address it by its shape
/// alone; a binding starts at the tensor's offset).
fn plain_f32(t: &CudaPrimitive) -> bool {
    t.dtype == DType::F32 && t.is_contiguous()
}

/// Whether `k` and `v` are a cache the kernels address: contiguous, starting on 16 bytes (the
/// kernels read keys and values in 16-byte vectors), both f32 or both bf16 (a bf16 cache
/// compiles the kernels with `CACHE_BF16`). `Some(bf16)` when they are.
fn cache_layout(k: &CudaPrimitive, v: &CudaPrimitive) -> Option<bool> {
    let bf16 = match k.dtype {
        DType::F32 => false,
        DType::BF16 => true,
        _ => return None,
    };
    let aligned = |t: &CudaPrimitive| t.handle.offset_start.unwrap_or(0).is_multiple_of(16);
    (v.dtype == k.dtype && k.is_contiguous() && v.is_contiguous() && aligned(k) && aligned(v))
        .then_some(bf16)
}

/// `values` as a device buffer of u32 words (as a decode step's positions go up).
fn words(values: &[usize], device: &burn::backend::cuda::CudaDevice) -> CudaPrimitive {
    reference::step_positions::<CudaBackend>(values, device)
        .into_primitive()
        .tensor()
}

fn primitive<const D: usize>(t: &Tensor<CudaBackend, D>) -> CudaPrimitive {
    t.clone().into_primitive().tensor()
}

/// The kernel's pointer operands: q, k, v, bias (a stand-in when there is none).
struct Bound {
    q: CudaPrimitive,
    k: CudaPrimitive,
    v: CudaPrimitive,
    bias: Option<CudaPrimitive>,
    q_stride: usize,
    kv_stride: usize,
    offsets: [usize; 3],
}

/// `t` as a row-major matrix with unit column stride: its row stride, or `None`.
fn row_stride(t: &CudaPrimitive) -> Option<usize> {
    let strides = t.meta.strides();
    (t.dtype == DType::F32 && strides.len() == 2 && strides[1] == 1).then(|| strides[0])
}

/// The kernel's operands for `projections`, or `None` where their dtype or layout does not
/// fit.
fn bind(
    projections: &Projections<CudaBackend>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Option<Bound> {
    match projections {
        Projections::Split { q, k, v } => {
            let [q, k, v] = [q, k, v].map(|t| into_contiguous(primitive(t)));
            if ![&q, &k, &v].iter().all(|t| t.dtype == DType::F32) {
                return None;
            }
            Some(Bound {
                q,
                k,
                v,
                bias: None,
                q_stride: heads * head_dim,
                kv_stride: kv_heads * head_dim,
                offsets: [0; 3],
            })
        }
        Projections::Packed { qkv, bias } => {
            let qkv = primitive(qkv);
            let stride = row_stride(&qkv)?;
            let bias = match bias {
                Some(b) => {
                    let b = into_contiguous(primitive(b));
                    if b.dtype != DType::F32 {
                        return None;
                    }
                    Some(b)
                }
                None => None,
            };
            let (q_len, kv_len) = (heads * head_dim, kv_heads * head_dim);
            Some(Bound {
                q: qkv.clone(),
                k: qkv.clone(),
                v: qkv,
                bias,
                q_stride: stride,
                kv_stride: stride,
                offsets: [0, q_len, q_len + kv_len],
            })
        }
    }
}

/// Keys per split of the flash-decoding path for a step whose slots attend to at most `keys`
/// positions, or 0 (one block per (kv head, slot)). Splitting pays where the plain grid leaves
/// the GPU's `sms` multiprocessors idle and each slot has many keys: a 4k-token context at batch
/// 1 is otherwise one block per kv head walking 4 000 keys alone. Splits are at least 128 keys
/// (one tile of the kernel: a 1 000-key attention at batch 1 took 27 µs in splits of 256 and
/// 20 µs in splits of 128 on an H200), a multiple of 32, and enough of them to give about two
/// blocks per multiprocessor.
pub fn split_len(kv_heads: usize, slots: usize, keys: usize, sms: usize) -> usize {
    const MIN_SPLIT: usize = 128;
    let blocks = kv_heads * slots;
    if keys < 2 * MIN_SPLIT || blocks >= sms {
        return 0;
    }
    let want = (2 * sms).div_ceil(blocks.max(1));
    let splits = want.min(keys / MIN_SPLIT).max(1);
    if splits <= 1 {
        return 0;
    }
    keys.div_ceil(splits).next_multiple_of(32)
}

/// One layer's decode step: the projections (before RoPE), `cos`, `sin` `[slots, head_dim]`,
/// `positions` `[slots]` (u32 words, `SlotKvCache::step_positions`); writes the rotated key
/// and the value into `cache_k` / `cache_v` `[slots, kv_heads, capacity, head_dim]` at each
/// slot's position, in place, and returns attention over positions `0..=position` `[slots,
/// heads · head_dim]`, in bf16 when `out_bf16` (the output projection's operand), else f32.
/// `keys` bounds the slots' positions + 1 (it sizes the split over keys, [`split_len`]).
/// `scores` scales, soft-caps and windows the scores. `round_bf16` rounds the products'
/// operands as bf16 products would. The projections come
/// back where the kernel does not apply (checked by the caller with [`applies`]; here too for
/// tensors of other dtypes or layouts).
#[allow(clippy::too_many_arguments)]
pub fn decode_attention(
    projections: Projections<CudaBackend>,
    cos: &Tensor<CudaBackend, 2>,
    sin: &Tensor<CudaBackend, 2>,
    positions: &Tensor<CudaBackend, 1>,
    (cache_k, cache_v): (&Tensor<CudaBackend, 4>, &Tensor<CudaBackend, 4>),
    keys: usize,
    scores: DecodeScores,
    (round_bf16, out_bf16): (bool, bool),
) -> Result<Tensor<CudaBackend, 2>, Projections<CudaBackend>> {
    let [slots, kv_heads, capacity, head_dim] = cache_k.dims();
    let (q_cols, kv_cols) = match &projections {
        Projections::Split { q, k, v } => {
            let fits = q.dims()[0] == slots && k.dims()[0] == slots && v.dims() == k.dims();
            (fits.then_some(q.dims()[1]), k.dims()[1])
        }
        Projections::Packed { qkv, bias } => {
            let total = qkv.dims()[1];
            let kv = kv_heads * head_dim;
            let fits = qkv.dims()[0] == slots
                && total > 2 * kv
                && bias.as_ref().is_none_or(|b| b.dims() == [total]);
            (fits.then(|| total - 2 * kv), kv)
        }
    };
    let heads = q_cols.unwrap_or(0) / head_dim.max(1);
    let shapes_fit = q_cols == Some(heads * head_dim)
        && kv_cols == kv_heads * head_dim
        && cos.dims() == [slots, head_dim]
        && sin.dims() == [slots, head_dim]
        && cache_v.dims() == cache_k.dims()
        && positions.dims() == [slots]
        && slots < 65_536;
    if !(shapes_fit && applies(heads, kv_heads, head_dim)) {
        return Err(projections);
    }
    let (ck, cv) = (primitive(cache_k), primitive(cache_v));
    let (cos, sin) = (
        into_contiguous(primitive(cos)),
        into_contiguous(primitive(sin)),
    );
    let pos = primitive(positions);
    let Some(bound) = bind(&projections, heads, kv_heads, head_dim) else {
        return Err(projections);
    };
    let Some(cache_bf16) = cache_layout(&ck, &cv) else {
        return Err(projections);
    };
    if ![&cos, &sin].iter().all(|t| plain_f32(t)) {
        return Err(projections);
    }
    let out = super::empty_of(
        &bound.q,
        vec![slots, heads * head_dim],
        if out_bf16 { DType::BF16 } else { DType::F32 },
    );
    let has_bias = bound.bias.is_some();
    let bias = bound.bias.as_ref().unwrap_or(&bound.q);
    let [q_offset, k_offset, v_offset] = bound.offsets;
    let sms = super::multiprocessors(&bound.q);
    let keys = keys.clamp(1, capacity);
    let split = if SPLIT.enabled() {
        split_len(kv_heads, slots, keys, sms)
    } else {
        0
    };
    let splits = if split == 0 { 1 } else { keys.div_ceil(split) };
    // The partial softmaxes of the splits (a one-element stand-in when there is no split).
    let partial = super::empty_of(
        &bound.q,
        vec![if split == 0 {
            1
        } else {
            slots * heads * splits * (head_dim + 2)
        }],
        DType::F32,
    );
    let mma = uses_mma(cache_bf16, round_bf16, heads / kv_heads, head_dim);
    let threads = if mma { mma_threads(head_dim) } else { THREADS };
    let source = |entry| CudaSource {
        entry,
        text: SOURCE,
        defines: vec![
            ("HEAD_DIM", head_dim as u32),
            ("REP", (heads / kv_heads) as u32),
            ("ROUND_BF16", round_bf16 as u32),
            ("HAS_BIAS", has_bias as u32),
            ("OUT_BF16", out_bf16 as u32),
            ("CACHE_BF16", cache_bf16 as u32),
            ("MMA", mma as u32),
            ("THREADS", threads as u32),
        ],
        block: threads as u32,
        shared_bytes: 0,
    };
    let params = pack_words(&[
        slots as u32,
        heads as u32,
        kv_heads as u32,
        capacity as u32,
        scores.divisor.to_bits(),
        bound.q_stride as u32,
        bound.kv_stride as u32,
        q_offset as u32,
        k_offset as u32,
        v_offset as u32,
        split as u32,
        splits as u32,
        scores.window.map_or(0, |w| w.min(u32::MAX as usize) as u32),
        scores.softcap.unwrap_or(0.0).to_bits(),
    ]);
    source("verl_decode_attention").launch(
        &bound.q.client,
        (kv_heads as u32, slots as u32, splits as u32),
        &[
            &bound.q, &bound.k, &bound.v, bias, &cos, &sin, &pos, &ck, &cv, &out, &partial,
        ],
        params.clone(),
    );
    if split > 0 {
        CudaSource {
            block: head_dim as u32,
            ..source("verl_decode_combine")
        }
        .launch(
            &bound.q.client,
            (heads as u32, slots as u32, 1),
            &[&partial, &pos, &out],
            params,
        );
    }
    Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
}

/// Writes a prefill's keys and values `[prompts, kv_heads, len, head_dim]` into the cache
/// (target `i`: the first `lens[i]` positions of prompt `sources[i]` into slot `slots[i]` from
/// position `starts[i]`), in place; the operands come back where the kernel does not apply.
#[allow(clippy::type_complexity)]
pub fn write_prefix(
    k: Tensor<CudaBackend, 4>,
    v: Tensor<CudaBackend, 4>,
    (sources, slots, lens, starts): PrefixTargets<'_>,
    (cache_k, cache_v): (&Tensor<CudaBackend, 4>, &Tensor<CudaBackend, 4>),
) -> Result<(), (Tensor<CudaBackend, 4>, Tensor<CudaBackend, 4>)> {
    let [prompts, kv_heads, len, head_dim] = k.dims();
    let [cache_slots, cache_heads, capacity, cache_dim] = cache_k.dims();
    let targets = slots.len();
    let fits = SWITCH.enabled()
        && v.dims() == k.dims()
        && cache_v.dims() == cache_k.dims()
        && cache_heads == kv_heads
        && cache_dim == head_dim
        && head_dim % 32 == 0
        && len <= capacity
        && sources.len() == targets
        && lens.len() == targets
        && starts.len() == targets
        && starts.iter().zip(lens).all(|(&s, &l)| s + l <= capacity)
        && sources.iter().all(|&s| s < prompts)
        && slots.iter().all(|&s| s < cache_slots)
        && lens.iter().all(|&l| l <= len)
        && targets < 65_536
        && kv_heads < 65_536;
    if !fits {
        return Err((k, v));
    }
    let (ck, cv) = (primitive(cache_k), primitive(cache_v));
    let (kp, vp) = (
        into_contiguous(primitive(&k)),
        into_contiguous(primitive(&v)),
    );
    let Some(cache_bf16) = cache_layout(&ck, &cv) else {
        return Err((k, v));
    };
    if kp.dtype != DType::F32 || vp.dtype != DType::F32 {
        return Err((k, v));
    }
    let device = k.device();
    let [source_words, slot_words, len_words, start_words] =
        [sources, slots, lens, starts].map(|values| words(values, &device));
    CudaSource {
        entry: "verl_cache_write_prefix",
        text: SOURCE,
        // The attention entry's defines must be valid for the source to compile.
        defines: vec![
            ("HEAD_DIM", head_dim as u32),
            ("REP", 1),
            ("CACHE_BF16", cache_bf16 as u32),
        ],
        block: THREADS as u32,
        shared_bytes: 0,
    }
    .launch(
        &kp.client,
        (
            (len * head_dim).div_ceil(THREADS) as u32,
            kv_heads as u32,
            targets as u32,
        ),
        &[
            &kp,
            &vp,
            &source_words,
            &slot_words,
            &len_words,
            &start_words,
            &ck,
            &cv,
        ],
        pack_words(&[targets as u32, kv_heads as u32, len as u32, capacity as u32]),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_that_fit_the_registers() {
        // Qwen2.5-0.5B (14 / 2 heads of 64), 1.5B (12 / 2 of 128), Llama-3-8B (32 / 8 of 128).
        assert!(SOURCE.contains("#define THREADS 128"));
        for (h, kv, d, ok) in [
            (14, 2, 64, true),
            (12, 2, 128, true),
            (32, 8, 128, true),
            (64, 2, 128, false),
            (8, 8, 48, false),
            (6, 4, 64, false),
        ] {
            assert_eq!(shape_fits(h, kv, d), ok, "{h}/{kv}/{d}");
        }
    }

    #[test]
    fn tensor_cores_take_bf16_caches_with_bf16_products_and_small_groups() {
        assert!(uses_mma(true, true, 7, 64));
        assert!(uses_mma(true, true, 8, 32));
        // An f32 cache, unrounded products, groups past one MMA's 8 columns, heads of 128.
        assert!(!uses_mma(false, true, 7, 64));
        assert!(!uses_mma(true, false, 7, 64));
        assert!(!uses_mma(true, true, 9, 64));
        assert!(uses_mma(true, true, 7, 128));
        assert!(!uses_mma(true, true, 7, 96));
        assert!(!uses_mma(true, true, 7, 256));
    }

    #[test]
    fn keys_are_split_only_where_blocks_are_few_and_contexts_long() {
        // 1.5B (2 kv heads) at batch 1 over 4 000 keys on 132 SMs: 132 blocks wanted, 31
        // possible (at least 128 keys each), which round up to splits of 160 keys (a multiple
        // of 32), 25 of them.
        let s = split_len(2, 1, 4000, 132);
        assert_eq!(s, 160);
        assert_eq!(4000usize.div_ceil(s), 25);
        // Short contexts, or a grid that already fills the GPU, are not split.
        assert_eq!(split_len(2, 1, 200, 132), 0);
        assert_eq!(split_len(4, 64, 8000, 132), 0);
        // Batch 8 of a 7B at tp 2 (2 kv heads): 16 blocks, 17 splits wanted, 31 possible.
        let s = split_len(2, 8, 8000, 132);
        assert!(s >= 128 && s.is_multiple_of(32), "{s}");
        assert!(8000usize.div_ceil(s) * 16 >= 2 * 132, "{s}");
        // Every split but the last is full, so the combine's split count (position / split + 1)
        // covers exactly the keys.
        for (kv, slots, keys) in [(2, 1, 512), (8, 3, 10_000), (1, 1, 131_072)] {
            let s = split_len(kv, slots, keys, 132);
            if s > 0 {
                assert!(s >= 128 && s.is_multiple_of(32));
                assert!((keys - 1) / s < keys.div_ceil(s));
            }
        }
    }
}
