// A decode step's product C = A · Wᵀ on Hopper's warpgroup tensor-core instruction (wgmma,
// sm_90a only): a few rows of activations A [M][K] (row pitch lda) against a weight stored as the
// model keeps it, W [N][K] (row pitch ldb), both bf16, f32 accumulation, C [M][N] (row pitch
// ldc) in f32 or bf16.
//
// The weights are the instruction's 64 rows and the batch its N (8 to 64 columns): a block owns
// WG_GROUPS x WG_TILES tiles of 64 weight rows and WG_NB 8-row groups of the batch. A copying
// warpgroup fills a WG_STAGES-deep ring of shared-memory stages with cp.async (each stage: the
// block's weight rows and batch rows over 64 of k, 128-byte swizzled as wgmma reads them) and
// hands each over by an mbarrier; the computing warpgroups issue their products back to back and
// give the stage back by another. This is what the mma.sync stream could not do at 17-64 batch
// rows: its warps spend their issue slots on loads, fragment shuffles and 16x8 products, where
// one wgmma does 64 x N x 16 from shared memory.
//
// k order: each output is one accumulator walking k tiles of 64 in order, with wgmma's own order
// inside a tile. That order does not depend on N (checked: a row's first 8 values are the same to
// the bit at N = 8, 16, 32 and 64), so a batch row's result does not depend on its batch mates or
// on the batch size, as long as a product keeps its k split. With grid y > 1, block y takes the
// y-th equal run of k tiles into f32 partial sums [y][M][ldc], added in y order into C either by
// the last of a unit's blocks to finish (parameter unused1 = 1: an atomic count per unit in
// `counters`, which it sets back to 0; no second launch, for a few batch rows) or by
// verl_decode_gemm_wgmma_sum (many rows: one block adding a unit's rows would be the tail). Both
// add the same f32 values in the same order. The caller fixes the split from the product's
// shape alone.
//
// Grid: x = at most ceil(N / (64 WG_GROUPS WG_TILES)) * batch_blocks units (a weight tile's batch
// blocks are neighbours, so the later ones find the tile in L2; fewer blocks loop over the units),
// y = k splits. batch_blocks comes in
// the parameter block's unused0. Compiled at run time by NVRTC for sm_90a
// (verl_megatron::cuda::kernels::decode_gemm prepends the defines and gemm_common.cuh), and by
// nvcc on a GPU machine for bench/gpu/decode_wgmma_harness.cu. The caller guarantees K % 8 == 0
// and 16-byte aligned rows and starts.

#ifndef WG_NB
#define WG_NB 8  // 8-row groups of the batch per block (1..16)
#endif
#ifndef WG_TILES
#define WG_TILES 2  // 64-row weight tiles per computing warpgroup
#endif
#ifndef WG_GROUPS
#define WG_GROUPS 1  // computing warpgroups
#endif
#ifndef WG_STAGES
#define WG_STAGES 6  // stages in the ring
#endif
#ifndef OUT_F32
#define OUT_F32 1
#endif
#if OUT_F32
typedef float out_t;
__device__ __forceinline__ float to_out(float x) { return x; }
#else
typedef bf16 out_t;
__device__ __forceinline__ bf16 to_out(float x) { return __float2bfloat16(x); }
#endif

#if WG_NB < 1 || WG_NB > 16
#error "WG_NB is 1..16"
#endif
#define WG_N (8 * WG_NB)
// Batch rows 0-63 of a block in one wgmma of N = 8 WG_LO, rows 64-127 in a second of 8 WG_HI.
#define WG_LO (WG_NB < 8 ? WG_NB : 8)
#define WG_HI (WG_NB - WG_LO)
#define WG_ROWS (64 * WG_TILES * WG_GROUPS)
#define WG_W_BYTES (WG_ROWS * 128)
#define WG_X_BYTES (WG_N * 128)
#define WG_STAGE_BYTES (WG_W_BYTES + WG_X_BYTES)
#define WG_THREADS (128 * (WG_GROUPS + 1))
// The ring plus 1 KiB to align its start to the swizzle's 1 KiB period.
#define WG_SMEM_BYTES (WG_STAGES * WG_STAGE_BYTES + 1024)

// A shared-memory descriptor of a K-major tile with the 128-byte swizzle: 8-row groups 1 KiB
// apart, a k step of 16 is 32 bytes along the row.
__device__ __forceinline__ unsigned long long wg_desc(unsigned int addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
           (1ull << 62);
}

// `ROWS` rows (from row0, of extent) x 64 of k (from k0, of k_extent) of a [row][k] matrix with
// pitch `ld`, copied by the 128 threads of the copying warpgroup into a swizzled tile: the
// 16-byte piece p of row r lands at piece p ^ (r % 8).
template <int ROWS>
__device__ __forceinline__ void wg_copy_tile(unsigned int tid, unsigned int dst, const bf16* src, unsigned int ld,
                                             unsigned int row0, unsigned int extent, unsigned int k0,
                                             unsigned int k_extent) {
#pragma unroll 4
    for (unsigned int c = tid; c < ROWS * 8; c += 128) {
        const unsigned int r = c / 8, q = c % 8;
        const unsigned int ok = row0 + r < extent ? inside(k0 + q * 8, k_extent) : 0u;
        const bf16* from = ok ? src + (unsigned long long)(row0 + r) * ld + k0 + q * 8 : src;
        copy16(dst + r * 128 + ((q ^ (r % 8)) * 16), from, ok);
    }
}

__device__ __forceinline__ void wg_bar_init(unsigned int bar, unsigned int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void wg_bar_arrive(unsigned int bar) {
    asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Arrives once this thread's earlier cp.async copies have landed (counted in the barrier's init).
__device__ __forceinline__ void wg_bar_arrive_copies(unsigned int bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void wg_bar_wait(unsigned int bar, unsigned int parity) {
    asm volatile(
        "{\n"
        " .reg .pred done;\n"
        "wait_%=:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra wait_%=;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// d (4 NBV f32 per thread) += W tile (64 x 16, K-major) · X tile (8 NBV x 16, K-major)ᵀ: one
// wgmma of N = 8 NBV. NBV = 0 does nothing (a block of at most 64 batch rows has no second half).
template <int NBV>
__device__ __forceinline__ void wg_mma(float* d, unsigned long long da, unsigned long long db) {}
template <>
__device__ __forceinline__ void wg_mma<1>(float* d, unsigned long long da, unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, 1, 1, 1, 0, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "l"(da), "l"(db));
}
template <>
__device__ __forceinline__ void wg_mma<2>(float* d, unsigned long long da, unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, 1, 1, 1, 0, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "l"(da), "l"(db));
}
template <>
__device__ __forceinline__ void wg_mma<3>(float* d, unsigned long long da, unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n24k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}, %12, %13, 1, 1, 1, 0, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
                 : "l"(da), "l"(db));
}
template <>
__device__ __forceinline__ void wg_mma<4>(float* d, unsigned long long da, unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, 1, 1, 1, 0, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "l"(da), "l"(db));
}
template <>
__device__ __forceinline__ void wg_mma<5>(float* d, unsigned long long da, unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n40k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19}, %20, %21, 1, 1, 1, 0, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19])
                 : "l"(da), "l"(db));
}
template <>
__device__ __forceinline__ void wg_mma<6>(float* d, unsigned long long da, unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, %24, %25, 1, 1, 1, 0, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
                 : "l"(da), "l"(db));
}
template <>
__device__ __forceinline__ void wg_mma<7>(float* d, unsigned long long da, unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n56k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27}, %28, %29, 1, 1, 1, 0, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27])
                 : "l"(da), "l"(db));
}
template <>
__device__ __forceinline__ void wg_mma<8>(float* d, unsigned long long da, unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, 1, 1, 1, 0, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(da), "l"(db));
}

// C[m][n] = v, or the f32 partial sum of split blockIdx.y ([split][M][ldc]) under a k split.
__device__ __forceinline__ void wg_store(out_t* c, float* parts, const GemmParams& p, unsigned int n, unsigned int m,
                                         float v) {
    if (m >= p.m || n >= p.n) return;
    if (gridDim.y > 1)
        parts[((unsigned long long)blockIdx.y * p.m + m) * p.ldc + n] = v;
    else
        c[(unsigned long long)m * p.ldc + n] = to_out(v);
}

// The computing warpgroups only (the copying one has left).
__device__ __forceinline__ void wg_consumers_sync() {
    asm volatile("bar.sync 1, %0;\n" ::"n"(WG_GROUPS * 128) : "memory");
}

// Parameters: unused0 = batch blocks, unused1 = 1 where the last block of a unit adds a split's
// partial sums. `parts` [splits][M][ldc] f32 and `counters` (one u32 per unit, all 0 at the
// launch and left 0) serve a split only (splits: the grid's y).
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1)
verl_decode_gemm_wgmma(const bf16* __restrict__ a, const bf16* __restrict__ w, out_t* __restrict__ c,
                       float* __restrict__ parts, unsigned int* __restrict__ counters, GemmParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(128) unsigned char wg_raw[];
    const unsigned int raw = (unsigned int)__cvta_generic_to_shared(wg_raw);
    const unsigned int base = raw + (1024 - raw % 1024) % 1024;
    // full[s]: the copying warpgroup's 128 threads arrive once their copies of stage s landed;
    // empty[s]: each computing warpgroup arrives once its products have read stage s.
    __shared__ __align__(8) unsigned long long bars[2 * WG_STAGES];
    const unsigned int full = (unsigned int)__cvta_generic_to_shared(bars), empty = full + WG_STAGES * 8;

    // Units of work: (weight tile of WG_ROWS rows, batch block) pairs, a tile's batch blocks
    // neighbours. Block x takes units x, x + gridDim.x, ... (a persistent grid when smaller than
    // the units: each block's ring runs on into its next unit while it writes the last one).
    const unsigned int batch_blocks = p.unused0 > 0 ? p.unused0 : 1u;
    const unsigned int units = (p.n + WG_ROWS - 1) / WG_ROWS * batch_blocks;
    const unsigned int all_tiles = (p.k + 63) / 64, per = (all_tiles + gridDim.y - 1) / gridDim.y;
    const unsigned int kt0 = blockIdx.y * per;
    const unsigned int k_tiles = kt0 < all_tiles ? min(per, all_tiles - kt0) : 0u;

    if (threadIdx.x == 0) {
        for (int s = 0; s < WG_STAGES; ++s) {
            wg_bar_init(full + s * 8, 128);
            wg_bar_init(empty + s * 8, WG_GROUPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const unsigned int group = threadIdx.x / 128;
    // `step` counts this block's k tiles over all its units: stage step % WG_STAGES, its
    // (step / WG_STAGES)-th use.
    unsigned int step = 0;
    if (group == WG_GROUPS) {
        const unsigned int tid = threadIdx.x % 128;
        for (unsigned int u = blockIdx.x; u < units; u += gridDim.x) {
            const unsigned int n0 = u / batch_blocks * WG_ROWS, m0 = u % batch_blocks * WG_N;
            for (unsigned int kt = 0; kt < k_tiles; ++kt, ++step) {
                const unsigned int s = step % WG_STAGES, stage = base + s * WG_STAGE_BYTES, k0 = (kt0 + kt) * 64;
                // The stage's previous tile must have been read by every computing group.
                if (step >= WG_STAGES) wg_bar_wait(empty + s * 8, ((step / WG_STAGES) + 1) & 1);
                wg_copy_tile<WG_ROWS>(tid, stage, w, p.ldb, n0, p.n, k0, p.k);
                wg_copy_tile<WG_N>(tid, stage + WG_W_BYTES, a, p.lda, m0, p.m, k0, p.k);
                wg_bar_arrive_copies(full + s * 8);
            }
        }
        // (The copies were never committed as groups: wait for them all before leaving.)
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        return;
    }

    const unsigned int q = (threadIdx.x % 128) / 32, l = threadIdx.x % 32;
    for (unsigned int u = blockIdx.x; u < units; u += gridDim.x) {
        const unsigned int n0 = u / batch_blocks * WG_ROWS, m0 = u % batch_blocks * WG_N;
        float lo[WG_TILES][4 * WG_LO], hi[WG_TILES][WG_HI > 0 ? 4 * WG_HI : 1];
#pragma unroll
        for (int t = 0; t < WG_TILES; ++t) {
#pragma unroll
            for (int i = 0; i < 4 * WG_LO; ++i) lo[t][i] = 0.0f;
#pragma unroll
            for (int i = 0; i < 4 * WG_HI; ++i) hi[t][i] = 0.0f;
        }
        for (unsigned int kt = 0; kt < k_tiles; ++kt, ++step) {
            const unsigned int s = step % WG_STAGES, stage = base + s * WG_STAGE_BYTES;
            wg_bar_wait(full + s * 8, (step / WG_STAGES) & 1);
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async's writes before wgmma's reads
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
#pragma unroll
                for (int t = 0; t < WG_TILES; ++t) {
                    const unsigned long long dw = wg_desc(stage + (group * WG_TILES + t) * 64 * 128 + kk * 32);
                    wg_mma<WG_LO>(lo[t], dw, wg_desc(stage + WG_W_BYTES + kk * 32));
                    wg_mma<WG_HI>(hi[t], dw, wg_desc(stage + WG_W_BYTES + 64 * 128 + kk * 32));
                }
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            // Keep this step's products in flight; the previous step's are done, so its stage
            // goes back to the copying warpgroup.
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            if (kt > 0 && threadIdx.x % 128 == 0) wg_bar_arrive(empty + ((step - 1) % WG_STAGES) * 8);
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        if (k_tiles > 0 && threadIdx.x % 128 == 0) wg_bar_arrive(empty + ((step - 1) % WG_STAGES) * 8);

        // Accumulator i of tile t, thread (warp q of the group, lane l): weight row
        // 16 q + l / 4 + 8 ((i / 2) % 2) of the tile, batch row 8 (i / 4) + 2 (l % 4) + i % 2 of
        // the half. For a fixed i a warp writes 8 consecutive columns of 4 rows: whole 32-byte
        // sectors in f32.
        const unsigned int row = n0 + 16 * q + l / 4;
#pragma unroll
        for (int t = 0; t < WG_TILES; ++t) {
#pragma unroll
            for (int i = 0; i < 4 * WG_LO; ++i)
                wg_store(c, parts, p, row + (group * WG_TILES + t) * 64 + 8 * ((i / 2) % 2),
                         m0 + 8 * (i / 4) + 2 * (l % 4) + i % 2, lo[t][i]);
#pragma unroll
            for (int i = 0; i < 4 * WG_HI; ++i)
                wg_store(c, parts, p, row + (group * WG_TILES + t) * 64 + 8 * ((i / 2) % 2),
                         m0 + 64 + 8 * (i / 4) + 2 * (l % 4) + i % 2, hi[t][i]);
        }
        if (gridDim.y > 1 && p.unused1 == 1) {
            // The unit's last block to finish adds the splits' partial sums in split order (the
            // fence before the count publishes this block's; the one after it makes the others'
            // visible, read past L1).
            __shared__ unsigned int last;
            __threadfence();
            wg_consumers_sync();
            if (threadIdx.x == 0) last = atomicAdd(counters + u, 1u) == gridDim.y - 1;
            wg_consumers_sync();
            if (last) {
                __threadfence();
                for (unsigned int e = threadIdx.x; e < WG_ROWS * WG_N; e += WG_GROUPS * 128) {
                    const unsigned int n = n0 + e % WG_ROWS, m = m0 + e / WG_ROWS;
                    if (m >= p.m || n >= p.n) continue;
                    float sum = 0.0f;
                    for (unsigned int v = 0; v < gridDim.y; ++v)
                        sum += __ldcg(parts + ((unsigned long long)v * p.m + m) * p.ldc + n);
                    c[(unsigned long long)m * p.ldc + n] = to_out(sum);
                }
                if (threadIdx.x == 0) counters[u] = 0;
            }
            // `last` is rewritten for the next unit only after every thread read it.
            wg_consumers_sync();
        }
    }
#else
    __trap();  // sm_90a only: the caller routes other GPUs to the mma.sync stream
#endif
}

// C from `splits` (parameter unused0) partial sums [splits][M][ldc], added in split order: the
// same values and order as the last block's sum above.
extern "C" __global__ void verl_decode_gemm_wgmma_sum(const float* __restrict__ parts, out_t* __restrict__ c,
                                                      GemmParams p) {
    const unsigned int e = blockIdx.x * 256 + threadIdx.x;
    if (e >= p.m * p.n) return;
    const unsigned int m = e / p.n, n = e % p.n;
    float sum = 0.0f;
    for (unsigned int v = 0; v < p.unused0; ++v) sum += parts[((unsigned long long)v * p.m + m) * p.ldc + n];
    c[(unsigned long long)m * p.ldc + n] = to_out(sum);
}
