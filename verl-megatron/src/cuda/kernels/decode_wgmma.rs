//! A decode step's products on Hopper's warpgroup tensor-core instruction
//! (`decode_gemm_wgmma.cu`): the weight's 64-row tiles as `wgmma`'s rows and the batch (1-128
//! rows a block) as its N, both staged in shared memory by a copying warpgroup, so the computing
//! warpgroups issue one 64 × N × 16 product where the `mma.sync` stream
//! ([`super::decode_gemm`]) spent its issue slots on loads, shuffles and 16 × 8 products. On the
//! 7B layer at 64 rows gate/up runs within 3 % of cuBLAS, 1.7× faster than the stream
//! (docs/PERFORMANCE.md).
//!
//! A row's result does not depend on the batch: each output is one accumulator over k tiles in
//! order, `wgmma`'s order inside a tile does not depend on N, and the k split
//! ([`DecodeWgmma::splits_for`]) is fixed by the product's shape alone. The tiles, warpgroups and
//! stages only decide which block computes a row. Under a split the partial sums are added in
//! split order, by the last block of a weight tile to finish for a few batch rows (no second
//! launch) or by a second kernel.

use std::cell::RefCell;
use std::collections::HashMap;

use burn::prelude::*;
use burn::tensor::DType;
use verl_core::backend::CudaBackend;

use super::source::{pack_words, CudaSource};
use super::{CudaPrimitive, KernelSwitch};

const SOURCE: &str = concat!(
    include_str!("gemm_common.cuh"),
    include_str!("decode_gemm_wgmma.cu")
);

/// Whether the decode step's products take this kernel on Hopper: on unless
/// `VERL_DECODE_WGMMA=decomposed` (then the `mma.sync` stream runs them, as on other GPUs).
pub static WGMMA: KernelSwitch = KernelSwitch::new("VERL_DECODE_WGMMA");

/// Batch rows one block takes (two `wgmma` of N = 64); larger batches run as neighbouring
/// blocks over the same weight tile.
pub const BLOCK_ROWS: usize = 128;

/// Batches of at most this many rows have a split's partial sums added by the last block of each
/// weight tile; larger ones by a second kernel over the whole output (one block adding a
/// tile's many rows became the product's tail: the 0.5B step at batch 64 went from 2.2 to
/// 2.9 ms on an H200, docs/PERFORMANCE.md). The sums are the same to the bit either way.
const LAST_BLOCK_SUM_ROWS: usize = 16;

/// The most shared memory a Hopper block may have.
const SHARED_LIMIT: usize = 227 * 1024;

/// Work units (64-row weight tiles × k splits) the k split aims for: a little over two per
/// multiprocessor of an H100/H200. A constant, not the device's count, so the k order (and so a
/// row's bits) is the same on every Hopper part.
const TARGET_UNITS: usize = 300;

/// Blocks of 384 weight rows a product needs to take them ([`DecodeWgmma::for_product`]): two
/// thirds of an H100's multiprocessors, so one wave leaves few idle.
const WIDE_BLOCKS: usize = 88;

/// Fewest tile × split units for which [`DecodeWgmma::pays_for`] takes a product by shape: about
/// one per multiprocessor of an H100 or H200 (132).
const MIN_UNITS: usize = 128;

/// The kernel's configuration (`decode_gemm_wgmma.cu`'s defines): `tiles` 64-row weight tiles
/// per computing warpgroup, `groups` computing warpgroups, a ring of `stages`, and k split over
/// `splits` blocks into f32 partial sums added in split order (by the last block of a weight
/// tile, or by a second kernel past [`LAST_BLOCK_SUM_ROWS`] rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeWgmma {
    pub tiles: usize,
    pub groups: usize,
    pub stages: usize,
    pub splits: usize,
}

impl DecodeWgmma {
    /// The configuration for `m` batch rows against a `[n, k]` weight, from the sweeps of
    /// `bench/gpu/decode_wgmma_sweep.sh` on the 7B, 1.5B and 0.5B products (one H200,
    /// docs/PERFORMANCE.md), with [`Self::splits_for`]'s k split:
    /// - wide weights (at least [`WIDE_BLOCKS`] blocks of 384 rows: the 7B gate/up and LM head)
    ///   up to 64 batch rows: 3 tiles for each of 2 computing warpgroups, a ring of 4, about one
    ///   block a multiprocessor (gate/up 69-80 µs at 1-64 rows, cuBLAS 68-74);
    /// - the rest: one 64-row tile a block, 8 stages up to 32 rows and 4 above (more blocks
    ///   resident where the batch's stage is wider).
    pub fn for_product(m: usize, n: usize, k: usize) -> Self {
        let splits = Self::splits_for(n, k);
        let wide = Self {
            tiles: 3,
            groups: 2,
            stages: 4,
            splits,
        };
        if splits == 1 && n.div_ceil(384) >= WIDE_BLOCKS && wide.valid_for(m) {
            return wide;
        }
        Self {
            tiles: 1,
            groups: 1,
            stages: if m <= 32 { 8 } else { 4 },
            splits,
        }
    }

    /// Whether a `[n, k]` weight runs on this kernel when chosen by shape: its 64-row tiles ×
    /// splits reach [`MIN_UNITS`]. Below that the kernel leaves most multiprocessors idle while
    /// the stream's 16-row tiles fill them: on the 0.5B layer (qkv 18 units, o 14, down 56) the
    /// step at batch 1 went from 2.3 to 3.0 ms on an H200 with every product here. The 7B
    /// layer's smallest products have 224 units.
    pub fn pays_for(n: usize, k: usize) -> bool {
        n.div_ceil(64) * Self::splits_for(n, k) >= MIN_UNITS
    }

    /// k splits for a `[n, k]` weight: enough that 64-row tiles × splits reach about
    /// [`TARGET_UNITS`], each split at least 12 k tiles of 64 (the partial sums and the second
    /// launch cost more below), a power of two up to 8. The 7B layer: qkv, o and down 4, gate/up
    /// and the LM head 1.
    pub fn splits_for(n: usize, k: usize) -> usize {
        let by_rows = TARGET_UNITS / n.div_ceil(64).max(1);
        let by_k = k.div_ceil(64) / 12;
        let s = by_rows.min(by_k).clamp(1, 8);
        1 << s.ilog2()
    }

    /// `"tiles,groups,stages[,splits]"`, e.g. `"1,1,8"` or `"3,2,4,1"`; without splits, the
    /// product's own ([`Self::splits_for`]) when launched.
    pub fn parse(text: &str) -> Option<(Self, bool)> {
        let v: Vec<usize> = text
            .split(',')
            .map(|s| s.trim().parse().ok())
            .collect::<Option<_>>()?;
        let (tiles, groups, stages, splits) = match v[..] {
            [t, g, s] => (t, g, s, None),
            [t, g, s, k] => (t, g, s, Some(k)),
            _ => return None,
        };
        Some((
            Self {
                tiles,
                groups,
                stages,
                splits: splits.unwrap_or(1),
            },
            splits.is_some(),
        ))
    }

    /// Whether the kernel can run this configuration for `m` batch rows: its ring fits a
    /// block's shared memory and the sizes are ones it is written for.
    pub fn valid_for(&self, m: usize) -> bool {
        (1..=super::decode_gemm::MAX_ROWS).contains(&m)
            && (1..=5).contains(&self.tiles)
            && (1..=3).contains(&self.groups)
            && (2..=8).contains(&self.stages)
            && [1, 2, 4, 8].contains(&self.splits)
            // Accumulators (4 f32 per 8 batch rows and tile) within the registers a thread
            // has at this block size.
            && self.tiles * Self::groups_of_eight(m) * 4 <= self.accumulator_limit()
            && self.shared_bytes(m) <= SHARED_LIMIT
    }

    /// f32 accumulators a computing thread may hold: 160 (measured without spills at one
    /// computing warpgroup), less where more warpgroups share the register file (65 536
    /// registers over 128 (groups + 1) threads, ~40 kept for addresses and descriptors).
    fn accumulator_limit(&self) -> usize {
        let registers = (65_536 / (128 * (self.groups + 1))).min(255);
        160.min(registers.saturating_sub(40))
    }

    /// 8-row groups of the batch per block: the batch spread evenly over blocks of at most
    /// [`BLOCK_ROWS`].
    fn groups_of_eight(m: usize) -> usize {
        let blocks = m.div_ceil(BLOCK_ROWS).max(1);
        m.div_ceil(blocks).div_ceil(8)
    }

    /// The ring (per stage: the weight rows and the batch rows over 64 of k, bf16) plus 1 KiB
    /// to align it to the swizzle's period.
    fn shared_bytes(&self, m: usize) -> usize {
        self.stages * (64 * self.tiles * self.groups + 8 * Self::groups_of_eight(m)) * 128 + 1024
    }
}

/// `lhs · rhs` (`lhs` `[.., m, k]` with row pitch `lda`, `rhs` the transposed view of a `[n, k]`
/// weight with row pitch `ldb`) by the `wgmma` kernel, in f32 when `out_f32`, else in `lhs`'s
/// dtype. The caller checked [`super::decode_gemm::takes`], a Hopper device and
/// `tiles.valid_for(m)`.
pub(super) fn launch(
    lhs: CudaPrimitive,
    rhs: CudaPrimitive,
    (lda, ldb): (usize, usize),
    out_f32: bool,
    tiles: DecodeWgmma,
) -> CudaPrimitive {
    let out_dtype = if out_f32 { DType::F32 } else { lhs.dtype };
    let out = burn_cubecl::kernel::matmul::init_matmul_output(&lhs, &rhs, out_dtype);
    let (m, k, n) = super::product_dims(&lhs, &rhs);
    let ldc = super::row_pitch(&out);
    let nb = DecodeWgmma::groups_of_eight(m);
    let batch_blocks = m.div_ceil(8 * nb);
    let last_block_sums = m <= LAST_BLOCK_SUM_ROWS;
    let words = pack_words(
        &[
            m,
            n,
            k,
            lda,
            ldb,
            ldc,
            batch_blocks,
            last_block_sums as usize,
        ]
        .map(|w| w as u32),
    );
    let defines = vec![
        ("WG_NB", nb as u32),
        ("WG_TILES", tiles.tiles as u32),
        ("WG_GROUPS", tiles.groups as u32),
        ("WG_STAGES", tiles.stages as u32),
        ("OUT_F32", out_f32 as u32),
    ];
    let units = n.div_ceil(64 * tiles.tiles * tiles.groups) * batch_blocks;
    let kernel = CudaSource {
        entry: "verl_decode_gemm_wgmma",
        text: SOURCE,
        defines: defines.clone(),
        block: (128 * (tiles.groups + 1)) as u32,
        shared_bytes: tiles.shared_bytes(m),
    };
    if tiles.splits == 1 {
        // (The partial sums and counters are not read: any buffer binds them.)
        kernel.launch(
            &out.client,
            (units as u32, 1, 1),
            &[&lhs, &rhs, &out, &out, &out],
            words,
        );
        return out;
    }
    // Each split's f32 partial sums [split][m][ldc], added in split order by the unit's last
    // block or by a second kernel.
    let parts = super::empty_of(&lhs, vec![tiles.splits * m * ldc], DType::F32);
    let counters = counters(&lhs, units);
    kernel.launch(
        &out.client,
        (units as u32, tiles.splits as u32, 1),
        &[&lhs, &rhs, &out, &parts, &counters],
        words,
    );
    if !last_block_sums {
        CudaSource {
            entry: "verl_decode_gemm_wgmma_sum",
            text: SOURCE,
            defines,
            block: 256,
            shared_bytes: 0,
        }
        .launch(
            &out.client,
            ((m * n).div_ceil(256) as u32, 1, 1),
            &[&parts, &out],
            pack_words(&[m, n, k, lda, ldb, ldc, tiles.splits, 0].map(|w| w as u32)),
        );
    }
    out
}

thread_local! {
    /// Per GPU and thread (a thread's launches share one stream, so one launch at a time uses
    /// them): a u32 count per unit of a split product, zero between launches (the last block of
    /// a unit sets its count back).
    static COUNTERS: RefCell<HashMap<usize, CudaPrimitive>> = RefCell::new(HashMap::new());
}

/// At least `units` zeroed counters on `like`'s device, made once (and again when a product
/// needs more).
fn counters(like: &CudaPrimitive, units: usize) -> CudaPrimitive {
    COUNTERS.with(|c| {
        let mut c = c.borrow_mut();
        if let Some(found) = c.get(&like.device.index) {
            if found.meta.shape()[0] >= units {
                return found.clone();
            }
        }
        // f32 zeros are u32 zeros.
        let made = Tensor::<CudaBackend, 1>::zeros([units.max(8192)], &like.device)
            .into_primitive()
            .tensor();
        c.insert(like.device.index, made.clone());
        made
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_follow_the_shape_alone() {
        // The 7B layer: qkv, o and the down projection split 4; gate/up and the LM head whole.
        assert_eq!(DecodeWgmma::splits_for(4608, 3584), 4);
        assert_eq!(DecodeWgmma::splits_for(3584, 3584), 4);
        assert_eq!(DecodeWgmma::splits_for(3584, 18_944), 4);
        assert_eq!(DecodeWgmma::splits_for(37_888, 3584), 1);
        assert_eq!(DecodeWgmma::splits_for(152_064, 3584), 1);
        // 0.5B: a short k keeps qkv whole; its down projection (k 4864) splits.
        assert_eq!(DecodeWgmma::splits_for(1152, 896), 1);
        assert_eq!(DecodeWgmma::splits_for(896, 4864), 4);
        // Tiny products stay whole; the split is a power of two up to 8.
        assert_eq!(DecodeWgmma::splits_for(3, 8), 1);
        assert_eq!(DecodeWgmma::splits_for(64, 1 << 20), 8);
        for m in [1, 17, 64, 128, 256] {
            for (n, k) in [(4608, 3584), (37_888, 3584), (151_936, 896)] {
                assert_eq!(
                    DecodeWgmma::for_product(m, n, k).splits,
                    DecodeWgmma::for_product(1, n, k).splits
                );
            }
        }
    }

    #[test]
    fn only_products_that_fill_the_gpu_take_the_kernel_by_shape() {
        // The 7B layer: every product (o and down have 56 tiles × 4 splits).
        for (n, k) in [
            (4608, 3584),
            (3584, 3584),
            (37_888, 3584),
            (3584, 18_944),
            (152_064, 3584),
        ] {
            assert!(DecodeWgmma::pays_for(n, k), "{n} x {k}");
        }
        // The 0.5B layer: gate/up (152 tiles) and the LM head; not qkv, o or down.
        assert!(DecodeWgmma::pays_for(9728, 896) && DecodeWgmma::pays_for(151_936, 896));
        for (n, k) in [(1152, 896), (896, 896), (896, 4864)] {
            assert!(!DecodeWgmma::pays_for(n, k), "{n} x {k}");
        }
    }

    #[test]
    fn wide_weights_take_384_row_blocks_while_they_fit() {
        let gate_up = |m| DecodeWgmma::for_product(m, 37_888, 3584);
        assert_eq!((gate_up(1).tiles, gate_up(1).groups), (3, 2));
        assert_eq!((gate_up(64).tiles, gate_up(64).groups), (3, 2));
        // Past 64 rows the ring no longer fits: one tile a block.
        assert_eq!(
            (gate_up(65).tiles, gate_up(65).groups, gate_up(65).stages),
            (1, 1, 4)
        );
        // The 0.5B gate/up (9728 rows: 26 such blocks) and the 7B qkv take 64-row blocks.
        assert_eq!(DecodeWgmma::for_product(8, 9728, 896).tiles, 1);
        assert_eq!(DecodeWgmma::for_product(8, 4608, 3584).stages, 8);
        assert_eq!(DecodeWgmma::for_product(33, 4608, 3584).stages, 4);
    }

    #[test]
    fn every_batch_has_a_valid_configuration() {
        for m in 1..=crate::cuda::kernels::decode_gemm::MAX_ROWS {
            for (n, k) in [(4608, 3584), (3584, 18_944), (152_064, 3584), (24, 136)] {
                let t = DecodeWgmma::for_product(m, n, k);
                assert!(t.valid_for(m), "m {m} ({n}, {k}): {t:?}");
            }
        }
        // 8 stages of 128 weight rows and 128 batch rows: 8 x 32 KiB + 1 KiB, too much.
        let wide = DecodeWgmma::parse("2,1,8").unwrap().0;
        assert!(wide.valid_for(64) && !wide.valid_for(128));
        assert_eq!(wide.shared_bytes(64), 8 * (128 + 64) * 128 + 1024);
        // 129 rows: two blocks of 72 rows (9 groups of 8).
        assert_eq!(DecodeWgmma::groups_of_eight(129), 9);
        assert_eq!(DecodeWgmma::groups_of_eight(256), 16);
        assert!(!DecodeWgmma::parse("6,1,4").unwrap().0.valid_for(8));
        assert!(!DecodeWgmma::parse("1,1,4,3").unwrap().0.valid_for(8));
        // 5 tiles at 64 rows need 160 accumulators a thread; at 128 rows, too many.
        let five = DecodeWgmma::parse("5,1,4").unwrap().0;
        assert!(five.valid_for(64) && !five.valid_for(128));
        // Two computing warpgroups leave ~130 (170 registers a thread): 3 tiles at 64 rows (96)
        // fit, 5 (160) do not; three leave ~88.
        assert!(DecodeWgmma::parse("3,2,4").unwrap().0.valid_for(64));
        assert!(!DecodeWgmma::parse("5,2,2").unwrap().0.valid_for(64));
        assert!(!DecodeWgmma::parse("3,3,2").unwrap().0.valid_for(64));
        assert!(DecodeWgmma::parse("1,3,4").unwrap().0.valid_for(128));
    }

    #[test]
    fn configurations_parse() {
        assert_eq!(
            DecodeWgmma::parse("3, 2,4,1"),
            Some((
                DecodeWgmma {
                    tiles: 3,
                    groups: 2,
                    stages: 4,
                    splits: 1
                },
                true
            ))
        );
        assert!(!DecodeWgmma::parse("1,1,8").unwrap().1);
        assert!(DecodeWgmma::parse("1,1").is_none() && DecodeWgmma::parse("1,1,8,1,1").is_none());
        assert!(DecodeWgmma::parse("a,1,8").is_none());
    }
}
