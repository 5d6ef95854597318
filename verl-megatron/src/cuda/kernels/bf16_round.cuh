// Rounding f32 to bf16 as a cast rounds it (to nearest, ties to even, on the upper 16 bits of a
// finite value), for the kernels that write bf16 operands or round products' inputs; prepended
// to their sources by verl_megatron::cuda::kernels.

// The bits of `x` as bf16.
__device__ __forceinline__ unsigned short bf16_bits(float x) {
    unsigned int b = __float_as_uint(x);
    b += 0x7fffu + ((b >> 16) & 1u);
    return (unsigned short)(b >> 16);
}

// `x` rounded to bf16, as an f32.
__device__ __forceinline__ float round_bf16(float x) {
    return __uint_as_float((unsigned int)bf16_bits(x) << 16);
}

