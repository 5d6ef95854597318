// Per-row statistics of logits over (a shard of) the vocabulary, from which log-probabilities
// of labels and the entropy follow, with their backward: one read of the logits forward, one
// read and one write backward, and no [rows, vocab] intermediate (burn's log_softmax + gather
// chain reads and writes the whole logits tensor about a dozen times).
//
// Compiled at run time by NVRTC (verl_megatron::cuda::kernels::vocab prepends the defines), and
// by nvcc on a GPU machine for a standalone check.
//   LOGITS_BF16 = 0: logits and their gradient are f32; 1: bf16.
//
// stats[r] = (m, s, p, w) for row r of x [rows][vocab] (row stride ld):
//   m = max_v x[v], s = sum_v exp(x[v] - m), p = x[label] (0 when the label is outside this
//   shard: label < 0 or >= vocab), w = sum_v exp(x[v] - m) * x[v].
// So log softmax(x)[label] = p - (log s + m) and entropy = log s + m - w / s on one shard; shards
// combine by rescaling s and w with exp(m - max m). The backward treats m as a constant (the
// combined results do not depend on it), so for the output's gradient (-, gs, gp, gw):
//   dx[v] = exp(x[v] - m) * (gs + gw * (x[v] + 1)) + (v == label ? gp : 0).

#include <cuda_bf16.h>

#ifndef LOGITS_BF16
#define LOGITS_BF16 0
#endif

#if LOGITS_BF16
typedef __nv_bfloat16 logit_t;
__device__ __forceinline__ float load_logit(const logit_t* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void store_logit(logit_t* p, float v) { *p = __float2bfloat16(v); }
#else
typedef float logit_t;
__device__ __forceinline__ float load_logit(const logit_t* p) { return *p; }
__device__ __forceinline__ void store_logit(logit_t* p, float v) { *p = v; }
#endif

#define STATS_THREADS 512
#define BACKWARD_THREADS 256
// Elements per thread per backward block.
#define BACKWARD_UNROLL 8
// -inf and +inf without <math.h> (NVRTC has no standard headers).
#define VERL_NEG_INF __int_as_float(0xff800000)

struct VocabParams {
    unsigned int rows;
    unsigned int vocab;
    // Row strides (elements) of the logits and of their gradient.
    unsigned int ld;
    unsigned int ld_grad;
};

// A running (max, sum of exp, sum of exp * x) over part of a row.
struct Online {
    float m;
    float s;
    float w;
};

__device__ __forceinline__ void push(Online& o, float x) {
    if (x > o.m) {
        const float c = expf(o.m - x);  // 0 when o.m is -inf
        o.s = o.s * c + 1.0f;
        o.w = o.w * c + x;
        o.m = x;
    } else if (x != VERL_NEG_INF) {
        const float e = expf(x - o.m);
        o.s += e;
        o.w += e * x;
    }
}

__device__ __forceinline__ Online merge(Online a, Online b) {
    if (b.m == VERL_NEG_INF) return a;
    if (a.m == VERL_NEG_INF) return b;
    const float m = fmaxf(a.m, b.m);
    const float ca = expf(a.m - m), cb = expf(b.m - m);
    Online r;
    r.m = m;
    r.s = a.s * ca + b.s * cb;
    r.w = a.w * ca + b.w * cb;
    return r;
}

__device__ __forceinline__ Online shuffle_merge(Online o, int offset) {
    Online other;
    other.m = __shfl_xor_sync(0xffffffffu, o.m, offset);
    other.s = __shfl_xor_sync(0xffffffffu, o.s, offset);
    other.w = __shfl_xor_sync(0xffffffffu, o.w, offset);
    return merge(o, other);
}

// Grid (rows): one block per row.
extern "C" __global__ void __launch_bounds__(STATS_THREADS)
verl_vocab_stats(const logit_t* __restrict__ x, const int* __restrict__ labels,
                 float* __restrict__ stats, VocabParams p) {
    __shared__ Online partial[STATS_THREADS / 32];
    const unsigned int row = blockIdx.x;
    const logit_t* xr = x + (unsigned long long)row * p.ld;

    Online o;
    o.m = VERL_NEG_INF;
    o.s = 0.0f;
    o.w = 0.0f;
    // Four loads in flight per thread before they are folded in.
    unsigned int v = threadIdx.x;
    for (; v + 3 * STATS_THREADS < p.vocab; v += 4 * STATS_THREADS) {
        const float x0 = load_logit(xr + v);
        const float x1 = load_logit(xr + v + STATS_THREADS);
        const float x2 = load_logit(xr + v + 2 * STATS_THREADS);
        const float x3 = load_logit(xr + v + 3 * STATS_THREADS);
        push(o, x0);
        push(o, x1);
        push(o, x2);
        push(o, x3);
    }
    for (; v < p.vocab; v += STATS_THREADS) push(o, load_logit(xr + v));

#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) o = shuffle_merge(o, offset);
    const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) partial[warp] = o;
    __syncthreads();
    if (warp == 0) {
        if (lane < STATS_THREADS / 32) {
            o = partial[lane];
        } else {
            o.m = VERL_NEG_INF;
            o.s = 0.0f;
            o.w = 0.0f;
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) o = shuffle_merge(o, offset);
        if (lane == 0) {
            const int label = labels[row];
            const float picked =
                (label >= 0 && (unsigned int)label < p.vocab) ? load_logit(xr + label) : 0.0f;
            float* out = stats + (unsigned long long)row * 4;
            out[0] = o.m;
            out[1] = o.s;
            out[2] = picked;
            out[3] = o.w;
        }
    }
}

// Grid (rows, ceil(vocab / (BACKWARD_THREADS * BACKWARD_UNROLL))).
extern "C" __global__ void __launch_bounds__(BACKWARD_THREADS)
verl_vocab_stats_backward(const logit_t* __restrict__ x, const int* __restrict__ labels,
                          const float* __restrict__ stats, const float* __restrict__ grad,
                          logit_t* __restrict__ dx, VocabParams p) {
    const unsigned int row = blockIdx.x;
    const float m = stats[(unsigned long long)row * 4];
    const float* g = grad + (unsigned long long)row * 4;
    const float gs = g[1], gp = g[2], gw = g[3];
    const int label = labels[row];
    const logit_t* xr = x + (unsigned long long)row * p.ld;
    logit_t* dr = dx + (unsigned long long)row * p.ld_grad;
    const unsigned int base = blockIdx.y * (BACKWARD_THREADS * BACKWARD_UNROLL) + threadIdx.x;
    float xs[BACKWARD_UNROLL];
#pragma unroll
    for (int i = 0; i < BACKWARD_UNROLL; ++i) {
        const unsigned int v = base + i * BACKWARD_THREADS;
        xs[i] = v < p.vocab ? load_logit(xr + v) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < BACKWARD_UNROLL; ++i) {
        const unsigned int v = base + i * BACKWARD_THREADS;
        if (v < p.vocab) {
            const float e = xs[i] == VERL_NEG_INF ? 0.0f : expf(xs[i] - m);
            float d = e * (gs + gw * (xs[i] + 1.0f));
            if ((int)v == label) d += gp;
            store_logit(dr + v, d);
        }
    }
}
