"""One C call for a decode step's attention in a layer on the CPU: rotate each new query and key, store the
new key and value in the paged pool, and attend over each sequence's context through its block table.

The PyTorch backend does the same in about 25 operator calls a layer (the rotation's halves, products and
concatenations, two ``index_copy_`` into the pool, three gathers through the block tables, the mask,
``scaled_dot_product_attention``, the copies back to the packed rows). At batch 1 of a 135M model each of
those costs more in dispatch than in arithmetic: this call replaces them with one, and reads each context
key and value once, in place in the pool.

The rotation is computed as PyTorch's ``x1 * cos - x2 * sin`` (compiled without floating-point
contraction, so no fused multiply-add changes its rounding): the keys stored in the pool are bit for bit
the PyTorch path's. The scores, softmax and weighted sum accumulate in float32 in another order than
``scaled_dot_product_attention``, so outputs agree to float32 rounding, not bitwise. OpenMP spreads the
query heads of all rows over torch's intra-op threads; a row's result does not depend on the batch.
"""

import ctypes
from functools import cache

from tokenmill.native import FLAGS, compile_library

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* A dot product in vectors of the machine's width, loaded by intrinsics (a 64-byte vector type on an
   AVX2 machine goes through the stack). */
static float dot(const float* a, const float* b, int64_t n) {
    int64_t i = 0;
    float total = 0.0f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    total = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    total = _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
#endif
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

/* out = x rotated by (cos, sin) of one position, rotate-half layout: [x1*c - x2*s, x2*c + x1*s]. */
static void rotate(const float* x, const float* cos_sin, int64_t d, float* out) {
    int64_t half = d / 2;
    const float* c = cos_sin;
    const float* s = cos_sin + half;
    for (int64_t i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[half + i];
        out[i] = x1 * c[i] - x2 * s[i];
        out[half + i] = x2 * c[i] + x1 * s[i];
    }
}

/* Rows t of T are one-token decodes of sequence t. Every row's key and value go to their slot first
   (slot < 0: not stored); then each (row, query head) attends over positions [first, seq_len) of its
   sequence, first = seq_len - window when a window is set, walking its block table block by block.
   cos_sin: [positions, d] (cos | sin), or NULL when the caller has rotated already. */
int decode_attention(const float* q, int64_t q_stride, const float* k, int64_t k_stride, const float* v,
                     int64_t v_stride, int64_t T, int64_t H, int64_t Hkv, int64_t d, const float* cos_sin,
                     const int64_t* positions, float* key_pool, float* value_pool, int64_t block_size,
                     const int64_t* slots, const int32_t* tables, int64_t table_width,
                     const int32_t* seq_lens, float scale, int64_t window, float* out, int threads) {
    if (H % Hkv != 0 || (cos_sin && d % 2 != 0)) return 1;
    int64_t group = H / Hkv, row_elems = Hkv * d, longest = 0;
    for (int64_t t = 0; t < T; t++) longest = seq_lens[t] > longest ? seq_lens[t] : longest;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            if (slots[t] < 0) continue;
            float* key_dst = key_pool + slots[t] * row_elems;
            for (int64_t h = 0; h < Hkv; h++) {
                const float* src = k + t * k_stride + h * d;
                if (cos_sin) rotate(src, cos_sin + positions[t] * d, d, key_dst + h * d);
                else memcpy(key_dst + h * d, src, d * sizeof(float));
            }
            memcpy(value_pool + slots[t] * row_elems, v + t * v_stride, row_elems * sizeof(float));
        }
        /* the implicit barrier of the loop above: every new key and value is stored before any is read */
        float* scores = malloc((longest > 0 ? longest : 1) * sizeof(float));
        float* query = malloc(2 * d * sizeof(float));
        if (scores == 0 || query == 0) failed = 1;
        float* acc = query + d;
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < T * H; task++) {
            if (scores == 0 || query == 0) continue;
            int64_t t = task / H, head = task % H, kv = head / group;
            int64_t len = seq_lens[t], first = (window > 0 && len > window) ? len - window : 0;
            const int32_t* table = tables + t * table_width;
            const float* q_src = q + t * q_stride + head * d;
            if (cos_sin) rotate(q_src, cos_sin + positions[t] * d, d, query);
            else memcpy(query, q_src, d * sizeof(float));
            float best = -INFINITY;
            for (int64_t start = first - first % block_size; start < len; start += block_size) {
                const float* keys = key_pool + (int64_t)table[start / block_size] * block_size * row_elems;
                int64_t lo = start > first ? start : first;
                int64_t hi = start + block_size < len ? start + block_size : len;
                for (int64_t p = lo; p < hi; p++) {
                    float score = dot(query, keys + (p - start) * row_elems + kv * d, d) * scale;
                    scores[p - first] = score;
                    best = score > best ? score : best;
                }
            }
            float total = 0.0f;
            memset(acc, 0, d * sizeof(float));
            for (int64_t start = first - first % block_size; start < len; start += block_size) {
                const float* values =
                    value_pool + (int64_t)table[start / block_size] * block_size * row_elems;
                int64_t lo = start > first ? start : first;
                int64_t hi = start + block_size < len ? start + block_size : len;
                for (int64_t p = lo; p < hi; p++) {
                    float weight = expf(scores[p - first] - best);
                    const float* value = values + (p - start) * row_elems + kv * d;
                    total += weight;
                    for (int64_t i = 0; i < d; i++) acc[i] += weight * value[i];
                }
            }
            float* dst = out + (t * H + head) * d;
            for (int64_t i = 0; i < d; i++) dst[i] = acc[i] / total;
        }
        free(scores);
        free(query);
    }
    return failed ? 2 : 0;
}
"""

_FLAGS = (*FLAGS, "-ffp-contract=off")  # the rotation rounds as PyTorch's separate products do


@cache
def load_decode_attention() -> ctypes.CDLL | None:
    """The compiled kernel, or None where no C compiler can build it."""
    library = compile_library("decode_attention", _SOURCE, _FLAGS)
    if library is None:
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.decode_attention.restype = ctypes.c_int
    library.decode_attention.argtypes = [
        *(pointer, size) * 3,  # q, k, v and their row strides
        *(size,) * 4,  # T, H, Hkv, d
        pointer,  # cos_sin (or NULL)
        pointer,  # positions
        pointer,  # key_pool
        pointer,  # value_pool
        size,  # block_size
        pointer,  # slots
        pointer,  # block tables
        size,  # table width
        pointer,  # seq_lens
        ctypes.c_float,  # scale
        size,  # window (0: none)
        pointer,  # out
        ctypes.c_int,  # threads
    ]
    return library
