//! Collectives among the GPUs of one node as one kernel on burn's stream (`collectives.cu`):
//! all-reduce (one-shot for small messages, two-shot above [`TWO_SHOT_BYTES`]), all-gather,
//! reduce-scatter and broadcast over peer-mapped staging buffers, meeting at a device-side
//! barrier. Ordered with burn's operations like any other kernel: no host wait.
//!
//! The staging buffers and their mapping are [`crate::cuda::peer::PeerBuffers`]'; this module
//! only knows the pointers it is handed ([`PeerCall`]). The fallback is NCCL behind a host
//! wait (`crate::cuda::nccl`), which `verl bench nccl` and the GPU tests compare this against.

use burn::tensor::DType;

use super::source::{pack_words, CudaSource};
use super::{empty_of, CudaPrimitive, KernelSwitch};

const SOURCE: &str = include_str!("collectives.cu");
/// Threads per block.
const THREADS: u32 = 512;
/// Blocks per launch at most (`MAX_BLOCKS` in the source: the flag arrays' size). Every block
/// must be resident at once on every GPU (they wait for each other): at most one per SM of
/// the smallest card (H100 PCIe: 114), two fit per SM.
pub const MAX_BLOCKS: u32 = 128;
/// Blocks for messages of at most [`LARGE_BYTES`]: fewer blocks, fewer flags to meet at the
/// barrier, which is most of a small message's time.
pub const SMALL_MESSAGE_BLOCKS: u32 = 48;
/// Messages above this many bytes take up to [`MAX_BLOCKS`] blocks, to keep enough reads in
/// flight over NVLink.
pub const LARGE_BYTES: usize = 4 << 20;
/// Ranks per group at most (`MAX_RANKS` in the source): the GPUs of one node.
pub const MAX_RANKS: usize = 8;
/// Bytes of one flag array: a slot per barrier of a call (two), block and rank.
pub const FLAG_BYTES: usize = 2 * MAX_BLOCKS as usize * MAX_RANKS * 4;
/// All-reduces of more bytes than this go two-shot (reduce-scatter then all-gather: each rank
/// reads 2(w-1)/w of the message instead of w times it).
pub const TWO_SHOT_BYTES: usize = 256 << 10;

/// Whether collectives of one node run as these kernels: on unless
/// `VERL_DEVICE_COLLECTIVES=decomposed` (NCCL behind a host wait), or `SWITCH.set(false)`.
pub static SWITCH: KernelSwitch = KernelSwitch::new("VERL_DEVICE_COLLECTIVES");

/// Which collective a launch runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    /// op over the ranks, element-wise; the output has the input's length.
    AllReduce(u32),
    /// The ranks' `[outer, inner]` inputs as `[outer, world, inner]` (outer 1: one after
    /// another).
    AllGather { outer: u32 },
    /// op over the ranks of the rank's place of the middle of the `[outer, world, inner]`
    /// input, as `[outer, inner]` (outer 1: the rank's `world`-th chunk).
    ReduceScatter { op: u32, outer: u32 },
    /// The root's input.
    Broadcast { root: u32 },
}

/// `Sum`, `Avg`, `Max` as the kernel numbers them.
pub const OP_SUM: u32 = 0;
pub const OP_AVG: u32 = 1;
pub const OP_MAX: u32 = 2;

/// One call's view of the group's staging buffers.
#[derive(Debug, Clone)]
pub struct PeerCall {
    /// Every rank's staging half for this call, by rank.
    pub data: Vec<u64>,
    /// Every rank's flag array, by rank.
    pub flags: Vec<u64>,
    pub rank: u32,
    /// The call's number in the group (from 1, the same on every rank).
    pub epoch: u32,
    pub timeout_ns: u64,
}

/// Elements of `dtype` that one 16-byte load carries (the kernel's vector unit).
fn vector(dtype: DType) -> usize {
    if dtype == DType::BF16 {
        8
    } else {
        4
    }
}

/// Whether the kernel takes tensors of `dtype`.
pub fn takes(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16)
}

/// Launches `collective` over the `n` elements of `input` (contiguous, f32 or bf16) into
/// `output` ([`output_for`]). The staging halves must hold `n` elements. Returns nothing: the
/// result is ordered on burn's stream.
pub fn launch(
    collective: Collective,
    input: &CudaPrimitive,
    output: &CudaPrimitive,
    n: usize,
    call: &PeerCall,
) {
    let world = call.data.len();
    let dtype = input.dtype;
    let v = vector(dtype);
    // `whole`: the elements of one contiguous run of a rank's part.
    let (kind, op, root, whole) = match collective {
        Collective::AllReduce(op) => {
            let bytes = n * dtype.size();
            let two_shot = bytes > TWO_SHOT_BYTES && n.is_multiple_of(world);
            let kind = if two_shot { 1 } else { 0 };
            (kind, op, 0, if two_shot { n / world } else { n })
        }
        Collective::AllGather { outer } => (2, OP_SUM, 0, n / outer as usize),
        Collective::ReduceScatter { op, outer } => (3, op, 0, n / (world * outer as usize)),
        Collective::Broadcast { root } => (4, OP_SUM, root, n),
    };
    // Vector loads need whole units everywhere: the count and each rank's chunk.
    let vectorised = n.is_multiple_of(v) && whole.is_multiple_of(v);
    let units = if vectorised { n / v } else { n };
    let cap = if n * dtype.size() > LARGE_BYTES {
        MAX_BLOCKS
    } else {
        SMALL_MESSAGE_BLOCKS
    };
    let blocks = (units as u32).div_ceil(THREADS).clamp(1, cap);
    let mut info = Vec::with_capacity(2 * MAX_RANKS + 6);
    for list in [&call.data, &call.flags] {
        info.extend(list.iter().copied());
        info.extend(std::iter::repeat_n(0, MAX_RANKS - list.len()));
    }
    info.extend(pack_words(&[
        call.rank,
        world as u32,
        n as u32,
        call.epoch,
        kind,
        root,
        op,
        vectorised as u32,
        match collective {
            Collective::AllGather { outer } | Collective::ReduceScatter { outer, .. } => outer,
            _ => 1,
        },
        0,
    ]));
    info.push(call.timeout_ns);
    CudaSource {
        entry: "verl_collective",
        text: SOURCE,
        defines: vec![
            ("ELEM_BF16", (dtype == DType::BF16) as u32),
            ("MAX_BLOCKS", MAX_BLOCKS),
            ("MAX_RANKS", MAX_RANKS as u32),
            ("THREADS", THREADS),
        ],
        block: THREADS,
        shared_bytes: 0,
    }
    .launch(&input.client, (blocks, 1, 1), &[input, output], info);
}

/// A new output for `collective` of `n` input elements over `world` ranks, like `input`.
pub fn output_for(
    collective: Collective,
    input: &CudaPrimitive,
    n: usize,
    world: usize,
) -> CudaPrimitive {
    let len = match collective {
        Collective::AllReduce(_) | Collective::Broadcast { .. } => n,
        Collective::AllGather { .. } => n * world,
        Collective::ReduceScatter { .. } => n / world,
    };
    empty_of(input, vec![len], input.dtype)
}
