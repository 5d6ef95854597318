// Sums of squares of up to TENSORS f32 matrices in one launch (the gradient norm reads every
// parameter's gradient: one launch per 16 tensors instead of a square and a reduction each).
//
// Compiled at run time by NVRTC (verl_megatron::cuda::kernels::sum_squares), and by nvcc on a GPU
// machine for a standalone check. Tensor j is rows[j] x cols[j] with row stride stride[j] (any
// pitch); a slot with rows[j] = 0 is unused. Block (x, j) adds up a grid-stride share of tensor
// j's elements and writes it to out[j * blocks + x]: the caller adds the partials in a fixed
// order, so the result does not depend on the order blocks run in.

#define TENSORS 16
#define THREADS 256

struct SumSquaresParams {
    unsigned int rows[TENSORS];
    unsigned int cols[TENSORS];
    unsigned int stride[TENSORS];
    unsigned int blocks;
    unsigned int unused;
};

// Grid (blocks, TENSORS).
extern "C" __global__ void __launch_bounds__(THREADS)
verl_sum_squares(const float* t0, const float* t1, const float* t2, const float* t3,
                 const float* t4, const float* t5, const float* t6, const float* t7,
                 const float* t8, const float* t9, const float* t10, const float* t11,
                 const float* t12, const float* t13, const float* t14, const float* t15,
                 float* __restrict__ out, SumSquaresParams p) {
    __shared__ float partial[THREADS / 32];
    const unsigned int j = blockIdx.y;
    const float* const tensors[TENSORS] = {t0, t1, t2,  t3,  t4,  t5,  t6,  t7,
                                           t8, t9, t10, t11, t12, t13, t14, t15};
    const float* t = tensors[j];
    const unsigned long long cols = p.cols[j];
    const unsigned long long n = (unsigned long long)p.rows[j] * cols;
    float acc = 0.0f;
    for (unsigned long long e = (unsigned long long)blockIdx.x * THREADS + threadIdx.x; e < n;
         e += (unsigned long long)p.blocks * THREADS) {
        const float v = t[(e / cols) * p.stride[j] + e % cols];
        acc += v * v;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
    const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) partial[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        acc = lane < THREADS / 32 ? partial[lane] : 0.0f;
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
        if (lane == 0) out[j * p.blocks + blockIdx.x] = acc;
    }
}
