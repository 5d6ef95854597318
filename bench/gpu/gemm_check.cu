// Standalone check and timing of verl-megatron's GEMM kernel (gemm.cu) against cuBLAS, built
// with nvcc on a GPU machine with its tile defines (see gemm_sweep.sh): for each shape, the
// relative error against cublasGemmEx (bf16 in, f32 compute) and both kernels' times.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include "../../verl-megatron/src/cuda/kernels/gemm_common.cuh"

#ifdef WGMMA
#include "../../verl-megatron/src/cuda/kernels/gemm_wgmma.cu"
#define KERNEL verl_gemm_bf16_wgmma
#define SMEM_BYTES GEMM_SMEM_BYTES
#define LABEL "wgmma BN%d S%d SP%d MB%d TMA%d W%d R%d P%d F%d", BN, STAGES, SPECIALIZED, MIN_BLOCKS, TMA, WIDE, REGS, PERSISTENT, OUT_F32
#if TMA
#include <cstring>
#include <cuda.h>
#endif
#else
#include "../../verl-megatron/src/cuda/kernels/gemm.cu"
#define KERNEL verl_gemm_bf16
#define SMEM_BYTES (STAGES * (A_STAGE + B_STAGE) * sizeof(bf16))
#define LABEL "wmma BM%d BN%d BK%d S%d W%dx%d", BM, BN, BK, STAGES, WARPS_M, WARPS_N
#endif

#define CHECK(x)                                                                     \
    do {                                                                             \
        cudaError_t e = (x);                                                         \
        if (e != cudaSuccess) {                                                      \
            printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); \
            exit(1);                                                                 \
        }                                                                            \
    } while (0)

static unsigned int pad8(unsigned int x) { return (x + 7) / 8 * 8; }

static bf16* random_matrix(size_t rows, size_t ld, unsigned int seed) {
    std::vector<bf16> h(rows * ld);
    unsigned int s = seed * 2654435761u + 1;
    for (auto& v : h) {
        s = s * 1664525u + 1013904223u;
        v = __float2bfloat16(((s >> 8) & 0xffff) / 32768.0f - 1.0f);
    }
    bf16* d;
    CHECK(cudaMalloc(&d, h.size() * sizeof(bf16)));
    CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(bf16), cudaMemcpyHostToDevice));
    return d;
}

#if defined(WGMMA) && TMA
// A tensor map over a row-major [rows][cols] bf16 matrix with row pitch `ld`, boxes of
// box_rows x 64 columns in the 128-byte swizzle, zero fill past the edges: what cubecl encodes
// at launch for verl-megatron's gemm.rs.
static TensorMap tensor_map(const bf16* base, unsigned int rows, unsigned int cols, unsigned int ld,
                            unsigned int box_rows) {
    CUtensorMap m;
    cuuint64_t dims[2] = {cols, rows};
    cuuint64_t strides[1] = {(cuuint64_t)ld * 2};
    cuuint32_t box[2] = {64, box_rows};
    cuuint32_t elem[2] = {1, 1};
    CUresult r = cuTensorMapEncodeTiled(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void*)base, dims, strides, box,
                                        elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        printf("cuTensorMapEncodeTiled failed (%d) for %u x %u, pitch %u\n", (int)r, rows, cols, ld);
        exit(1);
    }
    TensorMap t;
    memcpy(&t, &m, sizeof(t));
    return t;
}
#endif

static double as_double(bf16 x) { return (double)__bfloat162float(x); }
static double as_double(float x) { return (double)x; }

static double max_abs(const std::vector<bf16>& v) {
    double m = 0;
    for (auto x : v) m = fmax(m, fabs((double)__bfloat162float(x)));
    return m;
}

int main() {
    const unsigned int shapes[][3] = {
        {2048, 896, 4864},  {2048, 4864, 896},   {2048, 896, 896},    {2044, 896, 151936},
        {8192, 1536, 8960}, {8192, 8960, 1536},  {8192, 1536, 1536},
        {1536, 8192, 8960}, {896, 2044, 4864},
        // Odd sizes: edges in every dimension, a K that is no multiple of 8.
        {77, 130, 264},     {300, 1000, 200},    {129, 64, 136},
    };
    cublasHandle_t handle;
    cublasCreate(&handle);
    const size_t smem = SMEM_BYTES;
    CHECK(cudaFuncSetAttribute(KERNEL, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    cudaEvent_t t0, t1;
    cudaEventCreate(&t0);
    cudaEventCreate(&t1);
    for (auto& s : shapes) {
        const unsigned int m = s[0], k = s[1], n = s[2];
        // Stored shapes: A [M][K] or A^T [K][M]; B [K][N] or B^T [N][K]; rows padded to 8.
        const unsigned int a_rows = A_T ? k : m, a_cols = A_T ? m : k;
        const unsigned int b_rows = B_T ? n : k, b_cols = B_T ? k : n;
        GemmParams p = {m, n, k, pad8(a_cols), pad8(b_cols), pad8(n), 0, 0};
        bf16* a = random_matrix(a_rows, p.lda, 1);
        bf16* b = random_matrix(b_rows, p.ldb, 2);
        out_t* c;
        bf16* c_ref;
        CHECK(cudaMalloc(&c, (size_t)m * p.ldc * sizeof(out_t)));
        CHECK(cudaMalloc(&c_ref, (size_t)m * p.ldc * sizeof(bf16)));
        dim3 grid((n + BN - 1) / BN, (m + BM - 1) / BM);
#if defined(WGMMA) && PERSISTENT
        {
            int sms = 0;
            CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
            const unsigned int tiles = grid.x * grid.y;
            grid = dim3(tiles < (unsigned int)sms * MIN_BLOCKS ? tiles : (unsigned int)sms * MIN_BLOCKS, 1);
        }
#endif
#if defined(WGMMA) && TMA
        // K-major tiles are one box of their rows; MN-major ones a 64 x 64 box per 64 columns.
        const TensorMap ta = tensor_map(a, a_rows, a_cols, p.lda, A_T ? 64 : BM);
        const TensorMap tb = tensor_map(b, b_rows, b_cols, p.ldb, B_T ? BN : 64);
        auto ours = [&]() { KERNEL<<<grid, THREADS, smem>>>(ta, tb, a, b, a, b, c, p); };
#else
        auto ours = [&]() { KERNEL<<<grid, THREADS, smem>>>(a, b, c, p); };
#endif
        // Row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ.
        const float one = 1.0f, zero = 0.0f;
        auto theirs = [&]() {
            cublasGemmEx(handle, B_T ? CUBLAS_OP_T : CUBLAS_OP_N, A_T ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k,
                         &one, b, CUDA_R_16BF, p.ldb, a, CUDA_R_16BF, p.lda, &zero, c_ref, CUDA_R_16BF,
                         p.ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        };
        CHECK(cudaMemset(c, 0xff, (size_t)m * p.ldc * sizeof(out_t)));
        ours();
        CHECK(cudaGetLastError());
        theirs();
        CHECK(cudaDeviceSynchronize());
        std::vector<out_t> hc((size_t)m * p.ldc);
        std::vector<bf16> hr((size_t)m * p.ldc);
        CHECK(cudaMemcpy(hc.data(), c, hc.size() * sizeof(out_t), cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(hr.data(), c_ref, hr.size() * 2, cudaMemcpyDeviceToHost));
        double err = 0;
        // Every 7th row (and the last): the whole of the LM head's product is 300M values.
        for (unsigned int i = 0; i < m; i = (i + 7 < m || i == m - 1) ? i + 7 : m - 1)
            for (unsigned int j = 0; j < n; ++j) {
                const size_t at = (size_t)i * p.ldc + j;
                const double d = fabs(as_double(hc[at]) - __bfloat162float(hr[at]));
                err = d == d ? fmax(err, d) : INFINITY;  // a value never written is NaN
            }
        err /= max_abs(hr);
        float ms[2];
        for (int which = 0; which < 2; ++which) {
            const int reps = 20;
            cudaEventRecord(t0);
            for (int r = 0; r < reps; ++r) which ? theirs() : ours();
            cudaEventRecord(t1);
            CHECK(cudaEventSynchronize(t1));
            cudaEventElapsedTime(&ms[which], t0, t1);
            ms[which] /= reps;
        }
        const double flop = 2.0 * m * n * (double)k;
        printf(LABEL);
        printf(" %s%s (%5u,%5u,%6u): ours %.3f ms %5.0f TF, cublas %.3f ms %5.0f TF, %4.0f%%, rel err %.1e\n",
               A_T ? "T" : "N", B_T ? "T" : "N", m, k, n, ms[0],
               flop / ms[0] / 1e9, ms[1], flop / ms[1] / 1e9, 100.0 * ms[1] / ms[0], err);
        cudaFree(a);
        cudaFree(b);
        cudaFree(c);
        cudaFree(c_ref);
    }
    return 0;
}
