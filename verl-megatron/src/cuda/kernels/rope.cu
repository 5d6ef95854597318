// Rotary position embedding (the rotate-half form of HF's Llama/Qwen2) forward and backward, one
// element-wise kernel each way in place of burn's negate, concatenate, two products and a sum
// (and their gradients), for each of q and k in every layer.
//
// Compiled at run time by NVRTC (verl_megatron::cuda::kernels::rope), and by nvcc on a GPU
// machine for a standalone check. f32, contiguous:
//   x, y [rows][heads][dim] (rows = batch * seq), cos, sin [rows][dim] (shared by the heads).
// With h = dim / 2 and rotate(x)[i] = -x[i + h] (i < h), x[i - h] (i >= h):
//   forward:  y[i] = x[i] * cos[i] + rotate(x)[i] * sin[i]
//   backward: dx[i] = dy[i] * cos[i] + (i < h ? dy[i + h] * sin[i + h] : -dy[i - h] * sin[i - h])
// BACKWARD = 1 compiles the backward (same signature, dy in, dx out).

#define THREADS 256

#ifndef BACKWARD
#define BACKWARD 0
#endif

struct RopeParams {
    unsigned int rows;
    unsigned int heads;
    unsigned int dim;
    unsigned int unused;
};

// Grid (ceil(rows * heads * dim / THREADS)).
extern "C" __global__ void __launch_bounds__(THREADS)
verl_rope(const float* __restrict__ x, const float* __restrict__ cos_t,
          const float* __restrict__ sin_t, float* __restrict__ y, RopeParams p) {
    const unsigned long long n = (unsigned long long)p.rows * p.heads * p.dim;
    const unsigned long long e = (unsigned long long)blockIdx.x * THREADS + threadIdx.x;
    if (e >= n) return;
    const unsigned int i = (unsigned int)(e % p.dim);
    const unsigned long long row = e / ((unsigned long long)p.heads * p.dim);
    const unsigned int h = p.dim / 2;
    const float* c = cos_t + row * p.dim;
    const float* s = sin_t + row * p.dim;
#if BACKWARD
    const float other = i < h ? x[e + h] * s[i + h] : -x[e - h] * s[i - h];
    y[e] = x[e] * c[i] + other;
#else
    const float rotated = i < h ? -x[e + h] : x[e - h];
    y[e] = x[e] * c[i] + rotated * s[i];
#endif
}
