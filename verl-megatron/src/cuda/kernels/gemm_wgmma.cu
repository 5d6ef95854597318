// C = A · B for bf16 operands with f32 accumulation and a bf16 result on Hopper's warpgroup
// tensor-core instruction (wgmma.mma_async, sm_90a only): a BM x BN tile of C per block of two
// warpgroups, each warpgroup 64 rows of it with BN / 128 instructions of m64n128k16 per k step.
// The operands reach shared memory by a STAGES-deep pipeline (cp.async, or TMA below), laid out
// as wgmma reads them with the 128-byte swizzle, so any row pitch and a transpose of either
// operand need no copy:
//   A_T = 0: A stored row-major [M][K] (row stride lda), read K-major; 1: stored as A^T [K][M],
//            read M-major (wgmma's transpose bit).
//   B_T = 1: B stored as B^T [N][K], read K-major; 0: stored row-major [K][N], read N-major.
// C is row-major [M][N] with row stride ldc. Every operand's row pitch is a multiple of 8
// elements and its base 16-byte aligned (the caller checks); the parts of tiles past the matrix
// edges are zero-filled. Same parameters as gemm.cu's kernel, which stays the path on other GPUs.
//
// Shared layout of one stage, each tile in rows of 64 bf16 (128 bytes), the 16-byte pieces of
// row r stored at piece (p ^ (r % 8)) -- the 128-byte swizzle wgmma's descriptors name:
//   K-major tile (R rows of the M or N side x 64 of K): row r at r * 128 bytes.
//   MN-major tile (64 of K x R of the M or N side): R / 64 blocks of 64 rows (one per k) x 64
//   elements, block b at b * 8 KiB, row k at k * 128 bytes inside it.
// TMA = 1 (with SPECIALIZED = 1): one thread of the copying warpgroup fills each stage with
// Hopper's tensor-memory copies (cp.async.bulk.tensor, 128-byte swizzle, zero fill past the
// edges) from two tensor maps that arrive first among the parameters (cubecl encodes them at
// launch from the operands' bindings), and the stage's mbarrier counts the bytes. This is the
// layout above, made by one instruction a box instead of 2 048 16-byte copies a stage.
// Compiled at run time by NVRTC (verl_megatron::cuda::kernels::gemm prepends the defines), and
// by nvcc on a GPU machine for a standalone check (bench/gpu/gemm_check.cu -DWGMMA).


#ifndef A_T
#define A_T 0
#endif
#ifndef B_T
#define B_T 1
#endif
#ifndef BN
#define BN 128
#endif
#ifndef STAGES
#define STAGES 5
#endif
#ifndef SPECIALIZED
#define SPECIALIZED 1
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1
#endif
#ifndef TMA
#define TMA 0
#endif
// WIDE = 1 (BN = 256): one m64n256k16 instruction a k step instead of two of n128.
#ifndef WIDE
#define WIDE 0
#endif
#if TMA && !SPECIALIZED
#error "TMA loads are issued by the copying warpgroup (SPECIALIZED = 1)"
#endif
// REGS = 1 (with TMA): the copying warpgroup hands its registers to the computing ones
// (setmaxnreg: 40 a thread against 232).
#ifndef REGS
#define REGS TMA
#endif
// The register split assumes one block of 384 threads an SM (168 registers a thread at launch:
// 128 x 40 + 256 x 232 = 384 x 168); anything else would wait forever for registers.
#if REGS && (!TMA || MIN_BLOCKS != 1)
#error "REGS needs TMA and MIN_BLOCKS = 1"
#endif
// PERSISTENT = 1 (with TMA): gridDim.x blocks (one per multiprocessor) walk the tiles in groups
// of GROUP_M tile rows (for L2 reuse); the copying thread fills the next tile's stages while the
// computing warpgroups write the last one out, each from its own 64-row staging buffer past the
// pipeline (so the epilogue no longer leaves the tensor cores and the copies idle together).
#ifndef PERSISTENT
#define PERSISTENT 0
#endif
#define GROUP_M 8
#if PERSISTENT && !TMA
#error "the persistent schedule needs TMA loads"
#endif
#if WIDE && BN != 256
#error "WIDE needs BN = 256"
#endif
#define BM 128
#define BK 64
// Two warpgroups compute (64 rows each); SPECIALIZED = 1 adds a third that only copies, the
// stages handed over by mbarriers, so the computing warpgroups issue products back to back.
#define THREADS (SPECIALIZED ? 384 : 256)
#define CONSUMERS 256
#define NI (BN / 128)
#define TILE_A_BYTES (BM * BK * 2)
#define TILE_B_BYTES (BN * BK * 2)
#define STAGE_BYTES (TILE_A_BYTES + TILE_B_BYTES)
// The pipeline plus 1 KiB to align the start to the swizzle's 1 KiB period; the epilogue reuses
// the pipeline's memory for a BM x (BN + 8) bf16 or BM x (BN + 4) f32 tile.
// A warpgroup's staging buffer in the persistent epilogue: 64 rows of BN + 8 bf16, or of a
// 128-column half in f32 (128 + 4): 33 792 bytes either way at BN = 256.
#define EPI_WG_BYTES (64 * ((BN + 8) * 2 > 132 * 4 ? (BN + 8) * 2 : 132 * 4))
#if PERSISTENT
#define GEMM_SMEM_BYTES (STAGES * STAGE_BYTES + 2 * EPI_WG_BYTES + 1024)
#else
#define GEMM_SMEM_BYTES (STAGES * STAGE_BYTES + 1024)
#endif
static_assert(BM * (BN + 4) * 4 <= STAGES * STAGE_BYTES, "the f32 epilogue's tile must fit the pipeline");
#if SPECIALIZED && STAGES < 2
#error "SPECIALIZED needs at least 2 stages"
#endif
#if !SPECIALIZED && STAGES < 3
#error "the single-role pipeline needs at least 3 stages"
#endif
#define MN_BLOCK_BYTES (64 * 128)

// OUT_F32 = 1: the result is written in f32 (generation's products, which go on in f32).
#ifndef OUT_F32
#define OUT_F32 0
#endif
#if OUT_F32
typedef float out_t;
#else
typedef bf16 out_t;
#endif

// A K-major tile: `rows` rows (from `row0`, of `row_extent`) x 64 of K (from k0, of k_extent),
// the stored matrix [row][k] with pitch `ld`.
template <int ROWS, int LOADERS>
__device__ __forceinline__ void load_k_major(unsigned int tid, unsigned int dst, const bf16* src, unsigned int ld,
                                             unsigned int row0, unsigned int row_extent,
                                             unsigned int k0, unsigned int k_extent) {
#pragma unroll
    for (unsigned int c = tid; c < ROWS * 8; c += LOADERS) {
        const unsigned int r = c / 8, p = c % 8;
        const unsigned int ok = row0 + r < row_extent ? inside(k0 + p * 8, k_extent) : 0u;
        const bf16* from = ok ? src + (unsigned long long)(row0 + r) * ld + k0 + p * 8 : src;
        copy16(dst + r * 128 + ((p ^ (r % 8)) * 16), from, ok);
    }
}

// An MN-major tile: 64 of K (rows of the stored matrix [k][mn], pitch `ld`) x `cols` of M or N.
template <int COLS, int LOADERS>
__device__ __forceinline__ void load_mn_major(unsigned int tid, unsigned int dst, const bf16* src, unsigned int ld,
                                              unsigned int col0, unsigned int col_extent,
                                              unsigned int k0, unsigned int k_extent) {
#pragma unroll
    for (unsigned int c = tid; c < COLS * 8; c += LOADERS) {
        const unsigned int kr = c / (COLS / 8), q = c % (COLS / 8);
        const unsigned int block = q / 8, p = q % 8;
        const unsigned int ok = k0 + kr < k_extent ? inside(col0 + q * 8, col_extent) : 0u;
        const bf16* from = ok ? src + (unsigned long long)(k0 + kr) * ld + col0 + q * 8 : src;
        copy16(dst + block * MN_BLOCK_BYTES + kr * 128 + ((p ^ (kr % 8)) * 16), from, ok);
    }
}

template <int LOADERS>
__device__ __forceinline__ void load_stage(unsigned int tid, unsigned int a_dst, unsigned int b_dst, const bf16* a,
                                           const bf16* b, const GemmParams& p, unsigned int m0,
                                           unsigned int n0, unsigned int kt) {
    const unsigned int k0 = kt * BK;
#if A_T
    load_mn_major<BM, LOADERS>(tid, a_dst, a, p.lda, m0, p.m, k0, p.k);
#else
    load_k_major<BM, LOADERS>(tid, a_dst, a, p.lda, m0, p.m, k0, p.k);
#endif
#if B_T
    load_k_major<BN, LOADERS>(tid, b_dst, b, p.ldb, n0, p.n, k0, p.k);
#else
    load_mn_major<BN, LOADERS>(tid, b_dst, b, p.ldb, n0, p.n, k0, p.k);
#endif
}

// A shared-memory matrix descriptor with the 128-byte swizzle: start address, leading and
// stride byte offsets (in 16-byte units, 14 bits each), layout type 1 (128B) in bits 62-63.
__device__ __forceinline__ unsigned long long descriptor(unsigned int addr, unsigned int lbo,
                                                         unsigned int sbo) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) |
           ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// K-major: 8-row groups 1 KiB apart (SBO), the leading offset unused inside the swizzle span;
// a k step of 16 is 32 bytes along the row. MN-major: 64-element blocks 8 KiB apart (LBO),
// 8-row (k) groups 1 KiB apart (SBO); a k step of 16 is 16 rows, 2 KiB.
__device__ __forceinline__ unsigned long long k_major(unsigned int base, unsigned int kk) {
    return descriptor(base + kk * 32, 16, 1024);
}
__device__ __forceinline__ unsigned long long mn_major(unsigned int base, unsigned int kk) {
    return descriptor(base + kk * 2048, MN_BLOCK_BYTES, 1024);
}

template <int TA, int TB>
__device__ __forceinline__ void wgmma_m64n128k16(float* d, unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{" 
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, 1, 1, 1, %66, %67;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "n"(TA), "n"(TB));
}


// The same with a 256-wide B: a warpgroup's 64 x 256 slice of the tile in one instruction, so
// the A operand is read from shared memory once per k step instead of twice. Accumulator i
// lands where instruction i / 64 of n128 would put its i % 64 (columns 128 (i / 64) + ...).
template <int TA, int TB>
__device__ __forceinline__ void wgmma_m64n256k16(float* d, unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, 1, 1, 1, %130, %131;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "n"(TA), "n"(TB));
}


__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving reads of the accumulators above the last wgmma_wait (the
// registers are written by the asynchronous products, which the compiler cannot see).
__device__ __forceinline__ void fence_accumulators(float (&acc)[NI][64]) {
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
        for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(acc[j][i])::"memory");
}
__device__ __forceinline__ void proxy_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void barrier_init(unsigned int bar, unsigned int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void barrier_arrive(unsigned int bar) {
    asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Arrives on `bar` once this thread's earlier cp.async copies have landed (the barrier's count
// includes this arrival).
__device__ __forceinline__ void barrier_arrive_copies(unsigned int bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void barrier_wait(unsigned int bar, unsigned int parity) {
    asm volatile(
        "{\n"
        " .reg .pred done;\n"
        "wait_%=:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra wait_%=;\n"
        "}\n" ::"r"(bar), "r"(parity) : "memory");
}
// A barrier over the computing warpgroups only (the copying one may have left).
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(CONSUMERS) : "memory"); }

#if TMA
// A CUtensorMap as the driver encodes it (128 bytes, 64-byte aligned), passed by value as a
// __grid_constant__ parameter so its address is valid for the bulk copies.
struct __align__(64) TensorMap {
    unsigned long long words[16];
};

// A 2-D box of `map` at (inner, outer) element coordinates into shared address `dst`; its bytes
// count towards mbarrier `bar`'s expected transaction.
__device__ __forceinline__ void tma_box(unsigned int dst, const TensorMap* map, int inner, int outer,
                                        unsigned int bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
        ::"r"(dst), "l"((unsigned long long)map), "r"(inner), "r"(outer), "r"(bar)
        : "memory");
}

// Arrives on `bar` and tells it `bytes` more are on their way.
__device__ __forceinline__ void barrier_expect(unsigned int bar, unsigned int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Stage kt's tiles by bulk copies, in the shared layouts stage_products reads: a K-major tile is
// one box of its rows x 64 of K; an MN-major tile is one 64 x 64 box per 64 columns.
__device__ __forceinline__ void tma_stage(const TensorMap* ta, const TensorMap* tb, unsigned int a_dst,
                                          unsigned int b_dst, unsigned int bar, unsigned int m0,
                                          unsigned int n0, unsigned int k0) {
#if A_T
#pragma unroll
    for (int blk = 0; blk < BM / 64; ++blk) tma_box(a_dst + blk * MN_BLOCK_BYTES, ta, m0 + 64 * blk, k0, bar);
#else
    tma_box(a_dst, ta, k0, m0, bar);
#endif
#if B_T
    tma_box(b_dst, tb, k0, n0, bar);
#else
#pragma unroll
    for (int blk = 0; blk < BN / 64; ++blk) tma_box(b_dst + blk * MN_BLOCK_BYTES, tb, n0 + 64 * blk, k0, bar);
#endif
}
#endif  // TMA

// This warpgroup's products over one stage: 4 k steps of 16, NI instructions of n128 each.
__device__ __forceinline__ void stage_products(float (&acc)[NI][64], unsigned int a_tile, unsigned int group) {
    const unsigned int b_tile = a_tile + TILE_A_BYTES;
#pragma unroll
    for (unsigned int kk = 0; kk < BK / 16; ++kk) {
#if A_T
        const unsigned long long da = mn_major(a_tile + group * MN_BLOCK_BYTES, kk);
#else
        const unsigned long long da = k_major(a_tile + group * 64 * 128, kk);
#endif
#if WIDE
#if B_T
        const unsigned long long db = k_major(b_tile, kk);
#else
        const unsigned long long db = mn_major(b_tile, kk);
#endif
        wgmma_m64n256k16<A_T, 1 - B_T>(&acc[0][0], da, db);
#else
#pragma unroll
        for (int j = 0; j < NI; ++j) {
#if B_T
            const unsigned long long db = k_major(b_tile + j * 128 * 128, kk);
#else
            const unsigned long long db = mn_major(b_tile + j * 2 * MN_BLOCK_BYTES, kk);
#endif
            wgmma_m64n128k16<A_T, 1 - B_T>(acc[j], da, db);
        }
#endif
    }
}

#if PERSISTENT
// Tile t's first row and column: GROUP_M tile rows at a time, down the rows first, so the
// blocks running together share A's and B's tiles in L2.
__device__ __forceinline__ void tile_origin(unsigned int t, unsigned int tiles_m, unsigned int tiles_n,
                                            unsigned int& m0, unsigned int& n0) {
    const unsigned int per_group = GROUP_M * tiles_n;
    const unsigned int first = (t / per_group) * GROUP_M;
    const unsigned int rows = tiles_m - first < GROUP_M ? tiles_m - first : GROUP_M;
    const unsigned int in_group = t % per_group;
    m0 = (first + in_group % rows) * BM;
    n0 = (in_group / rows) * BN;
}

// A barrier over one computing warpgroup (ids 2 and 3).
__device__ __forceinline__ void group_sync(unsigned int group) {
    asm volatile("bar.sync %0, 128;\n" ::"r"(2 + group) : "memory");
}

// This warpgroup's 64 rows of the tile at (m0, n0) out through its staging buffer `buf`, in
// 16-byte pieces of rows.
__device__ __forceinline__ void write_rows(float (&acc)[NI][64], out_t* c, const GemmParams& p, unsigned int m0,
                                           unsigned int n0, unsigned int group, unsigned char* buf) {
    const unsigned int tid = threadIdx.x % 128, w = tid / 32, l = tid % 32;
    const unsigned int r0 = m0 + group * 64;
#if OUT_F32
    float* tile = (float*)buf;
#pragma unroll
    for (int j = 0; j < NI; ++j) {
#pragma unroll
        for (int i = 0; i < 64; i += 2) {
            const unsigned int row = 16 * w + l / 4 + 8 * ((i / 2) % 2);
            const unsigned int col = 8 * (i / 4) + 2 * (l % 4);
            *(float2*)(tile + row * 132 + col) = make_float2(acc[j][i], acc[j][i + 1]);
        }
        group_sync(group);
        for (unsigned int q = tid; q < 64 * 128 / 4; q += 128) {
            const unsigned int r = q / 32, c4 = (q % 32) * 4;
            const unsigned int gm = r0 + r, gn = n0 + 128 * j + c4;
            if (gm >= p.m || gn >= p.n) continue;
            float* dst = c + (unsigned long long)gm * p.ldc + gn;
            const float* from = tile + r * 132 + c4;
            if (gn + 4 <= p.n && p.ldc % 4 == 0) {
                *(float4*)dst = *(const float4*)from;
            } else {
                for (unsigned int e = 0; e < 4 && gn + e < p.n; ++e) dst[e] = from[e];
            }
        }
        group_sync(group);  // the buffer is free again
    }
#else
    bf16* tile = (bf16*)buf;
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
        for (int i = 0; i < 64; i += 2) {
            const unsigned int row = 16 * w + l / 4 + 8 * ((i / 2) % 2);
            const unsigned int col = 128 * j + 8 * (i / 4) + 2 * (l % 4);
            *(__nv_bfloat162*)(tile + row * (BN + 8) + col) = __floats2bfloat162_rn(acc[j][i], acc[j][i + 1]);
        }
    group_sync(group);
    for (unsigned int q = tid; q < 64 * BN / 8; q += 128) {
        const unsigned int r = q / (BN / 8), c8 = (q % (BN / 8)) * 8;
        const unsigned int gm = r0 + r, gn = n0 + c8;
        if (gm >= p.m || gn >= p.n) continue;
        bf16* dst = c + (unsigned long long)gm * p.ldc + gn;
        const bf16* from = tile + r * (BN + 8) + c8;
        if (gn + 8 <= p.n && p.ldc % 8 == 0) {
            *(uint4*)dst = *(const uint4*)from;
        } else {
            for (unsigned int e = 0; e < 8 && gn + e < p.n; ++e) dst[e] = from[e];
        }
    }
    group_sync(group);
#endif
}
#endif  // PERSISTENT

// Grid (ceil(n / BN), ceil(m / BM)); with PERSISTENT, (blocks, 1) over every tile.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
verl_gemm_bf16_wgmma(
#if TMA
                     const __grid_constant__ TensorMap ta, const __grid_constant__ TensorMap tb,
#endif
                     const bf16* __restrict__ a, const bf16* __restrict__ b,
#if TMA
                     // A and B again as plain buffers: cubecl orders a launch after other
                     // streams' writes only for its buffers, not for tensor maps' operands.
                     const bf16* a_buffer, const bf16* b_buffer,
#endif
                     out_t* __restrict__ c, GemmParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - ((unsigned int)__cvta_generic_to_shared(smem_raw) % 1024)) % 1024);
    const unsigned int base = (unsigned int)__cvta_generic_to_shared(smem);

#if PERSISTENT
    {
        const unsigned int k_tiles = (p.k + BK - 1) / BK;
        const unsigned int tiles_m = (p.m + BM - 1) / BM, tiles_n = (p.n + BN - 1) / BN;
        const unsigned int tiles = tiles_m * tiles_n;
        __shared__ __align__(8) unsigned long long bars[2 * STAGES];
        const unsigned int full = (unsigned int)__cvta_generic_to_shared(bars);
        const unsigned int empty = full + STAGES * 8;
        if (threadIdx.x == 0) {
            for (int s = 0; s < STAGES; ++s) {
                barrier_init(full + s * 8, 1);
                barrier_init(empty + s * 8, 2);
            }
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        __syncthreads();
        const unsigned int role = threadIdx.x / 128;
        // `it` counts stage uses across tiles: stage it % STAGES, phase (it / STAGES) & 1.
        unsigned int it = 0;
        if (role == 2) {
#if REGS
            asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
#endif
            if (threadIdx.x == CONSUMERS) {
                for (unsigned int t = blockIdx.x; t < tiles; t += gridDim.x) {
                    unsigned int m0, n0;
                    tile_origin(t, tiles_m, tiles_n, m0, n0);
                    for (unsigned int kt = 0; kt < k_tiles; ++kt, ++it) {
                        const unsigned int s = it % STAGES;
                        if (it >= STAGES) barrier_wait(empty + s * 8, ((it / STAGES) + 1) & 1);
                        barrier_expect(full + s * 8, STAGE_BYTES);
                        tma_stage(&ta, &tb, base + s * STAGE_BYTES, base + s * STAGE_BYTES + TILE_A_BYTES,
                                  full + s * 8, m0, n0, kt * BK);
                    }
                }
            }
            return;
        }
#if REGS
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
#endif
        const unsigned int group = role;
        unsigned char* buf = smem + STAGES * STAGE_BYTES + group * EPI_WG_BYTES;
        float acc[NI][64];
        for (unsigned int t = blockIdx.x; t < tiles; t += gridDim.x) {
            unsigned int m0, n0;
            tile_origin(t, tiles_m, tiles_n, m0, n0);
#pragma unroll
            for (int j = 0; j < NI; ++j)
#pragma unroll
                for (int i = 0; i < 64; ++i) acc[j][i] = 0.0f;
            for (unsigned int kt = 0; kt < k_tiles; ++kt, ++it) {
                const unsigned int s = it % STAGES;
                barrier_wait(full + s * 8, (it / STAGES) & 1);
                wgmma_fence();
                stage_products(acc, base + s * STAGE_BYTES, group);
                wgmma_commit();
                wgmma_wait<1>();
                if (kt > 0 && threadIdx.x % 128 == 0) barrier_arrive(empty + ((it - 1) % STAGES) * 8);
            }
            wgmma_wait<0>();
            fence_accumulators(acc);
            // The tile's last stage goes back too, so the next tile's copies are under way
            // while this one is written out.
            if (threadIdx.x % 128 == 0) barrier_arrive(empty + ((it - 1) % STAGES) * 8);
            write_rows(acc, c, p, m0, n0, group, buf);
        }
        return;
    }
#else
    const unsigned int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const unsigned int k_tiles = (p.k + BK - 1) / BK;
    float acc[NI][64];
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[j][i] = 0.0f;

#if SPECIALIZED
    // full[s]: the copying warpgroup's 128 threads arrive when their copies of stage s landed;
    // empty[s]: each computing warpgroup arrives once its products have read stage s.
    __shared__ __align__(8) unsigned long long bars[2 * STAGES];
    const unsigned int full = (unsigned int)__cvta_generic_to_shared(bars);
    const unsigned int empty = full + STAGES * 8;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            barrier_init(full + s * 8, TMA ? 1 : 128);
            barrier_init(empty + s * 8, 2);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const unsigned int role = threadIdx.x / 128;  // 0, 1: computing warpgroups; 2: copying
    if (role == 2) {
#if TMA
#if REGS
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
#endif
        if (threadIdx.x == CONSUMERS) {
            for (unsigned int kt = 0; kt < k_tiles; ++kt) {
                const unsigned int s = kt % STAGES;
                if (kt >= STAGES) barrier_wait(empty + s * 8, ((kt / STAGES) + 1) & 1);
                barrier_expect(full + s * 8, STAGE_BYTES);
                tma_stage(&ta, &tb, base + s * STAGE_BYTES, base + s * STAGE_BYTES + TILE_A_BYTES, full + s * 8,
                          m0, n0, kt * BK);
            }
        }
#else
        const unsigned int tid = threadIdx.x - CONSUMERS;
        for (unsigned int kt = 0; kt < k_tiles; ++kt) {
            const unsigned int s = kt % STAGES;
            // The stage's previous tile (kt - STAGES) must have been read by both warpgroups.
            if (kt >= STAGES) barrier_wait(empty + s * 8, ((kt / STAGES) + 1) & 1);
            load_stage<128>(tid, base + s * STAGE_BYTES, base + s * STAGE_BYTES + TILE_A_BYTES, a, b, p, m0, n0, kt);
            barrier_arrive_copies(full + s * 8);
        }
        wait_groups<0>();
#endif
        return;
    }
#if REGS
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
#endif
    const unsigned int group = role;
    for (unsigned int kt = 0; kt < k_tiles; ++kt) {
        const unsigned int s = kt % STAGES;
        barrier_wait(full + s * 8, (kt / STAGES) & 1);
#if !TMA
        proxy_fence();  // the copies (generic proxy) before wgmma's reads (async proxy)
#endif
        wgmma_fence();
        stage_products(acc, base + s * STAGE_BYTES, group);
        wgmma_commit();
        // Keep this step's products in flight; the previous step's are done, so its stage
        // goes back to the copying warpgroup.
        wgmma_wait<1>();
        if (kt > 0 && threadIdx.x % 128 == 0) barrier_arrive(empty + ((kt - 1) % STAGES) * 8);
    }
    wgmma_wait<0>();
    fence_accumulators(acc);
    consumers_sync();
#else
    const unsigned int group = threadIdx.x / 128;  // this warpgroup's 64 rows of the tile
    // Tile kt sits in stage kt % STAGES; tiles run STAGES - 2 ahead of the products, so the
    // stage refilled at step kt was read at step kt - 2, whose products every warpgroup has
    // waited for (wgmma_wait<1> at step kt - 1) before this step's barrier.
#pragma unroll
    for (int s = 0; s < STAGES - 2; ++s) {
        if (s < k_tiles) load_stage<THREADS>(threadIdx.x, base + s * STAGE_BYTES, base + s * STAGE_BYTES + TILE_A_BYTES, a, b, p, m0, n0, s);
        commit();
    }
    for (unsigned int kt = 0; kt < k_tiles; ++kt) {
        wait_groups<STAGES - 3>();
        proxy_fence();  // this thread's copies, visible to wgmma's (async) reads
        __syncthreads();
        const unsigned int next = kt + STAGES - 2;
        if (next < k_tiles) {
            const unsigned int s = next % STAGES;
            load_stage<THREADS>(threadIdx.x, base + s * STAGE_BYTES, base + s * STAGE_BYTES + TILE_A_BYTES, a, b, p, m0, n0, next);
        }
        commit();
        wgmma_fence();
        stage_products(acc, base + (kt % STAGES) * STAGE_BYTES, group);
        wgmma_commit();
        wgmma_wait<1>();
    }
    wgmma_wait<0>();
    fence_accumulators(acc);
    wait_groups<0>();
    __syncthreads();
#endif

#if OUT_F32
    // Epilogue for an f32 result (no cast follows the product): the accumulators into a
    // BM x (BN + 4) f32 tile over the pipeline's memory, then out in 16-byte pieces of rows, so
    // each warp writes whole rows (stores straight from the accumulators' layout below wrote 8
    // bytes a thread, 32 bytes a row, and made the f32 gradients' products slower than a bf16
    // product and a cast).
    {
        float* tile = (float*)smem;
        const unsigned int w = (threadIdx.x % 128) / 32, l = threadIdx.x % 32;
#pragma unroll
        for (int j = 0; j < NI; ++j)
#pragma unroll
            for (int i = 0; i < 64; i += 2) {
                const unsigned int row = group * 64 + 16 * w + l / 4 + 8 * ((i / 2) % 2);
                const unsigned int col = 128 * j + 8 * (i / 4) + 2 * (l % 4);
                *(float2*)(tile + row * (BN + 4) + col) = make_float2(acc[j][i], acc[j][i + 1]);
            }
        consumers_sync();
        for (unsigned int q = threadIdx.x; q < BM * BN / 4; q += CONSUMERS) {
            const unsigned int r = q / (BN / 4), c4 = (q % (BN / 4)) * 4;
            const unsigned int gm = m0 + r, gn = n0 + c4;
            if (gm >= p.m || gn >= p.n) continue;
            float* dst = c + (unsigned long long)gm * p.ldc + gn;
            const float* from = tile + r * (BN + 4) + c4;
            if (gn + 4 <= p.n && p.ldc % 4 == 0) {
                *(float4*)dst = *(const float4*)from;
            } else {
                for (unsigned int e = 0; e < 4 && gn + e < p.n; ++e) dst[e] = from[e];
            }
        }
    }
#else
    // Epilogue (computing warpgroups only): the accumulators as bf16 into a BM x (BN + 8)
    // shared tile over the pipeline's memory, then out in 16-byte pieces of rows. Accumulator
    // i of instruction j of thread t (warp w, lane l of its warpgroup): row
    // 16 w + l / 4 + 8 ((i / 2) % 2), column 128 j + 8 (i / 4) + 2 (l % 4) + i % 2.
    bf16* tile = (bf16*)smem;
    const unsigned int w = (threadIdx.x % 128) / 32, l = threadIdx.x % 32;
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
        for (int i = 0; i < 64; i += 2) {
            const unsigned int row = group * 64 + 16 * w + l / 4 + 8 * ((i / 2) % 2);
            const unsigned int col = 128 * j + 8 * (i / 4) + 2 * (l % 4);
            *(__nv_bfloat162*)(tile + row * (BN + 8) + col) = __floats2bfloat162_rn(acc[j][i], acc[j][i + 1]);
        }
    consumers_sync();
    for (unsigned int q = threadIdx.x; q < BM * BN / 8; q += CONSUMERS) {
        const unsigned int r = q / (BN / 8), c8 = (q % (BN / 8)) * 8;
        const unsigned int gm = m0 + r, gn = n0 + c8;
        if (gm >= p.m || gn >= p.n) continue;
        bf16* dst = c + (unsigned long long)gm * p.ldc + gn;
        const bf16* from = tile + r * (BN + 8) + c8;
        if (gn + 8 <= p.n && p.ldc % 8 == 0) {
            *(uint4*)dst = *(const uint4*)from;
        } else {
            for (unsigned int e = 0; e < 8 && gn + e < p.n; ++e) dst[e] = from[e];
        }
    }
#endif  // OUT_F32
#endif  // PERSISTENT
#endif
}
