// The next token of every row of a logits matrix, sampled on the GPU: temperature, min-p, top-k
// and top-p (in vLLM's order), then one draw from what is kept; only the token, its log-prob and
// the distribution's entropy leave the device. One block per row.
//
// Filtering keeps the tokens whose logit is at least a threshold. The top-k and top-p
// thresholds are found by a radix select over the logits' order-preserving 32-bit keys, 8 bits
// per pass: top-k counts tokens, top-p adds up their probabilities in 40-bit fixed point, so the
// sums (and the result) do not depend on the order the threads add in.
//
// The draw is the Gumbel-max trick: argmax over kept tokens of s_i + g_i, g_i = -log(-log(u_i))
// with u_i a counter-based hash of (row seed, step, token id), which samples exactly from the
// renormalised kept distribution and makes a request's tokens independent of its batch mates.
// `verl_megatron::cuda::kernels::sampling` holds the host-side reference of the same draw.
//
// Compiled at run time by NVRTC.

#define THREADS 1024
#define WARPS (THREADS / 32)
#define NEG_INF __int_as_float(0xff800000)
#define FIXED_ONE 1099511627776.0  // 2^40: a probability relative to the most likely token

struct SampleParams {
    unsigned int rows;
    unsigned int vocab;
    unsigned int row_pitch;
    // verl_row_max: columns per block (gridDim.y pieces of a row), or 0 for the whole row.
    unsigned int chunk;
};

// Per row, 8 words: temperature (0: greedy), top_k (<= 0: off), top_p (1: off), min_p (0: off),
// seed (low, high), step, unused.
struct RowParams {
    float temperature;
    int top_k;
    float top_p;
    float min_p;
    unsigned int seed_lo;
    unsigned int seed_hi;
    unsigned int step;
    unsigned int unused;
};

__device__ __forceinline__ unsigned int order_key(float f) {
    unsigned int b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// A uniform in (0, 1) from (seed, step, token), 24 bits.
__device__ __forceinline__ float uniform(unsigned long long seed, unsigned int step, unsigned int i) {
    unsigned long long z = mix64(seed + 0x9E3779B97F4A7C15ull * ((unsigned long long)step + 1ull));
    z = mix64(z ^ (0xD1B54A32D192ED03ull * ((unsigned long long)i + 1ull)));
    return ((float)(z >> 40) + 0.5f) * (1.0f / 16777216.0f);
}

struct Best {
    float value;
    unsigned int index;
};

// Larger value wins; ties go to the smaller index (the host sampler's rule).
__device__ __forceinline__ Best better(Best a, Best b) {
    if (b.value > a.value || (b.value == a.value && b.index < a.index)) return b;
    return a;
}

__device__ Best block_best(Best v, Best* scratch) {
    for (int o = 16; o > 0; o >>= 1) {
        Best other;
        other.value = __shfl_xor_sync(0xffffffffu, v.value, o);
        other.index = __shfl_xor_sync(0xffffffffu, v.index, o);
        v = better(v, other);
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < WARPS ? scratch[lane] : Best{NEG_INF, 0xffffffffu};
        for (int o = 16; o > 0; o >>= 1) {
            Best other;
            other.value = __shfl_xor_sync(0xffffffffu, v.value, o);
            other.index = __shfl_xor_sync(0xffffffffu, v.index, o);
            v = better(v, other);
        }
        if (lane == 0) scratch[0] = v;
    }
    __syncthreads();
    return scratch[0];
}

// Sums in a fixed order (per thread, then a fixed tree), so every run gives the same value.
__device__ float block_sum(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < WARPS ? scratch[lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) scratch[0] = v;
    }
    __syncthreads();
    return scratch[0];
}

// Grid (rows). out[row] = {token (bits), log-prob, entropy, tokens kept}.
extern "C" __global__ void __launch_bounds__(THREADS)
verl_sample_rows(const float* __restrict__ logits, const RowParams* __restrict__ params,
                 float* __restrict__ out, SampleParams p) {
    __shared__ Best best_scratch[WARPS];
    __shared__ float sum_scratch[WARPS];
    __shared__ unsigned int counts[256];
    __shared__ unsigned long long masses[256];
    __shared__ unsigned int chosen_bin;
    __shared__ unsigned long long carried;

    const unsigned int row = blockIdx.x;
    const float* x = logits + (unsigned long long)row * p.row_pitch;
    const RowParams rp = params[row];
    const unsigned int V = p.vocab;

    // Pass 1: the largest logit (the greedy token).
    Best local{NEG_INF, 0xffffffffu};
    for (unsigned int i = threadIdx.x; i < V; i += THREADS) local = better(local, Best{x[i], i});
    const Best top = block_best(local, best_scratch);
    const float m = top.value;
    const bool greedy = !(rp.temperature > 0.0f);
    // The log-prob and entropy are of softmax(logits / T) over the whole vocabulary (T = 1 when
    // greedy): what the actor recomputes.
    const float inv_t = greedy ? 1.0f : 1.0f / rp.temperature;

    // Pass 2: Z = sum exp(s), and sum exp(s) s for the entropy, s = (x - m) / T <= 0.
    float z_local = 0.0f, zs_local = 0.0f;
    for (unsigned int i = threadIdx.x; i < V; i += THREADS) {
        const float s = (x[i] - m) * inv_t;
        const float e = expf(s);
        z_local += e;
        zs_local += e * s;
    }
    const float z = block_sum(z_local, sum_scratch);
    const float zs = block_sum(zs_local, sum_scratch);
    const float log_z = logf(z);

    unsigned int token = top.index;
    unsigned int kept = 1;
    if (!greedy) {
        // min-p: keep s >= log(min_p) (probability at least min_p times the largest).
        const float min_s = rp.min_p > 0.0f ? logf(rp.min_p) : NEG_INF;
        unsigned int threshold = 0;  // keep order_key(x) >= threshold
        const bool top_k_on = rp.top_k > 0 && (unsigned int)rp.top_k < V;
        const bool top_p_on = rp.top_p < 1.0f;
        if (top_k_on) {
            // Radix select: the key of the k-th largest kept logit.
            unsigned int prefix = 0, mask = 0, remaining = (unsigned int)rp.top_k;
            bool all = false;
            for (int shift = 24; shift >= 0 && !all; shift -= 8) {
                for (int b = threadIdx.x; b < 256; b += THREADS) counts[b] = 0;
                __syncthreads();
                for (unsigned int i = threadIdx.x; i < V; i += THREADS) {
                    const float xi = x[i];
                    const unsigned int key = order_key(xi);
                    if ((xi - m) * inv_t >= min_s && (key & mask) == prefix)
                        atomicAdd(&counts[(key >> shift) & 255u], 1u);
                }
                __syncthreads();
                if (threadIdx.x == 0) {
                    unsigned int acc = 0, bin = 256;
                    for (int b = 255; b >= 0; --b) {
                        if (acc + counts[b] >= remaining) { bin = b; break; }
                        acc += counts[b];
                    }
                    chosen_bin = bin;
                    carried = acc;
                }
                __syncthreads();
                if (chosen_bin == 256) {
                    all = true;  // fewer than k tokens pass min-p: keep them all
                } else {
                    remaining -= (unsigned int)carried;
                    prefix |= chosen_bin << shift;
                    mask |= 255u << shift;
                }
                __syncthreads();
            }
            if (!all) threshold = prefix;
        }
        if (top_p_on) {
            // Radix select by probability mass: the largest key whose tokens at or above it
            // (among those kept so far) hold at least top_p of the kept mass.
            unsigned int prefix = 0, mask = 0;
            for (int shift = 24; shift >= 0; shift -= 8) {
                for (int b = threadIdx.x; b < 256; b += THREADS) masses[b] = 0ull;
                __syncthreads();
                for (unsigned int i = threadIdx.x; i < V; i += THREADS) {
                    const float xi = x[i];
                    const float s = (xi - m) * inv_t;
                    const unsigned int key = order_key(xi);
                    if (s >= min_s && key >= threshold && (key & mask) == prefix) {
                        const unsigned long long w =
                            (unsigned long long)((double)expf(s) * FIXED_ONE + 0.5);
                        if (w) atomicAdd(&masses[(key >> shift) & 255u], w);
                    }
                }
                __syncthreads();
                if (threadIdx.x == 0) {
                    // What the bins from the top must hold: top_p of the kept mass first, then
                    // what is left of it inside the bin chosen last.
                    unsigned long long need = carried;
                    if (shift == 24) {
                        unsigned long long total = 0;
                        for (int b = 0; b < 256; ++b) total += masses[b];
                        need = (unsigned long long)ceil((double)rp.top_p * (double)total);
                        if (need == 0) need = 1;
                    }
                    unsigned long long acc = 0;
                    unsigned int bin = 0;  // not reached: keep the whole prefix
                    for (int b = 255; b >= 0; --b) {
                        if (acc + masses[b] >= need) { bin = b; break; }
                        acc += masses[b];
                    }
                    chosen_bin = bin;
                    carried = need > acc ? need - acc : 1ull;
                }
                __syncthreads();
                prefix |= chosen_bin << shift;
                mask |= 255u << shift;
                __syncthreads();
            }
            threshold = threshold > prefix ? threshold : prefix;
        }
        // The draw: argmax of s + Gumbel noise over the kept tokens.
        const unsigned long long seed = ((unsigned long long)rp.seed_hi << 32) | rp.seed_lo;
        Best draw{NEG_INF, 0xffffffffu};
        unsigned int kept_local = 0;
        for (unsigned int i = threadIdx.x; i < V; i += THREADS) {
            const float xi = x[i];
            const float s = (xi - m) * inv_t;
            if (s >= min_s && order_key(xi) >= threshold) {
                const float g = -logf(-logf(uniform(seed, rp.step, i)));
                draw = better(draw, Best{s + g, i});
                kept_local += 1;
            }
        }
        const Best pick = block_best(draw, best_scratch);
        kept = (unsigned int)block_sum((float)kept_local, sum_scratch);
        // The most likely token always passes every filter, so a pick exists.
        token = pick.index < V ? pick.index : top.index;
    }
    if (threadIdx.x == 0) {
        // No token at all only when every logit is NaN: the caller reports it.
        const float s_tok = token < V ? (x[token] - m) * inv_t : __int_as_float(0x7fc00000);
        float* o = out + (unsigned long long)row * 4;
        o[0] = __uint_as_float(token);
        o[1] = s_tok - log_z;
        o[2] = log_z - zs / z;
        o[3] = (float)kept;
    }
}

// Each row's largest value among its first `vocab` columns (-inf when none): a vocabulary
// shard's part of the row maximum the tensor-parallel group agrees on. Grid (rows, pieces);
// `vocab` of the SampleParams is the count of valid columns. With `chunk` > 0 block (r, c) takes
// columns [c * chunk, (c + 1) * chunk) of row r and writes out[r * pieces + c] (a row spread
// over many blocks: one block walking 150 000 columns waits on its loads one after another).
extern "C" __global__ void __launch_bounds__(THREADS)
verl_row_max(const float* __restrict__ logits, float* __restrict__ out, SampleParams p) {
    __shared__ Best best_scratch[WARPS];
    const unsigned int row = blockIdx.x;
    const unsigned int c0 = p.chunk * blockIdx.y;
    const unsigned int end = p.chunk ? min(p.vocab, c0 + p.chunk) : p.vocab;
    const float* x = logits + (unsigned long long)row * p.row_pitch;
    Best local{NEG_INF, 0xffffffffu};
    for (unsigned int i = c0 + threadIdx.x; i < end; i += THREADS) local = better(local, Best{x[i], i});
    const Best top = block_best(local, best_scratch);
    if (threadIdx.x == 0) out[row * gridDim.y + blockIdx.y] = top.value;
}

struct ShardParams {
    unsigned int rows;
    unsigned int vocab;  // valid columns of the shard
    unsigned int row_pitch;
    unsigned int vocab_start;  // the shard's first id in the whole vocabulary
    // Columns per block (gridDim.y pieces of the shard, each its own draw), or 0 for the whole
    // shard.
    unsigned int chunk;
    unsigned int unused;
};

// One tensor-parallel rank's part of sampling rows whose logits are split over the vocabulary
// (`verl_megatron::sampling::sample_vocab_parallel`; no top-k or top-p: those rank the whole
// vocabulary). Relative to each row's maximum over the whole vocabulary (`row_max`, agreed by
// the group first), the same scores as `verl_sample_rows`: s = (x - max) / T, the Gumbel noise
// of the token's id in the whole vocabulary, so the best of the ranks' candidates is the token
// the whole row draws (greedy: the largest logit, smaller id on ties). Grid (rows). out[row] =
// {score, token (bits; ~0: none), sum exp(s), sum exp(s) s, kept (bits), s of the token,
// largest logit, its id (bits; ~0: none)}: the largest logit is also the token when no
// candidate passes the filters anywhere, as in the whole-row kernel.
//
// Grid (rows, pieces): with `chunk` > 0 block (r, c) is a shard of its own, columns
// [c * chunk, (c + 1) * chunk), writing out[r * pieces + c], and row_max holds the pieces'
// maxima of each row ([rows][pieces], verl_row_max with the same chunk), which every block
// reduces to the row's.
extern "C" __global__ void __launch_bounds__(THREADS)
verl_sample_shard(const float* __restrict__ logits, const float* __restrict__ row_max,
                  const RowParams* __restrict__ params, float* __restrict__ out, ShardParams p) {
    __shared__ Best best_scratch[WARPS];
    __shared__ float sum_scratch[WARPS];

    const unsigned int row = blockIdx.x, pieces = gridDim.y;
    const unsigned int c0 = p.chunk * blockIdx.y;
    const float* x = logits + (unsigned long long)row * p.row_pitch + c0;
    const RowParams rp = params[row];
    const unsigned int V = p.chunk ? (c0 < p.vocab ? min(p.chunk, p.vocab - c0) : 0) : p.vocab;
    const unsigned int vocab_start = p.vocab_start + c0;
    float m = NEG_INF;
    for (unsigned int c = 0; c < pieces; ++c) m = fmaxf(m, row_max[row * pieces + c]);
    const bool greedy = !(rp.temperature > 0.0f);
    const float inv_t = greedy ? 1.0f : 1.0f / rp.temperature;
    const float min_s = (!greedy && rp.min_p > 0.0f) ? logf(rp.min_p) : NEG_INF;
    const unsigned long long seed = ((unsigned long long)rp.seed_hi << 32) | rp.seed_lo;

    float z_local = 0.0f, zs_local = 0.0f;
    unsigned int kept_local = 0;
    Best draw{NEG_INF, 0xffffffffu}, largest{NEG_INF, 0xffffffffu};
    for (unsigned int i = threadIdx.x; i < V; i += THREADS) {
        const float xi = x[i];
        const float s = (xi - m) * inv_t;
        const float e = expf(s);
        z_local += e;
        zs_local += e * s;
        const unsigned int id = vocab_start + i;
        largest = better(largest, Best{xi, id});
        if (!greedy && s >= min_s) {
            const float g = -logf(-logf(uniform(seed, rp.step, id)));
            draw = better(draw, Best{s + g, id});
            kept_local += 1;
        }
    }
    const float z = block_sum(z_local, sum_scratch);
    const float zs = block_sum(zs_local, sum_scratch);
    const Best top = block_best(largest, best_scratch);
    // Greedy: the shard's largest logit (the whole-row kernel's first pass).
    const Best pick = greedy ? top : block_best(draw, best_scratch);
    const unsigned int kept = (unsigned int)block_sum((float)kept_local, sum_scratch);
    if (threadIdx.x == 0) {
        float* o = out + ((unsigned long long)row * pieces + blockIdx.y) * 8;
        const bool found = pick.index != 0xffffffffu;
        o[0] = pick.value;
        o[1] = __uint_as_float(pick.index);
        o[2] = z;
        o[3] = zs;
        o[4] = __uint_as_float(kept);
        o[5] = found ? (x[pick.index - vocab_start] - m) * inv_t : NEG_INF;
        o[6] = top.value;
        o[7] = __uint_as_float(top.index);
    }
}
