"""The CPU kernel of packed GGUF projections: a short C loop compiled on first use, called through ctypes.

Why C: PyTorch has no CPU kernel for these formats in float32 (see ``gguf_packed.py``), and an
Inductor-compiled PyTorch expression of the same arithmetic re-dequantizes every weight once per input
row and runs the products at a fraction of the FMA rate: 10-20x slower than float32 at 8 rows. The loop
here forms 32 weights of an output row at a time in vector registers (exactly: ``code * scale`` is exact
and ``+ offset`` rounds once, as gguf-py does; a fused multiply-add gives the same bits) and multiplies
them into up to four input rows before forming the next 32, so the codes are read once per four rows and
no float32 weight is ever stored.

Each output element is one dot product whose order (two 16-lane sums over the 32-weight chunks, then a
fixed pairwise fold) does not depend on the number of input rows, so a row's result does not depend on
the batch. OpenMP splits output rows across torch's intra-op threads; the library links the
``libgomp.so.1`` that torch has already loaded, so both share one thread pool.

The compiler is the one Inductor uses (``cc``, i.e. ``$CC`` or ``gcc``); the shared object is cached under
``~/.cache/tokenmill/kernels`` by a hash of its source, flags and the CPU's features. :func:`load_kernel`
returns None where it cannot be built, and callers fall back to PyTorch.
"""

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
#include <omp.h>

#define INLINE static inline __attribute__((always_inline))
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef uint8_t u8x16 __attribute__((vector_size(16), aligned(1)));
typedef int8_t i8x16 __attribute__((vector_size(16), aligned(1)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

/* 16 bytes to 16 floats. GCC 12 turns __builtin_convertvector on byte vectors into scalar conversions,
   so AVX-512 machines get the two instructions spelled out. */
#ifdef __AVX512F__
INLINE v16 unsigned_to_float(u8x16 b) { return (v16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32((__m128i)b)); }
INLINE v16 signed_to_float(i8x16 b) { return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32((__m128i)b)); }
#else
#define WIDEN(b) __builtin_convertvector(__builtin_convertvector(b, i32x16), v16)
INLINE v16 unsigned_to_float(u8x16 b) { return WIDEN(b); }
INLINE v16 signed_to_float(i8x16 b) { return WIDEN(b); }
#endif

INLINE float factor(const void* p, int64_t i, int half) {
    return half ? _cvtsh_ss(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

/* One output row's weights, bit for bit gguf-py's float32: w = code * scale (+ offset), 16 codes per
   vector. Inlined with constant format arguments, so that each format gets its own straight-line loop. */
INLINE v16 affine(v16 codes, float s, float o, const int has_offset) {
    v16 w = codes * s;
    return has_offset ? w + o : w;
}

/* Group g of output row `row` as 16-value vectors (two for groups of 32). */
INLINE void dequantize_group(const uint8_t* codes, const void* scale, const void* offset, int64_t row,
                             int64_t groups, int64_t g, const int group, const int four_bit,
                             const int half, const int has_offset, v16* parts) {
    float s = factor(scale, row * groups + g, half);
    float o = has_offset ? factor(offset, row * groups + g, half) : 0.0f;
    if (four_bit) {  /* group 32: value i in the low nibble of byte i, value 16 + i in its high one */
        u8x16 b = *(const u8x16*)(codes + (row * groups + g) * 16);
        parts[0] = affine(unsigned_to_float(b & 15), s, o, has_offset);
        parts[1] = affine(unsigned_to_float(b >> 4), s, o, has_offset);
    } else {
        const i8x16* q = (const i8x16*)(codes + (row * groups + g) * group);
        parts[0] = affine(signed_to_float(q[0]), s, o, has_offset);
        if (group == 32) parts[1] = affine(signed_to_float(q[1]), s, o, has_offset);
    }
}

/* An input row's dot product with a weight row accumulates in two 16-lane sums (elements k..k+15 and
   k+16..k+31 of each 32), folded pairwise at the end: the same operations in the same order whether the
   input row is computed alone or beside three others that share the weights. */
INLINE void accumulate(v16* a, v16* b, v16 w0, v16 w1, const float* x) {
    v16 x0, x1;
    memcpy(&x0, x, 64);
    memcpy(&x1, x + 16, 64);
    *a += w0 * x0;
    *b += w1 * x1;
}

INLINE float fold(v16 a, v16 b) {
    a += b;  /* then lanes i += i + 8, i += i + 4, i += i + 2, i += i + 1 */
    a += __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    a += __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
    a += __builtin_shufflevector(a, a, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
    a += __builtin_shufflevector(a, a, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
    return a[0];
}

/* The 32 weights [32c, 32c + 32) of output row `row`, in two vectors: one group of 32, or two of 16. */
INLINE void dequantize_chunk(const uint8_t* codes, const void* scale, const void* offset, int64_t row,
                             int64_t K, int64_t c, const int group, const int four_bit, const int half,
                             const int has_offset, v16* w) {
    int64_t groups = K / group;
    if (group == 32) {
        dequantize_group(codes, scale, offset, row, groups, c, 32, four_bit, half, has_offset, w);
    } else {
        dequantize_group(codes, scale, offset, row, groups, 2 * c, 16, four_bit, half, has_offset, w);
        dequantize_group(codes, scale, offset, row, groups, 2 * c + 1, 16, four_bit, half, has_offset, w + 1);
    }
}

/* Output row `row` against `rows` (1 or 4) input rows, its weights formed in registers once per chunk
   and used by every input row. */
INLINE void row_dots(const uint8_t* codes, const void* scale, const void* offset, int64_t row,
                     const float* x, int64_t K, const int rows, const int group, const int four_bit,
                     const int half, const int has_offset, float* y, int64_t stride) {
    v16 a[4] = {{0}}, b[4] = {{0}}, w[2];
    for (int64_t c = 0; c < K / 32; c++) {
        dequantize_chunk(codes, scale, offset, row, K, c, group, four_bit, half, has_offset, w);
        for (int r = 0; r < rows; r++) accumulate(&a[r], &b[r], w[0], w[1], x + r * K + c * 32);
    }
    for (int r = 0; r < rows; r++) y[r * stride] = fold(a[r], b[r]);
}

typedef void (*row_fn)(const float*, int64_t, int64_t, const uint8_t*, const void*, const void*, int64_t,
                       int64_t, int64_t, float*);

/* One function per format, its arguments constant: output rows [n0, n1) of y = x w^T, input rows four
   at a time (then one at a time); each output element sees the same operations either way. */
#define VARIANT(NAME, GROUP, FOUR, HALF, OFF)                                                              \
    static void NAME(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* scale,       \
                     const void* offset, int64_t n0, int64_t n1, int64_t N, float* y) {                   \
        for (int64_t n = n0; n < n1; n++) {                                                               \
            int64_t m = 0;                                                                                \
            for (; m < M; m += (M - m >= 4 ? 4 : 1))                                                      \
                row_dots(codes, scale, offset, n, x + m * K, K, M - m >= 4 ? 4 : 1, GROUP, FOUR, HALF, OFF,  \
                         y + m * N + n, N);                                                               \
        }                                                                                                 \
    }
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
"""

_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


def _cpu_features() -> str:
    """What ``-march=native`` compiles for: a cached library must not run on another CPU (a shared home
    directory across machines), so the CPU's flags are part of its name."""
    try:
        with Path("/proc/cpuinfo").open() as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), platform.machine())
    except OSError:
        return platform.machine()


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenmill" / "kernels"


def _build(target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "gguf_linear.c"
        source.write_text(_SOURCE)
        built = Path(tmp) / target.name
        subprocess.run([compiler, *_FLAGS, str(source), "-o", str(built)], check=True, capture_output=True)
        built.replace(target)  # atomic: concurrent builders each install a whole file


@cache
def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel (built once per source and flags), or None where it cannot be built."""
    digest = hashlib.sha256((_SOURCE + " ".join(_FLAGS) + _cpu_features()).encode()).hexdigest()[:16]
    target = _cache_dir() / f"gguf_linear_{digest}.so"
    try:
        if not target.is_file():
            _build(target)
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        logger.warning("packed GGUF kernel unavailable (%s %s); using PyTorch", error, detail.decode()[-500:])
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
