// A decode step's product C = A · Wᵀ: a few rows of activations A [M][K] (M <= 64 per block, row pitch lda)
// against a weight stored as the model keeps it, W [N][K] (row pitch ldb), both bf16, f32
// accumulation, C [M][N] (row pitch ldc) in f32 or bf16.
//
// The step reads every weight byte once, so the kernel is a weight stream: no shared-memory
// staging of W, each lane loading 16-byte pieces of weight rows straight into the registers that
// feed `mma.sync.m16n8k16`, one chunk ahead of the one it multiplies. The MMA's 16 rows are
// weight rows and its 8 columns batch rows ("swap AB"), so a batch of 1 wastes 7 of 8 columns
// instead of 15 of 16 rows, and a block needs no tile of the batch.
//
// Layout of the work: a block owns RT x 16 weight rows and all of K; its WARPS warps take K in
// chunks of 32 x U elements, chunk c to warp c % WARPS, so many warps stream one row at once and
// the grid has N / (16 RT) blocks with enough loads in flight to cover DRAM latency. The warps'
// partial sums meet in shared memory and are added in warp order: the result is deterministic,
// and a batch row's value does not depend on the batch size (the k order is fixed by WARPS and U
// alone).
//
// The 16-byte pieces: lane (g = lane / 4, t = lane % 4) loads elements 8t..8t+7 of a 32-wide
// k-slice of weight rows g and g + 8, and the same elements of batch row g of each 8-row group.
// The sum over k does not care which k goes to which MMA slot as long as A and B agree, so the
// slice is fed as two k16 steps: step s takes elements 4s..4s+3 of each lane's piece as the
// fragment's columns {2t, 2t+1, 2t+8, 2t+9}.
//
// verl_decode_gemm_shared (below) computes the same sums in the same order with the block's
// warps splitting rows instead of k, for batches past 16 rows.
//
// Compiled at run time by NVRTC (verl_megatron::cuda::kernels::decode_gemm prepends the defines
// and gemm_common.cuh). The caller guarantees K % 8 == 0, 16-byte aligned rows and starts.

#ifndef NB
#define NB 1  // 8-row groups of the batch: ceil(M / 8)
#endif
#ifndef RT
#define RT 1  // 16-row weight tiles per block
#endif
#ifndef WARPS
#define WARPS 8  // warps splitting k
#endif
#ifndef WR
#define WR 1  // groups of WARPS warps per block, each its own RT tiles (sharing L1's activations)
#endif
#ifndef U
#define U 4  // 32-wide k-slices per chunk
#endif
#ifndef BS
#define BS 1  // blocks sharing a weight tile, each NB groups of the batch (neighbours in launch order)
#endif
#ifndef OUT_F32
#define OUT_F32 1
#endif
#ifndef STAGE_A
#define STAGE_A 0  // 1: activations copied a chunk ahead into the warp's shared stages (cp.async)
#endif
#ifndef ROW_WARPS
#define ROW_WARPS 4  // shared-stage kernel: warps of a block, each its own RT tiles
#endif
#ifndef STAGES
#define STAGES 4  // shared-stage kernel: chunks in its ring
#endif
#define CHUNK (32 * U)
#define PARTIALS (RT * NB * 4)

#if OUT_F32
typedef float out_t;
__device__ __forceinline__ float to_out(float x) { return x; }
#else
typedef bf16 out_t;
__device__ __forceinline__ bf16 to_out(float x) { return __float2bfloat16(x); }
#endif

// A weight piece: read once, so kept out of L1 (the activations live there).
__device__ __forceinline__ uint4 load_weight(const bf16* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

__device__ __forceinline__ unsigned int word(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ void mma16816(float* c, unsigned int a0, unsigned int a1, unsigned int a2,
                                         unsigned int a3, unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Lane (g, t)'s weight rows g and g + 8 of each of its RT tiles from row n0, at its 8-element
// piece: rows past N read row 0 (valid memory), whose results are never written.
__device__ __forceinline__ void weight_rows(const bf16* (&wrow)[RT][2], const bf16* w, unsigned int n0,
                                            unsigned int g, unsigned int t, const GemmParams& p) {
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const unsigned int row = n0 + rt * 16 + g + 8 * h;
            wrow[rt][h] = w + (unsigned long long)(row < p.n ? row : 0) * p.ldb + 8 * t;
        }
}

// Chunk `k0`'s weight pieces into `dst` (zeros past K: a zero weight times a finite activation).
__device__ __forceinline__ void load_chunk(uint4 (&dst)[U][RT][2], const bf16* (&wrow)[RT][2],
                                           unsigned int k0, unsigned int t, unsigned int k_len) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const unsigned int k = k0 + 32 * u;
        const bool in = k + 8 * t < k_len;
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                dst[u][rt][h] = in ? load_weight(wrow[rt][h] + k) : make_uint4(0u, 0u, 0u, 0u);
    }
}

// The uint4 pieces of one chunk of a warp's activations: [U][NB][32 lanes].
#define STAGE_PIECES (U * NB * 32)

// Chunk `k0`'s activation pieces into a warp's stage, each lane copying the pieces it will read
// (so it needs no other lane's copy), zeros past K.
__device__ __forceinline__ void stage_chunk(uint4* dst, const bf16* (&arow)[NB], unsigned int k0,
                                            unsigned int t, unsigned int lane, unsigned int k_len) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            const unsigned int k = k0 + 32 * u;
            copy16((bf16*)&dst[(u * NB + b) * 32 + lane], arow[b] + k, inside(k + 8 * t, k_len));
        }
}

// Grid (ceil(N / (16 RT WR)) * BS, 1, 1), WR * WARPS * 32 threads.
extern "C" __global__ void __launch_bounds__(WR * WARPS * 32)
verl_decode_gemm(const bf16* __restrict__ a, const bf16* __restrict__ w, out_t* __restrict__ c,
                 GemmParams p) {
    // Each warp's partial sums, [WR][WARPS][PARTIALS][32] (dynamic: up to 96 KiB); with
    // STAGE_A, first each warp's two activation stages [WR][WARPS][2][STAGE_PIECES] (uint4).
    extern __shared__ __align__(16) float partial[];

    // `warp`: this warp's share of k; `group`: its rows' share of the block's.
    const unsigned int warp = (threadIdx.x / 32) % WARPS, group = threadIdx.x / 32 / WARPS;
    const unsigned int lane = threadIdx.x % 32;
    const unsigned int g = lane / 4, t = lane % 4;
    // Blocks of one weight tile are neighbours, so the second one's weight reads find L2.
    const unsigned int tile = blockIdx.x / BS, m0 = blockIdx.x % BS * NB * 8;
    const unsigned int n0 = (tile * WR + group) * 16 * RT;

    // Rows past N or M read row 0 (valid memory); their results are never written.
    const bf16* wrow[RT][2];
    weight_rows(wrow, w, n0, g, t, p);
    const bf16* arow[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) {
        const unsigned int row = m0 + b * 8 + g;
        arow[b] = a + (unsigned long long)(row < p.m ? row : 0) * p.lda + 8 * t;
    }

    float acc[RT][NB][4];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int b = 0; b < NB; ++b)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[rt][b][i] = 0.0f;

    const unsigned int chunks = (p.k + CHUNK - 1) / CHUNK;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    uint4 next[U][RT][2];
    unsigned int ch = warp;
#if STAGE_A
    uint4* stages = (uint4*)partial + (group * WARPS + warp) * 2 * STAGE_PIECES;
    unsigned int stage = 0;
    if (ch < chunks) stage_chunk(stages, arow, ch * CHUNK, t, lane, p.k);
    commit();
#endif
    if (ch < chunks) load_chunk(next, wrow, ch * CHUNK, t, p.k);
    for (; ch < chunks; ch += WARPS) {
        uint4 cur[U][RT][2];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int rt = 0; rt < RT; ++rt)
#pragma unroll
                for (int h = 0; h < 2; ++h) cur[u][rt][h] = next[u][rt][h];
#if STAGE_A
        // The other stage was read by the last chunk's products, which have all been issued.
        asm volatile("" ::: "memory");
        if (ch + WARPS < chunks)
            stage_chunk(stages + (stage ^ 1) * STAGE_PIECES, arow, (ch + WARPS) * CHUNK, t, lane, p.k);
        commit();
#endif
        if (ch + WARPS < chunks) load_chunk(next, wrow, (ch + WARPS) * CHUNK, t, p.k);
#if STAGE_A
        wait_groups<1>();  // this chunk's activations have landed
        asm volatile("" ::: "memory");
        const uint4* staged = stages + stage * STAGE_PIECES;
        stage ^= 1;
#endif
#pragma unroll
        for (int u = 0; u < U; ++u) {
#if !STAGE_A
            const unsigned int k = ch * CHUNK + 32 * u;
            const bool in = k + 8 * t < p.k;
#endif
#pragma unroll
            for (int b = 0; b < NB; ++b) {
#if STAGE_A
                const uint4 x = staged[(u * NB + b) * 32 + lane];
#else
                const uint4 x = in ? __ldg((const uint4*)(arow[b] + k)) : zero;
#endif
#pragma unroll
                for (int s = 0; s < 2; ++s)
#pragma unroll
                    for (int rt = 0; rt < RT; ++rt)
                        mma16816(acc[rt][b], word(cur[u][rt][0], 2 * s), word(cur[u][rt][1], 2 * s),
                                 word(cur[u][rt][0], 2 * s + 1), word(cur[u][rt][1], 2 * s + 1),
                                 word(x, 2 * s), word(x, 2 * s + 1));
            }
        }
    }

#if STAGE_A
    __syncthreads();  // the partial sums overwrite other warps' stages
#endif
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int b = 0; b < NB; ++b)
#pragma unroll
            for (int i = 0; i < 4; ++i) partial[((group * WARPS + warp) * PARTIALS + (rt * NB + b) * 4 + i) * 32 + lane] =
                    acc[rt][b][i];
    __syncthreads();

    // Each value: its warps' partials in warp order, then to C. Accumulator register i of lane
    // (g, t) holds weight row g (+8 for i >= 2) and batch row 2t (+1 for odd i) of its tiles.
    for (unsigned int e = threadIdx.x; e < WR * PARTIALS * 32; e += WR * WARPS * 32) {
        const unsigned int gr = e / (PARTIALS * 32), r = e / 32 % PARTIALS, l = e % 32;
        float sum = 0.0f;
#pragma unroll
        for (int v = 0; v < WARPS; ++v) sum += partial[((gr * WARPS + v) * PARTIALS + r) * 32 + l];
        const unsigned int i = r % 4, b = (r / 4) % NB, rt = r / (4 * NB);
        const unsigned int n = (tile * WR + gr) * 16 * RT + rt * 16 + l / 4 + (i >= 2 ? 8 : 0);
        const unsigned int m = m0 + b * 8 + (l % 4) * 2 + (i & 1);
        if (m < p.m && n < p.n) c[(unsigned long long)m * p.ldc + n] = to_out(sum);
    }
}

// ---- The shared-stage kernel ----
//
// Past 16 batch rows the stream re-reads the batch's activations once per 16 RT weight rows
// (each block holds all WARPS k residues' partial sums of its rows): at 64 rows that is twice
// the weight's bytes from L2. This kernel keeps the same k order but walks the residues one
// after another: each warp owns RT x 16 weight rows and the whole of k, sums residue 0's chunks
// (0, WARPS, 2 WARPS, ...) into `acc`, adds it to `total`, then residue 1's, ..., as the stream
// adds its warps' partials in warp order, so a row's result is the same to the bit. The block's
// ROW_WARPS warps multiply the same chunk together, so its activations are staged once per
// block and read by every warp, and the weights go through the same STAGES-deep cp.async ring
// (more bytes in flight than registers hold). Products with few weight rows and a long k (a
// down projection) run one block per residue (grid y = WARPS) into f32 partial sums, which
// verl_decode_gemm_residues adds in residue order.

// The residue-major chunk order: residue v's chunks v, v + WARPS, ... then residue v + 1's.
struct ChunkWalk {
    unsigned int v, c;
    __device__ __forceinline__ void step(unsigned int chunks) {
        c += WARPS;
        if (c >= chunks) {
            ++v;
            c = v;
        }
    }
};

// A stage: the chunk's activation pieces [U][NB][32 lanes] (lane (g, t) of group b reads batch
// row 8b + g, elements 8t..8t+7 of slice u; copied by all the block's threads and read by every
// warp), then each warp's weight pieces [ROW_WARPS][U][RT][2][32 lanes] (each lane copies and
// reads only its own, so they need no barrier, and the ring holds STAGES - 1 chunks of weights
// in flight without spending registers on them).
#define WEIGHT_PIECES (U * RT * 2 * 32)
#define SHARED_STAGE (STAGE_PIECES + ROW_WARPS * WEIGHT_PIECES)

__device__ __forceinline__ void stage_shared(uint4* dst, const bf16* a, const bf16* (&wrow)[RT][2],
                                             unsigned int m0, unsigned int chunk, unsigned int warp,
                                             unsigned int lane, const GemmParams& p) {
    for (unsigned int e = threadIdx.x; e < STAGE_PIECES; e += ROW_WARPS * 32) {
        const unsigned int u = e / (NB * 32), b = e / 32 % NB, l = e % 32;
        unsigned int row = m0 + 8 * b + l / 4;
        row = row < p.m ? row : 0;
        const unsigned int k = chunk * CHUNK + 32 * u + 8 * (l % 4);
        copy16((bf16*)&dst[e], a + (unsigned long long)row * p.lda + k, inside(k, p.k));
    }
    uint4* mine = dst + STAGE_PIECES + warp * WEIGHT_PIECES;
    const unsigned int t = lane % 4;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const unsigned int k = chunk * CHUNK + 32 * u;
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                copy16((bf16*)&mine[((u * RT + rt) * 2 + h) * 32 + lane], wrow[rt][h] + k, inside(k + 8 * t, p.k));
    }
}

// Grid (ceil(N / (16 RT ROW_WARPS)) * BS, splits, 1), ROW_WARPS * 32 threads, STAGES *
// SHARED_STAGE * 16 bytes of dynamic shared memory. splits == 1: C gets the sum over every
// residue; splits == WARPS (products with few weight rows): block y sums residue y alone into
// `c` as f32 [WARPS][M][ldc], and verl_decode_gemm_residues adds them in residue order.
extern "C" __global__ void __launch_bounds__(ROW_WARPS * 32)
verl_decode_gemm_shared(const bf16* __restrict__ a, const bf16* __restrict__ w, out_t* __restrict__ c,
                        GemmParams p) {
    extern __shared__ __align__(16) uint4 stages[];
    const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned int g = lane / 4, t = lane % 4;
    const unsigned int tile = blockIdx.x / BS, m0 = blockIdx.x % BS * NB * 8;
    const unsigned int n0 = (tile * ROW_WARPS + warp) * 16 * RT;
    const bool split = gridDim.y > 1;

    const bf16* wrow[RT][2];
    weight_rows(wrow, w, n0, g, t, p);

    float acc[RT][NB][4], total[RT][NB][4];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int b = 0; b < NB; ++b)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[rt][b][i] = total[rt][b][i] = 0.0f;

    const unsigned int chunks = (p.k + CHUNK - 1) / CHUNK;
    // This block's chunks: every residue in order, or residue blockIdx.y alone.
    const unsigned int first = split ? blockIdx.y : 0;
    const unsigned int steps = split ? (first < chunks ? (chunks - first + WARPS - 1) / WARPS : 0) : chunks;
    ChunkWalk staged_walk{first, first}, walk{first, first};
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if ((unsigned int)s < steps) {
            stage_shared(stages + s * SHARED_STAGE, a, wrow, m0, staged_walk.c, warp, lane, p);
            staged_walk.step(chunks);
        }
        commit();
    }

    for (unsigned int i = 0; i < steps; ++i) {
        wait_groups<STAGES - 2>();  // chunk i has landed (this thread's copies)
        __syncthreads();            // everyone's, and every warp is done with chunk i - 1's stage
        if (i + STAGES - 1 < steps) {
            stage_shared(stages + (i + STAGES - 1) % STAGES * SHARED_STAGE, a, wrow, m0, staged_walk.c, warp, lane, p);
            staged_walk.step(chunks);
        }
        commit();
        const uint4* staged = stages + i % STAGES * SHARED_STAGE;
        const uint4* mine = staged + STAGE_PIECES + warp * WEIGHT_PIECES;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            uint4 cur[RT][2];
#pragma unroll
            for (int rt = 0; rt < RT; ++rt)
#pragma unroll
                for (int h = 0; h < 2; ++h) cur[rt][h] = mine[((u * RT + rt) * 2 + h) * 32 + lane];
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                const uint4 x = staged[(u * NB + b) * 32 + lane];
#pragma unroll
                for (int s = 0; s < 2; ++s)
#pragma unroll
                    for (int rt = 0; rt < RT; ++rt)
                        mma16816(acc[rt][b], word(cur[rt][0], 2 * s), word(cur[rt][1], 2 * s),
                                 word(cur[rt][0], 2 * s + 1), word(cur[rt][1], 2 * s + 1),
                                 word(x, 2 * s), word(x, 2 * s + 1));
            }
        }
        // The residue's last chunk: its partial sum joins the total, in residue order.
        if (!split && walk.c + WARPS >= chunks) {
#pragma unroll
            for (int rt = 0; rt < RT; ++rt)
#pragma unroll
                for (int b = 0; b < NB; ++b)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        total[rt][b][e] += acc[rt][b][e];
                        acc[rt][b][e] = 0.0f;
                    }
        }
        walk.step(chunks);
    }

    // Accumulator register e of lane (g, t): weight row g (+8 for e >= 2), batch row 2t (+1 odd).
    float* parts = (float*)c + (unsigned long long)blockIdx.y * p.m * p.ldc;
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int b = 0; b < NB; ++b)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const unsigned int n = n0 + rt * 16 + g + (e >= 2 ? 8 : 0);
                const unsigned int m = m0 + b * 8 + 2 * t + (e & 1);
                if (m < p.m && n < p.n) {
                    if (split)
                        parts[(unsigned long long)m * p.ldc + n] = acc[rt][b][e];
                    else
                        c[(unsigned long long)m * p.ldc + n] = to_out(total[rt][b][e]);
                }
            }
}

// C from the residues' partial sums `parts` [WARPS][M][ldc] (f32), added in residue order as the
// stream adds its warps'. Grid (ceil(M * N / 256)), 256 threads.
extern "C" __global__ void __launch_bounds__(256)
verl_decode_gemm_residues(const float* __restrict__ parts, out_t* __restrict__ c, GemmParams p) {
    const unsigned int e = blockIdx.x * 256 + threadIdx.x;
    if (e >= p.m * p.n) return;
    const unsigned int m = e / p.n, n = e % p.n;
    float sum = 0.0f;
#pragma unroll
    for (int v = 0; v < WARPS; ++v) sum += parts[((unsigned long long)v * p.m + m) * p.ldc + n];
    c[(unsigned long long)m * p.ldc + n] = to_out(sum);
}
