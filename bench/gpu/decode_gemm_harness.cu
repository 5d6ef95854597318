// verl_decode_gemm (the weight stream) and verl_decode_gemm_shared built alone with nvcc on a
// device, on the Qwen2.5-7B layer's products at M = 8 * NB * BS batch rows, against cuBLAS
// (cublasGemmEx, bf16 operands, f32 compute) in the same process: each kernel's time per launch
// with the weights rotated past L2 (as in a decode step, where each layer's weights are cold),
// the weight bandwidth it reaches, its error against cuBLAS, and whether the shared-stage kernel
// (whole, and one block per residue with verl_decode_gemm_residues: "split") equals the stream
// to the bit (all sum k in one order). The kernels' compile-time switches come
// as -DV_<name> flags (NB, RT, WARPS, U, BS, STAGE_A for the stream; ROW_WARPS, STAGES for the
// shared-stage kernel);
// Usage: bash bench/gpu/decode_gemm_variants.sh
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cublas_v2.h>
#include <cuda_runtime.h>
// The kernels' one-letter defines come prefixed (V_U, ...) so that they do not rename the CUDA
// headers' template parameters.
#define NB V_NB
#define BS V_BS
#define RT V_RT
#define WARPS V_WARPS
#define U V_U
#define STAGE_A V_STAGE_A
#define ROW_WARPS V_ROW_WARPS
#define STAGES V_STAGES
#include "gemm_common.cuh"
#include "decode_gemm.cu"
#ifdef WGMMA_PROBE
#include "decode_gemm_wgmma_probe.cu"
#endif
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

int main() {
  struct Shape { const char* label; unsigned k, n; };
  const Shape shapes[] = {{"qkv", 3584, 4608}, {"o", 3584, 3584}, {"gate_up", 3584, 37888},
                          {"down", 18944, 3584}, {"lm_head", 3584, 152064}};
  const unsigned m = 8 * NB * BS;
  cublasHandle_t handle; cublasCreate(&handle);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  printf("M %u; stream RT %d WARPS %d U %d BS %d STAGE_A %d; shared ROW_WARPS %d STAGES %d RT %d\n", m,
         RT, WARPS, U, BS, STAGE_A, ROW_WARPS, STAGES, RT);
  for (const Shape& s : shapes) {
    // Enough copies of the weight to pass 400 MB, used in turn.
    const size_t wn = (size_t)s.n * s.k;
    const int copies = (int)(400e6 / (wn * 2.0)) + 1;
    std::vector<bf16*> ws; for (int i = 0; i < copies; ++i) ws.push_back(random_bf16(wn, 7 + i));
    bf16* a = random_bf16((size_t)m * s.k, 3);
    float *c_ref, *c_stream, *c_shared, *c_split, *parts;
    CK(cudaMalloc(&c_split, (size_t)m * s.n * 4)); CK(cudaMalloc(&parts, (size_t)WARPS * m * s.n * 4));
    CK(cudaMalloc(&c_ref, (size_t)m * s.n * 4)); CK(cudaMalloc(&c_stream, (size_t)m * s.n * 4)); CK(cudaMalloc(&c_shared, (size_t)m * s.n * 4));
    CK(cudaMemset(c_shared, 0xff, (size_t)m * s.n * 4));
    GemmParams p{m, s.n, s.k, s.k, s.k, s.n, 0, 0};
    const float one = 1.0f, zero = 0.0f;
    const int stream_warps = WR * WARPS;
    const size_t stream_smem = STAGE_A ? (size_t)WR * WARPS * 2 * STAGE_PIECES * 16 : 0;
    const size_t partial_smem = (size_t)WR * WARPS * PARTIALS * 32 * 4;
    const size_t smem_stream = stream_smem > partial_smem ? stream_smem : partial_smem;
    const size_t smem_shared = (size_t)STAGES * SHARED_STAGE * 16;
    CK(cudaFuncSetAttribute(verl_decode_gemm, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_stream));
    CK(cudaFuncSetAttribute(verl_decode_gemm_shared, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_shared));
    auto cublas = [&](int i, float* c) {
      cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, s.n, m, s.k, &one, ws[i], CUDA_R_16BF, s.k, a, CUDA_R_16BF, s.k,
                   &zero, c, CUDA_R_32F, s.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    };
    auto stream = [&](int i, float* c) {
      verl_decode_gemm<<<(s.n + 16 * RT * WR - 1) / (16 * RT * WR) * BS, stream_warps * 32, smem_stream>>>(a, ws[i], c, p);
    };
    auto shared = [&](int i, float* c) {
      verl_decode_gemm_shared<<<(s.n + 16 * RT * ROW_WARPS - 1) / (16 * RT * ROW_WARPS) * BS, ROW_WARPS * 32, smem_shared>>>(a, ws[i], c, p);
    };
    auto split = [&](int i, float* c) {
      verl_decode_gemm_shared<<<dim3((s.n + 16 * RT * ROW_WARPS - 1) / (16 * RT * ROW_WARPS) * BS, WARPS), ROW_WARPS * 32, smem_shared>>>(a, ws[i], parts, p);
      verl_decode_gemm_residues<<<(m * s.n + 255) / 256, 256>>>(parts, c, p);
    };
    auto timed = [&](auto f, float* c) {
      for (int i = 0; i < 3; ++i) f(i % copies, c);
      CK(cudaDeviceSynchronize());
      const int reps = 30;
      cudaEventRecord(e0);
      for (int i = 0; i < reps; ++i) f(i % copies, c);
      cudaEventRecord(e1); cudaEventSynchronize(e1);
      float ms; cudaEventElapsedTime(&ms, e0, e1);
      CK(cudaGetLastError());
      return 1000.0f * ms / reps;
    };
    const float t_ref = timed(cublas, c_ref), t_stream = timed(stream, c_stream), t_shared = timed(shared, c_shared), t_split = timed(split, c_split);
    // Outputs of one weight copy.
    std::vector<float> r((size_t)m * s.n), x((size_t)m * s.n), y((size_t)m * s.n), z((size_t)m * s.n);
    cublas(0, c_ref); stream(0, c_stream); shared(0, c_shared); split(0, c_split); CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(z.data(), c_split, z.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(r.data(), c_ref, r.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(x.data(), c_stream, x.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(y.data(), c_shared, y.size() * 4, cudaMemcpyDeviceToHost));
    double top = 0, es = 0, eh = 0; size_t differ = 0, differ_split = 0;
    for (size_t i = 0; i < r.size(); ++i) {
      top = fmax(top, fabs(r[i])); es = fmax(es, fabs(x[i] - r[i])); eh = fmax(eh, fabs(y[i] - r[i]));
      differ += memcmp(&x[i], &y[i], 4) != 0;
      differ_split += memcmp(&x[i], &z[i], 4) != 0;
    }
    const double gb = wn * 2.0 / 1e3;
    printf("%-8s k %5u n %6u: cublas %6.1f us (%4.0f GB/s)  stream %6.1f us (%4.0f GB/s, err %.1e)  shared %6.1f us (%4.0f GB/s, err %.1e, %zu differ)  split %6.1f us (%4.0f GB/s, %zu differ)\n",
           s.label, s.k, s.n, t_ref, gb / t_ref, t_stream, gb / t_stream, es / top, t_shared, gb / t_shared, eh / top, differ,
           t_split, gb / t_split, differ_split);
#ifdef WGMMA_PROBE
    probe_wgmma(s.label, a, ws, copies, p, r, top, timed);
#endif
    for (auto w : ws) cudaFree(w);
    cudaFree(a); cudaFree(c_ref); cudaFree(c_stream); cudaFree(c_shared); cudaFree(c_split); cudaFree(parts);
  }
  return 0;
}
