"""The CPU kernel of packed GGUF projections: a short C loop compiled on first use, called through ctypes.

Why C: PyTorch has no CPU kernel for these formats in float32 (see ``gguf_packed.py``), and an
Inductor-compiled PyTorch expression of the same arithmetic re-dequantizes every weight once per input
row and runs the products at a fraction of the FMA rate: 10-20x slower than float32 at 8 rows. The loop
here forms 32 weights of an output row at a time in vector registers (exactly: ``code * scale`` is exact
and ``+ offset`` rounds once, as gguf-py does; a fused multiply-add gives the same bits) and multiplies
them into up to four input rows before forming the next 32, so the codes are read once per four rows and
no float32 weight is ever stored.

Each output element is one dot product whose order (two 16-lane sums over the 32-weight chunks with
AVX-512, four 8-lane ones with AVX2, then a fixed pairwise fold) does not depend on the number of input
rows, so a row's result does not depend on the batch. OpenMP splits output rows across torch's intra-op
threads; the library links the ``libgomp.so.1`` that torch has already loaded, so both share one thread
pool.

It is built by :func:`tokenmill.native.compile_library`; :func:`load_kernel` returns None where it cannot
be, and callers fall back to PyTorch.
"""

import ctypes
from functools import cache

import torch

from tokenmill.native import compile_library
from tokenmill.quantization.gguf_prologue import FUSED_ARGTYPES, ROW_PROLOGUES

# The twelve format variants (a VARIANT macro each source defines) and the table that picks one: shared
# by this kernel and gguf_int8_kernel.py, whose variants take the same formats.
FORMAT_DISPATCH = r"""
VARIANT(q4_half_off, 32, 1, 1, 1) VARIANT(q4_float_off, 32, 1, 0, 1)
VARIANT(q4_half, 32, 1, 1, 0) VARIANT(q4_float, 32, 1, 0, 0)
VARIANT(q8_half, 32, 0, 1, 0) VARIANT(q8_float, 32, 0, 0, 0)
VARIANT(q8_half_off, 32, 0, 1, 1) VARIANT(q8_float_off, 32, 0, 0, 1)
VARIANT(q8g16_half, 16, 0, 1, 0) VARIANT(q8g16_float, 16, 0, 0, 0)
VARIANT(q8g16_half_off, 16, 0, 1, 1) VARIANT(q8g16_float_off, 16, 0, 0, 1)

static row_fn variant(int group, int four_bit, int half, int has_offset) {
    /* [group 16 / 32][8-bit / 4-bit][float / half factors][offset] */
    static const row_fn table[2][2][2][2] = {
        {{{q8g16_float, q8g16_float_off}, {q8g16_half, q8g16_half_off}}, {{0, 0}, {0, 0}}},
        {{{q8_float, q8_float_off}, {q8_half, q8_half_off}},
         {{q4_float, q4_float_off}, {q4_half, q4_half_off}}},
    };
    if (group != 16 && group != 32) return 0;
    return table[group == 32][four_bit != 0][half != 0][has_offset != 0];
}

"""

_SOURCE = (
    r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include <omp.h>

#define INLINE static inline __attribute__((always_inline))

/* The vector of LANES floats the loops work in: a zmm register where AVX-512 is, a ymm one elsewhere
   (GCC lowers a 64-byte vector type on AVX2 through the stack: 20x slower on a 2-core AVX2 machine).
   A chunk of 32 weights is PARTS vectors. Bytes become floats through the widening instructions spelled
   out (GCC 12 turns __builtin_convertvector on byte vectors into scalar conversions). */
#ifdef __AVX512F__
#define LANES 16
typedef float vf __attribute__((vector_size(64), aligned(4)));
INLINE __m128i load_lanes(const uint8_t* p) { return _mm_loadu_si128((const __m128i*)p); }
INLINE vf load_floats(const float* p) { return (vf)_mm512_loadu_ps(p); }
INLINE vf signed_to_float(__m128i b) { return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
typedef __m512i vi;
INLINE vi widen_bytes(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
INLINE vf low_nibbles(vi b) { return (vf)_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))); }
INLINE vf high_nibbles(vi b) { return (vf)_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)); }
#else
#define LANES 8
typedef float vf __attribute__((vector_size(32), aligned(4)));
INLINE __m128i load_lanes(const uint8_t* p) { return _mm_loadl_epi64((const __m128i*)p); }
INLINE vf load_floats(const float* p) { return (vf)_mm256_loadu_ps(p); }
INLINE vf signed_to_float(__m128i b) { return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
typedef __m256i vi;
INLINE vi widen_bytes(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
INLINE vf low_nibbles(vi b) { return (vf)_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15))); }
INLINE vf high_nibbles(vi b) { return (vf)_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)); }
#endif
#define PARTS (32 / LANES)

/* Factors [first, first + count) as float32 in `out` (float16 ones converted eight at a time), or a
   pointer to them where they are float32 already. The loops then broadcast each one from memory, where
   converting them one by one (an insert, a conversion and a broadcast each) made a one-row Q4_1 product
   1.15x slower on a 2-core AVX2 machine (3.86 against 3.36 ns per 32 weights). */
#define FACTOR_BLOCK 64
INLINE const float* row_factors(const void* p, int64_t first, int64_t count, const int half, float* out) {
    if (!half) return (const float*)p + first;
    const uint16_t* h = (const uint16_t*)p + first;
    int64_t i = 0;
    for (; i + 8 <= count; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))));
    for (; i < count; i++) out[i] = _cvtsh_ss(h[i]);
    return out;
}

/* One output row's weights, bit for bit gguf-py's float32: w = code * scale (+ offset), LANES codes per
   vector. Inlined with constant format arguments, so that each format gets its own straight-line loop. */
INLINE vf affine(vf codes, float s, float o, const int has_offset) {
    vf w = codes * s;
    return has_offset ? w + o : w;
}

/* Group g of output row `row` as vectors: 32 / LANES of them for a group of 32, half as many for 16. */
INLINE void dequantize_group(const uint8_t* codes, float s, float o, int64_t row, int64_t groups, int64_t g,
                             const int group, const int four_bit, const int has_offset, vf* parts) {
    if (four_bit) {
        /* group 32: value i in the low nibble of byte i, value 16 + i in its high one. Each byte widened
           once to a 32-bit lane serves both of its values (a mask, a shift): half the shuffles of
           splitting the nibbles first: 1.1-1.2x per call on a 2-core AVX2 machine, bit-identical. */
        const uint8_t* q = codes + (row * groups + g) * 16;
        #pragma GCC unroll 2
        for (int p = 0; p < PARTS / 2; p++) {
            vi bytes = widen_bytes(q + p * LANES);
            parts[p] = affine(low_nibbles(bytes), s, o, has_offset);
            parts[p + PARTS / 2] = affine(high_nibbles(bytes), s, o, has_offset);
        }
    } else {
        const uint8_t* q = codes + (row * groups + g) * group;
        #pragma GCC unroll 4
        for (int p = 0; p < group / LANES; p++)
            parts[p] = affine(signed_to_float(load_lanes(q + p * LANES)), s, o, has_offset);
    }
}

/* An input row's dot product with a weight row accumulates in PARTS sums of LANES lanes (lane j of sum
   p: elements 32c + LANES p + j), folded pairwise at the end: the same operations in the same order
   whether the input row is computed alone or beside three others that share the weights. */
INLINE void accumulate(vf* sums, const vf* w, const float* x) {
    #pragma GCC unroll 4
    for (int p = 0; p < PARTS; p++) sums[p] += w[p] * load_floats(x + p * LANES);
}

INLINE float fold(const vf* sums) {
    vf a = sums[0];
#if LANES == 8
    a = (sums[0] + sums[1]) + (sums[2] + sums[3]);  /* then lanes i += i + 4, i += i + 2, i += i + 1 */
    a += __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3);
    a += __builtin_shufflevector(a, a, 2, 3, 0, 1, 2, 3, 0, 1);
    a += __builtin_shufflevector(a, a, 1, 0, 1, 0, 1, 0, 1, 0);
#else
    a += sums[1];  /* then lanes i += i + 8, i += i + 4, i += i + 2, i += i + 1 */
    a += __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    a += __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
    a += __builtin_shufflevector(a, a, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
    a += __builtin_shufflevector(a, a, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
#endif
    return a[0];
}

/* The 32 weights [32c, 32c + 32) of output row `row`, in PARTS vectors: one group of 32, or two of 16; `s`
   and `o` point at the float32 factors of the chunk's first group. */
INLINE void dequantize_chunk(const uint8_t* codes, const float* s, const float* o, int64_t row, int64_t K,
                             int64_t c, const int group, const int four_bit, const int has_offset, vf* w) {
    int64_t groups = K / group;
    if (group == 32 || four_bit) {  /* 4-bit codes come in groups of 32 only */
        dequantize_group(codes, s[0], has_offset ? o[0] : 0.0f, row, groups, c, 32, four_bit, has_offset, w);
    } else {
        dequantize_group(codes, s[0], has_offset ? o[0] : 0.0f, row, groups, 2 * c, 16, four_bit, has_offset,
                         w);
        dequantize_group(codes, s[1], has_offset ? o[1] : 0.0f, row, groups, 2 * c + 1, 16, four_bit,
                         has_offset, w + PARTS / 2);
    }
}

/* Calls body(c, s, o) for every chunk c of output row `row`, its factors converted FACTOR_BLOCK chunks at a
   time (s and o: the factors of chunk c's first group). */
#define FOR_EACH_CHUNK(row, K, group, half, has_offset, scale, offset, body)                              \
    {                                                                                                     \
        float s_buf_[2 * FACTOR_BLOCK], o_buf_[2 * FACTOR_BLOCK];                                         \
        int64_t per_chunk_ = group == 16 ? 2 : 1, chunks_ = (K) / 32;                                     \
        for (int64_t c0_ = 0; c0_ < chunks_; c0_ += FACTOR_BLOCK) {                                       \
            int64_t n_ = chunks_ - c0_ < FACTOR_BLOCK ? chunks_ - c0_ : FACTOR_BLOCK;                     \
            int64_t first_ = ((row) * chunks_ + c0_) * per_chunk_;                                        \
            const float* s_ = row_factors(scale, first_, n_ * per_chunk_, half, s_buf_);                  \
            const float* o_ = has_offset ? row_factors(offset, first_, n_ * per_chunk_, half, o_buf_) : 0; \
            for (int64_t c = c0_; c < c0_ + n_; c++) {                                                    \
                const float* s = s_ + (c - c0_) * per_chunk_;                                             \
                const float* o = has_offset ? o_ + (c - c0_) * per_chunk_ : 0;                            \
                body;                                                                                     \
            }                                                                                             \
        }                                                                                                 \
    }

/* Output row `row` against `rows` (1 to 4) input rows, its weights formed in registers once per chunk
   and used by every input row. */
INLINE void row_dots(const uint8_t* codes, const void* scale, const void* offset, int64_t row,
                     const float* x, int64_t K, const int rows, const int group, const int four_bit,
                     const int half, const int has_offset, float* y, int64_t stride) {
    vf sums[4][PARTS], w[PARTS];
    #pragma GCC unroll 4
    for (int r = 0; r < rows; r++)
        #pragma GCC unroll 4
        for (int p = 0; p < PARTS; p++) sums[r][p] = (vf){0};
    FOR_EACH_CHUNK(row, K, group, half, has_offset, scale, offset, {
        dequantize_chunk(codes, s, o, row, K, c, group, four_bit, has_offset, w);
        _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++) accumulate(sums[r], w, x + r * K + c * 32);
    })
    for (int r = 0; r < rows; r++) y[r * stride] = fold(sums[r]);
}

typedef void (*row_fn)(const float*, int64_t, int64_t, const uint8_t*, const void*, const void*, int64_t,
                       int64_t, int64_t, float*);

/* One function per format, its arguments constant: output rows [n0, n1) of y = x w^T, input rows four
   at a time, then the last one to three together (one more pass over the weights, not one per row: a
   5-row verification step of speculative decoding is two passes); each output element sees the same
   operations whatever the row count. */
#define ROWS(R, GROUP, FOUR, HALF, OFF)                                                                   \
    row_dots(codes, scale, offset, n, x + m * K, K, R, GROUP, FOUR, HALF, OFF, y + m * N + n, N)
#define VARIANT(NAME, GROUP, FOUR, HALF, OFF)                                                              \
    static void NAME(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* scale,       \
                     const void* offset, int64_t n0, int64_t n1, int64_t N, float* y) {                   \
        for (int64_t n = n0; n < n1; n++) {                                                               \
            int64_t m = 0;                                                                                \
            for (; M - m >= 4; m += 4) /* constant row counts: the sums stay in registers */             \
                ROWS(4, GROUP, FOUR, HALF, OFF);                                                          \
            if (M - m == 3)                                                                               \
                ROWS(3, GROUP, FOUR, HALF, OFF);                                                          \
            else if (M - m == 2)                                                                          \
                ROWS(2, GROUP, FOUR, HALF, OFF);                                                          \
            else if (M - m == 1)                                                                          \
                ROWS(1, GROUP, FOUR, HALF, OFF);                                                          \
        }                                                                                                 \
    }
"""
    + FORMAT_DISPATCH
    + ROW_PROLOGUES
    + r"""
/* y[m, n] = sum_k x[m, k] * w[n, k] for the packed weight w of N rows; 1 for an unknown format. Each
   thread takes a contiguous range of output rows. */
int gguf_linear(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* scale,
                const void* offset, int64_t N, int group, int four_bit, int half, float* y, int threads) {
    row_fn fn = variant(group, four_bit, half, offset != 0);
    if (fn == 0) return 1;
    #pragma omp parallel num_threads(threads)
    {
        int64_t t = omp_get_thread_num(), count = omp_get_num_threads();
        fn(x, M, K, codes, scale, offset, N * t / count, N * (t + 1) / count, N, y);
    }
    return 0;
}

/* gguf_linear on the rows the prologue forms from x (gguf_prologue.py; x rows are 2K long for the gates),
   with the signature of gguf_linear_int8. 1 for an unknown format, 2 where scratch memory is short. */
int gguf_linear_prologue(FUSED_LINEAR_PARAMS) {
    row_fn fn = variant(group, four_bit, half, offset != 0);
    if (fn == 0 || K % 32 != 0) return 1;
    if (M == 0) return 0;
    int64_t x_stride = prologue >= SILU_GATE ? 2 * K : K;
    float* h = prologue == PLAIN ? 0 : malloc(M * K * sizeof(float));
    if (prologue != PLAIN && !h) return 2;
    const float* rows = prologue == PLAIN ? x : h;
    #pragma omp parallel num_threads(threads)
    {
        int64_t t = omp_get_thread_num(), count = omp_get_num_threads();
        if (prologue != PLAIN) {
            int64_t m0, m1, c0, c1;
            prologue_share(M, K, t, count, &m0, &m1, &c0, &c1);
            for (int64_t m = m0; m < m1; m++)
                form_columns(prologue, x + m * x_stride, K, c0, c1, residual ? residual + m * K : 0,
                             norm_weight, eps, unit_offset, h + m * K);
            #pragma omp barrier
            if (prologue == RMS_NORM)
                for (int64_t m = m0; m < m1; m++)
                    store_sums(x + m * K, c0, c1, residual ? residual + m * K : 0, sum_out + m * K);
        }
        fn(rows, M, K, codes, scale, offset, N * t / count, N * (t + 1) / count, N, y);
    }
    free(h);
    return 0;
}

/* The float32 weight itself, rows [0, N) into y ([N, K]): the values row_dots forms, stored. For steps of
   many input rows, where a BLAS product over the stored weight beats forming it again per four rows. */
int gguf_dequantize(const uint8_t* codes, const void* scale, const void* offset, int64_t N, int64_t K,
                    int group, int four_bit, int half, float* y, int threads) {
    if ((group != 16 && group != 32) || (four_bit && group != 32)) return 1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        vf w[PARTS];
        FOR_EACH_CHUNK(n, K, group, half, offset != 0, scale, offset, {
            dequantize_chunk(codes, s, o, n, K, c, group, four_bit, offset != 0, w);
            for (int p = 0; p < PARTS; p++) *(vf*)(y + n * K + c * 32 + p * LANES) = w[p];
        })
    }
    return 0;
}
"""
)


@cache
def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel (built once per source and flags), or None where it cannot be built."""
    library = compile_library("gguf_linear", _SOURCE)
    if library is None:
        return None
    library.gguf_linear.restype = ctypes.c_int
    pointer, size, flag = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.gguf_linear.argtypes = [
        pointer,
        size,
        size,
        pointer,
        pointer,
        pointer,
        size,
        flag,
        flag,
        flag,
        pointer,
        flag,
    ]  # x, M, K, codes, scale, offset, N, group, four_bit, half, y, threads
    library.gguf_linear_prologue.restype = ctypes.c_int
    library.gguf_linear_prologue.argtypes = FUSED_ARGTYPES
    library.gguf_dequantize.restype = ctypes.c_int
    # codes, scale, offset, N, K, group, four_bit, half, y, threads
    library.gguf_dequantize.argtypes = [pointer, pointer, pointer, size, size, flag, flag, flag, pointer,
                                        flag]  # fmt: skip
    return library


def run_kernel(
    library: ctypes.CDLL,
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group: int,
) -> torch.Tensor:
    """``[M, N]`` products of contiguous float32 ``x`` (``[M, K]``) with the packed weight; the factors
    (``scale`` and ``offset``, when present) share one dtype, float16 or float32."""
    rows, cols = x.shape
    out_features = codes.shape[0]
    out = torch.empty(rows, out_features, dtype=torch.float32)
    status = library.gguf_linear(
        x.data_ptr(), rows, cols, codes.data_ptr(), scale.data_ptr(),
        None if offset is None else offset.data_ptr(), out_features, group,
        int(codes.dtype == torch.uint8), int(scale.dtype == torch.float16), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"the packed GGUF kernel has no {codes.dtype} variant with groups of {group}")
    return out


def run_dequantize(
    library: ctypes.CDLL, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, group: int
) -> torch.Tensor:
    """The ``[N, K]`` float32 weight of the packed codes (bit for bit gguf-py's), formed by the kernel's
    own loop across torch's threads."""
    rows, in_features = codes.shape[0], codes.shape[1] * group
    out = torch.empty(rows, in_features, dtype=torch.float32)
    status = library.gguf_dequantize(
        codes.data_ptr(), scale.data_ptr(), None if offset is None else offset.data_ptr(), rows,
        in_features, group, int(codes.dtype == torch.uint8), int(scale.dtype == torch.float16),
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"the packed GGUF kernel has no {codes.dtype} variant with groups of {group}")
    return out
