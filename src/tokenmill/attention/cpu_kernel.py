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

typedef float v16 __attribute__((vector_size(64), aligned(4)));

static float dot(const float* a, const float* b, int64_t n) {
    int64_t i = 0;
    float total = 0.0f;
    if (n >= 16) {
        v16 acc = {0};
        for (; i + 16 <= n; i += 16) acc += *(const v16*)(a + i) * *(const v16*)(b + i);
        for (int j = 0; j < 16; j++) total += acc[j];
    }
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

static int64_t slot_of(const int32_t* table, int64_t position, int64_t block_size) {
    return (int64_t)table[position / block_size] * block_size + position % block_size;
}

/* Rows t of T are one-token decodes of sequence t. Every row's key and value go to their slot first
   (slot < 0: not stored); then each (row, query head) attends over positions [first, seq_len) of its
   sequence, first = seq_len - window when a window is set. cos_sin: [positions, d] (cos | sin), or NULL
   when the caller has rotated already. */
int decode_attention(const float* q, int64_t q_stride, const float* k, int64_t k_stride, const float* v,
                     int64_t v_stride, int64_t T, int64_t H, int64_t Hkv, int64_t d, const float* cos_sin,
                     const int64_t* positions, float* key_pool, float* value_pool, int64_t block_size,
                     const int64_t* slots, const int32_t* tables, int64_t table_width,
                     const int32_t* seq_lens, float scale, int64_t window, float* out, int threads) {
    if (H % Hkv != 0 || (cos_sin && d % 2 != 0)) return 1;
    int64_t group = H / Hkv, row_elems = Hkv * d;
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
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < T * H; task++) {
            int64_t t = task / H, head = task % H, kv = head / group;
            int64_t len = seq_lens[t], first = (window > 0 && len > window) ? len - window : 0;
            const int32_t* table = tables + t * table_width;
            float query[d], acc[d];
            const float* q_src = q + t * q_stride + head * d;
            if (cos_sin) rotate(q_src, cos_sin + positions[t] * d, d, query);
            else memcpy(query, q_src, d * sizeof(float));
            float* scores = malloc((len - first) * sizeof(float));
            float best = -INFINITY;
            for (int64_t p = first; p < len; p++) {
                float score = dot(query, key_pool + slot_of(table, p, block_size) * row_elems + kv * d, d);
                scores[p - first] = score * scale;
                if (scores[p - first] > best) best = scores[p - first];
            }
            float total = 0.0f;
            memset(acc, 0, d * sizeof(float));
            for (int64_t p = first; p < len; p++) {
                float weight = expf(scores[p - first] - best);
                total += weight;
                const float* value = value_pool + slot_of(table, p, block_size) * row_elems + kv * d;
                for (int64_t i = 0; i < d; i++) acc[i] += weight * value[i];
            }
            free(scores);
            float* dst = out + (t * H + head) * d;
            for (int64_t i = 0; i < d; i++) dst[i] = acc[i] / total;
        }
    }
    return 0;
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
