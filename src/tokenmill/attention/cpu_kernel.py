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
``scaled_dot_product_attention`` (with AVX2, fused multiply-adds and a polynomial exponential within
1 ulp of ``expf``), so outputs agree to float32 rounding, not bitwise.

The work is split as flash decoding splits it: a row's context is cut into spans of 64 positions, each
(row, kv head, span) is one OpenMP task that reads each key and value once for all the query heads of
its group, and the spans' partial softmax sums are merged in order. So both threads of a one-sequence
decode share its heads, and the split depends on the row's length only: a row's result does not depend
on the batch. On the 2-core AVX2 machine (``scripts/experiments/cpu_kernels_ab.py``), one row of
SmolLM2's attention (9 heads of 64 over 3 kv heads) took 1.2-2.0x less time on one thread and 1.3-1.9x
on two than the one-task-per-head loop it replaced, from 100 to 1,000 positions
(``reports/gguf-cpu/attention-spans/``).
"""

import ctypes
from functools import cache
from typing import Any

from tokenmill.native import FLAGS, compile_library

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__)
#define VECTORIZED 1  /* the loops below in AVX2 intrinsics with fused multiply-adds */
#include <immintrin.h>
#endif

/* Context positions a task attends at most: a row's context is cut into spans of SPAN positions from its
   first one, each (row, kv head, span) is one task, and the spans' partial softmax sums are merged in
   order. Two threads then share even one sequence's heads, and the cut depends on the row's own length
   only (a row's result does not depend on the batch or the thread count). */
#define SPAN 64
#define PREFETCH 8  /* positions ahead whose key / value rows are fetched into L1 */

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

#ifdef VECTORIZED
static inline float horizontal_sum(__m256 v) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

/* e^x for x <= 0 (scores minus their maximum), within 1 ulp of expf (checked at 2^24 points of [-87, 0]):
   x = n ln2 + r, a degree-6 polynomial in r, times 2^n formed in the exponent bits (below -87 the result is
   clamped to ~1e-38). */
static inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

static float dot(const float* a, const float* b, int64_t n) {
    int64_t i = 0;
    float total = 0.0f;
#ifdef VECTORIZED
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        even = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), even);
        odd = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), odd);
    }
    for (; i + 8 <= n; i += 8) even = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), even);
    total = horizontal_sum(_mm256_add_ps(even, odd));
#endif
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

/* weights[i] = e^(weights[i] - best) for i < n; returns their sum. */
static float exponentiate(float* weights, int64_t n, float best) {
    int64_t i = 0;
    float total = 0.0f;
#ifdef VECTORIZED
    __m256 sum = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(weights + i), _mm256_set1_ps(best)));
        _mm256_storeu_ps(weights + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    total = horizontal_sum(sum);
#endif
    for (; i < n; i++) {
        weights[i] = expf(weights[i] - best);
        total += weights[i];
    }
    return total;
}

/* The d floats of a key or value row into L1 ahead of their use (a no-op where the intrinsic is absent). */
static inline void prefetch_row(const float* row, int64_t d) {
#ifdef VECTORIZED
    for (int64_t i = 0; i < d; i += 16) _mm_prefetch((const char*)(row + i), _MM_HINT_T0);
#endif
}

/* acc[0, d) = sum over i < n of weights[i] * values[i][0, d). With AVX2, blocks of 64 columns are summed
   in eight registers across all n rows (a store and a reload per product would chain through memory). */
static void weighted_sum(const float* weights, const float* const* values, int64_t n, int64_t d, float* acc) {
    int64_t c = 0;
#ifdef VECTORIZED
    for (; c + 64 <= d; c += 64) {
        __m256 sums[8];
        for (int j = 0; j < 8; j++) sums[j] = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i++) {
            if (i + PREFETCH < n) prefetch_row(values[i + PREFETCH] + c, 64);
            __m256 w = _mm256_set1_ps(weights[i]);
            const float* value = values[i] + c;
            for (int j = 0; j < 8; j++) sums[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(value + 8 * j), sums[j]);
        }
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(acc + c + 8 * j, sums[j]);
    }
#endif
    for (; c < d; c++) {
        float total = 0.0f;
        for (int64_t i = 0; i < n; i++) total += weights[i] * values[i][c];
        acc[c] = total;
    }
}

/* acc[0, d) += weight * value[0, d) */
static void add_scaled(float* acc, float weight, const float* value, int64_t d) {
    int64_t i = 0;
#ifdef VECTORIZED
    __m256 w = _mm256_set1_ps(weight);
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(w, _mm256_loadu_ps(value + i), _mm256_loadu_ps(acc + i)));
#endif
    for (; i < d; i++) acc[i] += weight * value[i];
}

/* The `group` query heads of one kv head over positions [lo, hi) of a context: per head, the partial
   softmax (its maximum score, its sum of exponentials, the weighted sum of values) in part[h * (d + 2)]:
   max, sum, then d values. scores: group * SPAN floats of scratch. */
static void attend_span(const float* query, int64_t group, int64_t d, const float* key_pool,
                        const float* value_pool, int64_t row_elems, int64_t kv, const int32_t* table,
                        int64_t block_size, int64_t lo, int64_t hi, float scale, float* scores, float* part) {
    int64_t n = hi - lo;
    const float* keys[SPAN];
    const float* values[SPAN];
    int64_t block = lo / block_size, offset = lo % block_size;
    for (int64_t i = 0; i < n; i++, offset++) {
        if (offset == block_size) block++, offset = 0;
        int64_t at = ((int64_t)table[block] * block_size + offset) * row_elems + kv * d;
        keys[i] = key_pool + at;
        values[i] = value_pool + at;
    }
    for (int64_t i = 0; i < n; i++) {
        if (i + PREFETCH < n) prefetch_row(keys[i + PREFETCH], d);
        for (int64_t h = 0; h < group; h++) scores[h * SPAN + i] = dot(query + h * d, keys[i], d) * scale;
    }
    for (int64_t h = 0; h < group; h++) {
        float* weights = scores + h * SPAN;
        float best = -INFINITY;
        for (int64_t i = 0; i < n; i++) best = weights[i] > best ? weights[i] : best;
        float* out = part + h * (d + 2);
        out[0] = best;
        out[1] = exponentiate(weights, n, best);
        weighted_sum(weights, values, n, d, out + 2);
    }
}

/* The first context position row t attends (a sliding window starts later) and its number of spans. */
static int64_t first_position(const int32_t* seq_lens, int64_t t, int64_t window) {
    int64_t len = seq_lens[t];
    return (window > 0 && len > window) ? len - window : 0;
}

static int64_t span_count(const int32_t* seq_lens, int64_t t, int64_t window) {
    int64_t n = seq_lens[t] - first_position(seq_lens, t, window);
    return n > 0 ? (n + SPAN - 1) / SPAN : 0;
}

/* Row t's new key (rotated) and value into its slot (slot < 0: not stored). */
static void store_row(int64_t t, const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                      int64_t Hkv, int64_t d, const float* cos_sin, const int64_t* positions, float* key_pool,
                      float* value_pool, const int64_t* slots) {
    if (slots[t] < 0) return;
    float* key_dst = key_pool + slots[t] * Hkv * d;
    for (int64_t h = 0; h < Hkv; h++) {
        const float* src = k + t * k_stride + h * d;
        if (cos_sin) rotate(src, cos_sin + positions[t] * d, d, key_dst + h * d);
        else memcpy(key_dst + h * d, src, d * sizeof(float));
    }
    memcpy(value_pool + slots[t] * Hkv * d, v + t * v_stride, Hkv * d * sizeof(float));
}

/* out[0, d) for one head from its spans' partial softmax sums (spans parts, part_size floats apart). */
static void merge_spans(const float* first, int64_t spans, int64_t part_size, int64_t d, float* out) {
    memset(out, 0, d * sizeof(float));
    if (spans == 0) return;
    float best = -INFINITY, total = 0.0f;
    for (int64_t j = 0; j < spans; j++) best = first[j * part_size] > best ? first[j * part_size] : best;
    for (int64_t j = 0; j < spans; j++) {
        const float* part = first + j * part_size;
        float factor = spans == 1 ? 1.0f : expf(part[0] - best);
        total += factor * part[1];
        add_scaled(out, factor, part + 2, d);
    }
    for (int64_t i = 0; i < d; i++) out[i] /= total;
}

/* Rows t of T are new tokens of their sequences (row t attends positions [first, seq_lens[t])). Every
   row's key and value go to their slot first; then each (row, kv head, span) task attends with the kv
   head's query heads, walking the block table; then each (row, head) merges its spans (a task whose row
   has one span finishes its heads itself, and with no longer row the merge and its barrier are skipped).
   cos_sin: [positions, d] (cos | sin), or NULL when the caller has rotated already. */
int decode_attention(const float* q, int64_t q_stride, const float* k, int64_t k_stride, const float* v,
                     int64_t v_stride, int64_t T, int64_t H, int64_t Hkv, int64_t d, const float* cos_sin,
                     const int64_t* positions, float* key_pool, float* value_pool, int64_t block_size,
                     const int64_t* slots, const int32_t* tables, int64_t table_width,
                     const int32_t* seq_lens, float scale, int64_t window, float* out, int threads) {
    if (H % Hkv != 0 || (cos_sin && d % 2 != 0)) return 1;
    int64_t group = H / Hkv, part_size = group * (d + 2), most_spans = 0;
    int64_t* task_start = malloc((T + 1) * sizeof(int64_t));
    if (task_start == 0) return 2;
    task_start[0] = 0;
    for (int64_t t = 0; t < T; t++) {
        int64_t spans = span_count(seq_lens, t, window);
        most_spans = spans > most_spans ? spans : most_spans;
        task_start[t + 1] = task_start[t] + Hkv * spans;
    }
    int64_t tasks = task_start[T];
    float* parts = malloc((tasks > 0 ? tasks : 1) * part_size * sizeof(float));
    if (parts == 0) {
        free(task_start);
        return 2;
    }
    int failed = 0, store_in_parallel = T > 16;  /* a few rows are stored before the threads start */
    if (!store_in_parallel)
        for (int64_t t = 0; t < T; t++)
            store_row(t, k, k_stride, v, v_stride, Hkv, d, cos_sin, positions, key_pool, value_pool, slots);
    #pragma omp parallel num_threads(threads)
    {
        if (store_in_parallel) {
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++)
                store_row(t, k, k_stride, v, v_stride, Hkv, d, cos_sin, positions, key_pool, value_pool,
                          slots);
        }  /* (the loop's implicit barrier: every new key and value is stored before any is read) */
        float* scores = malloc(group * SPAN * sizeof(float));
        float* query = malloc(group * d * sizeof(float));
        if (scores == 0 || query == 0) failed = 1;
        int64_t t = 0;
        #pragma omp for schedule(static) nowait
        for (int64_t task = 0; task < tasks; task++) {
            if (scores == 0 || query == 0) continue;
            while (task_start[t + 1] <= task) t++;  /* tasks come in increasing order to each thread */
            int64_t spans = span_count(seq_lens, t, window), local = task - task_start[t];
            int64_t kv = local / spans, lo = first_position(seq_lens, t, window) + (local % spans) * SPAN;
            int64_t hi = lo + SPAN < seq_lens[t] ? lo + SPAN : seq_lens[t];
            for (int64_t h = 0; h < group; h++) {
                const float* q_src = q + t * q_stride + (kv * group + h) * d;
                if (cos_sin) rotate(q_src, cos_sin + positions[t] * d, d, query + h * d);
                else memcpy(query + h * d, q_src, d * sizeof(float));
            }
            float* part = parts + task * part_size;
            attend_span(query, group, d, key_pool, value_pool, Hkv * d, kv, tables + t * table_width,
                        block_size, lo, hi, scale, scores, part);
            if (spans == 1)
                for (int64_t h = 0; h < group; h++)
                    merge_spans(part + h * (d + 2), 1, part_size, d, out + (t * H + kv * group + h) * d);
        }
        free(scores);
        free(query);
        if (most_spans > 1) {
            #pragma omp barrier
            #pragma omp for schedule(static)
            for (int64_t task = 0; task < T * H; task++) {
                int64_t row = task / H, head = task % H, spans = span_count(seq_lens, row, window);
                const float* first = parts + (task_start[row] + head / group * spans) * part_size;
                if (spans != 1)
                    merge_spans(first + (head % group) * (d + 2), spans, part_size, d, out + task * d);
            }
        }
    }
    free(parts);
    free(task_start);
    return failed ? 2 : 0;
}
"""

_FLAGS = (*FLAGS, "-ffp-contract=off")  # the rotation rounds as PyTorch's separate products do


_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
ARGTYPES: list[Any] = [
    *(_POINTER, _SIZE) * 3,  # q, k, v and their row strides
    *(_SIZE,) * 4,  # T, H, Hkv, d
    _POINTER,  # cos_sin (or NULL)
    _POINTER,  # positions
    _POINTER,  # key_pool
    _POINTER,  # value_pool
    _SIZE,  # block_size
    _POINTER,  # slots
    _POINTER,  # block tables
    _SIZE,  # table width
    _POINTER,  # seq_lens
    ctypes.c_float,  # scale
    _SIZE,  # window (0: none)
    _POINTER,  # out
    ctypes.c_int,  # threads
]


@cache
def load_decode_attention(vectorized: bool = True) -> ctypes.CDLL | None:
    """The compiled kernel, or None where no C compiler can build it. ``vectorized=False`` builds it
    without AVX2 (x86 only: the loops other CPUs run, for tests)."""
    flags = _FLAGS if vectorized else (*_FLAGS, "-mno-avx2")
    library = compile_library("decode_attention" if vectorized else "decode_attention_scalar", _SOURCE, flags)
    if library is None:
        return None
    library.decode_attention.restype = ctypes.c_int
    library.decode_attention.argtypes = ARGTYPES
    return library
