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
// Defines: ELEM_BF16 (1: bf16 elements, else f32), MAX_BLOCKS, MAX_RANKS.

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
    unsigned long long timeout_ns;
};

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

template <int V>
__device__ __forceinline__ void copy_units(T* dst, const T* src, unsigned int units) {
    const Pack<V>* s = reinterpret_cast<const Pack<V>*>(src);
    Pack<V>* d = reinterpret_cast<Pack<V>*>(dst);
    for (unsigned int u = blockIdx.x * blockDim.x + threadIdx.x; u < units; u += gridDim.x * blockDim.x) {
        d[u] = s[u];
    }
}

// out[offset + u] = op over ranks of peer_r[offset + u], for the block's units of [0, units);
// also written to `keep` (the own staging buffer) when it is not null.
template <int V>
__device__ void reduce_units(const Info& a, T* out, T* keep, unsigned int offset, unsigned int units) {
    for (unsigned int u = blockIdx.x * blockDim.x + threadIdx.x; u < units; u += gridDim.x * blockDim.x) {
        float acc[V];
        for (unsigned int r = 0; r < a.world; ++r) {
            Pack<V> p = load_peer<V>((const T*)a.data[r], offset + u);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                float x = to_f(p.e[i]);
                acc[i] = r == 0 ? x : (a.op == OP_MAX ? fmaxf(acc[i], x) : acc[i] + x);
            }
        }
        Pack<V> o;
#pragma unroll
        for (int i = 0; i < V; ++i) {
            o.e[i] = from_f(a.op == OP_AVG ? acc[i] / (float)a.world : acc[i]);
        }
        reinterpret_cast<Pack<V>*>(out)[offset + u] = o;
        if (keep != nullptr) {
            reinterpret_cast<Pack<V>*>(keep)[offset + u] = o;
        }
    }
}

// out[dst_offset + u] = peer[src_offset + u] for the block's units of [0, units).
template <int V>
__device__ void gather_units(T* out, const T* peer, unsigned int dst_offset, unsigned int src_offset,
                             unsigned int units) {
    for (unsigned int u = blockIdx.x * blockDim.x + threadIdx.x; u < units; u += gridDim.x * blockDim.x) {
        reinterpret_cast<Pack<V>*>(out)[dst_offset + u] = load_peer<V>(peer, src_offset + u);
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
        reduce_units<V>(a, output, nullptr, 0, units);
        break;
    case KIND_ALL_REDUCE_TWO_SHOT: {
        // Reduce-scatter into the own chunk of the own staging buffer, then gather the chunks.
        // Copied chunk by chunk, so that block j writes the units of every chunk that block j
        // reads on every rank (the barrier is per block).
        unsigned int part = units / a.world;
        for (unsigned int r = 0; r < a.world; ++r) {
            copy_units<V>(mine + r * part * V, input + r * part * V, part);
        }
        barrier(a, 0);
        reduce_units<V>(a, output, mine, a.rank * part, part);
        barrier(a, 1);
        for (unsigned int r = 0; r < a.world; ++r) {
            if (r != a.rank) {
                gather_units<V>(output, (const T*)a.data[r], r * part, r * part, part);
            }
        }
        break;
    }
    case KIND_ALL_GATHER:
        copy_units<V>(mine, input, units);
        barrier(a, 0);
        for (unsigned int r = 0; r < a.world; ++r) {
            gather_units<V>(output, (const T*)a.data[r], r * units, 0, units);
        }
        break;
    case KIND_REDUCE_SCATTER: {
        // Chunk by chunk, as the two-shot all-reduce (block j owns the same units of each).
        unsigned int part = units / a.world;
        for (unsigned int r = 0; r < a.world; ++r) {
            copy_units<V>(mine + r * part * V, input + r * part * V, part);
        }
        barrier(a, 0);
        // The own chunk, written from the start of the output.
        for (unsigned int u = blockIdx.x * blockDim.x + threadIdx.x; u < part; u += gridDim.x * blockDim.x) {
            float acc[V];
            for (unsigned int r = 0; r < a.world; ++r) {
                Pack<V> p = load_peer<V>((const T*)a.data[r], a.rank * part + u);
#pragma unroll
                for (int i = 0; i < V; ++i) {
                    float x = to_f(p.e[i]);
                    acc[i] = r == 0 ? x : (a.op == OP_MAX ? fmaxf(acc[i], x) : acc[i] + x);
                }
            }
            Pack<V> o;
#pragma unroll
            for (int i = 0; i < V; ++i) {
                o.e[i] = from_f(a.op == OP_AVG ? acc[i] / (float)a.world : acc[i]);
            }
            reinterpret_cast<Pack<V>*>(output)[u] = o;
        }
        break;
    }
    case KIND_BROADCAST:
        if (a.rank == a.root) {
            copy_units<V>(mine, input, units);
        }
        barrier(a, 0);
        gather_units<V>(output, (const T*)a.data[a.root], 0, 0, units);
        break;
    default:
        barrier(a, 0);
        break;
    }
}

extern "C" __global__ void verl_collective(const T* input, T* output, Info a) {
    if (a.vectorised) {
        run<VEC>(input, output, a);
    } else {
        run<1>(input, output, a);
    }
}
