// verl_decode_gemm_wgmma (verl-megatron/src/cuda/kernels/decode_gemm_wgmma.cu) built alone with
// nvcc on a device, on a model's decode products at M batch rows, beside cuBLAS (cublasGemmEx,
// bf16 operands, f32 compute) in the same process: each k split's time per launch (the splits
// added by a unit's last block, or by the sum kernel past 16 rows, as the crate does; WG_LAST=0|1
// forces one) with the weights rotated past L2, the weight
// bandwidth, the error against cuBLAS relative to cuBLAS's largest value, and batch row 0's result written to
// $WG_DIR/<label>_s<split>_m<M>_<config>.bin, so the caller can check that a row's bits depend on
// the split alone (not on M, the tiles, the warpgroups or the stages).
// Build: nvcc -O3 -gencode arch=compute_90a,code=sm_90a -std=c++17 -DWG_NB=.. -DWG_TILES=..
//        -DWG_GROUPS=.. -DWG_STAGES=.. -I<kernels> decode_wgmma_harness.cu -lcublas
// Run:   ./h M SHAPES(7b|0.5b|1.5b) [splits...]      (bench/gpu/decode_wgmma_sweep.sh drives it)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <algorithm>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include "gemm_common.cuh"
#include "decode_gemm_wgmma.cu"
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1);} } while (0)

__global__ void fill(bf16* d, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned s = (unsigned)(i * 2654435761u) ^ (seed * 0x9e3779b9u);
    s ^= s >> 15; s *= 0x2c1b3c6du; s ^= s >> 12; s *= 0x297a2d39u; s ^= s >> 15;
    d[i] = __float2bfloat16(((s >> 8) & 0xffff) / 32768.0f - 1.0f);
  }
}

static bf16* random_bf16(size_t n, unsigned seed) {
  bf16* d; CK(cudaMalloc(&d, n * 2)); fill<<<1024, 256>>>(d, n, seed); CK(cudaDeviceSynchronize()); return d;
}

struct Shape { const char* label; unsigned k, n; };

int main(int argc, char** argv) {
  if (argc < 3) { printf("usage: %s M 7b|0.5b|1.5b [splits...]\n", argv[0]); return 2; }
  const unsigned m = (unsigned)atoi(argv[1]);
  const std::string set = argv[2];
  // k splits to try, and blocks per multiprocessor of a persistent grid (0: one block per unit).
  std::vector<unsigned> splits, residents;
  for (int i = 3; i < argc; ++i) splits.push_back((unsigned)atoi(argv[i]));
  if (splits.empty()) splits = {1, 2, 4, 8};
  {
    const char* r = getenv("WG_RESIDENT");
    std::string text = r ? r : "0";
    size_t at = 0;
    while (at < text.size()) { residents.push_back((unsigned)atoi(text.c_str() + at)); at = text.find(' ', at); if (at == std::string::npos) break; ++at; }
  }
  int sms = 0; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  std::vector<Shape> shapes;
  if (set == "7b") shapes = {{"qkv", 3584, 4608}, {"o", 3584, 3584}, {"gate_up", 3584, 37888}, {"down", 18944, 3584}, {"lm_head", 3584, 152064}};
  else if (set == "1.5b") shapes = {{"qkv", 1536, 2048}, {"o", 1536, 1536}, {"gate_up", 1536, 17920}, {"down", 8960, 1536}, {"lm_head", 1536, 151936}};
  else shapes = {{"qkv", 896, 1152}, {"o", 896, 896}, {"gate_up", 896, 9728}, {"down", 4864, 896}, {"lm_head", 896, 151936}};
  const char* dir = getenv("WG_DIR") ? getenv("WG_DIR") : "/tmp";
  char config[64];
  snprintf(config, sizeof config, "t%dg%ds%d", WG_TILES, WG_GROUPS, WG_STAGES);
  const unsigned batch_blocks = (m + WG_N - 1) / WG_N;
  // Who adds a split's partial sums: the last block of a unit (1) or a second kernel (0); as the
  // crate chooses (up to 16 rows the last block) unless WG_LAST says.
  const unsigned last = getenv("WG_LAST") ? (unsigned)atoi(getenv("WG_LAST")) : (m <= 16 ? 1u : 0u);
  cublasHandle_t handle; cublasCreate(&handle);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  CK(cudaFuncSetAttribute(verl_decode_gemm_wgmma, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)WG_SMEM_BYTES));
  for (const Shape& s : shapes) {
    const size_t wn = (size_t)s.n * s.k;
    const int copies = (int)(400e6 / (wn * 2.0)) + 1;
    std::vector<bf16*> ws; for (int i = 0; i < copies; ++i) ws.push_back(random_bf16(wn, 7 + i));
    bf16* a = random_bf16((size_t)m * s.k, 3);
    float *c_ref, *c, *parts;
    unsigned int* counters;
    CK(cudaMalloc(&c_ref, (size_t)m * s.n * 4)); CK(cudaMalloc(&c, (size_t)m * s.n * 4));
    CK(cudaMalloc(&parts, (size_t)8 * m * s.n * 4));
    CK(cudaMalloc(&counters, 65536 * 4)); CK(cudaMemset(counters, 0, 65536 * 4));
    const float one = 1.0f, zero = 0.0f;
    auto cublas = [&](int i, unsigned) {
      cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, s.n, m, s.k, &one, ws[i], CUDA_R_16BF, s.k, a, CUDA_R_16BF, s.k,
                   &zero, c_ref, CUDA_R_32F, s.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    };
    const unsigned units = (s.n + WG_ROWS - 1) / WG_ROWS * batch_blocks;
    unsigned grid = units;
    auto wgmma = [&](int i, unsigned ks) {
      GemmParams p{m, s.n, s.k, s.k, s.k, s.n, batch_blocks, last};
      verl_decode_gemm_wgmma<<<dim3(grid, ks), WG_THREADS, WG_SMEM_BYTES>>>(a, ws[i], c, parts, counters, p);
      if (ks > 1 && !last) {
        GemmParams q{m, s.n, s.k, s.k, s.k, s.n, ks, 0};
        verl_decode_gemm_wgmma_sum<<<(m * s.n + 255) / 256, 256>>>(parts, c, q);
      }
    };
    auto timed = [&](auto f, unsigned ks) {
      for (int i = 0; i < 3; ++i) f(i % copies, ks);
      CK(cudaDeviceSynchronize());
      const int reps = 40;
      cudaEventRecord(e0);
      for (int i = 0; i < reps; ++i) f(i % copies, ks);
      cudaEventRecord(e1); cudaEventSynchronize(e1);
      float ms; cudaEventElapsedTime(&ms, e0, e1);
      CK(cudaGetLastError());
      return 1000.0f * ms / reps;
    };
    const double gb = wn * 2.0 / 1e3;
    const float t_ref = timed(cublas, 1);
    std::vector<float> r((size_t)m * s.n), v((size_t)m * s.n);
    cublas(0, 1); CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(r.data(), c_ref, r.size() * 4, cudaMemcpyDeviceToHost));
    double top = 0;
    for (float x : r) top = fmax(top, fabs(x));
    printf("%s m %u %-8s k %5u n %6u cublas %7.1f us %5.0f GB/s\n", config, m, s.label, s.k, s.n, t_ref, gb / t_ref);
    for (unsigned res : residents)
    for (unsigned ks : splits) {
      if (ks > 1 && (s.k + 63) / 64 < 4 * ks) continue;
      grid = res == 0 ? units : std::min(units, (sms * res + ks - 1) / ks);
      if (res > 0 && grid == units) continue;
      const float t = timed(wgmma, ks);
      CK(cudaMemset(c, 0xff, (size_t)m * s.n * 4));
      wgmma(0, ks); CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(v.data(), c, v.size() * 4, cudaMemcpyDeviceToHost));
      double err = 0; size_t bad = 0;
      for (size_t i = 0; i < v.size(); ++i) {
        if (!(fabs(v[i] - r[i]) <= 1e30)) { ++bad; continue; }
        err = fmax(err, fabs(v[i] - r[i]));
      }
      char name[256];
      snprintf(name, sizeof name, "%s/%s_s%u_m%u_%sr%u.bin", dir, s.label, ks, m, config, res);
      if (FILE* f = fopen(name, "wb")) { fwrite(v.data(), 4, s.n, f); fclose(f); }
      printf("%sr%u m %u %-8s split %u wgmma %7.1f us %5.0f GB/s err %.1e unwritten %zu ratio_cublas %.2f\n", config, res, m,
             s.label, ks, t, gb / t, err / top, bad, t / t_ref);
    }
    for (auto w : ws) cudaFree(w);
    cudaFree(a); cudaFree(c_ref); cudaFree(c); cudaFree(parts); cudaFree(counters);
  }
  return 0;
}
