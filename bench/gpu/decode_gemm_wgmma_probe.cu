// A probe, not part of the crate: decode products on Hopper's wgmma, the weights as the
// instruction's 64 rows (WT tiles per warpgroup, WG warpgroups) and the batch as its N (8 NB),
// both operands staged in 128-byte-swizzled shared memory by a WSTAGES-deep cp.async ring, k in
// its natural order (optionally split over grid y into f32 partials, added in order). Built into
// bench/gpu/decode_gemm_harness.cu with -DWGMMA_PROBE (sm_90a: -gencode arch=compute_90a,code=sm_90a)
// to measure it beside the stream, the shared-stage kernel and cuBLAS, and to write each
// product's first 8 batch rows to /tmp/wg_<product>_m<M>.bin, so runs at different M show
// whether a row's result depends on N (it did not: docs/PERFORMANCE.md, 2026-11-27).
#ifndef WT
#define WT 5  // 64-row weight tiles per warpgroup
#endif
#ifndef WG
#define WG 1  // warpgroups
#endif
#ifndef WSTAGES
#define WSTAGES 4
#endif
#define WN (8 * NB)
#define W_ROWS (64 * WT * WG)
#define W_TILE (W_ROWS * 128)
#define X_TILE (WN * 128)
#define W_STAGE (W_TILE + X_TILE)
#define W_THREADS (128 * WG)
#define W_SMEM (WSTAGES * W_STAGE + 1024)

__device__ __forceinline__ unsigned long long wg_descriptor(unsigned int addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(16 >> 4) << 16) |
           ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void wg_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// `rows` K-major rows (from row0, of extent) x 64 of k into a 128-byte-swizzled tile.
template <int ROWS>
__device__ __forceinline__ void wg_load(unsigned int dst, const bf16* src, unsigned int ld, unsigned int row0,
                                        unsigned int extent, unsigned int k0, unsigned int k_extent) {
#pragma unroll 4
    for (unsigned int c = threadIdx.x; c < ROWS * 8; c += W_THREADS) {
        const unsigned int r = c / 8, q = c % 8;
        const unsigned int ok = row0 + r < extent ? inside(k0 + q * 8, k_extent) : 0u;
        const bf16* from = ok ? src + (unsigned long long)(row0 + r) * ld + k0 + q * 8 : src;
        copy16(dst + r * 128 + ((q ^ (r % 8)) * 16), from, ok);
    }
}

__device__ __forceinline__ void wg_mma_n8(float* d, unsigned long long da, unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, 1, 1, 1, 0, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "l"(da), "l"(db));
}

__device__ __forceinline__ void wg_mma_n16(float* d, unsigned long long da, unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, 1, 1, 1, 0, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]) : "l"(da), "l"(db));
}

__device__ __forceinline__ void wg_mma_n24(float* d, unsigned long long da, unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n24k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}, %12, %13, 1, 1, 1, 0, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]) : "l"(da), "l"(db));
}

__device__ __forceinline__ void wg_mma_n32(float* d, unsigned long long da, unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, 1, 1, 1, 0, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]) : "l"(da), "l"(db));
}

__device__ __forceinline__ void wg_mma_n40(float* d, unsigned long long da, unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n40k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19}, %20, %21, 1, 1, 1, 0, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]) : "l"(da), "l"(db));
}

__device__ __forceinline__ void wg_mma_n48(float* d, unsigned long long da, unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, %24, %25, 1, 1, 1, 0, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]) : "l"(da), "l"(db));
}

__device__ __forceinline__ void wg_mma_n56(float* d, unsigned long long da, unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n56k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27}, %28, %29, 1, 1, 1, 0, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]) : "l"(da), "l"(db));
}

__device__ __forceinline__ void wg_mma_n64(float* d, unsigned long long da, unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, 1, 1, 1, 0, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) : "l"(da), "l"(db));
}

#if NB == 1
#define WG_MMA_N wg_mma_n8
#elif NB == 2
#define WG_MMA_N wg_mma_n16
#elif NB == 3
#define WG_MMA_N wg_mma_n24
#elif NB == 4
#define WG_MMA_N wg_mma_n32
#elif NB == 5
#define WG_MMA_N wg_mma_n40
#elif NB == 6
#define WG_MMA_N wg_mma_n48
#elif NB == 7
#define WG_MMA_N wg_mma_n56
#else
#define WG_MMA_N wg_mma_n64
#endif

// Grid (ceil(N / W_ROWS)), W_THREADS threads, W_SMEM bytes. C [M][N] f32 or bf16 (out_t).
extern "C" __global__ void __launch_bounds__(W_THREADS)
verl_decode_gemm_wgmma(const bf16* __restrict__ a, const bf16* __restrict__ w, out_t* __restrict__ c, GemmParams p) {
    extern __shared__ __align__(128) unsigned char wg_raw[];
    const unsigned int raw = (unsigned int)__cvta_generic_to_shared(wg_raw);
    const unsigned int base = raw + (1024 - raw % 1024) % 1024;
    const unsigned int n0 = blockIdx.x * W_ROWS, group = threadIdx.x / 128;
    // Split k (grid y > 1): block y takes an equal run of k tiles into f32 partials [y][M][ldc].
    const unsigned int all_tiles = (p.k + 63) / 64, per = (all_tiles + gridDim.y - 1) / gridDim.y;
    const unsigned int kt0 = blockIdx.y * per;
    const unsigned int k_tiles = kt0 < all_tiles ? min(per, all_tiles - kt0) : 0;
    float acc[WT][WN / 2];
#pragma unroll
    for (int t = 0; t < WT; ++t)
#pragma unroll
        for (int i = 0; i < WN / 2; ++i) acc[t][i] = 0.0f;
#pragma unroll
    for (int s = 0; s < WSTAGES - 2; ++s) {
        if ((unsigned int)s < k_tiles) {
            wg_load<W_ROWS>(base + s * W_STAGE, w, p.ldb, n0, p.n, (kt0 + s) * 64, p.k);
            wg_load<WN>(base + s * W_STAGE + W_TILE, a, p.lda, 0, p.m, (kt0 + s) * 64, p.k);
        }
        commit();
    }
    for (unsigned int kt = 0; kt < k_tiles; ++kt) {
        wait_groups<WSTAGES - 3>();
        wg_proxy_fence();
        __syncthreads();
        const unsigned int next = kt + WSTAGES - 2;
        if (next < k_tiles) {
            const unsigned int s = next % WSTAGES;
            wg_load<W_ROWS>(base + s * W_STAGE, w, p.ldb, n0, p.n, (kt0 + next) * 64, p.k);
            wg_load<WN>(base + s * W_STAGE + W_TILE, a, p.lda, 0, p.m, (kt0 + next) * 64, p.k);
        }
        commit();
        const unsigned int stage = base + (kt % WSTAGES) * W_STAGE;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int t = 0; t < WT; ++t)
                WG_MMA_N(acc[t], wg_descriptor(stage + ((group * WT + t) * 64) * 128 + kk * 32),
                         wg_descriptor(stage + W_TILE + kk * 32));
        wg_commit();
        wg_wait<1>();
    }
    wg_wait<0>();
    // Value i of thread (warp w, lane l): weight row 16 w + l / 4 + 8 ((i / 2) % 2) of the
    // tile, batch row 8 (i / 4) + 2 (l % 4) + i % 2.
    const unsigned int wq = (threadIdx.x % 128) / 32, l = threadIdx.x % 32;
#pragma unroll
    for (int t = 0; t < WT; ++t)
#pragma unroll
        for (int i = 0; i < WN / 2; ++i) {
            const unsigned int n = n0 + (group * WT + t) * 64 + 16 * wq + l / 4 + 8 * ((i / 2) % 2);
            const unsigned int m = 8 * (i / 4) + 2 * (l % 4) + i % 2;
            if (m < p.m && n < p.n) {
                if (gridDim.y > 1)
                    ((float*)c)[((unsigned long long)blockIdx.y * p.m + m) * p.ldc + n] = acc[t][i];
                else
                    c[(unsigned long long)m * p.ldc + n] = to_out(acc[t][i]);
            }
        }
}

// C from `splits` partials [splits][M][ldc], added in order.
extern "C" __global__ void verl_decode_gemm_wg_reduce(const float* __restrict__ parts, out_t* __restrict__ c,
                                                      GemmParams p, unsigned int splits) {
    const unsigned int e = blockIdx.x * 256 + threadIdx.x;
    if (e >= p.m * p.n) return;
    const unsigned int m = e / p.n, n = e % p.n;
    float sum = 0.0f;
    for (unsigned int v = 0; v < splits; ++v) sum += parts[((unsigned long long)v * p.m + m) * p.ldc + n];
    c[(unsigned long long)m * p.ldc + n] = to_out(sum);
}

// Times the probe on one product (whole, and split over k where the tiles leave most
// multiprocessors idle), its error against cuBLAS's result `ref`, and writes its first 8 rows.
template <class Timed>
void probe_wgmma(const char* label, const bf16* a, const std::vector<bf16*>& ws, int copies, GemmParams p,
                 const std::vector<float>& ref, double top, Timed timed) {
    const unsigned int m = p.m, n = p.n;
    float *c, *parts;
    cudaMalloc(&c, (size_t)m * n * 4);
    cudaMalloc(&parts, (size_t)8 * m * n * 4);
    cudaFuncSetAttribute(verl_decode_gemm_wgmma, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)W_SMEM);
    const unsigned int blocks = (n + W_ROWS - 1) / W_ROWS;
    unsigned int ks = blocks >= 132 ? 1 : (264 + blocks - 1) / blocks;
    ks = ks > 8 ? 8 : ks;
    auto whole = [&](int i, float* out) { verl_decode_gemm_wgmma<<<blocks, W_THREADS, W_SMEM>>>(a, ws[i], out, p); };
    auto split = [&](int i, float* out) {
        verl_decode_gemm_wgmma<<<dim3(blocks, ks), W_THREADS, W_SMEM>>>(a, ws[i], ks > 1 ? parts : out, p);
        if (ks > 1) verl_decode_gemm_wg_reduce<<<(m * n + 255) / 256, 256>>>(parts, out, p, ks);
    };
    const float t_whole = timed(whole, c), t_split = timed(split, c);
    whole(0, c);
    std::vector<float> v((size_t)m * n);
    cudaMemcpy(v.data(), c, v.size() * 4, cudaMemcpyDeviceToHost);
    double err = 0;
    for (size_t i = 0; i < v.size(); ++i) err = fmax(err, fabs(v[i] - ref[i]));
    char name[128];
    snprintf(name, sizeof name, "/tmp/wg_%s_m%u.bin", label, m);
    if (FILE* f = fopen(name, "wb")) {
        fwrite(v.data(), 4, (size_t)n * (m < 8 ? m : 8), f);
        fclose(f);
    }
    printf("  wgmma probe (WT %d WG %d WSTAGES %d): %6.1f us (%4.0f GB/s, err %.1e vs cuBLAS); split %u: %6.1f us\n",
           WT, WG, WSTAGES, t_whole, n * (double)p.k * 2 / 1e3 / t_whole, err / top, ks, t_split);
    cudaFree(c);
    cudaFree(parts);
}
