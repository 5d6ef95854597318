// Copies from pinned, device-mapped host memory into a device buffer, as a kernel on burn's
// stream: how a checkpoint's bytes reach the device without cubecl's `create` (which copies
// every tensor once more on the host and then from pageable memory, ~0.6 GB/s measured).
//
// Compiled at run time by NVRTC (verl_megatron::cuda::kernels::host_copy). `verl_host_copy`
// reads `bytes` bytes at host address `src` (mapped: with unified addressing the host pointer
// is the device pointer) over the bus and writes them at byte `dst_offset` of `dst`. Many
// 16-byte loads in flight per thread keep the bus busy. `verl_host_flag` then stores `ticket`
// into the mapped flag the host polls before it reuses the staging chunk: launched after the
// copy on the same stream, it runs only once the copy's reads are done.

#define THREADS 256
#define UNROLL 4

struct CopyInfo {
    unsigned long long src;
    unsigned long long dst_offset;
    unsigned long long bytes;
};

extern "C" __global__ void __launch_bounds__(THREADS)
verl_host_copy(unsigned char* __restrict__ dst, CopyInfo info) {
    const unsigned char* src = (const unsigned char*)info.src;
    unsigned char* out = dst + info.dst_offset;
    // The caller keeps source and destination 16-byte aligned; the tail is copied bytewise.
    const unsigned long long vectors = info.bytes / 16;
    const uint4* s = (const uint4*)src;
    uint4* d = (uint4*)out;
    const unsigned long long stride = (unsigned long long)gridDim.x * THREADS;
    unsigned long long i = (unsigned long long)blockIdx.x * THREADS + threadIdx.x;
    for (; i + (UNROLL - 1) * stride < vectors; i += UNROLL * stride) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u] = s[i + u * stride];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) d[i + u * stride] = v[u];
    }
    for (; i < vectors; i += stride) d[i] = s[i];
    if (blockIdx.x == 0) {
        for (unsigned long long b = vectors * 16 + threadIdx.x; b < info.bytes; b += THREADS) {
            out[b] = src[b];
        }
    }
}

struct FlagInfo {
    unsigned long long flag;
    unsigned long long ticket;
};

extern "C" __global__ void verl_host_flag(unsigned char* unused, FlagInfo info) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        __threadfence_system();
        *(volatile unsigned long long*)info.flag = info.ticket;
        __threadfence_system();
    }
}
