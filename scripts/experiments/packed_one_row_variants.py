"""Exploration (CPU, packed GGUF default): the one-row float kernel with two output rows per pass against the
landed one, bit for bit and timed at SmolLM2 shapes, then the landed kernel with float16 and float32 factors (2 threads:
``python scripts/experiments/packed_one_row_variants.py 2``). The engine-level factor A/B is
``packed_factor_dtype_ab.py``. Not kept: see the README (packed GGUF, float32 inputs)."""

import ctypes
import statistics
import sys
import time

import torch

import tokenmill.quantization.gguf_cpu_kernel as K
from tokenmill.native import compile_library

src = K._SOURCE
pair = r"""
/* Two output rows against one input row: the same operations per row as row_dots(.., 1, ..), their chains
   interleaved (twice the independent sums in flight) and the input loaded once for both. */
INLINE void pair_dots(const uint8_t* codes, const void* scale, const void* offset, int64_t row,
                      const float* x, int64_t K, const int group, const int four_bit, const int half,
                      const int has_offset, float* y) {
    vf a[PARTS], b[PARTS], w[PARTS], v[PARTS];
    #pragma GCC unroll 4
    for (int p = 0; p < PARTS; p++) a[p] = b[p] = (vf){0};
    for (int64_t c = 0; c < K / 32; c++) {
        dequantize_chunk(codes, scale, offset, row, K, c, group, four_bit, half, has_offset, w);
        dequantize_chunk(codes, scale, offset, row + 1, K, c, group, four_bit, half, has_offset, v);
        #pragma GCC unroll 4
        for (int p = 0; p < PARTS; p++) {
            vf xp = load_floats(x + c * 32 + p * LANES);
            a[p] += w[p] * xp;
            b[p] += v[p] * xp;
        }
    }
    y[0] = fold(a);
    y[1] = fold(b);
}
"""
anchor = "typedef void (*row_fn)"
new = src.replace(anchor, pair + anchor)
new = new.replace(
    """        for (int64_t n = n0; n < n1; n++) {                                                               \\
            int64_t m = 0;                                                                                \\""",
    """        int64_t n = n0;                                                                                   \\
        if (M == 1)                                                                                       \\
            for (; n + 1 < n1; n += 2)                                                                    \\
                pair_dots(codes, scale, offset, n, x, K, GROUP, FOUR, HALF, OFF, y + n);                  \\
        for (; n < n1; n++) {                                                                             \\
            int64_t m = 0;                                                                                \\""",
)
assert new != src and "pair_dots(codes" in new
libs = {"current": K.load_kernel(), "pair": compile_library("gguf_linear_pair", new)}
for lib in libs.values():
    lib.gguf_linear.restype = ctypes.c_int
    P, S, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.gguf_linear.argtypes = [P, S, S, P, P, P, S, F, F, F, P, F]
torch.manual_seed(0)
threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
torch.set_num_threads(threads)
for name, N, Kd in (("gate/up", 3072, 576), ("down", 576, 1536), ("q/k/v", 960, 576)):
    codes = torch.randint(0, 256, (N, Kd // 2), dtype=torch.uint8)
    scale = torch.rand(N, Kd // 32, dtype=torch.float16)
    offset = -torch.rand(N, Kd // 32, dtype=torch.float16)
    x = torch.randn(1, Kd)
    outs = {}
    times = {k: [] for k in libs}
    for rep in range(7):
        for k, lib in libs.items():
            out = torch.empty(1, N)
            t = time.perf_counter()
            for _ in range(200):
                lib.gguf_linear(
                    x.data_ptr(),
                    1,
                    Kd,
                    codes.data_ptr(),
                    scale.data_ptr(),
                    offset.data_ptr(),
                    N,
                    32,
                    1,
                    1,
                    out.data_ptr(),
                    threads,
                )
            times[k].append((time.perf_counter() - t) / 200 * 1e6)
            outs[k] = out
    same = torch.equal(outs["current"], outs["pair"])
    print(
        name,
        {k: round(statistics.median(v), 2) for k, v in times.items()},
        "bit-identical" if same else "DIFFERENT",
    )

# Per call, the landed kernel with float16 factors (as packed) or float32 ones (half = 0), 1 / 4 / 5 rows.
for M in (1, 4, 5):
    for name, N, Kd in (("gate/up", 3072, 576), ("down", 576, 1536), ("q/k/v", 960, 576)):
        codes = torch.randint(0, 256, (N, Kd // 2), dtype=torch.uint8)
        scale = torch.rand(N, Kd // 32, dtype=torch.float16)
        offset = -torch.rand(N, Kd // 32, dtype=torch.float16)
        variants = {"half": (scale, offset, 1), "float": (scale.float(), offset.float(), 0)}
        x = torch.randn(M, Kd)
        outs = {}
        times = {k: [] for k in variants}
        for rep in range(7):
            for k, (s, o, half) in variants.items():
                out = torch.empty(M, N)
                t = time.perf_counter()
                for _ in range(200):
                    libs["current"].gguf_linear(
                        x.data_ptr(),
                        M,
                        Kd,
                        codes.data_ptr(),
                        s.data_ptr(),
                        o.data_ptr(),
                        N,
                        32,
                        1,
                        half,
                        out.data_ptr(),
                        threads,
                    )
                times[k].append((time.perf_counter() - t) / 200 * 1e6)
                outs[k] = out
        print(
            M,
            name,
            {k: round(statistics.median(v), 2) for k, v in times.items()},
            torch.equal(outs["half"], outs["float"]),
        )
