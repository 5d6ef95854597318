// SwiGLU's gate, silu(g) * u, forward and backward in one element-wise kernel each, in place of
// burn's sigmoid, two products and their gradients (about nine passes over the MLP's widest
// activations per layer).
//
// Compiled at run time by NVRTC (verl_megatron::cuda::kernels::swiglu), and by nvcc on a GPU
// machine for a standalone check. f32, contiguous, n elements each.
//   forward:  out = g * s * u,  with s = sigmoid(g)
//   backward: dg = dout * u * s * (1 + g * (1 - s)),  du = dout * g * s

#define THREADS 256

struct SwigluParams {
    unsigned int n;
    unsigned int unused;
};

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Grid (ceil(n / THREADS)).
extern "C" __global__ void __launch_bounds__(THREADS)
verl_swiglu_forward(const float* __restrict__ g, const float* __restrict__ u,
                    float* __restrict__ out, SwigluParams p) {
    const unsigned long long i = (unsigned long long)blockIdx.x * THREADS + threadIdx.x;
    if (i < p.n) {
        const float x = g[i];
        out[i] = x * sigmoid(x) * u[i];
    }
}

// Grid (ceil(n / THREADS)).
extern "C" __global__ void __launch_bounds__(THREADS)
verl_swiglu_backward(const float* __restrict__ g, const float* __restrict__ u,
                     const float* __restrict__ dout, float* __restrict__ dg,
                     float* __restrict__ du, SwigluParams p) {
    const unsigned long long i = (unsigned long long)blockIdx.x * THREADS + threadIdx.x;
    if (i < p.n) {
        const float x = g[i], s = sigmoid(x), d = dout[i];
        dg[i] = d * u[i] * s * (1.0f + x * (1.0f - s));
        du[i] = d * x * s;
    }
}

struct SwigluPackedParams {
    unsigned int rows;
    unsigned int inter;
};

// Decode steps (no backward): gate and up side by side in one row of the fused gate/up product,
// gu [rows][2 * inter] (gate first), the result rounded to bf16 for the down projection,
// out [rows][inter] bf16 (bf16_round.cuh's rounding, as a cast rounds). Grid (ceil(rows * inter /
// THREADS)).
extern "C" __global__ void __launch_bounds__(THREADS)
verl_swiglu_packed_bf16(const float* __restrict__ gu, unsigned short* __restrict__ out,
                        SwigluPackedParams p) {
    const unsigned long long i = (unsigned long long)blockIdx.x * THREADS + threadIdx.x;
    if (i >= (unsigned long long)p.rows * p.inter) return;
    const unsigned long long row = i / p.inter, col = i % p.inter;
    const float x = gu[row * 2 * p.inter + col];
    out[i] = bf16_bits(x * sigmoid(x) * gu[row * 2 * p.inter + p.inter + col]);
}
