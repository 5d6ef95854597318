// The rollout engine's KV cache on the GPU, written in place, and attention over it.
//
// verl_decode_attention: one decode step of one layer. Each slot feeds one token at its own
// position; one block per (kv head, slot) rotates that token's key (RoPE, rotate-half), writes
// key and value into the cache at the slot's position, rotates its REP query heads (grouped-query
// attention: query heads g*REP .. g*REP+REP-1 read kv head g), and attends over the slot's
// positions 0..=position with an online softmax, the block's warps taking keys in turn and
// merging at the end. No [slots, heads, 1, keys] score tensor, no mask, no copy of the cache.
// At long contexts with few blocks, the keys are split over several blocks per (kv head, slot)
// and verl_decode_combine merges their partial softmaxes (flash-decoding).
//
// verl_cache_write_prefix: a prefill's keys and values [prompts][kv_heads][len][HEAD_DIM] into
// slots of the cache (target i: the first lens[i] positions of prompt sources[i] into slot
// slots[i] from position starts[i]; one prompt may fill several slots, its n samples sharing one
// prefill, and a chunk of a long prompt starts where the previous chunk ended).
//
// f32 throughout; with ROUND_BF16 = 1 query, keys and values are rounded to bf16 before their
// products, as the decomposed path's bf16 products see them. q, k and v are rows of any stride at
// any element offset, so they can be three tensors or the one output of a fused q/k/v product;
// with HAS_BIAS = 1 the projections' biases (laid out as one such row) are added as they are
// read, and with OUT_BF16 = 1 the output is written as bf16 (the output projection's operand).
// With CACHE_BF16 = 1 the cache holds bf16 bits (keys and values rounded once as they are
// written; with ROUND_BF16 = 1 every product rounds them so anyway, so attention is unchanged to
// the bit, and the cache takes half the memory and half the reads).
// HEAD_DIM (a multiple of 32) and REP are compile-time. Compiled at run time by NVRTC
// (verl_megatron::cuda::kernels::decode_attention).

#define THREADS 128
#define WARPS (THREADS / 32)
#define PER_LANE (HEAD_DIM / 32)
#define NEG_INF __int_as_float(0xff800000)

#ifndef ROUND_BF16
#define ROUND_BF16 0
#endif
#ifndef HAS_BIAS
#define HAS_BIAS 0
#endif
#ifndef OUT_BF16
#define OUT_BF16 0
#endif
#ifndef CACHE_BF16
#define CACHE_BF16 0
#endif

// A cached key or value element: bf16 bits, or f32.
#if CACHE_BF16
typedef unsigned short cache_t;
__device__ __forceinline__ cache_t to_cache(float x) { return bf16_bits(x); }
__device__ __forceinline__ float from_cache(cache_t x) {
    return __uint_as_float((unsigned int)x << 16);
}
#else
typedef float cache_t;
__device__ __forceinline__ cache_t to_cache(float x) { return x; }
__device__ __forceinline__ float from_cache(cache_t x) { return x; }
#endif

struct DecodeParams {
    unsigned int slots;
    unsigned int heads;
    unsigned int kv_heads;
    unsigned int capacity;
    float sqrt_head_dim;
    // Row strides (elements) of q and of k / v, and where q, k and v start in their rows (and
    // in the bias row).
    unsigned int q_stride;
    unsigned int kv_stride;
    unsigned int q_offset;
    unsigned int k_offset;
    unsigned int v_offset;
    // Keys per split (flash-decoding), or 0 for one block per (kv head, slot) over all its keys.
    unsigned int split_len;
    // Splits per (kv head, slot): gridDim.z.
    unsigned int splits;
};

__device__ __forceinline__ float operand(float x) {
#if ROUND_BF16
    return round_bf16(x);
#else
    return x;
#endif
}

// Element i of a projection's head row, its bias added (one f32 add, as a separate bias add).
__device__ __forceinline__ float at(const float* row, const float* bias, int i) {
#if HAS_BIAS
    return row[i] + bias[i];
#else
    return row[i];
#endif
}

// x * cos + rotate_half(x) * sin at element d of a HEAD_DIM row, unfused (as burn's separate
// products and sum round it).
__device__ __forceinline__ float rotary(const float* row, const float* bias, const float* c,
                                        const float* s, int d) {
    const int h = HEAD_DIM / 2;
    const float other = d < h ? -at(row, bias, d + h) : at(row, bias, d - h);
    return __fadd_rn(__fmul_rn(at(row, bias, d), c[d]), __fmul_rn(other, s[d]));
}

__device__ __forceinline__ void store_out(void* out, unsigned long long o, float x) {
#if OUT_BF16
    ((unsigned short*)out)[o] = bf16_bits(x);
#else
    ((float*)out)[o] = x;
#endif
}

// Grid (kv_heads, slots, splits). Slot r's query heads at q + r * q_stride + q_offset, its key
// and value heads at k / v + r * kv_stride + k_offset / v_offset (heads of HEAD_DIM,
// contiguous); bias (with HAS_BIAS) at the same offsets; cos, sin [slots][HEAD_DIM], positions
// [slots] (u32), caches [slots][kv_heads][capacity][HEAD_DIM], out [slots][heads * HEAD_DIM]
// (f32, or bf16 bits). q, k and v may be one buffer: none is written.
//
// With split_len = 0 the block of (g, slot) attends to all of the slot's keys and writes out.
// With split_len > 0 (flash-decoding: a long context's keys spread over many blocks), block z
// attends to keys [z * split_len, (z + 1) * split_len) up to the slot's position and writes its
// unnormalised partial to partial [slots][heads][splits][HEAD_DIM + 2] (the values, then the
// block's running max and sum); verl_decode_combine merges them. Blocks past the slot's position
// do nothing. Split 0 writes the new key and value into the cache; every block reads the new
// token's key and value from its own registers, so no block waits for another's write.
extern "C" __global__ void __launch_bounds__(THREADS)
verl_decode_attention(const float* q, const float* k, const float* v, const float* bias,
                      const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                      const unsigned int* __restrict__ positions, cache_t* __restrict__ k_cache,
                      cache_t* __restrict__ v_cache, void* __restrict__ out,
                      float* __restrict__ partial, DecodeParams p) {
    __shared__ float q_rot[REP][HEAD_DIM];
    __shared__ float k_new[HEAD_DIM];
    __shared__ float v_new[HEAD_DIM];
    __shared__ float warp_max[WARPS][REP];
    __shared__ float warp_sum[WARPS][REP];
    __shared__ float warp_acc[WARPS][REP][HEAD_DIM];

    const unsigned int g = blockIdx.x, slot = blockIdx.y, split = blockIdx.z;
    const unsigned int pos = positions[slot];
    const unsigned int lo = p.split_len ? split * p.split_len : 0;
    if (lo > pos) return;
    const unsigned int hi = p.split_len ? min(lo + p.split_len, pos + 1) : pos + 1;
    const float* c = cos_t + (unsigned long long)slot * HEAD_DIM;
    const float* s = sin_t + (unsigned long long)slot * HEAD_DIM;
    const unsigned long long cache_row =
        (((unsigned long long)slot * p.kv_heads + g) * p.capacity) * HEAD_DIM;

    // This token's key (rotated) and value, into the cache from split 0, and the rotated queries.
    const unsigned int k_at = p.k_offset + g * HEAD_DIM, v_at = p.v_offset + g * HEAD_DIM;
    const float* k_row = k + (unsigned long long)slot * p.kv_stride + k_at;
    const float* v_row = v + (unsigned long long)slot * p.kv_stride + v_at;
    for (int d = threadIdx.x; d < HEAD_DIM; d += THREADS) {
        const float kd = rotary(k_row, bias + k_at, c, s, d);
        const float vd = at(v_row, bias + v_at, d);
        k_new[d] = kd;
        v_new[d] = vd;
        if (split == 0) {
            k_cache[cache_row + (unsigned long long)pos * HEAD_DIM + d] = to_cache(kd);
            v_cache[cache_row + (unsigned long long)pos * HEAD_DIM + d] = to_cache(vd);
        }
    }
    for (int e = threadIdx.x; e < REP * HEAD_DIM; e += THREADS) {
        const int r = e / HEAD_DIM, d = e % HEAD_DIM;
        const unsigned int q_at = p.q_offset + (g * REP + r) * HEAD_DIM;
        const float* q_row = q + (unsigned long long)slot * p.q_stride + q_at;
        q_rot[r][d] = operand(rotary(q_row, bias + q_at, c, s, d));
    }
    __syncthreads();

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float m[REP], l[REP], acc[REP][PER_LANE];
#pragma unroll
    for (int r = 0; r < REP; ++r) {
        m[r] = NEG_INF;
        l[r] = 0.0f;
#pragma unroll
        for (int t = 0; t < PER_LANE; ++t) acc[r][t] = 0.0f;
    }
    // Two keys per pass, both loaded before either is used, so a warp has two loads in flight.
    for (unsigned int j0 = lo + warp; j0 < hi; j0 += 2 * WARPS) {
        float kr[2][PER_LANE], vr[2][PER_LANE];
        const unsigned int js[2] = {j0, j0 + WARPS};
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const unsigned int j = js[u];
            if (j >= hi) continue;
            if (j == pos) {
#pragma unroll
                for (int t = 0; t < PER_LANE; ++t) {
                    kr[u][t] = operand(k_new[lane + 32 * t]);
                    vr[u][t] = operand(v_new[lane + 32 * t]);
                }
            } else {
                const cache_t* kj = k_cache + cache_row + (unsigned long long)j * HEAD_DIM;
                const cache_t* vj = v_cache + cache_row + (unsigned long long)j * HEAD_DIM;
#pragma unroll
                for (int t = 0; t < PER_LANE; ++t) {
                    kr[u][t] = operand(from_cache(kj[lane + 32 * t]));
                    vr[u][t] = operand(from_cache(vj[lane + 32 * t]));
                }
            }
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            if (js[u] >= hi) continue;
#pragma unroll
            for (int r = 0; r < REP; ++r) {
                float dot = 0.0f;
#pragma unroll
                for (int t = 0; t < PER_LANE; ++t) dot += q_rot[r][lane + 32 * t] * kr[u][t];
                for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
                const float score = dot / p.sqrt_head_dim;
                const float m_new = fmaxf(m[r], score);
                const float correction = expf(m[r] - m_new);
                const float w = expf(score - m_new);
                l[r] = l[r] * correction + w;
#pragma unroll
                for (int t = 0; t < PER_LANE; ++t) acc[r][t] = acc[r][t] * correction + w * vr[u][t];
                m[r] = m_new;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < REP; ++r) {
        if (lane == 0) {
            warp_max[warp][r] = m[r];
            warp_sum[warp][r] = l[r];
        }
#pragma unroll
        for (int t = 0; t < PER_LANE; ++t) warp_acc[warp][r][lane + 32 * t] = acc[r][t];
    }
    __syncthreads();
    // Merge the warps' partial softmaxes (a warp with no key has max -inf and weight 0).
    for (int e = threadIdx.x; e < REP * HEAD_DIM; e += THREADS) {
        const int r = e / HEAD_DIM, d = e % HEAD_DIM;
        float mx = NEG_INF;
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, warp_max[w][r]);
        float sum = 0.0f, value = 0.0f;
        for (int w = 0; w < WARPS; ++w) {
            if (warp_max[w][r] == NEG_INF) continue;
            const float f = expf(warp_max[w][r] - mx);
            sum += warp_sum[w][r] * f;
            value += warp_acc[w][r][d] * f;
        }
        const unsigned int head = g * REP + r;
        if (p.split_len == 0) {
            store_out(out, ((unsigned long long)slot * p.heads + head) * HEAD_DIM + d, value / sum);
        } else {
            float* part = partial +
                (((unsigned long long)slot * p.heads + head) * p.splits + split) * (HEAD_DIM + 2);
            part[d] = value;
            if (d == 0) {
                part[HEAD_DIM] = mx;
                part[HEAD_DIM + 1] = sum;
            }
        }
    }
}

// Grid (heads, slots), HEAD_DIM threads: merges the splits of a slot's head that hold keys
// (0 ..= position / split_len) into out.
extern "C" __global__ void verl_decode_combine(const float* __restrict__ partial,
                                               const unsigned int* __restrict__ positions,
                                               void* __restrict__ out, DecodeParams p) {
    const unsigned int head = blockIdx.x, slot = blockIdx.y, d = threadIdx.x;
    const unsigned int used = min(positions[slot] / p.split_len + 1, p.splits);
    const float* base = partial + ((unsigned long long)slot * p.heads + head) * p.splits * (HEAD_DIM + 2);
    float mx = NEG_INF;
    for (unsigned int s = 0; s < used; ++s) mx = fmaxf(mx, base[s * (HEAD_DIM + 2) + HEAD_DIM]);
    float sum = 0.0f, value = 0.0f;
    for (unsigned int s = 0; s < used; ++s) {
        const float* part = base + s * (HEAD_DIM + 2);
        const float f = expf(part[HEAD_DIM] - mx);
        sum += part[HEAD_DIM + 1] * f;
        value += part[d] * f;
    }
    store_out(out, ((unsigned long long)slot * p.heads + head) * HEAD_DIM + d, value / sum);
}

struct PrefixParams {
    unsigned int targets;
    unsigned int kv_heads;
    unsigned int len;
    unsigned int capacity;
};

// Grid (ceil(len * HEAD_DIM / THREADS), kv_heads, targets). k, v [prompts][kv_heads][len][HEAD_DIM];
// sources, slots, lens, starts [targets] (u32).
extern "C" __global__ void __launch_bounds__(THREADS)
verl_cache_write_prefix(const float* __restrict__ k, const float* __restrict__ v,
                        const unsigned int* __restrict__ sources,
                        const unsigned int* __restrict__ slots,
                        const unsigned int* __restrict__ lens,
                        const unsigned int* __restrict__ starts, cache_t* __restrict__ k_cache,
                        cache_t* __restrict__ v_cache, PrefixParams p) {
    const unsigned int i = blockIdx.z, h = blockIdx.y;
    const unsigned long long e = (unsigned long long)blockIdx.x * THREADS + threadIdx.x;
    const unsigned int position = (unsigned int)(e / HEAD_DIM);
    if (position >= lens[i] || position >= p.len) return;
    const unsigned long long from =
        (((unsigned long long)sources[i] * p.kv_heads + h) * p.len) * HEAD_DIM + e;
    const unsigned long long to =
        (((unsigned long long)slots[i] * p.kv_heads + h) * p.capacity + starts[i]) * HEAD_DIM + e;
    k_cache[to] = to_cache(k[from]);
    v_cache[to] = to_cache(v[from]);
}
