// verl_decode_attention built alone with nvcc on a device, timed per launch (after an
// L2-evicting kernel, as the weight stream evicts it between layers, and back to back) for 1,
// 32 and 64 slots over 100 and 1 000 keys, 4 kv heads; each output is written to
// /tmp/attn_<tag>_<slots>_<pos>.bin (bf16) so variants can be compared. The kernel's
// compile-time switches come as -D flags (HEAD_DIM, REP, MMA, THREADS, CACHE_BF16, ...;
// SPLIT_LEN > 0 adds the flash-decoding split and its combine). Iterating on the kernel here
// takes seconds a variant, against a release build and a device call for the crate.
// Usage: bash bench/gpu/decode_attention_variants.sh
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cstring>
#include <cuda_runtime.h>
#include "bf16_round.cuh"
#include "decode_attention.cu"
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1);} } while (0)
__global__ void touch(float* p, size_t n) { size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; for (; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] += 1.0f; }
static cache_t to_cache_host(float f) {
#if CACHE_BF16
  unsigned u; memcpy(&u, &f, 4); return (cache_t)(u >> 16);
#else
  return f;
#endif
}
int main(int argc, char** argv) {
  const int kv = 4, heads = kv * REP, D = HEAD_DIM;
  int slots_list[] = {1, 32, 64};
  int pos_list[] = {100, 1000};
  const int cap = 1040;
  float* flush; size_t fn = 64ull << 20; CK(cudaMalloc(&flush, fn * 4)); CK(cudaMemset(flush, 0, fn * 4));
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int slots : slots_list) for (int pos : pos_list) {
    const int cols = (heads + 2 * kv) * D;
    std::vector<float> hq((size_t)slots * cols), hb(cols), hc((size_t)slots * D), hs((size_t)slots * D);
    for (auto& x : hq) x = (rand() / (float)RAND_MAX - 0.5f);
    for (auto& x : hb) x = 0.01f * (rand() / (float)RAND_MAX - 0.5f);
    for (auto& x : hc) x = 0.8f; for (auto& x : hs) x = 0.6f;
    std::vector<unsigned> hp(slots, pos);
    float *q, *bias, *c, *s, *part; unsigned* P; cache_t *kc, *vc; void* out;
    size_t cache_n = (size_t)slots * kv * cap * D;
    CK(cudaMalloc(&q, hq.size() * 4)); CK(cudaMalloc(&bias, hb.size() * 4)); CK(cudaMalloc(&c, hc.size() * 4)); CK(cudaMalloc(&s, hs.size() * 4));
    CK(cudaMalloc(&P, slots * 4)); CK(cudaMalloc(&kc, cache_n * sizeof(cache_t))); CK(cudaMalloc(&vc, cache_n * sizeof(cache_t)));
    CK(cudaMalloc(&out, (size_t)slots * heads * D * 4)); 
#ifndef SPLIT_LEN
#define SPLIT_LEN 0
#endif
    const unsigned split = SPLIT_LEN, splits = split ? (pos + 1 + split - 1) / split : 1;
    CK(cudaMalloc(&part, split ? (size_t)slots * heads * splits * (D + 2) * 4 : 4));
    CK(cudaMemcpy(q, hq.data(), hq.size() * 4, cudaMemcpyHostToDevice)); CK(cudaMemcpy(bias, hb.data(), hb.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(c, hc.data(), hc.size() * 4, cudaMemcpyHostToDevice)); CK(cudaMemcpy(s, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(P, hp.data(), slots * 4, cudaMemcpyHostToDevice));
    { std::vector<cache_t> hk(cache_n); for (auto& x : hk) x = to_cache_host(rand() / (float)RAND_MAX - 0.5f);
      CK(cudaMemcpy(kc, hk.data(), cache_n * sizeof(cache_t), cudaMemcpyHostToDevice));
      for (auto& x : hk) x = to_cache_host(rand() / (float)RAND_MAX - 0.5f);
      CK(cudaMemcpy(vc, hk.data(), cache_n * sizeof(cache_t), cudaMemcpyHostToDevice)); }
    DecodeParams p{(unsigned)slots, (unsigned)heads, (unsigned)kv, (unsigned)cap, sqrtf((float)D), (unsigned)cols, (unsigned)cols, 0, (unsigned)(heads * D), (unsigned)((heads + kv) * D), split, splits};
    auto launch = [&]() {
      verl_decode_attention<<<dim3(kv, slots, splits), THREADS>>>(q, q, q, bias, c, s, P, kc, vc, out, part, p);
      if (split) verl_decode_combine<<<dim3(heads, slots), D>>>(part, P, out, p);
    };
    for (int i = 0; i < 5; ++i) launch();
    CK(cudaDeviceSynchronize());
    // Cold: an L2-evicting kernel between launches (as the weight stream does between layers).
    float cold = 0, warm = 0; const int N = 50;
    for (int i = 0; i < N; ++i) {
      touch<<<1056, 256>>>(flush, fn);
      cudaEventRecord(a); launch(); cudaEventRecord(b); cudaEventSynchronize(b);
      float ms; cudaEventElapsedTime(&ms, a, b); cold += ms;
    }
    cudaEventRecord(a); for (int i = 0; i < N; ++i) launch(); cudaEventRecord(b); cudaEventSynchronize(b);
    cudaEventElapsedTime(&warm, a, b);
    CK(cudaGetLastError());
    std::vector<unsigned short> ho((size_t)slots * heads * D);
    CK(cudaMemcpy(ho.data(), out, ho.size() * 2, cudaMemcpyDeviceToHost));
    unsigned long long hash = 1469598103934665603ull; for (auto x : ho) hash = (hash ^ x) * 1099511628211ull;
    { char name[256]; snprintf(name, sizeof name, "/tmp/attn_%s_%d_%d.bin", argc > 1 ? argv[1] : "x", slots, pos);
      FILE* f = fopen(name, "wb"); fwrite(ho.data(), 2, ho.size(), f); fclose(f); }
    double sum = 0; for (auto x : ho) { unsigned u = (unsigned)x << 16; float f; memcpy(&f, &u, 4); sum += f; }
    printf("slots %3d pos %5d: cold %7.2f us  back-to-back %7.2f us  out %016llx sum %.6f\n", slots, pos, 1000 * cold / N, 1000 * warm / N, hash, sum);
    cudaFree(q); cudaFree(bias); cudaFree(c); cudaFree(s); cudaFree(P); cudaFree(kc); cudaFree(vc); cudaFree(out); cudaFree(part);
  }
  return 0;
}
