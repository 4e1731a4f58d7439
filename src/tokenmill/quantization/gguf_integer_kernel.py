"""Packed GGUF projections with integer activations: each input row rounded per block of 32 values to
16-bit or 8-bit integers (llama.cpp's way) and multiplied with the 4- and 8-bit codes as integers.

The float kernel (``gguf_cpu_kernel.py``) turns every code into a float32 weight before multiplying: at
one input row that conversion, not memory, bounds it (SmolLM2's gate/up reads its 1.1 MB at ~10 GB/s on
a 2-core AVX2 machine). Here each input block gets one float step (``x ~ step * q``, ``step = max |x| /
ACT_MAX``) and a block's 32 products ``code * q`` are summed as integers; the weight's factors are applied
once per group::

    sum_i (code_i * scale + offset) * x_i  ~  scale * step * sum_i code_i * q_i  +  offset * sum_i x_i

(the offset term takes the exact float sum of the inputs). The weights are the same codes and factors;
only the inputs are rounded:

* 16 bits (``madd`` of 16-bit codes and inputs): at most 1/65534 of a block's largest value per input
  (finer than bfloat16's rounding near that value, coarser for values far below it); SmolLM2's and
  Gemma 3's greedy tokens and teacher-forced top-1 match float32's, their logits move by up to ~0.02. As
  fast as 8 bits at one row on a 2-core AVX2 machine (1.2-1.7x the float kernel).
* 8 bits (``maddubs`` then ``madd``): 1/254 of a block's largest value, llama.cpp's rounding; the model's
  outputs move (SmolLM2: 93% teacher-forced top-1 agreement with float32).

Integer sums are exact: a lane adds 4 products of at most 128 * 32767, below 2^24, so its conversion to
float32 is too. Each output element is one reduction in a fixed order, so a row's result does not depend
on the batch or the thread count.

AVX2 only; elsewhere :func:`load_integer_kernel` returns None and the float kernel runs.
"""

import ctypes
from functools import cache
from typing import Any

from tokenmill.native import compile_library
from tokenmill.quantization.gguf_cpu_kernel import FORMAT_DISPATCH
from tokenmill.quantization.gguf_prologue import FUSED_ARGTYPES, ROW_PROLOGUES

_SOURCE = (
    r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <immintrin.h>
#include <omp.h>

#define INLINE static inline __attribute__((always_inline))

#if ACT_BITS == 16
typedef int16_t act_t;
#define ACT_MAX 32767.0f
#define ACT_FUNCTION gguf_linear_int16
#else
typedef int8_t act_t;
#define ACT_MAX 127.0f
#define ACT_FUNCTION gguf_linear_int8
#endif

#ifdef __AVX2__
INLINE float hsum(__m256 v) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

/* Blocks [b0, b1) of row x of K values to integer codes q per block of 32 with step[b] (x ~ step * q,
   |q| <= ACT_MAX), and the float sums the offset terms take: each block's (sums[b]), then each half
   block's (sums[B + 2b], sums[B + 2b + 1]), B = K / 32 blocks. */
static void quantize_blocks(const float* x, int64_t K, int64_t b0, int64_t b1, act_t* q, float* step,
                            float* sums) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = b0; b < b1; b++) {
        const float* v = x + b * 32;
        __m256 a[4];
        for (int i = 0; i < 4; i++) a[i] = _mm256_loadu_ps(v + 8 * i);
        __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a[0]), _mm256_andnot_ps(sign, a[1])),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, a[2]), _mm256_andnot_ps(sign, a[3])));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        step[b] = amax / ACT_MAX;
        __m256 inverse = _mm256_set1_ps(amax > 0.0f ? ACT_MAX / amax : 0.0f);
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(a[0], inverse));  /* round to nearest even */
        __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(a[1], inverse));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(a[2], inverse));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(a[3], inverse));
        /* the packs interleave 128-bit halves; the permutations put the 32 codes back in order */
#if ACT_BITS == 16
        __m256i first = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8);
        __m256i second = _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xD8);
        _mm256_storeu_si256((__m256i*)(q + b * 32), first);
        _mm256_storeu_si256((__m256i*)(q + b * 32 + 16), second);
#else
        __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i*)(q + b * 32), packed);
#endif
        float low = hsum(_mm256_add_ps(a[0], a[1])), high = hsum(_mm256_add_ps(a[2], a[3]));
        sums[K / 32 + 2 * b] = low;
        sums[K / 32 + 2 * b + 1] = high;
        sums[b] = low + high;
    }
}

"""
    + ROW_PROLOGUES
    + r"""
INLINE float factor(const void* p, int64_t i, const int half) {
    return half ? _cvtsh_ss(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

#if ACT_BITS == 16
/* The 32 codes of a block as 16-bit integers in value order, values 0-15 and 16-31: 4-bit codes (value i
   in the low nibble of byte i, value 16 + i in the high one; each byte widened once serves both) or
   8-bit signed codes. */
typedef struct { __m256i low, high; } codes_t;
INLINE codes_t load_codes(const uint8_t* p, const int four_bit) {
    codes_t c;
    if (four_bit) {
        __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
        c.low = _mm256_and_si256(words, _mm256_set1_epi16(15));
        c.high = _mm256_srli_epi16(words, 4);
    } else {
        c.low = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p));
        c.high = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + 16)));
    }
    return c;
}

/* Eight sums of 4 products code * q each, as floats: for groups of 16, lanes 0-3 take values 0-15 and
   lanes 4-7 values 16-31; for groups of 32 the lanes' split does not matter. Exact: |code * q| <= 128 *
   32767, so a lane's 4 products stay below 2^24. */
INLINE __m256 block_dots(codes_t w, const act_t* q, const int group, const int four_bit) {
    (void)four_bit;
    __m256i low = _mm256_madd_epi16(w.low, _mm256_loadu_si256((const __m256i*)q));
    __m256i high = _mm256_madd_epi16(w.high, _mm256_loadu_si256((const __m256i*)(q + 16)));
    if (group == 32) return _mm256_cvtepi32_ps(_mm256_add_epi32(low, high));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_permute2x128_si256(low, high, 0x20),
                                               _mm256_permute2x128_si256(low, high, 0x31)));
}
#else
/* The 32 codes of a block as bytes in value order (4-bit codes, value i in the low nibble of byte i and
   value 16 + i in the high one, widened to unsigned bytes; or 8-bit signed codes as stored), and for
   signed codes their magnitudes. */
typedef struct { __m256i codes, magnitudes; } codes_t;
INLINE codes_t load_codes(const uint8_t* p, const int four_bit) {
    codes_t c;
    if (four_bit) {
        __m128i b = _mm_loadu_si128((const __m128i*)p);
        __m128i low = _mm_and_si128(b, _mm_set1_epi8(15));
        __m128i high = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
        c.codes = c.magnitudes = _mm256_set_m128i(high, low);
    } else {
        c.codes = _mm256_loadu_si256((const __m256i*)p);
        c.magnitudes = _mm256_abs_epi8(c.codes);
    }
    return c;
}

/* Eight int32 sums of 4 products code * q each (lanes 0-3: values 0-15, lanes 4-7: 16-31), as floats.
   maddubs takes an unsigned first operand: signed codes lend their sign to q. No pair sum saturates
   (|code| <= 128, |q| <= 127). */
INLINE __m256 block_dots(codes_t w, const act_t* q, const int group, const int four_bit) {
    (void)group;
    __m256i x = _mm256_loadu_si256((const __m256i*)q);
    __m256i pairs = four_bit ? _mm256_maddubs_epi16(w.codes, x)
                             : _mm256_maddubs_epi16(w.magnitudes, _mm256_sign_epi8(x, w.codes));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif

/* Block c of output row n against R (1 or 4) quantized input rows, into acc[r] and offsets[r]. */
INLINE void block_step(const uint8_t* codes, const void* scale, const void* offset, int64_t n, int64_t c,
                       const act_t* q, const float* step, const float* sums, int64_t K, const int R,
                       const int group, const int four_bit, const int half, const int has_offset,
                       __m256* acc, float* offsets) {
    int64_t blocks = K / 32, groups = K / group, bytes = four_bit ? 16 : 32;
    codes_t w = load_codes(codes + (n * blocks + c) * bytes, four_bit);
    int64_t g = n * groups + (group == 32 ? c : 2 * c);
    float s0 = factor(scale, g, half), s1 = group == 32 ? s0 : factor(scale, g + 1, half);
    float o0 = has_offset ? factor(offset, g, half) : 0.0f;
    float o1 = has_offset && group == 16 ? factor(offset, g + 1, half) : 0.0f;
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        __m256 dots = block_dots(w, q + r * K + c * 32, group, four_bit);
        float d = step[r * blocks + c];
        __m256 factors = group == 32 ? _mm256_set1_ps(s0 * d)
                                     : _mm256_set_m128(_mm_set1_ps(s1 * d), _mm_set1_ps(s0 * d));
        acc[r] = _mm256_fmadd_ps(dots, factors, acc[r]);
        if (has_offset) {
            const float* half_sums = sums + r * 3 * blocks + blocks + 2 * c;
            offsets[r] += group == 32 ? o0 * (half_sums[0] + half_sums[1])
                                      : o0 * half_sums[0] + o1 * half_sums[1];
        }
    }
}

INLINE __m256 load_factors(const void* p, int64_t i, const int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)p + i)))
                : _mm256_loadu_ps((const float*)p + i);
}

/* Blocks [c, c + 8) of output row n against R quantized input rows, groups of 32: the eight blocks'
   factors scale * step are formed in one vector per row and each block takes its lane; the offset terms
   offset * sum(x) of the eight blocks go into the even accumulator as one vector. */
INLINE void eight_blocks(const uint8_t* codes, const void* scale, const void* offset, int64_t n, int64_t c,
                         const act_t* q, const float* step, const float* sums, int64_t K, const int R,
                         const int four_bit, const int half, const int has_offset, __m256* even,
                         __m256* odd) {
    int64_t blocks = K / 32, bytes = four_bit ? 16 : 32;
    __m256 scales = load_factors(scale, n * blocks + c, half), factors[4];
    __m256 offsets = has_offset ? load_factors(offset, n * blocks + c, half) : _mm256_setzero_ps();
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        factors[r] = _mm256_mul_ps(scales, _mm256_loadu_ps(step + r * blocks + c));
        if (has_offset)
            even[r] = _mm256_fmadd_ps(offsets, _mm256_loadu_ps(sums + r * 3 * blocks + c), even[r]);
    }
    #pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        codes_t w = load_codes(codes + (n * blocks + c + j) * bytes, four_bit);
        __m256i lane = _mm256_set1_epi32(j);
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            __m256 dots = block_dots(w, q + r * K + (c + j) * 32, 32, four_bit);
            __m256 factor = _mm256_permutevar8x32_ps(factors[r], lane);
            if (j & 1) odd[r] = _mm256_fmadd_ps(dots, factor, odd[r]);
            else even[r] = _mm256_fmadd_ps(dots, factor, even[r]);
        }
    }
}

/* Output row n against R (1 or 4) quantized input rows. Even and odd blocks go to two accumulators (two
   dependency chains), folded in the same order whatever R is. */
INLINE void row_dots(const uint8_t* codes, const void* scale, const void* offset, int64_t n,
                     const act_t* q, const float* step, const float* sums, int64_t K, const int R,
                     const int group, const int four_bit, const int half, const int has_offset, float* y,
                     int64_t stride) {
    __m256 even[4], odd[4];
    float even_offsets[4] = {0.0f, 0.0f, 0.0f, 0.0f}, odd_offsets[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) even[r] = odd[r] = _mm256_setzero_ps();
    int64_t blocks = K / 32, c = 0;
    if (group == 32)
        for (; c + 8 <= blocks; c += 8)
            eight_blocks(codes, scale, offset, n, c, q, step, sums, K, R, four_bit, half, has_offset, even,
                         odd);
    for (; c + 2 <= blocks; c += 2) {
        block_step(codes, scale, offset, n, c, q, step, sums, K, R, group, four_bit, half, has_offset, even,
                   even_offsets);
        block_step(codes, scale, offset, n, c + 1, q, step, sums, K, R, group, four_bit, half, has_offset,
                   odd, odd_offsets);
    }
    if (c < blocks)
        block_step(codes, scale, offset, n, c, q, step, sums, K, R, group, four_bit, half, has_offset, even,
                   even_offsets);
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        y[r * stride] = hsum(_mm256_add_ps(even[r], odd[r])) + (even_offsets[r] + odd_offsets[r]);
}

typedef void (*row_fn)(const act_t*, const float*, const float*, int64_t, int64_t, const uint8_t*,
                       const void*, const void*, int64_t, int64_t, int64_t, float*);

#define VARIANT(NAME, GROUP, FOUR, HALF, OFF)                                                              \
    static void NAME(const act_t* q, const float* step, const float* sums, int64_t M, int64_t K,         \
                     const uint8_t* codes, const void* scale, const void* offset, int64_t n0, int64_t n1, \
                     int64_t N, float* y) {                                                               \
        int64_t blocks = K / 32;                                                                          \
        for (int64_t n = n0; n < n1; n++) {                                                               \
            int64_t m = 0;                                                                                \
            for (; M - m >= 4; m += 4)                                                                    \
                row_dots(codes, scale, offset, n, q + m * K, step + m * blocks, sums + m * 3 * blocks, K,  \
                         4, GROUP, FOUR, HALF, OFF, y + m * N + n, N);                                    \
            for (; m < M; m++)                                                                            \
                row_dots(codes, scale, offset, n, q + m * K, step + m * blocks, sums + m * 3 * blocks, K,  \
                         1, GROUP, FOUR, HALF, OFF, y + m * N + n, N);                                    \
        }                                                                                                 \
    }
"""
    + FORMAT_DISPATCH
    + r"""
/* y[m, n] ~ sum_k h[m, k] * w[n, k], h the rows formed by the prologue (PLAIN: h = x); 1 for an unknown
   format, 2 where scratch memory is short. x rows are 2K long for the gates, K otherwise. */
int ACT_FUNCTION(FUSED_LINEAR_PARAMS) {
    row_fn fn = variant(group, four_bit, half, offset != 0);
    if (fn == 0 || K % 32 != 0) return 1;
    if (M == 0) return 0;
    int64_t blocks = K / 32, x_stride = prologue >= SILU_GATE ? 2 * K : K;
    act_t* q = malloc(M * K * sizeof(act_t));
    float* step = malloc(M * blocks * sizeof(float));
    float* sums = malloc(M * 3 * blocks * sizeof(float));
    float* h = prologue == PLAIN ? 0 : malloc(M * K * sizeof(float));
    int status = (q && step && sums && (prologue == PLAIN || h)) ? 0 : 2;
    if (status == 0) {
        #pragma omp parallel num_threads(threads)
        {
            int64_t t = omp_get_thread_num(), count = omp_get_num_threads(), m0, m1, c0, c1;
            prologue_share(M, K, t, count, &m0, &m1, &c0, &c1);
            for (int64_t m = m0; m < m1; m++) {
                const float* row = x + m * x_stride;
                if (prologue != PLAIN) {
                    form_columns(prologue, row, K, c0, c1, residual ? residual + m * K : 0, norm_weight, eps,
                                 unit_offset, h + m * K);
                    row = h + m * K;
                }
                quantize_blocks(row, K, c0 / 32, c1 / 32, q + m * K, step + m * blocks,
                                sums + m * 3 * blocks);
            }
            #pragma omp barrier
            if (prologue == RMS_NORM)
                for (int64_t m = m0; m < m1; m++)
                    store_sums(x + m * x_stride, c0, c1, residual ? residual + m * K : 0, sum_out + m * K);
            fn(q, step, sums, M, K, codes, scale, offset, N * t / count, N * (t + 1) / count, N, y);
        }
    }
    free(q);
    free(step);
    free(sums);
    free(h);
    return status;
}
#endif
"""
)


@cache
def load_integer_kernel(bits: int) -> ctypes.CDLL | None:
    """The kernel rounding inputs to ``bits`` (8 or 16) bit integers, or None where it cannot be built (no
    compiler, or no AVX2)."""
    if bits not in (8, 16):
        raise ValueError(f"integer activations have 8 or 16 bits, not {bits}")
    name = f"gguf_linear_int{bits}"
    library = compile_library(name, f"#define ACT_BITS {bits}\n" + _SOURCE)
    if library is None or not hasattr(library, name):
        return None
    function = getattr(library, name)
    function.restype = ctypes.c_int
    function.argtypes = FUSED_ARGTYPES
    return library


def integer_function(bits: int) -> Any | None:
    """The fused C function (``gguf_prologue.py``'s calling convention) rounding inputs to ``bits`` bits,
    or None where it is not built."""
    library = load_integer_kernel(bits)
    return None if library is None else getattr(library, f"gguf_linear_int{bits}")
