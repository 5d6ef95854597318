// C = A · B for bf16 operands with f32 accumulation and a bf16 (or f32) result, on tensor cores (wmma
// 16x16x16), fed by a STAGES-deep cp.async pipeline: a BM x BN tile of C per block of
// WARPS_M x WARPS_N warps, each warp (BM / WARPS_M) x (BN / WARPS_N), k in steps of BK. The
// caller passes them as defines; the defaults here are its choice (128 x 128 x 32, 4 stages,
// 2 x 2 warps of 64 x 64: the fastest of bench/gpu/gemm_sweep.sh's configurations on an H100).
//
// Compiled at run time by NVRTC (verl_megatron::cuda::kernels::gemm prepends the defines and
// gemm_common.cuh).
//   A_T = 0: A is stored row-major [M][K] (row stride lda); 1: stored as A^T, [K][M].
//   B_T = 0: B is stored row-major [K][N] (row stride ldb); 1: stored as B^T, [N][K].
// C is row-major [M][N] with row stride ldc. Every operand's row pitch is a multiple of 8
// elements and its base 16-byte aligned (the caller checks), so each copy is one 16-byte
// cp.async; the parts of tiles past the matrix edges (rows, and the last piece of a row whose
// length is not a multiple of 8) are zero-filled.

#include <mma.h>

#ifndef A_T
#define A_T 0
#endif
#ifndef B_T
#define B_T 0
#endif

using namespace nvcuda;

#ifndef BM
#define BM 128
#endif
#ifndef BN
#define BN 128
#endif
#ifndef BK
#define BK 32
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef WARPS_M
#define WARPS_M 2
#endif
#ifndef WARPS_N
#define WARPS_N 2
#endif
#define THREADS (32 * WARPS_M * WARPS_N)
// Each warp's tile, in 16 x 16 fragments.
#define WARP_M (BM / WARPS_M)
#define WARP_N (BN / WARPS_N)
#define FRAGS_M (WARP_M / 16)
#define FRAGS_N (WARP_N / 16)
// Shared tiles keep the operand's own orientation (so copies stay 16-byte vectors), padded by 8
// elements against bank conflicts.
#if A_T
#define A_ROWS BK
#define A_LD (BM + 8)
#else
#define A_ROWS BM
#define A_LD (BK + 8)
#endif
#if B_T
#define B_ROWS BN
#define B_LD (BK + 8)
#else
#define B_ROWS BK
#define B_LD (BN + 8)
#endif
#define A_STAGE (A_ROWS * A_LD)
#define B_STAGE (B_ROWS * B_LD)

// Copies k-tile `kt` of A and B into stage buffers `as`, `bs`.
__device__ __forceinline__ void load_stage(bf16* as, bf16* bs, const bf16* a, const bf16* b,
                                           const GemmParams& p, unsigned int m0, unsigned int n0,
                                           unsigned int kt) {
    const unsigned int k0 = kt * BK;
    // Each operand tile in pieces of 8 elements along its stored rows.
    for (unsigned int c = threadIdx.x; c < BM * BK / 8; c += THREADS) {
#if A_T
        const unsigned int r = c / (BM / 8), col = (c % (BM / 8)) * 8;  // r: k, col: m
        const unsigned int n_ok = k0 + r < p.k ? inside(m0 + col, p.m) : 0u;
        const bf16* src = n_ok ? a + (unsigned long long)(k0 + r) * p.lda + m0 + col : a;
#else
        const unsigned int r = c / (BK / 8), col = (c % (BK / 8)) * 8;  // r: m, col: k
        const unsigned int n_ok = m0 + r < p.m ? inside(k0 + col, p.k) : 0u;
        const bf16* src = n_ok ? a + (unsigned long long)(m0 + r) * p.lda + k0 + col : a;
#endif
        copy16(as + r * A_LD + col, src, n_ok);
    }
    for (unsigned int c = threadIdx.x; c < BN * BK / 8; c += THREADS) {
#if B_T
        const unsigned int r = c / (BK / 8), col = (c % (BK / 8)) * 8;  // r: n, col: k
        const unsigned int n_ok = n0 + r < p.n ? inside(k0 + col, p.k) : 0u;
        const bf16* src = n_ok ? b + (unsigned long long)(n0 + r) * p.ldb + k0 + col : b;
#else
        const unsigned int r = c / (BN / 8), col = (c % (BN / 8)) * 8;  // r: k, col: n
        const unsigned int n_ok = k0 + r < p.k ? inside(n0 + col, p.n) : 0u;
        const bf16* src = n_ok ? b + (unsigned long long)(k0 + r) * p.ldb + n0 + col : b;
#endif
        copy16(bs + r * B_LD + col, src, n_ok);
    }
}

#if A_T
typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::col_major> FragA;
#else
typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> FragA;
#endif
#if B_T
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> FragB;
#else
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> FragB;
#endif
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> FragC;

// OUT_F32 = 1: C is f32 (products whose result goes on in f32: generation), else bf16.
#ifndef OUT_F32
#define OUT_F32 0
#endif
#if OUT_F32
typedef float out_t;
__device__ __forceinline__ float to_out(float x) { return x; }
#else
typedef bf16 out_t;
__device__ __forceinline__ bf16 to_out(float x) { return __float2bfloat16(x); }
#endif

// Grid (ceil(n / BN), ceil(m / BM)).
extern "C" __global__ void __launch_bounds__(THREADS)
verl_gemm_bf16(const bf16* __restrict__ a, const bf16* __restrict__ b, out_t* __restrict__ c,
               GemmParams p) {
    extern __shared__ __align__(128) unsigned char smem[];
    bf16* a_tiles = (bf16*)smem;
    bf16* b_tiles = a_tiles + STAGES * A_STAGE;

    const unsigned int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned int wm = warp / WARPS_N, wn = warp % WARPS_N;

    FragC acc[FRAGS_M][FRAGS_N];
#pragma unroll
    for (int i = 0; i < FRAGS_M; ++i)
#pragma unroll
        for (int j = 0; j < FRAGS_N; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

    const unsigned int k_tiles = (p.k + BK - 1) / BK;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < k_tiles) load_stage(a_tiles + s * A_STAGE, b_tiles + s * B_STAGE, a, b, p, m0, n0, s);
        commit();
    }

    for (unsigned int kt = 0; kt < k_tiles; ++kt) {
        wait_groups<STAGES - 2>();
        __syncthreads();
        // The stage refilled here was read in the previous iteration, which every warp has
        // finished (the barrier above).
        const unsigned int next = kt + STAGES - 1;
        if (next < k_tiles) {
            const unsigned int s = next % STAGES;
            load_stage(a_tiles + s * A_STAGE, b_tiles + s * B_STAGE, a, b, p, m0, n0, next);
        }
        commit();

        const bf16* as = a_tiles + (kt % STAGES) * A_STAGE;
        const bf16* bs = b_tiles + (kt % STAGES) * B_STAGE;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            FragA fa[FRAGS_M];
            FragB fb[FRAGS_N];
#pragma unroll
            for (int i = 0; i < FRAGS_M; ++i) {
                const unsigned int row = wm * WARP_M + i * 16;
#if A_T
                wmma::load_matrix_sync(fa[i], as + kk * A_LD + row, A_LD);
#else
                wmma::load_matrix_sync(fa[i], as + row * A_LD + kk, A_LD);
#endif
            }
#pragma unroll
            for (int j = 0; j < FRAGS_N; ++j) {
                const unsigned int col = wn * WARP_N + j * 16;
#if B_T
                wmma::load_matrix_sync(fb[j], bs + col * B_LD + kk, B_LD);
#else
                wmma::load_matrix_sync(fb[j], bs + kk * B_LD + col, B_LD);
#endif
            }
#pragma unroll
            for (int i = 0; i < FRAGS_M; ++i)
#pragma unroll
                for (int j = 0; j < FRAGS_N; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
    }
    wait_groups<0>();
    __syncthreads();

    // Epilogue through a 16 x 16 f32 scratch per warp (the pipeline's memory, now free): each
    // lane converts and writes 8 consecutive elements of one row.
    float* scratch = (float*)smem + warp * 16 * 20;
    const unsigned int r = lane / 2, c8 = (lane % 2) * 8;
#pragma unroll
    for (int i = 0; i < FRAGS_M; ++i) {
#pragma unroll
        for (int j = 0; j < FRAGS_N; ++j) {
            wmma::store_matrix_sync(scratch, acc[i][j], 20, wmma::mem_row_major);
            __syncwarp();
            const unsigned int gm = m0 + wm * WARP_M + i * 16 + r;
            const unsigned int gn = n0 + wn * WARP_N + j * 16 + c8;
            if (gm < p.m) {
                out_t* dst = c + (unsigned long long)gm * p.ldc + gn;
                if (gn + 8 <= p.n && p.ldc % 8 == 0) {
                    __align__(32) out_t v[8];
#pragma unroll
                    for (int e = 0; e < 8; ++e) v[e] = to_out(scratch[r * 20 + c8 + e]);
#pragma unroll
                    for (int q = 0; q < (int)sizeof(v) / 16; ++q) ((uint4*)dst)[q] = ((const uint4*)v)[q];
                } else {
                    for (unsigned int e = 0; e < 8 && gn + e < p.n; ++e)
                        dst[e] = to_out(scratch[r * 20 + c8 + e]);
                }
            }
            __syncwarp();
        }
    }
}
