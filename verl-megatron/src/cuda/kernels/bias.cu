// Column sums of a row-major f32 matrix [rows][cols] (a bias's gradient: the output gradient
// summed over every token; the RMSNorm weight gradient's per-block partials): each block takes
// THREADS columns of one chunk of rows and writes their sums to partial[chunk][col], adding the
// rows in order. Called twice (chunks, then the chunks' sums) so every column is summed by many
// blocks at once; burn's sum over the first dimension gives each column to a single thread of
// one or two blocks (~1 ms for 8192 x 256).
//
// Compiled at run time by NVRTC (verl_megatron::cuda::kernels::bias).

#define THREADS 128

struct SumRowsParams {
    unsigned int rows;
    unsigned int cols;
    unsigned int rows_per_chunk;
    unsigned int unused;
};

// Grid (ceil(cols / THREADS), chunks).
extern "C" __global__ void __launch_bounds__(THREADS)
verl_sum_rows(const float* __restrict__ x, float* __restrict__ partial, SumRowsParams p) {
    const unsigned int col = blockIdx.x * THREADS + threadIdx.x;
    if (col >= p.cols) return;
    const unsigned int r0 = blockIdx.y * p.rows_per_chunk;
    const unsigned int r1 = min(r0 + p.rows_per_chunk, p.rows);
    float sum = 0.0f;
    for (unsigned int r = r0; r < r1; ++r) sum += x[(unsigned long long)r * p.cols + col];
    partial[(unsigned long long)blockIdx.y * p.cols + col] = sum;
}
