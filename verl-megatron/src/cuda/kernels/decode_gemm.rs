//! A decode step's products as a weight stream (`decode_gemm.cu`): a few rows of activations
//! (the batch, at most [`MAX_ROWS`]) against a weight stored `[n, k]` as the model keeps it.
//!
//! Such a product reads each weight byte once and does almost no arithmetic per byte, so its
//! time is the weight's size over the memory bandwidth the kernel sustains. The kernel loads
//! weight rows straight into `mma.sync` registers (weight rows as the MMA's 16 rows, batch rows
//! as its 8 columns), one chunk ahead, with many warps of a block splitting k, so enough bytes
//! are in flight; the warps' partial sums are added in a fixed order (deterministic, and a row's
//! result does not depend on the batch size). Past 16 rows, on the largest weights, a second
//! kernel computes the same sums in the same order with the warps splitting rows over one
//! shared-memory ring ([`SharedStage`]): the batch's activations are read once per block instead
//! of once per 32 weight rows. [`super::gemm`] routes products here; its `wmma` decode tiles
//! remain for other operand layouts and under `VERL_DECODE_GEMM=tiles`.

use burn::tensor::DType;
use burn_cubecl::kernel::matmul::init_matmul_output;

use super::decode_wgmma::{self, DecodeWgmma, WGMMA};
use super::source::{pack_words, CudaSource};
use super::{CudaPrimitive, KernelSwitch};

/// The most batch rows the kernel takes (eight 8-row groups per block, up to four blocks per
/// weight tile).
pub const MAX_ROWS: usize = 256;

const SOURCE: &str = concat!(
    include_str!("gemm_common.cuh"),
    include_str!("decode_gemm.cu")
);

/// Shared memory a block may use for its partial sums or activation stages (more would leave
/// one block a multiprocessor).
const SHARED_LIMIT: usize = 128 * 1024;

/// How the kernel splits a product (`decode_gemm.cu`'s defines): `row_tiles` 16-row weight
/// tiles per warp, `warps` warps splitting k, chunks of `slices` 32-wide k-slices, and
/// `row_groups` such sets of warps per block, each with its own rows (they read the same
/// activations at about the same time, so the block reads them from L2 once), and
/// `batch_splits` neighbouring blocks per weight tile, each with its share of the batch (the
/// later ones find the tile in L2); `staged`: each warp copies the activations of its next
/// chunk into shared memory (cp.async) while it multiplies the current one, instead of loading
/// them from L1/L2 as it multiplies. `shared`: whether the shared-stage kernel computes the
/// same sums instead ([`Shared`]); `wgmma`: whether Hopper's `wgmma` kernel runs the product
/// instead ([`Wgmma`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamTiles {
    pub row_tiles: usize,
    pub warps: usize,
    pub slices: usize,
    pub row_groups: usize,
    pub batch_splits: usize,
    pub staged: bool,
    pub shared: Shared,
    pub wgmma: Wgmma,
}

/// Whether [`decode_wgmma`]'s kernel runs a product instead of the stream (Hopper only; its k
/// order differs from the stream's, so it runs every product of a shape or none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wgmma {
    /// The stream (or the shared-stage kernel) always.
    Off,
    /// On Hopper, with [`DecodeWgmma::for_product`], for the shapes whose tiles fill the GPU
    /// ([`DecodeWgmma::pays_for`]), unless `VERL_DECODE_WGMMA=decomposed`.
    ByShape,
    /// This configuration (on Hopper; elsewhere the stream).
    On(DecodeWgmma),
}

/// Whether [`SharedStage::for_product`]'s choices are taken: on unless
/// `VERL_DECODE_SHARED=decomposed` (then the stream runs every product it takes).
pub static SHARED: KernelSwitch = KernelSwitch::new("VERL_DECODE_SHARED");

/// Whether `verl_decode_gemm_shared` runs a product instead of the stream: the same k order
/// (the stream's `warps` residues of `slices`-slice chunks, added in residue order, so a row's
/// result is the same to the bit), with the block's warps splitting weight rows instead of k
/// over activations and weights staged in one shared-memory ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shared {
    /// The stream always (a configuration forced for a sweep).
    Off,
    /// Where it was faster on the 7B layer's products ([`SharedStage::for_product`]).
    WhereFaster,
    /// This configuration always.
    On(SharedStage),
}

/// The shared-stage kernel's configuration (`decode_gemm.cu`'s ROW_WARPS and STAGES, with the
/// stream's row tiles, k order and batch splits): `row_warps` warps a block, each `row_tiles`
/// 16-row weight tiles over the whole of k, a ring of `stages` chunks; `residue_split`: one
/// block per k residue into f32 partial sums, added in order by a second kernel (for products
/// with few weight rows and a long k, which would otherwise leave most multiprocessors idle).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedStage {
    pub row_tiles: usize,
    pub row_warps: usize,
    pub stages: usize,
    pub residue_split: bool,
}

impl SharedStage {
    /// Where the shared-stage kernel beat the stream on the Qwen2.5-7B layer's products (one
    /// H200, `bash bench/gpu/decode_gemm_variants.sh`, docs/PERFORMANCE.md), among weights of
    /// at least 32 MB (below, a second launch costs more than it saves):
    /// - down projections (k at least 4 n) at every batch up to 64 rows, one block per residue
    ///   (18944 → 3584: 48.5 → 42.5 µs at 8 rows, 67 → 59 µs at 64);
    /// - wide products (n ≥ 16 384) from 17 to 32 rows (gate/up 92 → 79 µs), and the LM
    ///   head (n ≥ 65 536) up to 64 (492 → 357 µs at 64 rows).
    pub fn for_product(m: usize, n: usize, k: usize) -> Option<Self> {
        if m > 64 || n * k < 16 << 20 {
            return None;
        }
        if k >= 4 * n {
            return Some(Self {
                row_tiles: if m <= 16 { 1 } else { 2 },
                row_warps: 4,
                stages: 4,
                residue_split: true,
            });
        }
        if m > 16 && (n >= 65_536 || (n >= 16_384 && m <= 32)) {
            return Some(Self {
                row_tiles: 2,
                row_warps: if m <= 32 { 3 } else { 4 },
                stages: 4,
                residue_split: false,
            });
        }
        None
    }

    /// `"row_tiles,row_warps,stages,residue_split"`, e.g. `"2,4,4,0"` (split is 0 or 1).
    pub fn parse(text: &str) -> Option<Self> {
        let v: Vec<usize> = text
            .split(',')
            .map(|s| s.trim().parse().ok())
            .collect::<Option<_>>()?;
        match v[..] {
            [row_tiles, row_warps, stages, split @ (0 | 1)] => Some(Self {
                row_tiles,
                row_warps,
                stages,
                residue_split: split == 1,
            }),
            _ => None,
        }
    }

    /// The ring's bytes for `groups` 8-row groups of the batch and chunks of `slices` slices:
    /// per stage the activations (16 bytes per lane, group and slice) and each warp's weight
    /// pieces (16 bytes per lane, slice, tile and half).
    fn shared_bytes(&self, groups: usize, slices: usize) -> usize {
        let pieces = slices * groups * 32 + self.row_warps * slices * self.row_tiles * 2 * 32;
        self.stages * pieces * 16
    }
}

impl StreamTiles {
    /// The configuration for a batch of `m` rows: 8 warps over chunks of 64 elements for every
    /// batch (one k order for all batch sizes, so a row's result does not depend on the
    /// batch); one 16-row tile per warp up to 16 rows and two above (halving how often each
    /// block re-reads the batch's activations); past 16 rows the activations staged in shared
    /// memory a chunk ahead (their loads no longer stall the products), and past 64 a block
    /// per 64 rows of the batch. Chosen from `verl bench kernels --only decode_gemm`'s sweep on
    /// an H200 (docs/PERFORMANCE.md).
    pub fn for_rows(m: usize) -> Self {
        if let Some(forced) = forced() {
            return forced;
        }
        Self {
            row_tiles: if m <= 16 { 1 } else { 2 },
            warps: 8,
            slices: 2,
            row_groups: 1,
            batch_splits: m.div_ceil(64).clamp(1, 4),
            staged: m > 16,
            shared: Shared::WhereFaster,
            wgmma: Wgmma::ByShape,
        }
    }

    /// The `wgmma` configuration this product runs on instead of the stream, if any: on a
    /// Hopper device (`hopper`), where the configuration fits the batch.
    pub fn wgmma_tiles(&self, m: usize, n: usize, k: usize, hopper: bool) -> Option<DecodeWgmma> {
        let tiles = match self.wgmma {
            Wgmma::Off => None,
            Wgmma::ByShape if WGMMA.enabled() && DecodeWgmma::pays_for(n, k) => {
                Some(DecodeWgmma::for_product(m, n, k))
            }
            Wgmma::ByShape => None,
            Wgmma::On(tiles) => Some(tiles),
        }?;
        (hopper && tiles.valid_for(m)).then_some(tiles)
    }

    /// The shared-stage kernel this product runs on instead of the stream, if any.
    pub fn shared_stage(&self, m: usize, n: usize, k: usize) -> Option<SharedStage> {
        let stage = match self.shared {
            Shared::Off => None,
            Shared::WhereFaster if SHARED.enabled() => SharedStage::for_product(m, n, k),
            Shared::WhereFaster => None,
            Shared::On(stage) => Some(stage),
        }?;
        // Its own row tiles, the stream's k order and batch split.
        let tiles = Self {
            row_tiles: stage.row_tiles,
            ..*self
        };
        // One block per residue needs residues (the kernel tells a split launch by its grid).
        (stage.shared_bytes(tiles.groups(m), self.slices) <= SHARED_LIMIT
            && (!stage.residue_split || self.warps >= 2)
            && (1..=4).contains(&stage.row_tiles)
            && (1..=8).contains(&stage.row_warps)
            && (2..=8).contains(&stage.stages))
        .then_some(stage)
    }

    /// `"row_tiles,warps,slices[,row_groups[,batch_splits[,staged]]]"`, e.g. `"1,8,2"`,
    /// `"2,4,2,2,2"` or `"2,8,2,1,2,1"` (staged is 0 or 1).
    pub fn parse(text: &str) -> Option<Self> {
        let v: Vec<usize> = text
            .split(',')
            .map(|s| s.trim().parse().ok())
            .collect::<Option<_>>()?;
        let (row_groups, batch_splits, staged) = match v.len() {
            3 => (1, 1, 0),
            4 => (v[3], 1, 0),
            5 => (v[3], v[4], 0),
            6 => (v[3], v[4], v[5]),
            _ => return None,
        };
        Some(Self {
            row_tiles: v[0],
            warps: v[1],
            slices: v[2],
            row_groups,
            batch_splits,
            staged: match staged {
                0 => false,
                1 => true,
                _ => return None,
            },
            shared: Shared::Off,
            wgmma: Wgmma::Off,
        })
    }

    /// Whether the kernel can run this configuration for `m` batch rows: its partial sums fit
    /// the static shared memory, and the sizes are ones it is written for.
    pub fn valid_for(&self, m: usize) -> bool {
        (1..=MAX_ROWS).contains(&m)
            && (1..=4).contains(&self.batch_splits)
            && self.groups(m) <= 8
            && (1..=4).contains(&self.row_tiles)
            && (1..=16).contains(&self.warps)
            && (1..=8).contains(&self.slices)
            && (1..=4).contains(&self.row_groups)
            && self.warps * self.row_groups <= 32
            && self.shared_bytes(m) <= SHARED_LIMIT
    }

    /// The shared memory for `m` batch rows: the partial sums (an f32 per warp, accumulator
    /// and lane), and with `staged` the warps' two activation stages (16 bytes per lane, 8-row
    /// group and slice), which the partial sums reuse.
    fn shared_bytes(&self, m: usize) -> usize {
        let warps = self.row_groups * self.warps;
        let partials = warps * self.row_tiles * self.groups(m) * 4 * 32 * 4;
        let stages = warps * 2 * self.slices * self.groups(m) * 32 * 16;
        if self.staged {
            partials.max(stages)
        } else {
            partials
        }
    }

    /// 8-row groups of the batch per block.
    fn groups(&self, m: usize) -> usize {
        m.div_ceil(8).div_ceil(self.batch_splits)
    }
}

/// `VERL_DECODE_STREAM=row_tiles,warps,slices[,row_groups[,batch_splits[,staged]]]`, read
/// once: one configuration of the stream for every batch (benchmarks sweep it; it also keeps
/// the `wgmma` kernel off). Ignored, with a warning, when
/// it does not parse.
fn forced() -> Option<StreamTiles> {
    static FORCED: std::sync::OnceLock<Option<StreamTiles>> = std::sync::OnceLock::new();
    *FORCED.get_or_init(|| {
        let text = std::env::var("VERL_DECODE_STREAM").ok()?;
        let tiles = StreamTiles::parse(&text);
        if tiles.is_none() {
            tracing::warn!(
                "VERL_DECODE_STREAM={text} is not \
                 `row_tiles,warps,slices[,row_groups[,batch_splits[,staged]]]`; ignored"
            );
        }
        tiles
    })
}

/// Whether the kernel takes a product of `m` rows over `k`: `lhs` row-major, `rhs` the
/// transpose of a row-major `[n, k]` matrix (`rhs_transposed`), k a multiple of 8 (whole
/// 16-byte pieces). The caller has checked dtypes, single matrices and 16-byte pitches.
pub(super) fn takes(m: usize, k: usize, lhs_transposed: bool, rhs_transposed: bool) -> bool {
    (1..=MAX_ROWS).contains(&m) && k.is_multiple_of(8) && !lhs_transposed && rhs_transposed
}

/// `lhs · rhs` (`lhs` `[.., m, k]` with row pitch `lda`, `rhs` the transposed view of a `[n, k]`
/// weight with row pitch `ldb`) by the stream kernel with `tiles`, in f32 when `out_f32`, else
/// in `lhs`'s dtype; on a Hopper device (`hopper`) by the `wgmma` kernel where `tiles` say so.
/// The caller checked [`takes`] and `tiles.valid_for(m)`.
pub(super) fn launch(
    lhs: CudaPrimitive,
    rhs: CudaPrimitive,
    (lda, ldb): (usize, usize),
    out_f32: bool,
    tiles: StreamTiles,
    hopper: bool,
) -> CudaPrimitive {
    let (m, k, n) = super::product_dims(&lhs, &rhs);
    if let Some(w) = tiles.wgmma_tiles(m, n, k, hopper) {
        return decode_wgmma::launch(lhs, rhs, (lda, ldb), out_f32, w);
    }
    let out_dtype = if out_f32 { DType::F32 } else { lhs.dtype };
    let out = init_matmul_output(&lhs, &rhs, out_dtype);
    let ldc = super::row_pitch(&out);
    let words = pack_words(&[m, n, k, lda, ldb, ldc, 0, 0].map(|w| w as u32));
    let defines = |row_tiles: usize| {
        vec![
            ("NB", tiles.groups(m) as u32),
            ("RT", row_tiles as u32),
            ("WARPS", tiles.warps as u32),
            ("U", tiles.slices as u32),
            ("WR", tiles.row_groups as u32),
            ("BS", tiles.batch_splits as u32),
            ("OUT_F32", out_f32 as u32),
            ("STAGE_A", tiles.staged as u32),
        ]
    };
    if let Some(stage) = tiles.shared_stage(m, n, k) {
        let mut defines = defines(stage.row_tiles);
        defines.extend([
            ("ROW_WARPS", stage.row_warps as u32),
            ("STAGES", stage.stages as u32),
        ]);
        let kernel = CudaSource {
            entry: "verl_decode_gemm_shared",
            text: SOURCE,
            defines: defines.clone(),
            block: (32 * stage.row_warps) as u32,
            shared_bytes: stage.shared_bytes(tiles.groups(m), tiles.slices),
        };
        let blocks =
            (n.div_ceil(16 * stage.row_tiles * stage.row_warps) * tiles.batch_splits) as u32;
        if !stage.residue_split {
            kernel.launch(&out.client, (blocks, 1, 1), &[&lhs, &rhs, &out], words);
            return out;
        }
        // One block per residue into f32 partial sums [warps][m][ldc], then added in order.
        let parts = super::empty_of(&lhs, vec![tiles.warps * m * ldc], DType::F32);
        kernel.launch(
            &out.client,
            (blocks, tiles.warps as u32, 1),
            &[&lhs, &rhs, &parts],
            words.clone(),
        );
        CudaSource {
            entry: "verl_decode_gemm_residues",
            text: SOURCE,
            defines,
            block: 256,
            shared_bytes: 0,
        }
        .launch(
            &out.client,
            ((m * n).div_ceil(256) as u32, 1, 1),
            &[&parts, &out],
            words,
        );
        return out;
    }
    let kernel = CudaSource {
        entry: "verl_decode_gemm",
        text: SOURCE,
        defines: defines(tiles.row_tiles),
        block: (32 * tiles.warps * tiles.row_groups) as u32,
        shared_bytes: tiles.shared_bytes(m),
    };
    kernel.launch(
        &out.client,
        (
            (n.div_ceil(16 * tiles.row_tiles * tiles.row_groups) * tiles.batch_splits) as u32,
            1,
            1,
        ),
        &[&lhs, &rhs, &out],
        words,
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_batch_has_a_valid_configuration_with_one_k_order() {
        let first = StreamTiles::for_rows(1);
        for m in 1..=MAX_ROWS {
            let t = StreamTiles::for_rows(m);
            assert!(t.valid_for(m), "m {m}: {t:?}");
            // The k order (warps, slices) is the same for every batch size.
            assert_eq!((t.warps, t.slices), (first.warps, first.slices));
        }
        assert!(!first.valid_for(0) && !first.valid_for(MAX_ROWS + 1));
    }

    #[test]
    fn configurations_parse_and_are_bounded_by_shared_memory() {
        let t = StreamTiles::parse("2, 8,4").unwrap();
        assert_eq!(
            t,
            StreamTiles {
                row_tiles: 2,
                warps: 8,
                slices: 4,
                row_groups: 1,
                batch_splits: 1,
                staged: false,
                shared: Shared::Off,
                wgmma: Wgmma::Off,
            }
        );
        assert!(StreamTiles::parse("2,8,2,1,2,1").unwrap().staged);
        assert!(StreamTiles::parse("2,8,2,1,2,2").is_none());
        assert_eq!(StreamTiles::parse("1,8,2,1,4").unwrap().batch_splits, 4);
        assert!(StreamTiles::parse("1,8,2,1,4,1,0").is_none());
        assert_eq!(StreamTiles::parse("1,4,2,4").unwrap().row_groups, 4);
        assert!(StreamTiles::parse("2,8").is_none() && StreamTiles::parse("a,b,c").is_none());
        // 16 warps x 4 tiles x 8 groups of partial sums is 256 KiB: refused.
        let big = StreamTiles {
            row_tiles: 4,
            warps: 16,
            slices: 4,
            row_groups: 1,
            batch_splits: 1,
            staged: false,
            shared: Shared::Off,
            wgmma: Wgmma::Off,
        };
        assert!(big.valid_for(8) && !big.valid_for(64));
        // Staged: 8 warps' two stages of 8 groups and 2 slices are 128 KiB, at the limit.
        let staged = StreamTiles::parse("2,8,2,1,1,1").unwrap();
        assert_eq!(staged.shared_bytes(64), 128 * 1024);
        assert!(staged.valid_for(64) && !StreamTiles::parse("2,8,4,1,1,1").unwrap().valid_for(64));
        // 33 warps: more threads than a block has.
        assert!(!StreamTiles::parse("1,11,2,3").unwrap().valid_for(1));
    }

    #[test]
    fn the_shared_stage_runs_where_it_was_faster_and_fits() {
        // The 7B layer: down projections at every batch, one block per residue; gate/up from
        // 17 to 32 rows; the LM head up to 64; nothing past 64 rows or on small weights.
        let down = SharedStage::for_product(8, 3584, 18_944).unwrap();
        assert!(down.residue_split && down.row_tiles == 1);
        assert!(
            SharedStage::for_product(64, 3584, 18_944)
                .unwrap()
                .residue_split
        );
        assert_eq!(SharedStage::for_product(16, 37_888, 3584), None);
        assert!(
            !SharedStage::for_product(32, 37_888, 3584)
                .unwrap()
                .residue_split
        );
        assert_eq!(SharedStage::for_product(64, 37_888, 3584), None);
        assert!(SharedStage::for_product(64, 152_064, 3584).is_some());
        assert_eq!(SharedStage::for_product(65, 152_064, 3584), None);
        assert_eq!(SharedStage::for_product(8, 4608, 3584), None);
        assert_eq!(SharedStage::for_product(8, 896, 4864), None); // 0.5B down: too small
                                                                  // The stream's k order goes with it; a forced stream configuration never switches.
        let tiles = StreamTiles::for_rows(32);
        assert_eq!(
            tiles.shared_stage(32, 37_888, 3584),
            SharedStage::for_product(32, 37_888, 3584)
        );
        let forced = StreamTiles::parse("2,8,2,1,1,1").unwrap();
        assert_eq!(forced.shared_stage(32, 37_888, 3584), None);
        // A ring past the shared-memory limit is refused.
        let huge = StreamTiles {
            shared: Shared::On(SharedStage::parse("4,8,8,0").unwrap()),
            ..tiles
        };
        assert_eq!(huge.shared_stage(64, 37_888, 3584), None);
        let chosen = StreamTiles {
            shared: Shared::On(SharedStage::parse("2,4,4,1").unwrap()),
            ..StreamTiles::for_rows(64)
        };
        // 4 stages x (2 slices x 8 groups + 4 warps x 2 slices x 2 tiles x 2) x 32 lanes x 16 B.
        assert_eq!(
            SharedStage::parse("2,4,4,1").unwrap().shared_bytes(8, 2),
            4 * (16 + 32) * 32 * 16
        );
        assert!(chosen.shared_stage(64, 512, 3584).is_some());
        assert_eq!(SharedStage::parse("2,4,4,2"), None);
        assert_eq!(SharedStage::parse("2,4,4"), None);
    }

    #[test]
    fn takes_only_a_weight_stream() {
        assert!(takes(1, 3584, false, true));
        assert!(takes(64, 8, false, true));
        assert!(!takes(MAX_ROWS + 1, 3584, false, true));
        assert!(!takes(1, 3586, false, true));
        assert!(!takes(1, 3584, true, true) && !takes(1, 3584, false, false));
    }
}
