// The rollout engine's KV cache on the GPU, written in place, and attention over it.
//
// verl_decode_attention: one decode step of one layer. Each slot feeds one token at its own
// position; one block per (kv head, slot) rotates that token's key (RoPE, rotate-half), writes
// key and value into the cache at the slot's position, rotates its REP query heads (grouped-query
// attention: query heads g*REP .. g*REP+REP-1 read kv head g), and attends over the slot's
// positions 0..=position (its last `window` of them with a sliding window; scores scaled by
// score_divisor and soft-capped where asked) with an online softmax over tiles of keys (scores a key a thread,
// weighted values a few dimensions a thread). No [slots, heads, 1, keys] score tensor, no
// mask, no copy of the cache.
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

#ifndef THREADS
#define THREADS 128
#endif
#define WARPS (THREADS / 32)
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
// 1: the tensor-core path (needs CACHE_BF16, ROUND_BF16 and REP <= 8; see attend_mma).
#ifndef MMA
#define MMA 0
#endif
#if MMA && !(CACHE_BF16 && ROUND_BF16 && REP <= 8)
#error "the tensor-core decode attention needs a bf16 cache, bf16 products and at most 8 heads a group"
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
    // Scores are q·k divided by this (√head_dim, or the model's own scale's inverse).
    float score_divisor;
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
    // A sliding window: a slot attends to its last `window` positions (0: all of them).
    unsigned int window;
    // Scores soft-capped as cap · tanh(s / cap) (0: none; Gemma 2).
    float softcap;
};

// The first key a slot at `pos` attends to.
__device__ __forceinline__ unsigned int first_key(unsigned int pos, const DecodeParams& p) {
    return p.window && pos + 1 > p.window ? pos + 1 - p.window : 0u;
}

// A key's score from its product with the query: scaled, then soft-capped.
__device__ __forceinline__ float score(float dot, const DecodeParams& p) {
    const float x = dot / p.score_divisor;
    return p.softcap > 0.0f ? tanhf(x / p.softcap) * p.softcap : x;
}

__device__ __forceinline__ float operand(float x) {
#if ROUND_BF16
    return round_bf16(x);
#else
    return x;
#endif
}

// A cached key or value element as a product's operand. A bf16 cache holds bf16 values already,
// which rounding leaves unchanged (their low 16 bits are zero), so it is skipped: the same bits
// for four fewer instructions an element (15 % of a 1 000-key block's time on an H200).
__device__ __forceinline__ float cached_operand(float x) {
#if CACHE_BF16
    return x;
#else
    return operand(x);
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

// Eight consecutive cached elements (16-byte aligned) as f32.
__device__ __forceinline__ void load8(const cache_t* src, float (&x)[8]) {
#if CACHE_BF16
    const uint4 u = *(const uint4*)src;
    const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        x[2 * i] = __uint_as_float(w[i] << 16);
        x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
#else
    const float4 a = *(const float4*)src, b = *(const float4*)(src + 4);
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
    x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
#endif
}

// Keys a block scores at once: one a thread.
#define TILE THREADS
// The value product: each thread owns VEC neighbouring dimensions of every head of the group
// (GROUPS threads cover a head; VEC keeps the REP x VEC sums near 64 registers) and every
// KSPLIT-th key of a tile; the KSPLIT threads of a group are neighbouring lanes, so their sums
// meet by shuffles. KSPLIT is a power of two of at most a warp.
#define VEC (REP <= 8 ? 8 : REP <= 16 ? 4 : 2)
#define GROUPS (HEAD_DIM / VEC)
#define KSPLIT_MAX (THREADS / GROUPS < 32 ? THREADS / GROUPS : 32)
#define KSPLIT (KSPLIT_MAX >= 32 ? 32 : KSPLIT_MAX >= 16 ? 16 : KSPLIT_MAX >= 8 ? 8 : KSPLIT_MAX >= 4 ? 4 : KSPLIT_MAX >= 2 ? 2 : 1)
// Keys whose values a thread loads before it uses the first (loads in flight at once).
#define IN_FLIGHT 8
// Query elements a thread rotates.
#define Q_PER_THREAD ((REP * HEAD_DIM + THREADS - 1) / THREADS)

// VEC consecutive cached elements (aligned to VEC) as f32.
__device__ __forceinline__ void load_vec(const cache_t* src, float (&x)[VEC]) {
#if VEC == 8
    load8(src, x);
#elif CACHE_BF16
#if VEC == 4
    const uint2 u = *(const uint2*)src;
    const unsigned int w[2] = {u.x, u.y};
#else
    const unsigned int w[1] = {*(const unsigned int*)src};
#endif
#pragma unroll
    for (int i = 0; i < VEC / 2; ++i) {
        x[2 * i] = __uint_as_float(w[i] << 16);
        x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
#elif VEC == 4
    const float4 a = *(const float4*)src;
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
#else
    const float2 a = *(const float2*)src;
    x[0] = a.x; x[1] = a.y;
#endif
}

#if MMA
// The tensor-core path (a bf16 cache with bf16 products and at most 8 query heads a group):
// each warp takes every WARPS-th chunk of 16 keys and keeps its own online softmax; the
// warps' partial results meet in shared memory in warp order.
//
// Scores S [heads x 16 keys] = Q · Kᵀ as two m16n8k16 products per 16 dimensions: the MMA's 16
// rows are the group's query heads (rows past REP, and 8..15, zero), its 8 columns 8 keys. Lane
// (gq = lane / 4, t = lane % 4) loads 16-byte pieces, elements 32s + 8t .. + 7 of key rows gq
// and gq + 8; the sum over dimensions takes them in any order as long as Q agrees, so a piece
// feeds two k16 steps (step u: elements 4u .. 4u + 3 as the fragment's columns 2t, 2t + 1,
// 2t + 8, 2t + 9), and Q is packed in the same order. The scores come out as the next
// product's A fragment (head gq, keys 2t, 2t + 1 and 8 + 2t, 9 + 2t), rounded to bf16 as the
// plain path's bf16 products see the softmax. Values O [heads x HEAD_DIM] += P · V: V's pieces
// (8 dimensions of one key a lane) become the B fragments (two keys of one dimension a lane)
// by one movmatrix transpose per 8 x 8 block; the output dimensions then come in a known
// permuted order (tile 4s + j, column n: dimension 32s + 8(n / 2) + 2j + n % 2).
#define SLICES (HEAD_DIM / 32)
#define OUT_TILES (HEAD_DIM / 8)

__device__ __forceinline__ void mma_bf16(float (&c)[4], unsigned int a0, unsigned int a2,
                                         unsigned int b0, unsigned int b1) {
    // Rows 8..15 of A (a1, a3) are zero: at most 8 heads a group.
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned int pack_bf16(float lo, float hi) {
    return (unsigned int)bf16_bits(lo) | ((unsigned int)bf16_bits(hi) << 16);
}

__device__ __forceinline__ unsigned int transposed(unsigned int x) {
    unsigned int y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

__device__ __forceinline__ unsigned int word_of(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Key `key`'s pieces (elements 32s + 8t .. + 7): zeros past `hi` (a masked key's value must
// not be NaN), the new token's from shared memory (not written to the cache by every split).
__device__ __forceinline__ void load_pieces(uint4 (&dst)[SLICES], const cache_t* cache,
                                            unsigned long long row, unsigned int key,
                                            unsigned int hi, unsigned int pos,
                                            const float* fresh, unsigned int t) {
#pragma unroll
    for (int s = 0; s < SLICES; ++s) {
        const unsigned int e = 32 * s + 8 * t;
        if (key >= hi) {
            dst[s] = make_uint4(0, 0, 0, 0);
        } else if (key == pos) {
            dst[s] = make_uint4(pack_bf16(fresh[e], fresh[e + 1]), pack_bf16(fresh[e + 2], fresh[e + 3]),
                                pack_bf16(fresh[e + 4], fresh[e + 5]), pack_bf16(fresh[e + 6], fresh[e + 7]));
        } else {
            dst[s] = *(const uint4*)(cache + row + (unsigned long long)key * HEAD_DIM + e);
        }
    }
}

__device__ __forceinline__ void attend_mma(const float (*q_rot)[HEAD_DIM], const float* k_new,
                                           const float* v_new, const cache_t* k_cache,
                                           const cache_t* v_cache, unsigned long long cache_row,
                                           unsigned int lo, unsigned int hi, unsigned int pos,
                                           const DecodeParams& p, unsigned int slot,
                                           unsigned int g, unsigned int split, void* out,
                                           float* partial) {
    __shared__ float part_o[WARPS][REP][HEAD_DIM];
    __shared__ float part_m[WARPS][REP], part_l[WARPS][REP];
    const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned int gq = lane / 4, t = lane % 4;
    unsigned int qa[SLICES][2][2];
#pragma unroll
    for (int s = 0; s < SLICES; ++s)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const unsigned int e = 32 * s + 8 * t + 4 * u;
            const bool head = gq < REP;
            qa[s][u][0] = head ? pack_bf16(q_rot[gq][e], q_rot[gq][e + 1]) : 0u;
            qa[s][u][1] = head ? pack_bf16(q_rot[gq][e + 2], q_rot[gq][e + 3]) : 0u;
        }
    float o[OUT_TILES][4];
#pragma unroll
    for (int n = 0; n < OUT_TILES; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    // Head gq's running max and sum (the four lanes of gq agree).
    float m = NEG_INF, l = 0.0f;
    for (unsigned int c0 = lo + 16 * warp; c0 < hi; c0 += 16 * WARPS) {
        uint4 kr[2][SLICES], vr[2][SLICES];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            load_pieces(kr[h], k_cache, cache_row, c0 + 8 * h + gq, hi, pos, k_new, t);
            load_pieces(vr[h], v_cache, cache_row, c0 + 8 * h + gq, hi, pos, v_new, t);
        }
        float sc[2][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            sc[h][0] = sc[h][1] = sc[h][2] = sc[h][3] = 0.0f;
#pragma unroll
            for (int s = 0; s < SLICES; ++s)
#pragma unroll
                for (int u = 0; u < 2; ++u)
                    mma_bf16(sc[h], qa[s][u][0], qa[s][u][1], word_of(kr[h][s], 2 * u),
                             word_of(kr[h][s], 2 * u + 1));
        }
        // This lane's scores of head gq: keys c0 + 8h + 2t + i.
        float w[2][2];
        float mx = NEG_INF;
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const unsigned int key = c0 + 8 * h + 2 * t + i;
                w[h][i] = key < hi ? score(sc[h][i], p) : NEG_INF;
                mx = fmaxf(mx, w[h][i]);
            }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m, mx), correction = expf(m - m_new);
        float sum = 0.0f;
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                w[h][i] = round_bf16(expf(w[h][i] - m_new));
                sum += w[h][i];
            }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        l = l * correction + sum;
        m = m_new;
        const unsigned int pa0 = pack_bf16(w[0][0], w[0][1]), pa2 = pack_bf16(w[1][0], w[1][1]);
#pragma unroll
        for (int s = 0; s < SLICES; ++s)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float (&acc)[4] = o[4 * s + j];
                acc[0] *= correction;
                acc[1] *= correction;
                mma_bf16(acc, pa0, pa2, transposed(word_of(vr[0][s], j)),
                         transposed(word_of(vr[1][s], j)));
            }
    }
    if (gq < REP) {
        if (t == 0) {
            part_m[warp][gq] = m;
            part_l[warp][gq] = l;
        }
#pragma unroll
        for (int s = 0; s < SLICES; ++s)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const unsigned int d = 32 * s + 8 * t + 2 * j;
                part_o[warp][gq][d] = o[4 * s + j][0];
                part_o[warp][gq][d + 1] = o[4 * s + j][1];
            }
    }
    __syncthreads();
    // The warps' partial softmaxes merged in warp order (a warp without keys has max -inf and
    // adds nothing).
    for (unsigned int i = threadIdx.x; i < REP * HEAD_DIM; i += THREADS) {
        const unsigned int r = i / HEAD_DIM, d = i % HEAD_DIM;
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, part_m[w][r]);
        float sum = 0.0f, value = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float f = part_m[w][r] == NEG_INF ? 0.0f : expf(part_m[w][r] - mx);
            sum += part_l[w][r] * f;
            value += part_o[w][r][d] * f;
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
#endif

// Grid (kv_heads, slots, splits). Slot r's query heads at q + r * q_stride + q_offset, its key
// and value heads at k / v + r * kv_stride + k_offset / v_offset (heads of HEAD_DIM,
// contiguous); bias (with HAS_BIAS) at the same offsets; cos, sin [slots][HEAD_DIM], positions
// [slots] (u32), caches [slots][kv_heads][capacity][HEAD_DIM], out [slots][heads * HEAD_DIM]
// (f32, or bf16 bits). q, k and v may be one buffer: none is written.
//
// The keys go by tiles of TILE: every thread scores one key against the group's REP queries
// (a dot product in its own registers, no shuffle per key), one warp per head turns the tile's
// scores into weights with a running max and sum (online softmax across tiles), and the
// threads then add the weighted values, each its few dimensions over its share of the
// tile's keys. Every sum has a fixed order (dimension order, then the xor trees), so a slot's
// result does not depend on its batch mates.
//
// With split_len = 0 the block of (g, slot) attends to all of the slot's keys and writes out.
// With split_len > 0 (flash-decoding: a long context's keys spread over many blocks), block z
// attends to keys [z * split_len, (z + 1) * split_len) up to the slot's position and writes its
// unnormalised partial to partial [slots][heads][splits][HEAD_DIM + 2] (the values, then the
// block's running max and sum); verl_decode_combine merges them. Blocks past the slot's position
// do nothing. Split 0 writes the new key and value into the cache; every block reads the new
// token's key and value from shared memory, so no block waits for another's write.
extern "C" __global__ void __launch_bounds__(THREADS)
verl_decode_attention(const float* q, const float* k, const float* v, const float* bias,
                      const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                      const unsigned int* __restrict__ positions, cache_t* __restrict__ k_cache,
                      cache_t* __restrict__ v_cache, void* __restrict__ out,
                      float* __restrict__ partial, DecodeParams p) {
    __shared__ __align__(16) float q_rot[REP][HEAD_DIM];
    __shared__ __align__(16) float k_new[HEAD_DIM];
    __shared__ __align__(16) float v_new[HEAD_DIM];
#if !MMA
    __shared__ float weights[REP][TILE];
#endif
    __shared__ float run_max[REP], run_sum[REP], correction[REP];

    const unsigned int g = blockIdx.x, slot = blockIdx.y, split = blockIdx.z;
    const unsigned int pos = positions[slot];
    const unsigned int split_lo = p.split_len ? split * p.split_len : 0;
    if (split_lo > pos) return;
    const unsigned int hi = p.split_len ? min(split_lo + p.split_len, pos + 1) : pos + 1;
    // A sliding window starts the keys later; a split wholly before it has none, but split 0
    // still writes the new key and value (verl_decode_combine skips it).
    const unsigned int first = first_key(pos, p);
    if (hi <= first && split != 0) return;
    const unsigned int lo = max(split_lo, first);
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
        // Scored as the cached keys are: rounded here, as cached_operand skips it.
        k_new[d] = CACHE_BF16 ? operand(kd) : kd;
        v_new[d] = vd;
        if (split == 0) {
            k_cache[cache_row + (unsigned long long)pos * HEAD_DIM + d] = to_cache(kd);
            v_cache[cache_row + (unsigned long long)pos * HEAD_DIM + d] = to_cache(vd);
        }
    }
    if (hi <= first) return;
    {
        // The queries' elements, all loads issued before the first product (a block is short
        // work: its time is load latency), then rotated as rotary() does.
        float xq[Q_PER_THREAD], oq[Q_PER_THREAD], cq[Q_PER_THREAD], sq[Q_PER_THREAD];
#pragma unroll
        for (int i = 0; i < Q_PER_THREAD; ++i) {
            const int e = threadIdx.x + i * THREADS, r = e / HEAD_DIM, d = e % HEAD_DIM;
            const int h = HEAD_DIM / 2;
            if (e < REP * HEAD_DIM) {
                const unsigned int q_at = p.q_offset + (g * REP + r) * HEAD_DIM;
                const float* q_row = q + (unsigned long long)slot * p.q_stride + q_at;
                xq[i] = at(q_row, bias + q_at, d);
                oq[i] = d < h ? -at(q_row, bias + q_at, d + h) : at(q_row, bias + q_at, d - h);
                cq[i] = c[d];
                sq[i] = s[d];
            }
        }
#pragma unroll
        for (int i = 0; i < Q_PER_THREAD; ++i) {
            const int e = threadIdx.x + i * THREADS;
            if (e < REP * HEAD_DIM)
                q_rot[e / HEAD_DIM][e % HEAD_DIM] =
                    operand(__fadd_rn(__fmul_rn(xq[i], cq[i]), __fmul_rn(oq[i], sq[i])));
        }
    }
    for (int r = threadIdx.x; r < REP; r += THREADS) {
        run_max[r] = NEG_INF;
        run_sum[r] = 0.0f;
    }
    __syncthreads();
#if MMA
    attend_mma(q_rot, k_new, v_new, k_cache, v_cache, cache_row, lo, hi, pos, p, slot, g, split, out,
               partial);
#else
    const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned int group = threadIdx.x / KSPLIT, sub = threadIdx.x % KSPLIT;
    const unsigned int d0 = VEC * group;
    float acc[REP][VEC];
#pragma unroll
    for (int r = 0; r < REP; ++r)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[r][e] = 0.0f;

    for (unsigned int t0 = lo; t0 < hi; t0 += TILE) {
        // Scores: this thread's key against the group's queries.
        const unsigned int j = t0 + threadIdx.x;
        float dot[REP];
#pragma unroll
        for (int r = 0; r < REP; ++r) dot[r] = 0.0f;
        if (j < hi) {
            const cache_t* kj = k_cache + cache_row + (unsigned long long)j * HEAD_DIM;
#pragma unroll
            for (int d = 0; d < HEAD_DIM; d += 8) {
                float x[8];
                if (j == pos) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) x[e] = k_new[d + e];
                } else {
                    load8(kj + d, x);
                }
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    const float ke = cached_operand(x[e]);
#pragma unroll
                    for (int r = 0; r < REP; ++r) dot[r] += q_rot[r][d + e] * ke;
                }
            }
        }
#pragma unroll
        for (int r = 0; r < REP; ++r) weights[r][threadIdx.x] = j < hi ? score(dot[r], p) : NEG_INF;
        __syncthreads();

        // Weights: a warp per head; the running max and sum carry over from the last tile.
        for (unsigned int r = warp; r < REP; r += WARPS) {
            float mx = NEG_INF;
#pragma unroll
            for (int i = 0; i < TILE / 32; ++i) mx = fmaxf(mx, weights[r][lane + 32 * i]);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float m_old = run_max[r], m_new = fmaxf(m_old, mx);
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < TILE / 32; ++i) {
                const float w = expf(weights[r][lane + 32 * i] - m_new);
                weights[r][lane + 32 * i] = w;
                sum += w;
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            __syncwarp();
            if (lane == 0) {
                const float f = expf(m_old - m_new);
                correction[r] = f;
                run_sum[r] = run_sum[r] * f + sum;
                run_max[r] = m_new;
            }
        }
        __syncthreads();

        // Values: the cached keys of the tile, IN_FLIGHT keys' loads at a time, then the new
        // token's (always the last key).
        if (group < GROUPS) {
#pragma unroll
            for (int r = 0; r < REP; ++r)
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[r][e] *= correction[r];
            const unsigned int end = min(hi, t0 + TILE), cached_end = min(end, pos);
            const cache_t* vd = v_cache + cache_row + d0;
#pragma unroll
            for (int i0 = 0; i0 < TILE / KSPLIT; i0 += IN_FLIGHT) {
                if (t0 + sub + i0 * KSPLIT >= cached_end) break;
                float x[IN_FLIGHT][VEC];
#pragma unroll
                for (int b = 0; b < IN_FLIGHT; ++b) {
                    const unsigned int jj = t0 + sub + (i0 + b) * KSPLIT;
                    if (i0 + b < TILE / KSPLIT && jj < cached_end) {
                        load_vec(vd + (unsigned long long)jj * HEAD_DIM, x[b]);
                    } else {
#pragma unroll
                        for (int e = 0; e < VEC; ++e) x[b][e] = 0.0f;
                    }
                }
#pragma unroll
                for (int b = 0; b < IN_FLIGHT; ++b) {
                    const unsigned int jj = t0 + sub + (i0 + b) * KSPLIT;
                    if (i0 + b < TILE / KSPLIT && jj < cached_end) {
#pragma unroll
                        for (int r = 0; r < REP; ++r) {
                            const float w = weights[r][jj - t0];
#pragma unroll
                            for (int e = 0; e < VEC; ++e) acc[r][e] += w * cached_operand(x[b][e]);
                        }
                    }
                }
            }
            if (pos >= t0 && pos < end && (pos - t0) % KSPLIT == sub) {
#pragma unroll
                for (int r = 0; r < REP; ++r) {
                    const float w = weights[r][pos - t0];
#pragma unroll
                    for (int e = 0; e < VEC; ++e) acc[r][e] += w * operand(v_new[d0 + e]);
                }
            }
        }
        __syncthreads();  // the weights are rewritten by the next tile
    }

    // The KSPLIT lanes of a group hold disjoint keys: their sums meet in a fixed xor tree.
#pragma unroll
    for (int r = 0; r < REP; ++r)
#pragma unroll
        for (int o = 1; o < KSPLIT; o <<= 1)
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[r][e] += __shfl_xor_sync(0xffffffffu, acc[r][e], o);
    if (sub != 0 || group >= GROUPS) return;
#pragma unroll
    for (int r = 0; r < REP; ++r) {
        const unsigned int head = g * REP + r;
        if (p.split_len == 0) {
            const unsigned long long o = ((unsigned long long)slot * p.heads + head) * HEAD_DIM + d0;
#pragma unroll
            for (int e = 0; e < VEC; ++e) store_out(out, o + e, acc[r][e] / run_sum[r]);
        } else {
            float* part = partial +
                (((unsigned long long)slot * p.heads + head) * p.splits + split) * (HEAD_DIM + 2);
#pragma unroll
            for (int e = 0; e < VEC; ++e) part[d0 + e] = acc[r][e];
            if (d0 == 0) {
                part[HEAD_DIM] = run_max[r];
                part[HEAD_DIM + 1] = run_sum[r];
            }
        }
    }
#endif
}


// Grid (heads, slots), HEAD_DIM threads: merges the splits of a slot's head that hold keys
// (first key / split_len ..= position / split_len) into out.
extern "C" __global__ void verl_decode_combine(const float* __restrict__ partial,
                                               const unsigned int* __restrict__ positions,
                                               void* __restrict__ out, DecodeParams p) {
    const unsigned int head = blockIdx.x, slot = blockIdx.y, d = threadIdx.x;
    const unsigned int used = min(positions[slot] / p.split_len + 1, p.splits);
    // Splits before a sliding window's first key hold nothing.
    const unsigned int from = first_key(positions[slot], p) / p.split_len;
    const float* base = partial + ((unsigned long long)slot * p.heads + head) * p.splits * (HEAD_DIM + 2);
    float mx = NEG_INF;
    for (unsigned int s = from; s < used; ++s) mx = fmaxf(mx, base[s * (HEAD_DIM + 2) + HEAD_DIM]);
    float sum = 0.0f, value = 0.0f;
    for (unsigned int s = from; s < used; ++s) {
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
