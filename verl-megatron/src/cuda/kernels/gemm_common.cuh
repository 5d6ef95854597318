// What our GEMM kernels share (gemm.cu: wmma; gemm_wgmma.cu: wgmma; decode_gemm.cu), prepended
// to each by its module, and to attention.cu: the parameter block, and the cp.async copies that
// fill shared-memory stages.

#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;

struct GemmParams {
    unsigned int m;
    unsigned int n;
    unsigned int k;
    unsigned int lda;
    unsigned int ldb;
    unsigned int ldc;
    unsigned int unused0;
    unsigned int unused1;
};

// Copies `valid` (0..8) elements from `src` to shared address `dst` and zero-fills the rest of
// the 16 bytes: a row out of range copies none, and the last piece of a row whose length is not
// a multiple of 8 copies only what lies inside it (reading on would take the next row's values).
__device__ __forceinline__ void copy16(unsigned int dst, const bf16* src, unsigned int valid) {
    const int bytes = (int)(valid < 8u ? valid : 8u) * 2;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

// The same, to a generic pointer into shared memory.
__device__ __forceinline__ void copy16(bf16* dst, const bf16* src, unsigned int valid) {
    copy16((unsigned int)__cvta_generic_to_shared(dst), src, valid);
}

// Elements of a piece of 8 starting at `at` inside a dimension of `extent` (0 past the end).
__device__ __forceinline__ unsigned int inside(unsigned int at, unsigned int extent) {
    return at < extent ? extent - at : 0u;
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most N committed copy groups are still in flight.
template <int N>
__device__ __forceinline__ void wait_groups() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

