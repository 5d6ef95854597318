// Fused causal attention with grouped-query heads: forward and backward, FlashAttention-2 style
// (online softmax over key tiles; the backward recomputes probabilities from the saved
// log-sum-exp), so no [batch, heads, seq, seq] tensor is ever stored.
//
// Compiled at run time by NVRTC (verl_megatron::cuda::kernels::attention prepends
// gemm_common.cuh, for its cp.async copies, and `#define HEAD_DIM <d>`, a multiple of 16 up to
// 128).
//
// Layouts (contiguous): q/dout bf16 [batch, seq, heads, HEAD_DIM], k/v bf16 [batch, seq,
// kv_heads, HEAD_DIM]; out/dq f32 [batch, seq, heads, HEAD_DIM], dk/dv f32 per query head
// [batch, seq, heads, HEAD_DIM], key_mask f32 [batch, seq] (1 = token, 0 = padding), lse/delta
// f32 [batch, heads, seq]. Query i attends to key j when j <= i and key j is a token or j == i
// (a padded query attends to itself, so its softmax stays finite), the same rule as the
// decomposed path's additive bias.
//
// Products run on bf16 tensor cores (`mma.sync.m16n8k16`, f32 accumulation). Tiles reach shared
// memory by cp.async, the next tile's copies in flight while the current one is multiplied (two
// stages), and the warps read their operands with `ldmatrix`. Scores, probabilities and their
// gradients never leave registers: the accumulator of one product is, packed to bf16, the A
// operand of the next (FlashAttention-2's layout). Softmax statistics stay f32, in base 2
// (scores pre-multiplied by log2(e), `exp2f`).
//
// Each block has 4 warps and owns 64 rows (queries in the forward and dq kernels, keys in the
// dk/dv kernel); warp w owns rows 16w..16w+15. In an accumulator fragment lane l holds rows
// l/4 and l/4 + 8 of its warp's 16, so a row's statistics are reduced over the 4 lanes of a quad.

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif

#define TILE 64
#define THREADS 128
// Padded row stride of the bf16 tiles (elements): rows stay 16-byte aligned for cp.async and
// `ldmatrix`, and the 8 rows of one 8x8 matrix fall on distinct banks.
#define LDH (HEAD_DIM + 8)
#define KSTEPS (HEAD_DIM / 16)
#define DTILES (HEAD_DIM / 8)
// Queries per step of the dk/dv kernel: its dk and dv accumulators take 2 * HEAD_DIM / 2 registers
// a lane, so large heads step through narrower query tiles to stay within 255 registers.
#if HEAD_DIM > 64
#define QTILE 32
#else
#define QTILE 64
#endif
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

// +inf without <math.h> (NVRTC has no standard headers).
#define VERL_INF __int_as_float(0x7f800000)

struct AttnParams {
    unsigned int batch;
    unsigned int seq;
    unsigned int heads;
    unsigned int kv_heads;
    float scale;
    // A sliding window: query i attends to keys j with i - j < window (0: none).
    unsigned int window;
    unsigned int unused1;
    unsigned int unused2;
};

// Bytes of shared memory, each region rounded up to 128 bytes.
__device__ __forceinline__ unsigned int round128(unsigned int x) { return (x + 127u) & ~127u; }

// Starts the copies of rows row0..row0+ROWS-1 of one head of a [batch, seq, nheads, HEAD_DIM]
// bf16 tensor into a tile of row stride LDH (zeros past the end of the sequence). The caller
// commits them as one group.
template <int ROWS>
__device__ __forceinline__ void copy_tile(bf16* dst, const bf16* src, unsigned int b,
                                          unsigned int row0, unsigned int head,
                                          unsigned int nheads, unsigned int seq) {
    constexpr int PER_ROW = HEAD_DIM / 8;
    constexpr int ITER = (ROWS * PER_ROW + THREADS - 1) / THREADS;
#pragma unroll
    for (int it = 0; it < ITER; ++it) {
        const unsigned int idx = it * THREADS + threadIdx.x;
        if (idx >= ROWS * PER_ROW) break;
        const unsigned int r = idx / PER_ROW, c = (idx % PER_ROW) * 8, i = row0 + r;
        const unsigned int row = i < seq ? i : 0u;
        copy16(dst + r * LDH + c,
               src + ((unsigned long long)(b * seq + row) * nheads + head) * HEAD_DIM + c,
               i < seq ? 8u : 0u);
    }
}

__device__ __forceinline__ void ldsm_x4(unsigned int (&r)[4], const bf16* p) {
    const unsigned int a = (unsigned int)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void ldsm_x4_trans(unsigned int (&r)[4], const bf16* p) {
    const unsigned int a = (unsigned int)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// c[16 x 8] += a[16 x 16] * b[16 x 8] (bf16 operands, f32 accumulators).
__device__ __forceinline__ void mma(float (&c)[4], const unsigned int (&a)[4], unsigned int b0,
                                    unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The A fragment of k-step s of 16 rows stored row-major (stride LDH) at `rows`.
__device__ __forceinline__ void load_a(unsigned int (&a)[4], const bf16* rows, int s) {
    const unsigned int lane = threadIdx.x % 32;
    ldsm_x4(a, rows + (lane % 16) * LDH + s * 16 + (lane / 16) * 8);
}

// B fragments of n-tiles n0/8 and n0/8 + 1 at k-step s, for a product with the transpose of a
// tile stored row-major [n][k] (keys against queries: the k dimension is the head's).
// b[0], b[1] belong to the first n-tile, b[2], b[3] to the second.
__device__ __forceinline__ void load_b_rows(unsigned int (&b)[4], const bf16* tile, int n0, int s) {
    const unsigned int lane = threadIdx.x % 32;
    ldsm_x4(b, tile + (n0 + lane % 8 + (lane / 16) * 8) * LDH + s * 16 + ((lane / 8) % 2) * 8);
}

// B fragments of head-dimension tiles n0/8 and n0/8 + 1 at k-step s, for a product with a tile
// stored row-major [k][n] (probabilities times values: k runs over the tile's rows).
__device__ __forceinline__ void load_b_cols(unsigned int (&b)[4], const bf16* tile, int s, int n0) {
    const unsigned int lane = threadIdx.x % 32;
    ldsm_x4_trans(b, tile + (s * 16 + lane % 8 + ((lane / 8) % 2) * 8) * LDH + n0 + (lane / 16) * 8);
}

// acc[16 x 8*NT] = a (16 x HEAD_DIM, fragments in registers) * tile^T (tile: 8*NT rows).
template <int NT>
__device__ __forceinline__ void scores(float (&acc)[NT][4], const unsigned int (&a)[KSTEPS][4],
                                       const bf16* tile) {
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
#pragma unroll
        for (int t = 0; t < NT; t += 2) {
            unsigned int b[4];
            load_b_rows(b, tile, t * 8, s);
            mma(acc[t], a[s], b[0], b[1]);
            mma(acc[t + 1], a[s], b[2], b[3]);
        }
    }
}

// The same with the 16 rows read from shared memory one k-step at a time (fewer registers).
template <int NT>
__device__ __forceinline__ void scores_from(float (&acc)[NT][4], const bf16* rows,
                                            const bf16* tile) {
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
        unsigned int a[4];
        load_a(a, rows, s);
#pragma unroll
        for (int t = 0; t < NT; t += 2) {
            unsigned int b[4];
            load_b_rows(b, tile, t * 8, s);
            mma(acc[t], a, b[0], b[1]);
            mma(acc[t + 1], a, b[2], b[3]);
        }
    }
}

__device__ __forceinline__ unsigned int pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(unsigned int*)&v;
}

// An accumulator [16 x 8*NT] as the A operand (16 x 8*NT, k-steps of 16) of the next product.
template <int NT>
__device__ __forceinline__ void as_a(unsigned int (&a)[NT / 2][4], const float (&x)[NT][4]) {
#pragma unroll
    for (int s = 0; s < NT / 2; ++s) {
        a[s][0] = pack(x[2 * s][0], x[2 * s][1]);
        a[s][1] = pack(x[2 * s][2], x[2 * s][3]);
        a[s][2] = pack(x[2 * s + 1][0], x[2 * s + 1][1]);
        a[s][3] = pack(x[2 * s + 1][2], x[2 * s + 1][3]);
    }
}

// acc[16 x HEAD_DIM] += a (16 x 8*NT) * tile (8*NT rows x HEAD_DIM).
template <int NT>
__device__ __forceinline__ void accumulate(float (&acc)[DTILES][4],
                                           const unsigned int (&a)[NT / 2][4], const bf16* tile) {
#pragma unroll
    for (int s = 0; s < NT / 2; ++s) {
#pragma unroll
        for (int d = 0; d < DTILES; d += 2) {
            unsigned int b[4];
            load_b_cols(b, tile, s, d * 8);
            mma(acc[d], a[s], b[0], b[1]);
            mma(acc[d + 1], a[s], b[2], b[3]);
        }
    }
}

__device__ __forceinline__ bool allowed(unsigned int i, unsigned int j, unsigned int seq,
                                        float key_is_token, unsigned int window) {
    return j <= i && i < seq && (key_is_token > 0.5f || j == i) && (window == 0u || i - j < window);
}

// Whether keys j0..j0+TILE-1 are all within the sliding window of queries q0..q0+rows-1 (keys
// before the queries).
__device__ __forceinline__ bool inside_window(unsigned int q0, unsigned int rows, unsigned int j0,
                                              unsigned int window) {
    return window == 0u || q0 + rows - 1 - j0 < window;
}

// Sum over the 4 lanes of a quad (the lanes that share a row).
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// Loads the key mask of keys j0..j0+TILE-1 into `kmask` and returns, after a barrier, whether
// every one of them is a token inside the sequence.
__device__ __forceinline__ bool load_key_mask(float* kmask, const float* key_mask, unsigned int b,
                                              unsigned int j0, unsigned int seq) {
    float km = 1.0f;
    if (threadIdx.x < TILE) {
        const unsigned int j = j0 + threadIdx.x;
        km = j < seq ? key_mask[(unsigned long long)b * seq + j] : 0.0f;
        kmask[threadIdx.x] = km;
    }
    return __syncthreads_and(km > 0.5f) != 0;
}

// Writes a [16 x HEAD_DIM] accumulator's row `half` (0: lane/4, 1: lane/4 + 8), times `mul`.
__device__ __forceinline__ void store_row(float* dst, const float (&acc)[DTILES][4], int half,
                                          float mul) {
    const unsigned int t4 = threadIdx.x % 4;
#pragma unroll
    for (int d = 0; d < DTILES; ++d)
        *(float2*)(dst + d * 8 + 2 * t4) =
            make_float2(acc[d][2 * half] * mul, acc[d][2 * half + 1] * mul);
}

// One step of the key-tile loop (forward, dq): starts the copies of key tile kt + 1's keys and
// values into the other stage (`stage` elements away), waits for tile kt's, loads its key mask
// and returns whether the tile needs no mask: tokens wholly before the block's first query q0.
// The barrier inside also publishes every thread's copies.
__device__ __forceinline__ bool next_key_tile(bf16* ks, bf16* vs, float* kmask, const bf16* k,
                                              const bf16* v, const float* key_mask,
                                              unsigned int kt, unsigned int key_tiles,
                                              unsigned int stage, unsigned int b,
                                              unsigned int kvh, unsigned int q0,
                                              const AttnParams& p) {
    const unsigned int j0 = kt * TILE;
    if (kt + 1 < key_tiles) {
        const unsigned int nxt = ((kt + 1) % 2) * stage;
        copy_tile<TILE>(ks + nxt, k, b, j0 + TILE, kvh, p.kv_heads, p.seq);
        copy_tile<TILE>(vs + nxt, v, b, j0 + TILE, kvh, p.kv_heads, p.seq);
        commit();
        wait_groups<1>();
    } else {
        wait_groups<0>();
    }
    return load_key_mask(kmask, key_mask, b, j0, p.seq) && j0 + TILE <= q0 &&
           inside_window(q0, TILE, j0, p.window);
}

// Forward: grid (ceil(seq / 64), heads, batch).
extern "C" __global__ void __launch_bounds__(THREADS)
verl_attention_forward(const bf16* __restrict__ q, const bf16* __restrict__ k,
                       const bf16* __restrict__ v, const float* __restrict__ key_mask,
                       float* __restrict__ out, float* __restrict__ lse, AttnParams p) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned int off = 0;
    bf16* qs = (bf16*)(smem + off); off += round128(TILE * LDH * 2);
    bf16* ks = (bf16*)(smem + off); off += 2 * round128(TILE * LDH * 2);
    bf16* vs = (bf16*)(smem + off); off += 2 * round128(TILE * LDH * 2);
    float* kmask = (float*)(smem + off);
    const unsigned int stage = round128(TILE * LDH * 2) / 2;  // elements between the two stages

    const unsigned int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * TILE;
    const unsigned int kvh = h / (p.heads / p.kv_heads);
    const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned int row = warp * 16 + lane / 4, t4 = lane % 4;
    const float scale2 = p.scale * LOG2E;
    const unsigned int key_tiles = min((p.seq + TILE - 1) / TILE, blockIdx.x + 1);

    copy_tile<TILE>(qs, q, b, q0, h, p.heads, p.seq);
    copy_tile<TILE>(ks, k, b, 0, kvh, p.kv_heads, p.seq);
    copy_tile<TILE>(vs, v, b, 0, kvh, p.kv_heads, p.seq);
    commit();

    unsigned int qf[KSTEPS][4];
    float o[DTILES][4];
#pragma unroll
    for (int d = 0; d < DTILES; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
    // Running maximum (base 2) and this lane's part of the normaliser, for rows row and row + 8.
    float m[2] = {-VERL_INF, -VERL_INF}, l[2] = {0.0f, 0.0f};

    for (unsigned int kt = 0; kt < key_tiles; ++kt) {
        const unsigned int j0 = kt * TILE, cur = (kt % 2) * stage;
        const bool full = next_key_tile(ks, vs, kmask, k, v, key_mask, kt, key_tiles, stage, b,
                                        kvh, q0, p);
        if (kt == 0) {
#pragma unroll
            for (int s = 0; s < KSTEPS; ++s) load_a(qf[s], qs + warp * 16 * LDH, s);
        }

        float s[TILE / 8][4];
        scores<TILE / 8>(s, qf, ks + cur);
        float mx[2] = {-VERL_INF, -VERL_INF};
#pragma unroll
        for (int t = 0; t < TILE / 8; ++t) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const unsigned int col = t * 8 + 2 * t4 + (e & 1);
                float x = s[t][e] * scale2;
                if (!full && !allowed(q0 + row + (e >> 1) * 8, j0 + col, p.seq, kmask[col], p.window))
                    x = -VERL_INF;
                s[t][e] = x;
                mx[e >> 1] = fmaxf(mx[e >> 1], x);
            }
        }
        float ref[2], alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float m_new = fmaxf(m[r], quad_max(mx[r]));
            ref[r] = (m_new == -VERL_INF) ? 0.0f : m_new;
            alpha[r] = exp2f(m[r] - ref[r]);
            m[r] = m_new;
            l[r] *= alpha[r];
        }
#pragma unroll
        for (int t = 0; t < TILE / 8; ++t) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float pr = exp2f(s[t][e] - ref[e >> 1]);
                s[t][e] = pr;
                l[e >> 1] += pr;
            }
        }
#pragma unroll
        for (int d = 0; d < DTILES; ++d) {
            o[d][0] *= alpha[0];
            o[d][1] *= alpha[0];
            o[d][2] *= alpha[1];
            o[d][3] *= alpha[1];
        }
        unsigned int pf[TILE / 16][4];
        as_a<TILE / 8>(pf, s);
        accumulate<TILE / 8>(o, pf, vs + cur);
        // Every warp is done with this stage before the next iteration copies into it.
        __syncthreads();
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const unsigned int i = q0 + row + r * 8;
        const float total = quad_sum(l[r]);
        if (i < p.seq) {
            store_row(out + ((unsigned long long)(b * p.seq + i) * p.heads + h) * HEAD_DIM, o, r,
                      1.0f / total);
            if (t4 == 0)
                lse[((unsigned long long)b * p.heads + h) * p.seq + i] = (m[r] + log2f(total)) * LN2;
        }
    }
}

// Backward, part 1 (run first): dq for 64 queries of one head, and delta = rowsum(dout * out)
// for those queries, which part 2 reads. Grid (ceil(seq / 64), heads, batch).
extern "C" __global__ void __launch_bounds__(THREADS)
verl_attention_backward_dq(const bf16* __restrict__ q, const bf16* __restrict__ k,
                           const bf16* __restrict__ v, const float* __restrict__ key_mask,
                           const float* __restrict__ out, const bf16* __restrict__ dout,
                           const float* __restrict__ lse, float* __restrict__ dq,
                           float* __restrict__ delta, AttnParams p) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned int off = 0;
    bf16* qs = (bf16*)(smem + off); off += round128(TILE * LDH * 2);
    bf16* dos = (bf16*)(smem + off); off += round128(TILE * LDH * 2);
    bf16* ks = (bf16*)(smem + off); off += 2 * round128(TILE * LDH * 2);
    bf16* vs = (bf16*)(smem + off); off += 2 * round128(TILE * LDH * 2);
    float* lse_s = (float*)(smem + off); off += round128(TILE * 4);
    float* delta_s = (float*)(smem + off); off += round128(TILE * 4);
    float* kmask = (float*)(smem + off);
    const unsigned int stage = round128(TILE * LDH * 2) / 2;

    const unsigned int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * TILE;
    const unsigned int kvh = h / (p.heads / p.kv_heads);
    const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned int row = warp * 16 + lane / 4, t4 = lane % 4;
    const float scale2 = p.scale * LOG2E;
    const unsigned int key_tiles = min((p.seq + TILE - 1) / TILE, blockIdx.x + 1);

    copy_tile<TILE>(qs, q, b, q0, h, p.heads, p.seq);
    copy_tile<TILE>(dos, dout, b, q0, h, p.heads, p.seq);
    copy_tile<TILE>(ks, k, b, 0, kvh, p.kv_heads, p.seq);
    copy_tile<TILE>(vs, v, b, 0, kvh, p.kv_heads, p.seq);
    commit();
    {
        // delta = rowsum(dout * out) in f32 while the copies fly, two threads a row.
        const unsigned int r = threadIdx.x / 2, part = threadIdx.x % 2, i = q0 + r;
        float d = 0.0f, row_lse = 0.0f;
        if (i < p.seq) {
            const unsigned long long base =
                ((unsigned long long)(b * p.seq + i) * p.heads + h) * HEAD_DIM + part * (HEAD_DIM / 2);
#pragma unroll
            for (int c = 0; c < HEAD_DIM / 2; c += 8) {
                const uint4 g = *(const uint4*)(dout + base + c);
                const float4 y0 = *(const float4*)(out + base + c);
                const float4 y1 = *(const float4*)(out + base + c + 4);
                const float2 g0 = __bfloat1622float2(*(const __nv_bfloat162*)&g.x);
                const float2 g1 = __bfloat1622float2(*(const __nv_bfloat162*)&g.y);
                const float2 g2 = __bfloat1622float2(*(const __nv_bfloat162*)&g.z);
                const float2 g3 = __bfloat1622float2(*(const __nv_bfloat162*)&g.w);
                d += g0.x * y0.x + g0.y * y0.y + g1.x * y0.z + g1.y * y0.w;
                d += g2.x * y1.x + g2.y * y1.y + g3.x * y1.z + g3.y * y1.w;
            }
            row_lse = lse[((unsigned long long)b * p.heads + h) * p.seq + i];
        }
        d += __shfl_xor_sync(0xffffffffu, d, 1);
        if (part == 0) {
            if (i < p.seq) delta[((unsigned long long)b * p.heads + h) * p.seq + i] = d;
            delta_s[r] = d;
            lse_s[r] = row_lse * LOG2E;
        }
    }

    float row_lse[2], row_delta[2];
    float dqa[DTILES][4];
#pragma unroll
    for (int d = 0; d < DTILES; ++d) dqa[d][0] = dqa[d][1] = dqa[d][2] = dqa[d][3] = 0.0f;

    for (unsigned int kt = 0; kt < key_tiles; ++kt) {
        const unsigned int j0 = kt * TILE, cur = (kt % 2) * stage;
        const bool full = next_key_tile(ks, vs, kmask, k, v, key_mask, kt, key_tiles, stage, b,
                                        kvh, q0, p);
        if (kt == 0) {
            row_lse[0] = lse_s[row];
            row_lse[1] = lse_s[row + 8];
            row_delta[0] = delta_s[row];
            row_delta[1] = delta_s[row + 8];
        }

        float s[TILE / 8][4], dp[TILE / 8][4];
        scores_from<TILE / 8>(s, qs + warp * 16 * LDH, ks + cur);
        scores_from<TILE / 8>(dp, dos + warp * 16 * LDH, vs + cur);
#pragma unroll
        for (int t = 0; t < TILE / 8; ++t) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const unsigned int col = t * 8 + 2 * t4 + (e & 1);
                float ds = 0.0f;
                if (full || allowed(q0 + row + (e >> 1) * 8, j0 + col, p.seq, kmask[col], p.window)) {
                    const float prob = exp2f(s[t][e] * scale2 - row_lse[e >> 1]);
                    ds = prob * (dp[t][e] - row_delta[e >> 1]) * p.scale;
                }
                s[t][e] = ds;
            }
        }
        unsigned int dsf[TILE / 16][4];
        as_a<TILE / 8>(dsf, s);
        accumulate<TILE / 8>(dqa, dsf, ks + cur);
        __syncthreads();
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const unsigned int i = q0 + row + r * 8;
        if (i < p.seq)
            store_row(dq + ((unsigned long long)(b * p.seq + i) * p.heads + h) * HEAD_DIM, dqa, r,
                      1.0f);
    }
}

// Starts the copies of query tile q0's q and dout rows into the stage the pointers point at,
// and loads its log-sum-exp (base 2) and delta (the dk/dv kernel's next step).
__device__ __forceinline__ void stage_queries(bf16* qs, bf16* dos, float* lse_s, float* delta_s,
                                              const bf16* q, const bf16* dout, const float* lse,
                                              const float* delta, unsigned int b,
                                              unsigned int q0, unsigned int h, const AttnParams& p) {
    copy_tile<QTILE>(qs, q, b, q0, h, p.heads, p.seq);
    copy_tile<QTILE>(dos, dout, b, q0, h, p.heads, p.seq);
    commit();
    if (threadIdx.x < QTILE) {
        const unsigned int i = q0 + threadIdx.x;
        const unsigned long long at = ((unsigned long long)b * p.heads + h) * p.seq + i;
        lse_s[threadIdx.x] = i < p.seq ? lse[at] * LOG2E : 0.0f;
        delta_s[threadIdx.x] = i < p.seq ? delta[at] : 0.0f;
    }
}

// Backward, part 2: one query head's share of dk and dv for 64 keys of its kv head, summed over
// every query at or after the keys, written per query head ([batch, seq, heads, HEAD_DIM]; the
// group sum below adds each kv head's query heads). One block per (key tile, query head) keeps
// the GPU busy where one per kv head would leave most of it idle. Grid (ceil(seq / 64), heads,
// batch).
extern "C" __global__ void __launch_bounds__(THREADS)
verl_attention_backward_dkv(const bf16* __restrict__ q, const bf16* __restrict__ k,
                            const bf16* __restrict__ v, const float* __restrict__ key_mask,
                            const bf16* __restrict__ dout, const float* __restrict__ lse,
                            const float* __restrict__ delta, float* __restrict__ dk,
                            float* __restrict__ dv, AttnParams p) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned int off = 0;
    bf16* ks = (bf16*)(smem + off); off += round128(TILE * LDH * 2);
    bf16* vs = (bf16*)(smem + off); off += round128(TILE * LDH * 2);
    bf16* qs = (bf16*)(smem + off); off += 2 * round128(QTILE * LDH * 2);
    bf16* dos = (bf16*)(smem + off); off += 2 * round128(QTILE * LDH * 2);
    float* lse_s = (float*)(smem + off); off += 2 * round128(QTILE * 4);
    float* delta_s = (float*)(smem + off);
    const unsigned int stage = round128(QTILE * LDH * 2) / 2, stats = round128(QTILE * 4) / 4;

    const unsigned int b = blockIdx.z, h = blockIdx.y, j0 = blockIdx.x * TILE;
    const unsigned int kvh = h / (p.heads / p.kv_heads);
    const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned int row = warp * 16 + lane / 4, t4 = lane % 4;
    const float scale2 = p.scale * LOG2E;

    copy_tile<TILE>(ks, k, b, j0, kvh, p.kv_heads, p.seq);
    copy_tile<TILE>(vs, v, b, j0, kvh, p.kv_heads, p.seq);
    stage_queries(qs, dos, lse_s, delta_s, q, dout, lse, delta, b, j0, h, p);
    // This lane's two keys: whether each is a token (0 past the sequence).
    float key_is_token[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const unsigned int j = j0 + row + r * 8;
        key_is_token[r] = j < p.seq ? key_mask[(unsigned long long)b * p.seq + j] : 0.0f;
    }
    // Whether every key of the block is a token inside the sequence (a barrier, too).
    float km = 1.0f;
    if (threadIdx.x < TILE) {
        const unsigned int j = j0 + threadIdx.x;
        km = j < p.seq ? key_mask[(unsigned long long)b * p.seq + j] : 0.0f;
    }
    const bool all_tokens = __syncthreads_and(km > 0.5f) != 0;

    float dka[DTILES][4], dva[DTILES][4];
#pragma unroll
    for (int d = 0; d < DTILES; ++d) {
        dka[d][0] = dka[d][1] = dka[d][2] = dka[d][3] = 0.0f;
        dva[d][0] = dva[d][1] = dva[d][2] = dva[d][3] = 0.0f;
    }

    unsigned int it = 0;
    for (unsigned int q0 = j0; q0 < p.seq; q0 += QTILE, ++it) {
        const unsigned int cur = (it % 2) * stage, cur_s = (it % 2) * stats;
        if (q0 + QTILE < p.seq) {
            const unsigned int nxt = ((it + 1) % 2) * stage, nxt_s = ((it + 1) % 2) * stats;
            stage_queries(qs + nxt, dos + nxt, lse_s + nxt_s, delta_s + nxt_s, q, dout, lse, delta,
                          b, q0 + QTILE, h, p);
            wait_groups<1>();
        } else {
            wait_groups<0>();
        }
        __syncthreads();
        const bf16* qt = qs + cur;
        const bf16* dot = dos + cur;
        const float* lse_t = lse_s + cur_s;
        const float* delta_t = delta_s + cur_s;
        // Every query of the tile after every key of the block, all of them in the sequence.
        const bool full = all_tokens && q0 >= j0 + TILE && q0 + QTILE <= p.seq &&
                          inside_window(q0, QTILE, j0, p.window);

        // Transposed probabilities: rows are this warp's keys, columns the tile's queries.
        float s[QTILE / 8][4];
        scores_from<QTILE / 8>(s, ks + warp * 16 * LDH, qt);
#pragma unroll
        for (int t = 0; t < QTILE / 8; ++t) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const unsigned int col = t * 8 + 2 * t4 + (e & 1);
                const unsigned int j = j0 + row + (e >> 1) * 8;
                const bool ok = full || (j < p.seq && allowed(q0 + col, j, p.seq, key_is_token[e >> 1], p.window));
                s[t][e] = ok ? exp2f(s[t][e] * scale2 - lse_t[col]) : 0.0f;
            }
        }
        unsigned int af[QTILE / 16][4];
        as_a<QTILE / 8>(af, s);
        accumulate<QTILE / 8>(dva, af, dot);

        float dp[QTILE / 8][4];
        scores_from<QTILE / 8>(dp, vs + warp * 16 * LDH, dot);
#pragma unroll
        for (int t = 0; t < QTILE / 8; ++t) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const unsigned int col = t * 8 + 2 * t4 + (e & 1);
                dp[t][e] = s[t][e] * (dp[t][e] - delta_t[col]) * p.scale;
            }
        }
        as_a<QTILE / 8>(af, dp);
        accumulate<QTILE / 8>(dka, af, qt);
        __syncthreads();
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const unsigned int j = j0 + row + r * 8;
        if (j < p.seq) {
            const unsigned long long base = ((unsigned long long)(b * p.seq + j) * p.heads + h) * HEAD_DIM;
            store_row(dk + base, dka, r, 1.0f);
            store_row(dv + base, dva, r, 1.0f);
        }
    }
}
// dk or dv per query head [batch, seq, heads, HEAD_DIM] summed over each kv head's group of
// query heads, in head order: [batch, seq, kv_heads, HEAD_DIM]. Query head g * rep + r belongs to
// kv head g, so a kv row's group is `rep` consecutive rows of the input. A thread sums 4 floats.
// Grid (ceil(batch * seq * kv_heads * HEAD_DIM / 4 / 256)), 256 threads.
extern "C" __global__ void __launch_bounds__(256)
verl_attention_group_sum(const float* __restrict__ per_head, float* __restrict__ out,
                         AttnParams p) {
    const unsigned long long units = (unsigned long long)p.batch * p.seq * p.kv_heads * (HEAD_DIM / 4);
    const unsigned long long u = (unsigned long long)blockIdx.x * 256 + threadIdx.x;
    if (u >= units) return;
    const unsigned int rep = p.heads / p.kv_heads;
    const unsigned long long kv_row = u / (HEAD_DIM / 4), c = u % (HEAD_DIM / 4);
    const float4* src = (const float4*)per_head + kv_row * rep * (HEAD_DIM / 4) + c;
    float4 s = src[0];
    for (unsigned int r = 1; r < rep; ++r) {
        const float4 x = src[r * (HEAD_DIM / 4)];
        s.x += x.x;
        s.y += x.y;
        s.z += x.z;
        s.w += x.w;
    }
    ((float4*)out)[u] = s;
}
