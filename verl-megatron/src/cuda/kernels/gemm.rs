//! The one seam the model's bf16 matrix products go through on burn-cuda: the linear layers,
//! the LM head and attention's two batched products, forward and both backward products.
//!
//! burn 0.21 without autotune runs every product with one generic cubek strategy
//! (`SimpleCyclicCmma`: single stage, no TMA). Here a 2-D product whose operands are row-major
//! or plain transposes with 16-byte row pitches runs our own CUDA C++ kernel (the default,
//! [`GemmKind::Own`]): on Hopper `gemm_wgmma.cu` (warpgroup `wgmma` instructions over
//! 128-byte-swizzled shared tiles that one thread fills with TMA bulk copies, persistent
//! blocks), elsewhere `gemm.cu` (`wmma` tensor-core fragments fed by a `cp.async` pipeline). The
//! others (batched products) run a fixed cubek strategy chosen per shape class by
//! [`table_strategy`] (measured once by `verl bench kernels`; no autotune, whose candidates
//! can fail or hang). A strategy that cannot run a shape (a setup error) is remembered and
//! that shape class falls back to burn's own product, which is also the path on every other
//! backend and under `VERL_GEMM=burn`.
//!
//! Under autodiff the product is one custom operation that casts its operands to bf16, writes
//! an f32 result, and whose backward (`dA = dC·Bᵀ`, `dB = Aᵀ·dC`, transposes as views) goes
//! through the same seam and gives each gradient in its operand's dtype.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;

use burn::backend::Autodiff;
use burn::prelude::*;
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, FloatDType, TensorPrimitive};
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops};
use burn_cubecl::kernel::matmul::init_matmul_output;
use cubek::matmul::definition::{MatmulElems, MatmulGlobalElems};
use cubek::matmul::launch::Strategy;
use cubek::std::InputBinding;
use verl_core::backend::CudaBackend;

use super::decode_gemm::{self, Shared, SharedStage, StreamTiles, Wgmma};
use super::decode_wgmma::DecodeWgmma;
use super::source::{pack_words, CudaSource, TileMap};
use super::{record, CudaPrimitive, KernelSwitch};

/// Which implementation runs the seam's products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmKind {
    /// burn's own `matmul` (cubek's default strategy).
    Burn,
    /// cubek with a fixed strategy per shape class.
    Cubek,
    /// Our CUDA C++ kernel for the 2-D products whose operand layouts it takes (`wgmma` on
    /// Hopper, `wmma` elsewhere); cubek for the rest.
    Own,
    /// As [`GemmKind::Own`] but the `wmma` kernel on every GPU (for comparison on Hopper).
    Wmma,
}

/// 0: not read yet, 1: burn, 2: cubek, 3: own, 4: wmma.
static KIND: AtomicU8 = AtomicU8::new(0);

/// The implementation in use: `VERL_GEMM=burn|cubek|own|wmma` in the environment, else our
/// own kernel (cubek where it does not apply, burn's product where neither does).
pub fn kind() -> GemmKind {
    match KIND.load(Ordering::Relaxed) {
        0 => {
            let k = match std::env::var("VERL_GEMM").as_deref() {
                Ok("burn") => GemmKind::Burn,
                Ok("cubek") => GemmKind::Cubek,
                Ok("wmma") => GemmKind::Wmma,
                _ => GemmKind::Own,
            };
            set_kind(k);
            k
        }
        1 => GemmKind::Burn,
        3 => GemmKind::Own,
        4 => GemmKind::Wmma,
        _ => GemmKind::Cubek,
    }
}

/// Switches the implementation for the whole process.
pub fn set_kind(kind: GemmKind) {
    KIND.store(
        match kind {
            GemmKind::Burn => 1,
            GemmKind::Cubek => 2,
            GemmKind::Own => 3,
            GemmKind::Wmma => 4,
        },
        Ordering::Relaxed,
    );
}

/// Each kernel's source after what both share (`gemm_common.cuh`: parameters, cp.async copies).
const OWN_SOURCE: &str = concat!(include_str!("gemm_common.cuh"), include_str!("gemm.cu"));
const WGMMA_SOURCE: &str = concat!(
    include_str!("gemm_common.cuh"),
    include_str!("gemm_wgmma.cu")
);

/// Whether CUDA device `index` is a Hopper GPU (compute capability 9.x), the only one with
/// `wgmma` (Blackwell's sm_100a has no such instruction). Asked of the driver once per device.
fn hopper(index: usize) -> bool {
    static KNOWN: Mutex<Vec<(usize, bool)>> = Mutex::new(Vec::new());
    let mut known = KNOWN
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(&(_, h)) = known.iter().find(|(i, _)| *i == index) {
        return h;
    }
    let major = (|| {
        use cudarc::driver::{result, sys};
        result::init().ok()?;
        let device = result::device::get(index as i32).ok()?;
        // SAFETY: `device` is a valid handle just returned by the driver.
        unsafe {
            result::device::get_attribute(
                device,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            )
        }
        .ok()
    })();
    let h = major == Some(9);
    known.push((index, h));
    h
}

/// How our kernel reads `lhs · rhs` when it takes them: bf16, one matrix each (no batch), each
/// operand row-major or a plain transpose with 16-byte rows and a 16-byte-aligned start.
fn own_layouts(lhs: &CudaPrimitive, rhs: &CudaPrimitive) -> Option<[StoredLayout; 2]> {
    let single = |p: &CudaPrimitive| {
        let s = p.meta.shape();
        s[..s.num_dims() - 2].iter().product::<usize>() == 1
    };
    let fits = |p: &CudaPrimitive| p.meta.shape().iter().all(|&d| d > 0 && d < (1 << 31));
    // The grid's y dimension counts row tiles of the product and may not pass 65 535.
    let rows = lhs.meta.shape()[lhs.meta.shape().num_dims() - 2];
    let applies = lhs.dtype == DType::BF16
        && rhs.dtype == DType::BF16
        && rows.div_ceil(OWN_TILES.bm) <= 65_535
        && single(lhs)
        && single(rhs)
        && fits(lhs)
        && fits(rhs);
    if !applies {
        return None;
    }
    Some([stored_layout(lhs)?, stored_layout(rhs)?])
}

/// How a matrix operand is stored: transposed or not, and its row pitch in elements (burn-cuda
/// pads rows, e.g. 896 bf16 columns to a stride of 1 024).
#[derive(Debug, Clone, Copy)]
struct StoredLayout {
    transposed: bool,
    pitch: usize,
}

/// The layout of a matrix operand our kernel can copy in 16-byte pieces: its last two
/// dimensions row-major or a plain transpose, with a row pitch that is a multiple of 16 bytes,
/// and a 16-byte-aligned start; `None` otherwise.
fn stored_layout(p: &CudaPrimitive) -> Option<StoredLayout> {
    let shape = p.meta.shape();
    let strides = p.meta.strides();
    let n = shape.num_dims();
    if n < 2 {
        return None;
    }
    let (rows, cols) = (shape[n - 2], shape[n - 1]);
    let layout = if strides[n - 1] == 1 && strides[n - 2] >= cols {
        StoredLayout {
            transposed: false,
            pitch: strides[n - 2],
        }
    } else if strides[n - 2] == 1 && strides[n - 1] >= rows {
        StoredLayout {
            transposed: true,
            pitch: strides[n - 1],
        }
    } else {
        return None;
    };
    let offset_ok = p.handle.offset_start.unwrap_or(0).is_multiple_of(16);
    ((layout.pitch * p.dtype.size()).is_multiple_of(16) && offset_ok).then_some(layout)
}

/// Our kernel's tile configuration, passed to `gemm.cu` as defines: a `bm × bn` tile of the
/// product per block of `warps_m × warps_n` warps, `bk` deep, a `stages`-deep copy pipeline.
/// Chosen by `bash bench/gpu/gemm_sweep.sh` on an H100 over the step's product shapes in all
/// three layouts (docs/PERFORMANCE.md): 128 × 128 × 32, 4 stages, 2 × 2 warps of 64 × 64 was
/// the fastest of 13 configurations on every layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct OwnTiles {
    bm: usize,
    bn: usize,
    bk: usize,
    stages: usize,
    warps_m: usize,
    warps_n: usize,
}

const OWN_TILES: OwnTiles = OwnTiles {
    bm: 128,
    bn: 128,
    bk: 32,
    stages: 4,
    warps_m: 2,
    warps_n: 2,
};

/// Products of at most this many rows (a decode step's batch against a weight) take
/// [`decode_tiles`] where the weight stream does not take them.
pub const DECODE_ROWS: usize = 64;

/// Products of at most this many rows take the weight stream ([`decode_gemm`]). Measured on one
/// H200 (docs/PERFORMANCE.md): the 7B decode step at batch 128 takes 16.0 ms with the staged
/// stream, 20.0 ms with the unstaged one and 22.2 ms with the training GEMM.
pub const STREAM_ROWS: usize = 128;

/// The `gemm.cu` configuration for a product of `m ≤ DECODE_ROWS` rows: a weight-streaming
/// shape. The training tiles (128 × 128) leave a decode step's wide weights in a few dozen
/// blocks (a 7B model's down projection: 28 blocks on 132 SMs), each streaming megabytes
/// alone; 32-column tiles give 4× the blocks, and a deep pipeline of 128-wide k steps keeps
/// enough bytes in flight per SM to run at the memory's pace. Row tiles of 16, 32 or 64 fit the
/// batch so no tensor-core work is spent on padding rows beyond the next 16.
fn decode_tiles(m: usize) -> OwnTiles {
    let bm = match m {
        0..=16 => 16,
        17..=32 => 32,
        _ => 64,
    };
    OwnTiles {
        bm,
        bn: 32,
        bk: 128,
        stages: if bm == 64 { 4 } else { 6 },
        warps_m: bm / 16,
        warps_n: 2,
    }
}

/// How products of few rows run, from `VERL_DECODE_GEMM`: `0` as any other product, `tiles`
/// with [`decode_tiles`] only, else (the default) the weight stream of [`decode_gemm`] where it
/// takes the operands and the decode tiles elsewhere (the A/B switch of `bench/gpu/rollout.sh`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DecodeGemm {
    Off,
    Tiles,
    Stream,
}

/// Products of at most this many rows take the weight stream: [`STREAM_ROWS`], or
/// `VERL_DECODE_ROWS` (up to [`decode_gemm::MAX_ROWS`]; benchmarks move the cut-over).
fn stream_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| {
        std::env::var("VERL_DECODE_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(STREAM_ROWS, |r: usize| r.min(decode_gemm::MAX_ROWS))
    })
}

fn decode_gemm_mode() -> DecodeGemm {
    static MODE: std::sync::OnceLock<DecodeGemm> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("VERL_DECODE_GEMM").as_deref() {
        Ok("0") => DecodeGemm::Off,
        Ok("tiles") => DecodeGemm::Tiles,
        _ => DecodeGemm::Stream,
    })
}

impl OwnTiles {
    fn threads(&self) -> u32 {
        (32 * self.warps_m * self.warps_n) as u32
    }

    /// Dynamic shared memory of a layout variant, as `gemm.cu` lays it out (tiles in the
    /// operands' stored orientation, rows padded by 8 elements).
    fn shared_bytes(&self, a_t: bool, b_t: bool) -> usize {
        let (bm, bn, bk) = (self.bm, self.bn, self.bk);
        let a = if a_t { bk * (bm + 8) } else { bm * (bk + 8) };
        let b = if b_t { bn * (bk + 8) } else { bk * (bn + 8) };
        self.stages * (a + b) * 2
    }

    fn defines(&self, a_t: bool, b_t: bool) -> Vec<(&'static str, u32)> {
        vec![
            ("A_T", a_t as u32),
            ("B_T", b_t as u32),
            ("BM", self.bm as u32),
            ("BN", self.bn as u32),
            ("BK", self.bk as u32),
            ("STAGES", self.stages as u32),
            ("WARPS_M", self.warps_m as u32),
            ("WARPS_N", self.warps_n as u32),
        ]
    }
}

/// The `wgmma` kernel's configuration (`gemm_wgmma.cu`'s defines): a 128 × `bn` tile per block
/// of two computing warpgroups, k in steps of 64, a `stages`-deep pipeline, whether a third
/// warpgroup does the copies and whether they are bulk tensor copies (TMA). Chosen by
/// `WGMMA=1 bash bench/gpu/gemm_sweep.sh` (docs/PERFORMANCE.md): without TMA, 128 × 128, 3
/// stages and no copying warpgroup was the fastest of 9 configurations on an H100 (128 threads
/// cannot issue a stage's 2 048 `cp.async` copies fast enough); with TMA one thread issues a
/// stage in 2-6 instructions and the copying warpgroup pays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct WgmmaTiles {
    bn: usize,
    stages: usize,
    specialized: bool,
    /// The copying warpgroup fills stages with bulk tensor copies (TMA) from tensor maps.
    tma: bool,
    /// One `m64n256k16` instruction a k step (`bn` 256).
    wide: bool,
    /// One block per multiprocessor walks the tiles; each computing warpgroup writes its rows
    /// out through its own staging buffer while the next tile's stages fill.
    persistent: bool,
}

/// The `cp.async` configuration: where TMA is switched off (`VERL_GEMM_TMA=decomposed`).
const WGMMA_TILES: WgmmaTiles = WgmmaTiles {
    bn: 128,
    stages: 3,
    specialized: false,
    tma: false,
    wide: false,
    persistent: false,
};

/// The TMA configuration for most products, the default on Hopper: persistent blocks of
/// 128 × 256 tiles, 3 stages of 48 KiB filled by one thread's bulk copies, two computing
/// warpgroups of one `m64n256k16` each a k step. `WGMMA=1 bash bench/gpu/gemm_sweep.sh` on an
/// H200 (docs/PERFORMANCE.md): 94-95 % of cuBLAS on the step's NN/NT shapes and 117 % on TN
/// with a bf16 result (85 / 85 / 108 % in f32), against 49-61 % for the `cp.async` tiles.
const WGMMA_TMA_TILES: WgmmaTiles = WgmmaTiles {
    bn: 256,
    stages: 3,
    specialized: true,
    tma: true,
    wide: true,
    persistent: true,
};

/// The TMA configuration where 128 × 128 tiles finish sooner ([`wgmma_tiles`]): a narrow n
/// (the 0.5B's `o`/`down` at 896 columns made 64 tiles of 128 × 256 for 132 SMs, 55-62 % of
/// cuBLAS, against 93-107 % here), or a last wave mostly empty. 4 stages of 32 KiB.
const WGMMA_TMA_NARROW_TILES: WgmmaTiles = WgmmaTiles {
    bn: 128,
    stages: 4,
    specialized: true,
    tma: true,
    wide: false,
    persistent: true,
};

/// The Hopper GEMM's operand loads by TMA (on unless `VERL_GEMM_TMA=decomposed`, which keeps
/// the `cp.async` pipeline).
pub static TMA: KernelSwitch = KernelSwitch::new("VERL_GEMM_TMA");

/// A 128 × 128 tile's time against a 128 × 256 tile's: the wide tile reads A once for twice
/// the columns (about 10 % faster per column in the sweep).
const NARROW_TILE_COST: f64 = 0.55;

/// The `wgmma` tiles for an `m × n` product on a GPU of `sms` multiprocessors (see
/// [`tma_tiles`]), or the `cp.async` ones where TMA is switched off.
fn wgmma_tiles(m: usize, n: usize, sms: usize) -> WgmmaTiles {
    if TMA.enabled() {
        tma_tiles(m, n, sms)
    } else {
        WGMMA_TILES
    }
}

/// The TMA tiles whose waves of persistent blocks end first (a wave of wide tiles costs 1, of
/// narrow ones [`NARROW_TILE_COST`]).
fn tma_tiles(m: usize, n: usize, sms: usize) -> WgmmaTiles {
    let waves = |bn: usize| (m.div_ceil(WGMMA_BM) * n.div_ceil(bn)).div_ceil(sms.max(1)) as f64;
    if waves(WGMMA_TMA_TILES.bn) <= NARROW_TILE_COST * waves(WGMMA_TMA_NARROW_TILES.bn) {
        WGMMA_TMA_TILES
    } else {
        WGMMA_TMA_NARROW_TILES
    }
}

/// Rows of the product per block in `gemm_wgmma.cu` (two warpgroups of 64) and its k step.
const WGMMA_BM: usize = 128;
const WGMMA_BK: usize = 64;

impl WgmmaTiles {
    fn threads(&self) -> u32 {
        if self.specialized {
            384
        } else {
            256
        }
    }

    /// The pipeline's stages (both operands' tiles, bf16) plus 1 KiB to align its start to the
    /// 128-byte swizzle's 1 KiB period, as `gemm_wgmma.cu` lays it out, and with the
    /// persistent schedule the two warpgroups' staging buffers (`EPI_WG_BYTES`).
    fn shared_bytes(&self) -> usize {
        let staging = if self.persistent {
            2 * 64 * ((self.bn + 8) * 2).max(132 * 4)
        } else {
            0
        };
        self.stages * (WGMMA_BM + self.bn) * WGMMA_BK * 2 + staging + 1024
    }

    /// Blocks for an `m × n` product: one per tile, or with the persistent schedule at most
    /// one per multiprocessor (`sms`).
    fn grid(&self, m: usize, n: usize, sms: usize) -> (u32, u32, u32) {
        let (rows, cols) = (m.div_ceil(WGMMA_BM), n.div_ceil(self.bn));
        if self.persistent {
            ((rows * cols).min(sms.max(1)) as u32, 1, 1)
        } else {
            (cols as u32, rows as u32, 1)
        }
    }

    fn defines(&self, a_t: bool, b_t: bool) -> Vec<(&'static str, u32)> {
        vec![
            ("A_T", a_t as u32),
            ("B_T", b_t as u32),
            ("BN", self.bn as u32),
            ("STAGES", self.stages as u32),
            ("SPECIALIZED", self.specialized as u32),
            ("TMA", self.tma as u32),
            ("WIDE", self.wide as u32),
            ("PERSISTENT", self.persistent as u32),
        ]
    }
}

/// Which of our kernels and tiles [`launch_own`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OwnKernel {
    /// `wgmma` on Hopper, else `wmma` with the training tiles.
    Default,
    /// As `Default` with the `cp.async` pipeline on Hopper even where TMA is on.
    CpAsync,
    /// `wmma` with the training tiles on every GPU.
    Wmma,
    /// `wmma` with [`decode_tiles`].
    Decode,
    /// [`decode_gemm`]'s weight stream with these tiles where it takes the operands, else as
    /// [`OwnKernel::Decode`].
    Stream(StreamTiles),
}

/// `lhs · rhs` by our kernel, the operands read as [`own_layouts`] found them: the `wgmma` one
/// on Hopper unless `wmma` or the decode tiles are asked for.
fn launch_own(
    lhs: CudaPrimitive,
    rhs: CudaPrimitive,
    [a, b]: [StoredLayout; 2],
    which: OwnKernel,
    out_f32: bool,
) -> CudaPrimitive {
    let which = match which {
        OwnKernel::Stream(tiles) => {
            let (m, k, _) = super::product_dims(&lhs, &rhs);
            if decode_gemm::takes(m, k, a.transposed, b.transposed) && tiles.valid_for(m) {
                let hopper = hopper(lhs.device.index);
                return decode_gemm::launch(lhs, rhs, (a.pitch, b.pitch), out_f32, tiles, hopper);
            }
            match m <= DECODE_ROWS {
                true => OwnKernel::Decode,
                false => OwnKernel::Default,
            }
        }
        other => other,
    };
    let wgmma =
        matches!(which, OwnKernel::Default | OwnKernel::CpAsync) && hopper(lhs.device.index);
    // The wgmma kernel and the decode tiles write f32 when asked (the wmma training tiles
    // ignore `out_f32`).
    let out_f32 = out_f32 && (wgmma || which == OwnKernel::Decode);
    let out_dtype = if out_f32 { DType::F32 } else { lhs.dtype };
    let out = init_matmul_output(&lhs, &rhs, out_dtype);
    let (m, k, n) = super::product_dims(&lhs, &rhs);
    let (a_t, lda) = (a.transposed, a.pitch);
    let (b_t, ldb) = (b.transposed, b.pitch);
    // The kernel, its grid, and the tile width of a TMA kernel (whose B boxes are that wide).
    let (kernel, grid, tma_bn) = if wgmma {
        let sms = super::multiprocessors(&lhs);
        let tiles = match which {
            OwnKernel::CpAsync => WGMMA_TILES,
            _ => wgmma_tiles(m, n, sms),
        };
        let mut defines = tiles.defines(a_t, b_t);
        defines.push(("OUT_F32", out_f32 as u32));
        let kernel = CudaSource {
            entry: "verl_gemm_bf16_wgmma",
            text: WGMMA_SOURCE,
            defines,
            block: tiles.threads(),
            shared_bytes: tiles.shared_bytes(),
        };
        let grid = tiles.grid(m, n, sms);
        (kernel, grid, tiles.tma.then_some(tiles.bn))
    } else {
        let tiles = match which {
            OwnKernel::Decode => decode_tiles(m),
            _ => OWN_TILES,
        };
        let mut defines = tiles.defines(a_t, b_t);
        defines.push(("OUT_F32", out_f32 as u32));
        let kernel = CudaSource {
            entry: "verl_gemm_bf16",
            text: OWN_SOURCE,
            defines,
            block: tiles.threads(),
            shared_bytes: tiles.shared_bytes(a_t, b_t),
        };
        let grid = (n.div_ceil(tiles.bn) as u32, m.div_ceil(tiles.bm) as u32, 1);
        (kernel, grid, None)
    };
    // The output may be pitched too.
    let ldc = super::row_pitch(&out);
    let words = [m, n, k, lda, ldb, ldc, 0, 0].map(|w| w as u32);
    if let Some(bn) = tma_bn {
        // Stored [rows][cols]: A as [m][k] (K-major tiles: one box of the tile's rows) or
        // Aᵀ [k][m] (MN-major: 64 × 64 boxes); B as Bᵀ [n][k] or [k][n] likewise.
        let (a_rows, a_cols) = if a_t { (k, m) } else { (m, k) };
        let (b_rows, b_cols) = if b_t { (n, k) } else { (k, n) };
        let maps = [
            TileMap {
                operand: &lhs,
                rows: a_rows,
                cols: a_cols,
                pitch: lda,
                box_rows: if a_t { TileMap::BOX_COLS } else { WGMMA_BM },
            },
            TileMap {
                operand: &rhs,
                rows: b_rows,
                cols: b_cols,
                pitch: ldb,
                box_rows: if b_t { bn } else { TileMap::BOX_COLS },
            },
        ];
        // A and B go again as plain buffers too: cubecl orders a launch after another stream's
        // writes (a tensor made on another thread) only for its buffers.
        kernel.launch_with_maps(
            &out.client,
            grid,
            &maps,
            &[&lhs, &rhs, &out],
            pack_words(&words),
        );
    } else {
        kernel.launch(&out.client, grid, &[&lhs, &rhs, &out], pack_words(&words));
    }
    out
}

/// The cubek strategies `verl bench kernels` compares, by name.
pub const STRATEGY_NAMES: [&str; 7] = [
    "simple_cyclic_cmma",
    "simple_cyclic_mma",
    "double_tma_mma",
    "specialized_tma_mma",
    "specialized_tma_cmma",
    "specialized_cyclic_mma",
    "ordered_double_mma",
];

/// The strategy of a name in [`STRATEGY_NAMES`].
pub fn strategy(name: &str) -> Option<Strategy> {
    Some(match name {
        "simple_cyclic_cmma" => Strategy::SimpleCyclicCmma(Default::default()),
        "simple_cyclic_mma" => Strategy::SimpleCyclicMma(Default::default()),
        "double_tma_mma" => Strategy::DoubleTmaMma(Default::default()),
        "specialized_tma_mma" => Strategy::SpecializedTmaMma(Default::default()),
        "specialized_tma_cmma" => Strategy::SpecializedTmaCmma(Default::default()),
        "specialized_cyclic_mma" => Strategy::SpecializedCyclicMma(Default::default()),
        "ordered_double_mma" => Strategy::OrderedDoubleMma(Default::default()),
        _ => return None,
    })
}

/// A product's shape class: batched or not, and which operands are transposed views.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ShapeClass {
    pub batched: bool,
    pub lhs_transposed: bool,
    pub rhs_transposed: bool,
    /// An output side of at least [`WIDE`] (the LM head's vocabulary).
    pub wide_m: bool,
    pub wide_n: bool,
}

/// Where an output side counts as wide (the vocabulary of an LM head, not a hidden size).
pub const WIDE: usize = 32_768;

/// The strategy per shape class. Measured on an H100 (docs/PERFORMANCE.md, "GPU products"):
/// the warp-specialised TMA kernel with `mma.sync` tiles is the fastest or within 20 % of the
/// fastest on every product of the 0.5B step (the LM head 9.2 → 2.9 ms), and the only one
/// checked equal to burn's product on all of them, gradients included. Faster on a few
/// shapes but left out: WMMA tiles (`specialized_tma_cmma`), which failed at launch on the
/// LM head's `dC · Bᵀ` ("tile shape must be non-zero and <= 256", leaving the device unusable),
/// and double-buffered TMA on the LM head's weight gradient (6 % faster, not checked yet).
/// `VERL_GEMM_STRATEGY=<name>` overrides it for every class.
pub fn table_strategy(_class: ShapeClass) -> &'static str {
    "specialized_tma_mma"
}

/// `VERL_GEMM_STRATEGY`, read once (a name not in [`STRATEGY_NAMES`] is reported and ignored).
fn forced_strategy() -> Option<&'static str> {
    static FORCED: std::sync::OnceLock<Option<&'static str>> = std::sync::OnceLock::new();
    *FORCED.get_or_init(|| {
        let name = std::env::var("VERL_GEMM_STRATEGY").ok()?;
        let known = STRATEGY_NAMES.iter().copied().find(|n| *n == name);
        if known.is_none() {
            tracing::warn!(
                "VERL_GEMM_STRATEGY={name} is not one of {STRATEGY_NAMES:?}; using the table"
            );
        }
        known
    })
}

fn strategy_for(class: ShapeClass) -> (&'static str, Strategy) {
    let name = forced_strategy().unwrap_or_else(|| table_strategy(class));
    let s = strategy(name).expect("the table and STRATEGY_NAMES name known strategies");
    (name, s)
}

/// Shapes (with their strategy) that failed to set up once: they go to burn's product.
static FAILED: Mutex<Option<HashSet<FailedShape>>> = Mutex::new(None);

/// A strategy's name with the operand shapes it could not set up.
type FailedShape = (&'static str, Vec<usize>, Vec<usize>);

/// Whether `p`'s last two dimensions are stored transposed (a linear layer's weight `[out, in]`
/// seen as `wᵀ`).
fn is_transposed(p: &CudaPrimitive) -> bool {
    let strides = p.meta.strides();
    let n = strides.len();
    n >= 2 && strides[n - 2] == 1 && strides[n - 1] != 1
}

/// Whether an operand has a layout the TMA kernels take: contiguous, or the transpose of a
/// contiguous matrix (batch dimensions contiguous either way), its rows 16-byte aligned and its
/// first element at a 16-byte aligned offset (TMA descriptors need both). Anything else goes
/// to burn's product.
fn tma_friendly(p: &CudaPrimitive) -> bool {
    let shape = p.meta.shape();
    let strides = p.meta.strides();
    let n = shape.num_dims();
    if n < 2 {
        return false;
    }
    let (rows, cols) = (shape[n - 2], shape[n - 1]);
    let elem = p.dtype.size();
    let row_major = strides[n - 1] == 1 && strides[n - 2] == cols;
    let transposed = strides[n - 2] == 1 && strides[n - 1] == rows;
    let inner = if row_major { cols } else { rows };
    let mut batch_stride = rows * cols;
    let mut batch_ok = true;
    for d in (0..n - 2).rev() {
        batch_ok &= shape[d] == 1 || strides[d] == batch_stride;
        batch_stride *= shape[d];
    }
    let offset_ok = p.handle.offset_start.unwrap_or(0).is_multiple_of(16);
    (row_major || transposed) && batch_ok && (inner * elem).is_multiple_of(16) && offset_ok
}

fn class_of(lhs: &CudaPrimitive, rhs: &CudaPrimitive) -> ShapeClass {
    let (ls, rs) = (lhs.meta.shape(), rhs.meta.shape());
    let (m, n) = (ls[ls.num_dims() - 2], rs[rs.num_dims() - 1]);
    ShapeClass {
        batched: ls.num_dims() > 2 && ls[..ls.num_dims() - 2].iter().product::<usize>() > 1,
        lhs_transposed: is_transposed(lhs),
        rhs_transposed: is_transposed(rhs),
        wide_m: m >= WIDE,
        wide_n: n >= WIDE,
    }
}

/// `lhs · rhs` with the strategy named (a cubek one, `own`: our kernel, `own_cp`: ours with the
/// `cp.async` pipeline on Hopper (TMA's comparison), `wmma`: our `wmma`
/// kernel even on Hopper, `own_f32`: ours with an f32 result on Hopper, `decode`: the decode
/// step's choice (the `wgmma` decode kernel on Hopper or the weight stream where it applies,
/// else the decode tiles), `decode_stream`: the same without the `wgmma` kernel, `tiles`: the
/// `wmma` kernel with the decode tiles, `stream:R,W,U`: the weight stream with those tiles or an
/// error, `shared:R,W,S,split`: the shared-stage kernel so configured (the stream's k order for
/// the batch) or an error, `wgmma:T,G,S[,K]`: the Hopper decode kernel with T tiles, G
/// warpgroups, S stages (and K k splits, else the shape's) or an error; a `_f32` suffix asks for an f32 result), on burn-cuda primitives; a
/// setup error comes back as text. Public for `verl bench kernels`, which times every strategy.
pub fn launch_strategy(
    name: &str,
    lhs: CudaPrimitive,
    rhs: CudaPrimitive,
) -> Result<CudaPrimitive, String> {
    let base = name.strip_suffix("_f32").unwrap_or(name);
    let shared = base.strip_prefix("shared:");
    let wgmma = base.strip_prefix("wgmma:");
    let stream = base
        .strip_prefix("stream:")
        .or(shared.map(|_| ""))
        .or(wgmma.map(|_| ""));
    if matches!(
        base,
        "own" | "own_cp" | "wmma" | "decode" | "decode_stream" | "tiles"
    ) || stream.is_some()
    {
        let (rows, k, n) = super::product_dims(&lhs, &rhs);
        let which = match base {
            "wmma" => OwnKernel::Wmma,
            "own_cp" => OwnKernel::CpAsync,
            "decode" => OwnKernel::Stream(StreamTiles::for_rows(rows)),
            "decode_stream" => OwnKernel::Stream(StreamTiles {
                wgmma: Wgmma::Off,
                ..StreamTiles::for_rows(rows)
            }),
            "tiles" => OwnKernel::Decode,
            _ if wgmma.is_some() => {
                let text = wgmma.unwrap_or_default();
                if !hopper(lhs.device.index) {
                    return Err("the wgmma decode kernel needs a Hopper GPU".into());
                }
                let tiles = DecodeWgmma::parse(text)
                    .map(|(t, own_splits)| DecodeWgmma {
                        splits: if own_splits {
                            t.splits
                        } else {
                            DecodeWgmma::splits_for(n, k)
                        },
                        ..t
                    })
                    .filter(|t| t.valid_for(rows))
                    .ok_or_else(|| format!("`{text}`: no wgmma configuration for {rows} rows"))?;
                OwnKernel::Stream(StreamTiles {
                    shared: Shared::Off,
                    wgmma: Wgmma::On(tiles),
                    ..StreamTiles::for_rows(rows)
                })
            }
            _ if shared.is_some() => {
                let text = shared.unwrap_or_default();
                let tiles = SharedStage::parse(text)
                    .map(|stage| StreamTiles {
                        shared: Shared::On(stage),
                        wgmma: Wgmma::Off,
                        ..StreamTiles::for_rows(rows)
                    })
                    .filter(|t| t.valid_for(rows) && t.shared_stage(rows, n, k).is_some())
                    .ok_or_else(|| {
                        format!("`{text}`: no shared-stage configuration for {rows} rows")
                    })?;
                OwnKernel::Stream(tiles)
            }
            _ => match stream {
                Some(text) => {
                    let tiles = StreamTiles::parse(text)
                        .filter(|t| t.valid_for(rows))
                        .ok_or_else(|| {
                            format!("`{text}`: no stream configuration for {rows} rows")
                        })?;
                    OwnKernel::Stream(tiles)
                }
                None => OwnKernel::Default,
            },
        };
        let layouts = own_layouts(&lhs, &rhs);
        if let (OwnKernel::Stream(_), Some([a, b])) = (which, layouts) {
            if stream.is_some() && !decode_gemm::takes(rows, k, a.transposed, b.transposed) {
                // (`shared:` too: it takes what the stream takes.)
                return Err(format!(
                    "the weight stream does not take {rows} x {k} in this layout"
                ));
            }
        }
        return if let Some(layouts) = layouts {
            Ok(launch_own(lhs, rhs, layouts, which, name.ends_with("_f32")))
        } else {
            Err(format!(
                "our kernel does not take {:?}/{:?} x {:?}/{:?} ({:?}, {:?})",
                lhs.meta.shape(),
                lhs.meta.strides(),
                rhs.meta.shape(),
                rhs.meta.strides(),
                lhs.dtype,
                rhs.dtype
            ))
        };
    }
    let strategy = strategy(name).ok_or_else(|| format!("no strategy `{name}`"))?;
    launch(&strategy, lhs, rhs)
}

fn launch(
    strategy: &Strategy,
    lhs: CudaPrimitive,
    rhs: CudaPrimitive,
) -> Result<CudaPrimitive, String> {
    let out = init_matmul_output(&lhs, &rhs, lhs.dtype);
    let mut dtypes = MatmulElems::from_globals(&MatmulGlobalElems {
        lhs: lhs.dtype.into(),
        rhs: rhs.dtype.into(),
        out: out.dtype.into(),
    });
    let client = out.client.clone();
    let (lhs_dtype, rhs_dtype) = (lhs.dtype.into(), rhs.dtype.into());
    cubek::matmul::launch::launch_ref(
        strategy,
        &client,
        InputBinding::new(lhs.binding(), lhs_dtype),
        InputBinding::new(rhs.binding(), rhs_dtype),
        out.clone().binding(),
        &mut dtypes,
    )
    .map_err(|e| format!("{e:?}"))?;
    Ok(out)
}

/// `lhs · rhs` on burn-cuda primitives through the seam: the fixed strategy, or burn's product
/// when the seam is off or the strategy cannot run this shape.
pub fn matmul_primitive(lhs: CudaPrimitive, rhs: CudaPrimitive) -> CudaPrimitive {
    let kind = kind();
    if kind == GemmKind::Own || kind == GemmKind::Wmma {
        if let Some(layouts) = own_layouts(&lhs, &rhs) {
            let which = own_kernel(kind, &lhs);
            return launch_own(lhs, rhs, layouts, which, false);
        }
    }
    if kind != GemmKind::Burn && tma_friendly(&lhs) && tma_friendly(&rhs) {
        let (name, strategy) = strategy_for(class_of(&lhs, &rhs));
        let key = (name, lhs.meta.shape().to_vec(), rhs.meta.shape().to_vec());
        let failed = FAILED
            .lock()
            .map(|f| f.as_ref().is_some_and(|f| f.contains(&key)))
            .unwrap_or(false);
        if !failed {
            match launch(&strategy, lhs.clone(), rhs.clone()) {
                Ok(out) => return out,
                Err(e) => {
                    tracing::warn!(
                        "cubek {} cannot run {:?} x {:?} ({e}); burn's product takes this shape",
                        key.0,
                        key.1,
                        key.2
                    );
                    if let Ok(mut f) = FAILED.lock() {
                        f.get_or_insert_with(HashSet::new).insert(key);
                    }
                }
            }
        }
    }
    CudaBackend::float_matmul(lhs, rhs)
}

/// `lhs · rhs` of bf16 operands with an f32 result where our Hopper kernel runs (its epilogue
/// writes f32, so no cast follows), else [`matmul_primitive`]'s bf16 result: for products
/// whose result goes on in f32 outside autodiff (generation).
pub fn matmul_primitive_f32(lhs: CudaPrimitive, rhs: CudaPrimitive) -> CudaPrimitive {
    let kind = kind();
    if kind == GemmKind::Own || kind == GemmKind::Wmma {
        let which = own_kernel(kind, &lhs);
        let decode = matches!(which, OwnKernel::Decode | OwnKernel::Stream(_));
        if decode || (kind == GemmKind::Own && hopper(lhs.device.index)) {
            if let Some(layouts) = own_layouts(&lhs, &rhs) {
                return launch_own(lhs, rhs, layouts, which, true);
            }
        }
    }
    matmul_primitive(lhs, rhs)
}

/// Which of our kernels a product of `lhs`'s rows takes under `kind`: the decode tiles for at
/// most [`DECODE_ROWS`] rows (unless switched off), else `kind`'s.
fn own_kernel(kind: GemmKind, lhs: &CudaPrimitive) -> OwnKernel {
    let shape = lhs.meta.shape();
    let rows = shape[shape.num_dims() - 2];
    match kind {
        // Past the decode tiles' rows, `VERL_GEMM=wmma` keeps its kernel (a comparison switch).
        _ if rows <= stream_rows()
            && decode_gemm_mode() == DecodeGemm::Stream
            && (rows <= DECODE_ROWS || kind != GemmKind::Wmma) =>
        {
            OwnKernel::Stream(StreamTiles::for_rows(rows))
        }
        _ if rows <= DECODE_ROWS && decode_gemm_mode() == DecodeGemm::Tiles => OwnKernel::Decode,
        GemmKind::Wmma => OwnKernel::Wmma,
        _ => OwnKernel::Default,
    }
}

fn transpose(p: CudaPrimitive) -> CudaPrimitive {
    let n = p.meta.shape().num_dims();
    CudaBackend::float_swap_dims(p, n - 2, n - 1)
}

/// `p` as bf16: itself if it is, else cast. A transposed view (a linear layer's `wᵀ`) is cast
/// through its stored order and viewed transposed again, so the cast reads and writes
/// contiguous rows (a transposed tensor is cast one element at a time).
fn low(p: CudaPrimitive) -> CudaPrimitive {
    if p.dtype == DType::BF16 {
        p
    } else if is_transposed(&p) {
        transpose(CudaBackend::float_cast(transpose(p), FloatDType::BF16))
    } else {
        CudaBackend::float_cast(p, FloatDType::BF16)
    }
}

/// `lhs · rhs` of bf16 operands with the result in `dtype`: written as f32 by our Hopper
/// kernel's epilogue where it runs (no cast kernel, no bf16 rounding of the result), else cast.
fn product_in(lhs: CudaPrimitive, rhs: CudaPrimitive, dtype: DType) -> CudaPrimitive {
    let out = if dtype == DType::F32 {
        matmul_primitive_f32(lhs, rhs)
    } else {
        matmul_primitive(lhs, rhs)
    };
    debug_assert!(
        matches!(dtype, DType::F32 | DType::BF16 | DType::F16),
        "a product's gradient in {dtype:?}"
    );
    if out.dtype == dtype {
        out
    } else {
        let dtype = match dtype {
            DType::BF16 => FloatDType::BF16,
            DType::F16 => FloatDType::F16,
            _ => FloatDType::F32,
        };
        CudaBackend::float_cast(out, dtype)
    }
}

/// The backward step of `C = A · B` (bf16 products, C in f32): `dA = dC · Bᵀ`, `dB = Aᵀ · dC`,
/// each written in its operand's own dtype (an f32 weight's gradient straight from the
/// product's epilogue). Where B is stored transposed, `dB = (dCᵀ · A)ᵀ`: the product writes the
/// gradient in B's stored order, so a weight's gradient is row-major like the weight.
#[derive(Debug)]
struct MatmulBackward;

impl Backward<CudaBackend, 2> for MatmulBackward {
    /// The bf16 operands, and the dtypes of the operands as given.
    type State = (CudaPrimitive, CudaPrimitive, DType, DType);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (a, b, a_dtype, b_dtype) = ops.state;
        let b_transposed = is_transposed(&b);
        // The incoming gradient is cast to bf16 once for both products (burn's `binary` would
        // hand each product its own f32 copy to cast).
        let dc = low(grads.consume::<CudaBackend>(&ops.node));
        let [a_node, b_node] = ops.parents;
        if let Some(node) = a_node {
            grads.register::<CudaBackend>(node.id, product_in(dc.clone(), transpose(b), a_dtype));
        }
        if let Some(node) = b_node {
            let db = if b_transposed {
                transpose(product_in(transpose(dc), a, b_dtype))
            } else {
                product_in(transpose(a), dc, b_dtype)
            };
            grads.register::<CudaBackend>(node.id, db);
        }
    }
}

/// The operands handed back.
pub type NotApplied<B, const D: usize> = (Tensor<B, D>, Tensor<B, D>);

/// Whether the seam takes operands of these shapes (same batch dimensions).
fn applies<const D: usize>(da: [usize; D], db: [usize; D]) -> bool {
    kind() != GemmKind::Burn && D >= 2 && da[..D - 2] == db[..D - 2]
}

/// `a · b` through the seam when both operands have the same batch dimensions, the operands
/// (f32 or bf16) read as bf16; the operands back otherwise (the caller multiplies with burn).
/// The result may come as f32 (callers cast to f32 either way).
pub fn matmul<const D: usize>(
    a: Tensor<CudaBackend, D>,
    b: Tensor<CudaBackend, D>,
) -> Result<Tensor<CudaBackend, D>, NotApplied<CudaBackend, D>> {
    if !applies(a.dims(), b.dims()) {
        return Err((a, b));
    }
    let (a, b) = (a.into_primitive().tensor(), b.into_primitive().tensor());
    let c = matmul_primitive_f32(low(a), low(b));
    Ok(Tensor::from_primitive(TensorPrimitive::Float(c)))
}

/// [`matmul`] under autodiff: one custom operation that casts its operands to bf16 itself,
/// returns f32 and gives each operand's gradient in that operand's dtype, its two backward
/// products through the seam too. Against a chain of burn casts around a bf16 product it saves
/// three cast kernels a product (the result's, and both gradients').
pub fn matmul_tracked<C: CheckpointStrategy, const D: usize>(
    a: Tensor<Autodiff<CudaBackend, C>, D>,
    b: Tensor<Autodiff<CudaBackend, C>, D>,
) -> Result<Tensor<Autodiff<CudaBackend, C>, D>, NotApplied<Autodiff<CudaBackend, C>, D>> {
    if !applies(a.dims(), b.dims()) {
        return Err((a, b));
    }
    let a = a.into_primitive().tensor();
    let b = b.into_primitive().tensor();
    let (a_dtype, b_dtype) = (a.primitive.dtype, b.primitive.dtype);
    let (a16, b16) = (low(a.primitive.clone()), low(b.primitive.clone()));
    let c = product_in(a16.clone(), b16.clone(), DType::F32);
    Ok(record(
        MatmulBackward,
        [&a, &b],
        (a16, b16, a_dtype, b_dtype),
        c,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tiles split into whole 16 × 16 fragments per warp and whole 16-byte copies, and every
    /// layout's pipeline fits the H100's 227 KiB of shared memory per block.
    #[test]
    fn tile_configuration_is_consistent() {
        let t = OWN_TILES;
        assert_eq!(t.bm % (16 * t.warps_m), 0);
        assert_eq!(t.bn % (16 * t.warps_n), 0);
        assert!(t.bk.is_multiple_of(16) && t.stages >= 2);
        for (a_t, b_t) in [(false, false), (false, true), (true, false), (true, true)] {
            assert!(t.shared_bytes(a_t, b_t) <= 227 * 1024);
        }
        // A: 128 rows of 32 + 8, B stored transposed: 128 rows of 32 + 8; 4 stages of bf16.
        assert_eq!(t.shared_bytes(false, true), 4 * (128 * 40 + 128 * 40) * 2);
        assert_eq!(t.threads(), 128);
        assert_eq!(t.defines(true, false)[..2], [("A_T", 1), ("B_T", 0)]);
    }

    /// The decode tiles: whole fragments per warp and whole copies for every batch up to
    /// [`DECODE_ROWS`], row tiles less than 32 rows taller than the batch, and
    /// at least two blocks' pipelines per H100 SM (its 227 KiB).
    #[test]
    fn decode_tiles_are_consistent() {
        for m in 1..=DECODE_ROWS {
            let t = decode_tiles(m);
            assert_eq!(t.bm, 16 * t.warps_m);
            assert_eq!(t.bn % (16 * t.warps_n), 0);
            assert!(t.bm >= m && t.bm - m < 32, "m {m}: {} rows", t.bm);
            assert!(t.bk.is_multiple_of(16) && t.stages >= 2);
            assert!(2 * t.shared_bytes(false, true) <= 227 * 1024, "m {m}");
        }
        assert_eq!(decode_tiles(1).bm, 16);
        assert_eq!(decode_tiles(17).bm, 32);
        assert_eq!(decode_tiles(64).bm, 64);
        // 6 stages of (16 + 32) rows of 128 + 8 bf16.
        assert_eq!(decode_tiles(8).shared_bytes(false, true), 6 * 48 * 136 * 2);
    }

    /// The `wgmma` kernel's pipeline fits the 227 KiB a Hopper block may have, its tile is whole
    /// n128 instructions, and the sizes match `gemm_wgmma.cu`'s `GEMM_SMEM_BYTES`.
    #[test]
    fn wgmma_configuration_is_consistent() {
        let t = WGMMA_TILES;
        assert!(t.bn.is_multiple_of(128) && t.bn <= 256);
        assert!(t.stages >= if t.specialized { 2 } else { 3 });
        assert!(t.shared_bytes() <= 227 * 1024);
        // 3 stages of (128 + 128) rows of 64 bf16, plus the alignment slack.
        assert_eq!(t.shared_bytes(), 3 * 256 * 64 * 2 + 1024);
        assert_eq!(t.threads(), 256);
        assert!(WGMMA_SOURCE.contains("#define BM 128") && WGMMA_SOURCE.contains("#define BK 64"));
        assert_eq!(t.defines(false, true)[..2], [("A_T", 0), ("B_T", 1)]);
        // The TMA tiles: one m64n256 instruction per warpgroup, boxes of at most 256 rows, and
        // a stage that the single expect-tx count covers (A's and B's boxes, bf16).
        for t in [WGMMA_TILES, WGMMA_TMA_TILES, WGMMA_TMA_NARROW_TILES] {
            // The f32 epilogue's BM × (BN + 4) tile reuses the pipeline's memory.
            assert!(WGMMA_BM * (t.bn + 4) * 4 <= t.stages * (WGMMA_BM + t.bn) * WGMMA_BK * 2);
            assert!(!t.persistent || t.tma);
        }
        for t in [WGMMA_TMA_TILES, WGMMA_TMA_NARROW_TILES] {
            assert!(t.tma && t.specialized && t.threads() == 384);
            assert!(!t.wide || t.bn == 256);
            assert!(t.bn <= 256 && WGMMA_BM <= 256);
            assert!(t.shared_bytes() + 2 * t.stages * 8 <= 227 * 1024);
            assert!(t.defines(true, true).contains(&("TMA", 1)));
        }
        // 3 stages of (128 + 256) rows of 64 bf16, two staging buffers of 64 × (256 + 8) bf16.
        assert_eq!(
            WGMMA_TMA_TILES.shared_bytes(),
            3 * (128 + 256) * 64 * 2 + 2 * 64 * 264 * 2 + 1024
        );
        // The narrow tiles where the wide ones would leave multiprocessors idle or a last wave
        // mostly empty (the sweep's choices, docs/PERFORMANCE.md).
        assert_eq!(tma_tiles(2048, 4864, 132), WGMMA_TMA_NARROW_TILES);
        assert_eq!(tma_tiles(2048, 896, 132), WGMMA_TMA_NARROW_TILES);
        assert_eq!(tma_tiles(8192, 1536, 132), WGMMA_TMA_TILES);
        assert_eq!(tma_tiles(2044, 151_936, 132), WGMMA_TMA_TILES);
        assert_eq!(tma_tiles(8192, 8960, 132), WGMMA_TMA_TILES);
        // Persistent blocks: at most one per multiprocessor, never more than the tiles.
        assert_eq!(WGMMA_TMA_TILES.grid(8192, 1536, 132), (132, 1, 1));
        assert_eq!(WGMMA_TMA_TILES.grid(100, 300, 132), (2, 1, 1));
        assert_eq!(WGMMA_TILES.grid(300, 300, 132), (3, 3, 1));
    }
}
