// RMSNorm forward and backward over the last dimension of f32 rows, one launch each way in
// place of burn's chain (square, mean, add, sqrt, divide, multiply, and about twice as many
// operations backward).
//
// Compiled at run time by NVRTC (verl_megatron::cuda::kernels::norm), and by nvcc on a GPU
// machine for a standalone check.
//
// Forward, per row r of x [rows][hidden]: rstd = 1 / sqrt(mean(x^2) + eps), y = x * rstd * w;
// rstd [rows] is kept for the backward. Backward, with x^ = x * rstd and g = dy * w:
//   dx = rstd * (g - x^ * mean(g * x^)),   dw = sum over rows of dy * x^,
// dw as one partial sum per block ([blocks][hidden]), summed by the caller, so the result does
// not depend on the order blocks run in.
//
// verl_add_rms_norm_bf16 (decode steps, no backward): the residual sum s = h + delta and the
// norm of s rounded to bf16 (the next products' operand) in one launch, where the plain path
// takes an add, the norm and a cast. Same summation order as the forward above, so its output
// is bit-identical to that chain.

#define THREADS 256
#define ROWS_PER_BLOCK 16

struct NormParams {
    unsigned int rows;
    unsigned int hidden;
    float eps;
    unsigned int unused;
};

// Sum over the block; every thread gets the result. `scratch` holds THREADS / 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();  // scratch may still be read from the previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < THREADS / 32 ? scratch[lane] : 0.0f;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Grid (rows).
extern "C" __global__ void __launch_bounds__(THREADS)
verl_rms_norm_forward(const float* __restrict__ x, const float* __restrict__ w,
                      float* __restrict__ y, float* __restrict__ rstd, NormParams p) {
    __shared__ float scratch[THREADS / 32];
    const unsigned int row = blockIdx.x;
    const float* xr = x + (unsigned long long)row * p.hidden;
    float* yr = y + (unsigned long long)row * p.hidden;
    float ss = 0.0f;
    for (unsigned int i = threadIdx.x; i < p.hidden; i += THREADS) ss += xr[i] * xr[i];
    const float r = rsqrtf(block_sum(ss, scratch) / (float)p.hidden + p.eps);
    for (unsigned int i = threadIdx.x; i < p.hidden; i += THREADS) yr[i] = xr[i] * r * w[i];
    if (threadIdx.x == 0) rstd[row] = r;
}

// Grid (ceil(rows / ROWS_PER_BLOCK)); dynamic shared memory: hidden floats (this block's dw).
extern "C" __global__ void __launch_bounds__(THREADS)
verl_rms_norm_backward(const float* __restrict__ x, const float* __restrict__ w,
                       const float* __restrict__ rstd, const float* __restrict__ dy,
                       float* __restrict__ dx, float* __restrict__ dw_partial, NormParams p) {
    extern __shared__ float dw[];
    __shared__ float scratch[THREADS / 32];
    for (unsigned int i = threadIdx.x; i < p.hidden; i += THREADS) dw[i] = 0.0f;
    const unsigned int first = blockIdx.x * ROWS_PER_BLOCK;
    for (unsigned int row = first; row < first + ROWS_PER_BLOCK && row < p.rows; ++row) {
        const unsigned long long at = (unsigned long long)row * p.hidden;
        const float r = rstd[row];
        float dot = 0.0f;
        for (unsigned int i = threadIdx.x; i < p.hidden; i += THREADS)
            dot += dy[at + i] * w[i] * x[at + i] * r;
        const float mean = block_sum(dot, scratch) / (float)p.hidden;
        // Each thread touches the same columns of dw in every row: no other thread's.
        for (unsigned int i = threadIdx.x; i < p.hidden; i += THREADS) {
            const float xh = x[at + i] * r, g = dy[at + i];
            dx[at + i] = r * (g * w[i] - xh * mean);
            dw[i] += g * xh;
        }
    }
    float* out = dw_partial + (unsigned long long)blockIdx.x * p.hidden;
    for (unsigned int i = threadIdx.x; i < p.hidden; i += THREADS) out[i] = dw[i];
}

struct AddNormParams {
    unsigned int rows;
    unsigned int hidden;
    float eps;
    // 1: s = h + delta (written to `sum`); 0: s = h (`delta` and `sum` unread / unwritten).
    unsigned int add;
};

// Elements a thread keeps in registers between the two passes of verl_add_rms_norm_bf16
// (hidden up to REGS * THREADS; longer rows go through memory).
#define REGS 32

// Grid (rows). h, delta, sum [rows][hidden] f32; w [hidden] f32; y [rows][hidden] bf16.
//
// A decode step's row is short work for one block, so its time is load latency: every load a
// thread needs is issued before the first is used, and the sums stay in registers for the second
// pass. Thread t handles elements t, t + THREADS, ... in that order either way, so the result is
// the same to the bit as the forward above.
extern "C" __global__ void __launch_bounds__(THREADS)
verl_add_rms_norm_bf16(const float* h, const float* delta, const float* __restrict__ w,
                       float* sum, unsigned short* __restrict__ y, AddNormParams p) {
    __shared__ float scratch[THREADS / 32];
    const unsigned long long at = (unsigned long long)blockIdx.x * p.hidden;
    if (p.hidden <= REGS * THREADS) {
        float sv[REGS], dv[REGS];
#pragma unroll
        for (int j = 0; j < REGS; ++j) {
            const unsigned int i = threadIdx.x + j * THREADS;
            sv[j] = i < p.hidden ? h[at + i] : 0.0f;
            dv[j] = (p.add && i < p.hidden) ? delta[at + i] : 0.0f;
        }
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < REGS; ++j) {
            const unsigned int i = threadIdx.x + j * THREADS;
            if (i < p.hidden) {
                if (p.add) {
                    sv[j] = sv[j] + dv[j];
                    sum[at + i] = sv[j];
                }
                ss += sv[j] * sv[j];
            }
        }
        const float r = rsqrtf(block_sum(ss, scratch) / (float)p.hidden + p.eps);
#pragma unroll
        for (int j = 0; j < REGS; ++j) {
            const unsigned int i = threadIdx.x + j * THREADS;
            if (i < p.hidden) y[at + i] = bf16_bits(sv[j] * r * w[i]);
        }
        return;
    }
    float ss = 0.0f;
    for (unsigned int i = threadIdx.x; i < p.hidden; i += THREADS) {
        float s = h[at + i];
        if (p.add) {
            s = s + delta[at + i];
            sum[at + i] = s;
        }
        ss += s * s;
    }
    const float r = rsqrtf(block_sum(ss, scratch) / (float)p.hidden + p.eps);
    // Each thread reads back only what it wrote (or h itself).
    const float* s = p.add ? sum : h;
    for (unsigned int i = threadIdx.x; i < p.hidden; i += THREADS)
        y[at + i] = bf16_bits(s[at + i] * r * w[i]);
}
