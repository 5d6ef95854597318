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
    const unsigned int rows = p.rows[j], cols = p.cols[j], stride = p.stride[j];
    // Four independent sums, and four 16-byte loads in flight a thread: one load at a time
    // left the largest gradient (the LM head's, ~1 GB) waiting on memory latency.
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    const unsigned long long step = (unsigned long long)p.blocks * THREADS;
    const unsigned long long first = (unsigned long long)blockIdx.x * THREADS + threadIdx.x;
    if ((stride == cols || rows == 1) && ((unsigned long long)t & 15ull) == 0) {
        // Contiguous: one flat run of float4s, then the last n % 4 elements.
        const unsigned long long n = (unsigned long long)rows * cols, n4 = n / 4;
        const float4* v = (const float4*)t;
        unsigned long long e = first;
        for (; e + 3 * step < n4; e += 4 * step) {
            float4 x[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) x[u] = __ldg(v + e + u * step);
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                a0 += x[u].x * x[u].x;
                a1 += x[u].y * x[u].y;
                a2 += x[u].z * x[u].z;
                a3 += x[u].w * x[u].w;
            }
        }
        for (; e < n4; e += step) {
            const float4 x = __ldg(v + e);
            a0 += x.x * x.x;
            a1 += x.y * x.y;
            a2 += x.z * x.z;
            a3 += x.w * x.w;
        }
        for (unsigned long long r = n4 * 4 + first; r < n; r += step) a0 += t[r] * t[r];
    } else {
        // Padded rows: each block takes whole rows, its threads the columns (no division).
        for (unsigned int r = blockIdx.x; r < rows; r += p.blocks) {
            const float* row = t + (unsigned long long)r * stride;
            for (unsigned int c = threadIdx.x; c < cols; c += THREADS) a0 += row[c] * row[c];
        }
    }
    float acc = (a0 + a1) + (a2 + a3);
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
