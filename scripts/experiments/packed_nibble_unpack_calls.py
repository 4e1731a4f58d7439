"""Exploration (CPU, packed GGUF default): per-call times of the float kernel with the 4-bit codes unpacked the old
way (commit ee536b8) and the landed one, at SmolLM2 Q4_1 shapes, 1 / 5 / 8 rows, 30 random weights per shape (called in
turn, as a decode step does), the two libraries alternating, medians; outputs compared bit for bit:
``python scripts/experiments/packed_nibble_unpack_calls.py``."""

import statistics
import subprocess
import time

import torch

import tokenmill.quantization.gguf_cpu_kernel as K

old_text = subprocess.run(["git", "show", "ee536b8:src/tokenmill/quantization/gguf_cpu_kernel.py"], capture_output=True, text=True, check=True).stdout
ns = {}
exec(old_text.split("\n\n\n@cache", 1)[0], ns)
libs = {}
new_src = K._SOURCE
for name, src in (("old", ns["_SOURCE"]), ("new", new_src)):
    K._SOURCE = src
    libs[name] = K.load_kernel.__wrapped__()
torch.set_num_threads(2)
shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
L = 30
for proj, (N, Kd) in shapes.items():
    codes = [torch.randint(0, 255, (N, Kd // 2), dtype=torch.uint8) for _ in range(L)]
    scale = [torch.rand(N, Kd // 32).half() * 0.01 for _ in range(L)]
    off = [torch.rand(N, Kd // 32).half() * -0.08 for _ in range(L)]
    for rows in (1, 5, 8):
        x = torch.randn(rows, Kd)
        res = {"old": [], "new": []}
        outs = {}
        for sample in range(12):
            for name, lib in libs.items():
                t = time.perf_counter()
                for i in range(L):
                    outs[name] = K.run_kernel(lib, x, codes[i], scale[i], off[i], 32)
                res[name].append((time.perf_counter() - t) / L * 1e6)
        o, n = statistics.median(res["old"]), statistics.median(res["new"])
        print(f"{proj:8s} rows {rows}: old {o:7.1f} us new {n:7.1f} us  {o / n:.2f}x  equal={torch.equal(outs['old'], outs['new'])}", flush=True)
