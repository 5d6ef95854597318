// Fused causal attention with grouped-query heads: forward and backward, FlashAttention-2 style
// (online softmax over key tiles; the backward recomputes probabilities from the saved
// log-sum-exp), so no [batch, heads, seq, seq] tensor is ever stored.
//
// Compiled at run time by NVRTC (verl_megatron::cuda::kernels::attention prepends
// `#define HEAD_DIM <d>`), and by nvcc on a GPU machine for a standalone check.
//
// Layouts (f32, contiguous): q/out/dq [batch, seq, heads, HEAD_DIM], k/v [batch, seq, kv_heads,
// HEAD_DIM], dk/dv per query head [batch, seq, heads, HEAD_DIM], key_mask [batch, seq] (1 = token, 0 = padding), lse/delta
// [batch, heads, seq]. Query i attends to key j when j <= i and key j is a token or j == i (a
// padded query attends to itself, so its softmax stays finite), the same rule as the
// decomposed path's additive bias. Products run on bf16 tensor cores with f32 accumulation;
// softmax statistics stay f32.
//
// Each block has 4 warps and owns 64 rows (queries in the forward and dq kernels, keys in the
// dk/dv kernel); warp w owns rows 16w..16w+15, and lanes 2r and 2r+1 of a warp share row r
// (each takes half of the columns), so softmax statistics never leave the warp.

#include <cuda_bf16.h>
#include <mma.h>

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif

using namespace nvcuda;

#define TILE 64
#define THREADS 128
// Padded leading dimensions (elements): multiples of 8 (bf16) and 4 (f32) as wmma requires,
// offset from powers of two to spread shared-memory banks.
#define LDH (HEAD_DIM + 8)
#define LDS (TILE + 4)
#define LDP (TILE + 8)
#define LDO (HEAD_DIM + 4)

typedef __nv_bfloat16 bf16;
// +inf without <math.h> (NVRTC has no standard headers).
#define VERL_INF __int_as_float(0x7f800000)

struct AttnParams {
    unsigned int batch;
    unsigned int seq;
    unsigned int heads;
    unsigned int kv_heads;
    float scale;
    unsigned int unused0;
    unsigned int unused1;
    unsigned int unused2;
};

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> FragA;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> FragB;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> FragBt;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> FragC;

// Bytes of shared memory, each region rounded up to 128 bytes.
__device__ __forceinline__ unsigned int round128(unsigned int x) { return (x + 127u) & ~127u; }

// Rows row0..row0+63 of one head of a [batch, seq, nheads, HEAD_DIM] f32 tensor into a bf16
// tile (zeros past the end of the sequence).
__device__ __forceinline__ void load_tile(bf16* dst, const float* src, unsigned int b,
                                          unsigned int row0, unsigned int head,
                                          unsigned int nheads, unsigned int seq) {
    for (unsigned int idx = threadIdx.x; idx < TILE * HEAD_DIM; idx += THREADS) {
        unsigned int r = idx / HEAD_DIM, c = idx % HEAD_DIM;
        unsigned int i = row0 + r;
        float v = 0.0f;
        if (i < seq) v = src[((unsigned long long)(b * seq + i) * nheads + head) * HEAD_DIM + c];
        dst[r * LDH + c] = __float2bfloat16(v);
    }
}

// C[16 x 64] (f32, ld LDS) = A[16 x HEAD_DIM] (bf16 row-major, ld LDH) * B^T where B is
// [64 x HEAD_DIM] bf16 row-major (ld LDH): scores of 16 rows against a tile of 64.
__device__ __forceinline__ void rows_times_tile_t(float* c, const bf16* a, const bf16* b) {
    for (int n = 0; n < TILE / 16; ++n) {
        FragC acc;
        wmma::fill_fragment(acc, 0.0f);
        for (int k = 0; k < HEAD_DIM / 16; ++k) {
            FragA fa;
            FragBt fb;
            wmma::load_matrix_sync(fa, a + k * 16, LDH);
            wmma::load_matrix_sync(fb, b + n * 16 * LDH + k * 16, LDH);
            wmma::mma_sync(acc, fa, fb, acc);
        }
        wmma::store_matrix_sync(c + n * 16, acc, LDS, wmma::mem_row_major);
    }
}

// C[16 x HEAD_DIM] (f32, ld LDO) += A[16 x 64] (bf16, ld LDP) * B[64 x HEAD_DIM] (bf16, ld LDH).
__device__ __forceinline__ void accumulate_rows(float* c, const bf16* a, const bf16* b) {
    for (int n = 0; n < HEAD_DIM / 16; ++n) {
        FragC acc;
        wmma::load_matrix_sync(acc, c + n * 16, LDO, wmma::mem_row_major);
        for (int k = 0; k < TILE / 16; ++k) {
            FragA fa;
            FragB fb;
            wmma::load_matrix_sync(fa, a + k * 16, LDP);
            wmma::load_matrix_sync(fb, b + k * 16 * LDH + n * 16, LDH);
            wmma::mma_sync(acc, fa, fb, acc);
        }
        wmma::store_matrix_sync(c + n * 16, acc, LDO, wmma::mem_row_major);
    }
}

__device__ __forceinline__ bool allowed(unsigned int i, unsigned int j, unsigned int seq,
                                        float key_is_token) {
    return j <= i && i < seq && (key_is_token > 0.5f || j == i);
}

// Forward: grid (ceil(seq / 64), heads, batch).
extern "C" __global__ void __launch_bounds__(THREADS)
verl_attention_forward(const float* __restrict__ q, const float* __restrict__ k,
                       const float* __restrict__ v, const float* __restrict__ key_mask,
                       float* __restrict__ out, float* __restrict__ lse, AttnParams p) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned int off = 0;
    bf16* qs = (bf16*)(smem + off); off += round128(TILE * LDH * 2);
    bf16* ks = (bf16*)(smem + off); off += round128(TILE * LDH * 2);
    bf16* vs = (bf16*)(smem + off); off += round128(TILE * LDH * 2);
    float* ss = (float*)(smem + off); off += round128(TILE * LDS * 4);
    bf16* ps = (bf16*)(smem + off); off += round128(TILE * LDP * 2);
    float* os = (float*)(smem + off); off += round128(TILE * LDO * 4);
    float* kmask = (float*)(smem + off);

    const unsigned int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * TILE;
    const unsigned int kvh = h / (p.heads / p.kv_heads);
    const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned int row = warp * 16 + lane / 2, half = lane % 2;
    const unsigned int i = q0 + row;

    load_tile(qs, q, b, q0, h, p.heads, p.seq);
    for (unsigned int idx = threadIdx.x; idx < TILE * LDO; idx += THREADS) os[idx] = 0.0f;
    float m = -VERL_INF, l = 0.0f;

    const unsigned int key_tiles = min((p.seq + TILE - 1) / TILE, blockIdx.x + 1);
    for (unsigned int kt = 0; kt < key_tiles; ++kt) {
        const unsigned int j0 = kt * TILE;
        __syncthreads();
        load_tile(ks, k, b, j0, kvh, p.kv_heads, p.seq);
        load_tile(vs, v, b, j0, kvh, p.kv_heads, p.seq);
        for (unsigned int r = threadIdx.x; r < TILE; r += THREADS)
            kmask[r] = (j0 + r < p.seq) ? key_mask[b * p.seq + j0 + r] : 0.0f;
        __syncthreads();

        rows_times_tile_t(ss + warp * 16 * LDS, qs + warp * 16 * LDH, ks);
        __syncwarp();

        float s[TILE / 2];
        float mx = -VERL_INF;
#pragma unroll
        for (int c = 0; c < TILE / 2; ++c) {
            const unsigned int col = half * (TILE / 2) + c, j = j0 + col;
            const bool ok = allowed(i, j, p.seq, kmask[col]);
            s[c] = ok ? ss[row * LDS + col] * p.scale : -VERL_INF;
            mx = fmaxf(mx, s[c]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        const float m_new = fmaxf(m, mx);
        const float ref = (m_new == -VERL_INF) ? 0.0f : m_new;
        const float alpha = expf(m - ref);
        float sum = 0.0f;
#pragma unroll
        for (int c = 0; c < TILE / 2; ++c) {
            const unsigned int col = half * (TILE / 2) + c;
            const float e = (s[c] == -VERL_INF) ? 0.0f : expf(s[c] - ref);
            sum += e;
            ps[row * LDP + col] = __float2bfloat16(e);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        l = l * alpha + sum;
        m = m_new;
        for (int c = 0; c < HEAD_DIM / 2; ++c) os[row * LDO + half * (HEAD_DIM / 2) + c] *= alpha;
        __syncwarp();

        accumulate_rows(os + warp * 16 * LDO, ps + warp * 16 * LDP, vs);
        __syncwarp();
    }

    if (i < p.seq) {
        const float inv = 1.0f / l;
        float* dst = out + ((unsigned long long)(b * p.seq + i) * p.heads + h) * HEAD_DIM;
        for (int c = 0; c < HEAD_DIM / 2; ++c) {
            const unsigned int col = half * (HEAD_DIM / 2) + c;
            dst[col] = os[row * LDO + col] * inv;
        }
        if (half == 0) lse[((unsigned long long)b * p.heads + h) * p.seq + i] = m + logf(l);
    }
}

// Backward, part 1 (run first): dq for 64 queries of one head, and delta = rowsum(dout * out)
// for those queries, which part 2 reads. Grid (ceil(seq / 64), heads, batch).
extern "C" __global__ void __launch_bounds__(THREADS)
verl_attention_backward_dq(const float* __restrict__ q, const float* __restrict__ k,
                           const float* __restrict__ v, const float* __restrict__ key_mask,
                           const float* __restrict__ out, const float* __restrict__ dout,
                           const float* __restrict__ lse, float* __restrict__ dq,
                           float* __restrict__ delta, AttnParams p) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned int off = 0;
    bf16* qs = (bf16*)(smem + off); off += round128(TILE * LDH * 2);
    bf16* dos = (bf16*)(smem + off); off += round128(TILE * LDH * 2);
    bf16* ks = (bf16*)(smem + off); off += round128(TILE * LDH * 2);
    bf16* vs = (bf16*)(smem + off); off += round128(TILE * LDH * 2);
    float* ss = (float*)(smem + off); off += round128(TILE * LDS * 4);
    float* dps = (float*)(smem + off); off += round128(TILE * LDS * 4);
    bf16* dss = (bf16*)(smem + off); off += round128(TILE * LDP * 2);
    float* dqs = (float*)(smem + off); off += round128(TILE * LDO * 4);
    float* kmask = (float*)(smem + off);

    const unsigned int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * TILE;
    const unsigned int kvh = h / (p.heads / p.kv_heads);
    const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned int row = warp * 16 + lane / 2, half = lane % 2;
    const unsigned int i = q0 + row;

    load_tile(qs, q, b, q0, h, p.heads, p.seq);
    load_tile(dos, dout, b, q0, h, p.heads, p.seq);
    for (unsigned int idx = threadIdx.x; idx < TILE * LDO; idx += THREADS) dqs[idx] = 0.0f;

    float d = 0.0f, row_lse = 0.0f;
    if (i < p.seq) {
        const unsigned long long base = ((unsigned long long)(b * p.seq + i) * p.heads + h) * HEAD_DIM;
        for (int c = 0; c < HEAD_DIM / 2; ++c) {
            const unsigned int col = half * (HEAD_DIM / 2) + c;
            d += dout[base + col] * out[base + col];
        }
        row_lse = lse[((unsigned long long)b * p.heads + h) * p.seq + i];
    }
    d += __shfl_xor_sync(0xffffffffu, d, 1);
    if (i < p.seq && half == 0) delta[((unsigned long long)b * p.heads + h) * p.seq + i] = d;

    const unsigned int key_tiles = min((p.seq + TILE - 1) / TILE, blockIdx.x + 1);
    for (unsigned int kt = 0; kt < key_tiles; ++kt) {
        const unsigned int j0 = kt * TILE;
        __syncthreads();
        load_tile(ks, k, b, j0, kvh, p.kv_heads, p.seq);
        load_tile(vs, v, b, j0, kvh, p.kv_heads, p.seq);
        for (unsigned int r = threadIdx.x; r < TILE; r += THREADS)
            kmask[r] = (j0 + r < p.seq) ? key_mask[b * p.seq + j0 + r] : 0.0f;
        __syncthreads();

        rows_times_tile_t(ss + warp * 16 * LDS, qs + warp * 16 * LDH, ks);
        rows_times_tile_t(dps + warp * 16 * LDS, dos + warp * 16 * LDH, vs);
        __syncwarp();

#pragma unroll
        for (int c = 0; c < TILE / 2; ++c) {
            const unsigned int col = half * (TILE / 2) + c, j = j0 + col;
            float ds = 0.0f;
            if (allowed(i, j, p.seq, kmask[col])) {
                const float prob = expf(ss[row * LDS + col] * p.scale - row_lse);
                ds = prob * (dps[row * LDS + col] - d) * p.scale;
            }
            dss[row * LDP + col] = __float2bfloat16(ds);
        }
        __syncwarp();

        accumulate_rows(dqs + warp * 16 * LDO, dss + warp * 16 * LDP, ks);
        __syncwarp();
    }

    if (i < p.seq) {
        float* dst = dq + ((unsigned long long)(b * p.seq + i) * p.heads + h) * HEAD_DIM;
        for (int c = 0; c < HEAD_DIM / 2; ++c) {
            const unsigned int col = half * (HEAD_DIM / 2) + c;
            dst[col] = dqs[row * LDO + col];
        }
    }
}

// Backward, part 2: one query head's share of dk and dv for 64 keys of its kv head, summed over
// every query tile at or after the keys, written per query head ([batch, seq, heads, HEAD_DIM];
// the caller sums each group's heads). One block per (key tile, query head) keeps the GPU busy
// where one per kv head would leave most of it idle. Grid (ceil(seq / 64), heads, batch).
extern "C" __global__ void __launch_bounds__(THREADS)
verl_attention_backward_dkv(const float* __restrict__ q, const float* __restrict__ k,
                            const float* __restrict__ v, const float* __restrict__ key_mask,
                            const float* __restrict__ dout, const float* __restrict__ lse,
                            const float* __restrict__ delta, float* __restrict__ dk,
                            float* __restrict__ dv, AttnParams p) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned int off = 0;
    bf16* ks = (bf16*)(smem + off); off += round128(TILE * LDH * 2);
    bf16* vs = (bf16*)(smem + off); off += round128(TILE * LDH * 2);
    bf16* qs = (bf16*)(smem + off); off += round128(TILE * LDH * 2);
    bf16* dos = (bf16*)(smem + off); off += round128(TILE * LDH * 2);
    float* ss = (float*)(smem + off); off += round128(TILE * LDS * 4);
    float* dps = (float*)(smem + off); off += round128(TILE * LDS * 4);
    bf16* pts = (bf16*)(smem + off); off += round128(TILE * LDP * 2);
    bf16* dsts = (bf16*)(smem + off); off += round128(TILE * LDP * 2);
    float* dks = (float*)(smem + off); off += round128(TILE * LDO * 4);
    float* dvs = (float*)(smem + off); off += round128(TILE * LDO * 4);
    float* lse_s = (float*)(smem + off); off += round128(TILE * 4);
    float* delta_s = (float*)(smem + off);

    const unsigned int b = blockIdx.z, h = blockIdx.y, j0 = blockIdx.x * TILE;
    const unsigned int kvh = h / (p.heads / p.kv_heads);
    const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned int row = warp * 16 + lane / 2, half = lane % 2;
    const unsigned int j = j0 + row;
    const float key_is_token = (j < p.seq) ? key_mask[b * p.seq + j] : 0.0f;

    load_tile(ks, k, b, j0, kvh, p.kv_heads, p.seq);
    load_tile(vs, v, b, j0, kvh, p.kv_heads, p.seq);
    for (unsigned int idx = threadIdx.x; idx < TILE * LDO; idx += THREADS) {
        dks[idx] = 0.0f;
        dvs[idx] = 0.0f;
    }

    const unsigned int query_tiles = (p.seq + TILE - 1) / TILE;
    {
        for (unsigned int qt = blockIdx.x; qt < query_tiles; ++qt) {
            const unsigned int q0 = qt * TILE;
            __syncthreads();
            load_tile(qs, q, b, q0, h, p.heads, p.seq);
            load_tile(dos, dout, b, q0, h, p.heads, p.seq);
            for (unsigned int r = threadIdx.x; r < TILE; r += THREADS) {
                const bool in = q0 + r < p.seq;
                const unsigned long long at = ((unsigned long long)b * p.heads + h) * p.seq + q0 + r;
                lse_s[r] = in ? lse[at] : 0.0f;
                delta_s[r] = in ? delta[at] : 0.0f;
            }
            __syncthreads();

            // Transposed scores and dP: rows are this warp's keys, columns the tile's queries.
            rows_times_tile_t(ss + warp * 16 * LDS, ks + warp * 16 * LDH, qs);
            rows_times_tile_t(dps + warp * 16 * LDS, vs + warp * 16 * LDH, dos);
            __syncwarp();

#pragma unroll
        for (int c = 0; c < TILE / 2; ++c) {
                const unsigned int col = half * (TILE / 2) + c, i = q0 + col;
                float prob = 0.0f, ds = 0.0f;
                if (j < p.seq && allowed(i, j, p.seq, key_is_token)) {
                    prob = expf(ss[row * LDS + col] * p.scale - lse_s[col]);
                    ds = prob * (dps[row * LDS + col] - delta_s[col]) * p.scale;
                }
                pts[row * LDP + col] = __float2bfloat16(prob);
                dsts[row * LDP + col] = __float2bfloat16(ds);
            }
            __syncwarp();

            accumulate_rows(dvs + warp * 16 * LDO, pts + warp * 16 * LDP, dos);
            accumulate_rows(dks + warp * 16 * LDO, dsts + warp * 16 * LDP, qs);
            __syncwarp();
        }
    }

    if (j < p.seq) {
        const unsigned long long base = ((unsigned long long)(b * p.seq + j) * p.heads + h) * HEAD_DIM;
        for (int c = 0; c < HEAD_DIM / 2; ++c) {
            const unsigned int col = half * (HEAD_DIM / 2) + c;
            dk[base + col] = dks[row * LDO + col];
            dv[base + col] = dvs[row * LDO + col];
        }
    }
}
