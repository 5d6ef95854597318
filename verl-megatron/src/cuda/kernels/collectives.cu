// Collectives among the GPUs of one node as one kernel on burn's stream, over peer-mapped
// staging buffers (CUDA IPC between rank processes, peer access between threads): each rank
// copies its input into its own staging buffer, the ranks meet at a device-side barrier (flags
// written into every peer's flag array with release stores, read with acquire loads), and each
// rank reads what it needs from its peers' staging buffers. Nothing waits on the host.
//
// Sums run over the ranks in rank order 0..world on every rank (one-shot), or once by the rank
// that owns a chunk (two-shot), so every rank gets the same bits.
//
// Each block owns the same slice of every buffer on every rank (a grid-stride over units, of
// each rank's chunk where the kind reads by chunk), and the barrier is per block: block j's
// flags say that peer block j has written its slice.
// Staging is double-buffered by call (the host alternates halves): a rank can only start call
// e + 2 after every peer has started call e + 1, so after every peer has finished reading
// call e's half.
//
// Defines: ELEM_BF16 (1: bf16 elements, else f32), MAX_BLOCKS, MAX_RANKS, THREADS.

#include <cuda_bf16.h>

#if ELEM_BF16
typedef __nv_bfloat16 T;
#define VEC 8
__device__ __forceinline__ float to_f(T x) { return __bfloat162float(x); }
__device__ __forceinline__ T from_f(float x) { return __float2bfloat16(x); }
#else
typedef float T;
#define VEC 4
__device__ __forceinline__ float to_f(T x) { return x; }
__device__ __forceinline__ T from_f(float x) { return x; }
#endif

#define KIND_ALL_REDUCE_ONE_SHOT 0
#define KIND_ALL_REDUCE_TWO_SHOT 1
#define KIND_ALL_GATHER 2
#define KIND_REDUCE_SCATTER 3
#define KIND_BROADCAST 4
#define KIND_BARRIER 5

#define OP_SUM 0
#define OP_AVG 1
#define OP_MAX 2

struct Info {
    unsigned long long data[MAX_RANKS];   // each rank's staging half of this call
    unsigned long long flags[MAX_RANKS];  // each rank's flag array
    unsigned int rank, world;
    unsigned int n, epoch;       // elements (per rank for all-gather; in all for the others)
    unsigned int kind, root;
    unsigned int op, vectorised; // vectorised: n (and the chunks) are whole VEC-element units
    // The all-gather's output and the reduce-scatter's input are [outer, world, inner]: the
    // ranks' parts interleaved along a middle dimension (1: one after another).
    unsigned int outer, pad;
    unsigned long long timeout_ns;
};

// Unit p of a [outer, inner] part (units) at place r of the middle of [outer, span, inner].
__device__ __forceinline__ unsigned int interleaved(unsigned int p, unsigned int r, unsigned int inner,
                                                    unsigned int span) {
    unsigned int o = p / inner;
    return (o * span + r) * inner + (p - o * inner);
}

template <int V>
struct __align__(sizeof(T) * V) Pack {
    T e[V];
};

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ void store_release(unsigned int* p, unsigned int v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned int load_acquire(const unsigned int* p) {
    unsigned int v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Every rank's block j meets here. Slot `which` keeps the barriers of one call apart (each slot
// only ever sees rising epochs, so a peer that is already one call ahead still passes).
__device__ void barrier(const Info& a, unsigned int which) {
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x < a.world) {
        unsigned int slot = (which * MAX_BLOCKS + blockIdx.x) * MAX_RANKS;
        unsigned int* theirs = (unsigned int*)a.flags[threadIdx.x] + slot + a.rank;
        store_release(theirs, a.epoch);
        const unsigned int* mine = (const unsigned int*)a.flags[a.rank] + slot + threadIdx.x;
        unsigned long long start = 0;
        while ((int)(load_acquire(mine) - a.epoch) < 0) {
            unsigned long long t = now_ns();
            if (start == 0) {
                start = t;
            } else if (t - start > a.timeout_ns) {
                printf("verl collective: rank %u waited %llu s for rank %u (call %u); a peer "
                       "left the collective\n",
                       a.rank, (t - start) / 1000000000ull, threadIdx.x, a.epoch);
                __trap();
            }
        }
    }
    __syncthreads();
}

template <int V>
__device__ __forceinline__ Pack<V> load_peer(const T* base, unsigned int unit) {
    const Pack<V>* p = reinterpret_cast<const Pack<V>*>(base) + unit;
    Pack<V> out;
    if (V * sizeof(T) == 16) {
        uint4 raw = __ldcg(reinterpret_cast<const uint4*>(p));
        out = *reinterpret_cast<Pack<V>*>(&raw);
    } else {
        // One element: read it through L2 only (a peer's line must not come from L1).
        const T* e = reinterpret_cast<const T*>(p);
#if ELEM_BF16
        unsigned short raw = __ldcg(reinterpret_cast<const unsigned short*>(e));
        out.e[0] = *reinterpret_cast<T*>(&raw);
#else
        out.e[0] = __ldcg(e);
#endif
    }
    return out;
}

// Units each thread moves per round of the grid-stride loops: the loads of a round are issued
// before its stores, so that more bytes are in flight over NVLink than one 16-byte load a
// thread at a time.
#define UNROLL 4

template <int V>
__device__ __forceinline__ void copy_units(T* dst, const T* src, unsigned int units) {
    const Pack<V>* s = reinterpret_cast<const Pack<V>*>(src);
    Pack<V>* d = reinterpret_cast<Pack<V>*>(dst);
    const unsigned int stride = gridDim.x * blockDim.x;
    unsigned int u = blockIdx.x * blockDim.x + threadIdx.x;
    for (; u + (UNROLL - 1) * stride < units; u += UNROLL * stride) {
        Pack<V> p[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) p[k] = s[u + k * stride];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) d[u + k * stride] = p[k];
    }
    for (; u < units; u += stride) {
        d[u] = s[u];
    }
}

// op over the ranks, in rank order, of unit `unit` of every rank's staging buffer. All ranks'
// loads are issued before the first is used (the loop is unrolled to MAX_RANKS and guarded).
template <int V>
__device__ __forceinline__ Pack<V> reduce_pack(const Info& a, unsigned int unit) {
    Pack<V> p[MAX_RANKS];
#pragma unroll
    for (unsigned int r = 0; r < MAX_RANKS; ++r) {
        if (r < a.world) p[r] = load_peer<V>((const T*)a.data[r], unit);
    }
    float acc[V];
#pragma unroll
    for (unsigned int r = 0; r < MAX_RANKS; ++r) {
        if (r < a.world) {
#pragma unroll
            for (int i = 0; i < V; ++i) {
                float x = to_f(p[r].e[i]);
                acc[i] = r == 0 ? x : (a.op == OP_MAX ? fmaxf(acc[i], x) : acc[i] + x);
            }
        }
    }
    Pack<V> o;
#pragma unroll
    for (int i = 0; i < V; ++i) {
        o.e[i] = from_f(a.op == OP_AVG ? acc[i] / (float)a.world : acc[i]);
    }
    return o;
}

// out[d] = op over ranks of peer_r[q], q = interleaved(u, slot, inner, span), for the block's
// units u of [0, units), d = q when `at_source` else u; also written to `keep[d]` (the own
// staging buffer) when it is not null. Two units a round.
template <int V>
__device__ void reduce_units(const Info& a, T* out, T* keep, unsigned int slot, unsigned int inner,
                             unsigned int span, bool at_source, unsigned int units) {
    Pack<V>* o = reinterpret_cast<Pack<V>*>(out);
    Pack<V>* k = reinterpret_cast<Pack<V>*>(keep);
    const unsigned int stride = gridDim.x * blockDim.x;
    unsigned int u = blockIdx.x * blockDim.x + threadIdx.x;
    for (; u + stride < units; u += 2 * stride) {
        unsigned int q0 = interleaved(u, slot, inner, span);
        unsigned int q1 = interleaved(u + stride, slot, inner, span);
        Pack<V> x0 = reduce_pack<V>(a, q0);
        Pack<V> x1 = reduce_pack<V>(a, q1);
        unsigned int d0 = at_source ? q0 : u, d1 = at_source ? q1 : u + stride;
        o[d0] = x0;
        o[d1] = x1;
        if (k != nullptr) {
            k[d0] = x0;
            k[d1] = x1;
        }
    }
    for (; u < units; u += stride) {
        unsigned int q = interleaved(u, slot, inner, span);
        Pack<V> x = reduce_pack<V>(a, q);
        unsigned int d = at_source ? q : u;
        o[d] = x;
        if (k != nullptr) k[d] = x;
    }
}

// out[interleaved(p, r)] = src[p] for the block's units p of [0, units): a rank's part placed
// at r of the middle of [outer, span, inner] (outer = 1: at r · units).
template <int V>
__device__ void gather_part(T* out, const T* src, unsigned int r, unsigned int inner, unsigned int span,
                            unsigned int units) {
    Pack<V>* o = reinterpret_cast<Pack<V>*>(out);
    const unsigned int stride = gridDim.x * blockDim.x;
    unsigned int u = blockIdx.x * blockDim.x + threadIdx.x;
    for (; u + (UNROLL - 1) * stride < units; u += UNROLL * stride) {
        Pack<V> p[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) p[k] = load_peer<V>(src, u + k * stride);
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) o[interleaved(u + k * stride, r, inner, span)] = p[k];
    }
    for (; u < units; u += stride) {
        o[interleaved(u, r, inner, span)] = load_peer<V>(src, u);
    }
}

// dst[q] = src[q] for every place r of the middle of [outer, world, inner] at the block's units
// p of a part ([0, part)), q = interleaved(p, r): block j stages exactly the units that block j
// of every rank reads after the barrier.
template <int V>
__device__ void stage_parts(T* dst, const T* src, unsigned int inner, unsigned int world,
                            unsigned int part) {
    const Pack<V>* s = reinterpret_cast<const Pack<V>*>(src);
    Pack<V>* d = reinterpret_cast<Pack<V>*>(dst);
    for (unsigned int u = blockIdx.x * blockDim.x + threadIdx.x; u < part; u += gridDim.x * blockDim.x) {
        Pack<V> p[MAX_RANKS];
#pragma unroll
        for (unsigned int r = 0; r < MAX_RANKS; ++r) {
            if (r < world) p[r] = s[interleaved(u, r, inner, world)];
        }
#pragma unroll
        for (unsigned int r = 0; r < MAX_RANKS; ++r) {
            if (r < world) d[interleaved(u, r, inner, world)] = p[r];
        }
    }
}

template <int V>
__device__ void run(const T* input, T* output, const Info& a) {
    T* mine = (T*)a.data[a.rank];
    unsigned int units = a.n / V;
    switch (a.kind) {
    case KIND_ALL_REDUCE_ONE_SHOT:
        copy_units<V>(mine, input, units);
        barrier(a, 0);
        reduce_units<V>(a, output, nullptr, 0, units, 1, false, units);
        break;
    case KIND_ALL_REDUCE_TWO_SHOT: {
        // Reduce-scatter into the own chunk of the own staging buffer, then gather the chunks.
        unsigned int part = units / a.world;
        stage_parts<V>(mine, input, part, a.world, part);
        barrier(a, 0);
        reduce_units<V>(a, output, mine, a.rank, part, a.world, true, part);
        barrier(a, 1);
        // Each rank starts at its next peer, so that no rank's link serves every reader at once.
        for (unsigned int s = 1; s < a.world; ++s) {
            unsigned int r = (a.rank + s) % a.world;
            gather_part<V>(output, (const T*)a.data[r] + r * part * V, r, part, a.world, part);
        }
        break;
    }
    case KIND_ALL_GATHER: {
        unsigned int inner = units / a.outer;
        copy_units<V>(mine, input, units);
        // The own part straight from the input, while the peers are still staging theirs.
        gather_part<V>(output, input, a.rank, inner, a.world, units);
        barrier(a, 0);
        for (unsigned int s = 1; s < a.world; ++s) {
            unsigned int r = (a.rank + s) % a.world;
            gather_part<V>(output, (const T*)a.data[r], r, inner, a.world, units);
        }
        break;
    }
    case KIND_REDUCE_SCATTER: {
        unsigned int part = units / a.world;
        unsigned int inner = part / a.outer;
        stage_parts<V>(mine, input, inner, a.world, part);
        barrier(a, 0);
        // The own place of the middle, written as a [outer, inner] part.
        reduce_units<V>(a, output, nullptr, a.rank, inner, a.world, false, part);
        break;
    }
    case KIND_BROADCAST:
        if (a.rank == a.root) {
            copy_units<V>(mine, input, units);
        }
        barrier(a, 0);
        gather_part<V>(output, (const T*)a.data[a.root], 0, units, 1, units);
        break;
    default:
        barrier(a, 0);
        break;
    }
}

// At most THREADS threads a block: the compiler keeps the registers within what a block of
// that size may hold (the bf16 reductions asked for more and failed to launch).
extern "C" __global__ void __launch_bounds__(THREADS) verl_collective(const T* input, T* output, Info a) {
    if (a.vectorised) {
        run<VEC>(input, output, a);
    } else {
        run<1>(input, output, a);
    }
}
