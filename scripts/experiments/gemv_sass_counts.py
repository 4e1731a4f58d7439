"""Exploration for issue 18, no GPU needed: compile the landed one-row GEMV (``kernels/gemv.py``) for sm_90
with the installed Triton's bundled ptxas, and print its register count and the instruction mix of its main
loop (the largest backward branch), for int8 / e4m3 / bf16 weights and each prologue.

    python scripts/experiments/gemv_sass_counts.py [i8|fp8e4nv|bf16] [prologue] [block_n block_k warps stages]
"""

import collections
import os
import re
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tokenmill.kernels.gemv import _gemv_kernel

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_gemv(weight: str, prologue: int, block: tuple[int, int, int, int]) -> bytes:
    block_n, block_k, warps, stages = block
    signature = {
        "x_ptr": "*bf16", "residual_ptr": "*bf16", "norm_weight_ptr": "*bf16", "weight_ptr": f"*{weight}",
        "weight_scale_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16", "new_residual_ptr": "*bf16",
        "out_features": "i32", "in_features": "i32", "weight_row_stride": "i32", "eps": "fp32",
        "prologue": "constexpr", "unit_offset": "constexpr", "has_bias": "constexpr",
        "has_weight_scale": "constexpr", "block_n": "constexpr", "block_k": "constexpr", "pdl": "constexpr",
    }  # fmt: skip
    constants = {"prologue": prologue, "unit_offset": False, "has_bias": False,
                 "has_weight_scale": weight != "bf16", "block_n": block_n, "block_k": block_k, "pdl": True}  # fmt: skip
    # pointers and the K / stride arguments divisible by 16, as the runtime JIT specializes them
    divisible = [i for i, (name, kind) in enumerate(signature.items())
                 if kind.startswith("*") or name in ("in_features", "weight_row_stride")]  # fmt: skip
    source = ASTSource(
        _gemv_kernel, signature, constants, {(i,): [["tt.divisibility", 16]] for i in divisible}
    )
    kernel = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )
    return kernel.asm["cubin"]


def main(argv: list[str]) -> None:
    weight = argv[0] if argv else "i8"
    prologue = int(argv[1]) if len(argv) > 1 else 0
    block = tuple(int(v) for v in argv[2:6]) if len(argv) > 5 else (8, 1024, 4, 2)
    path = "/tmp/gemv_sm90.cubin"
    with open(path, "wb") as file:
        file.write(compile_gemv(weight, prologue, block))  # type: ignore[arg-type]
    sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", path], capture_output=True, text=True).stdout
    usage = subprocess.run(
        [os.path.join(BIN, "cuobjdump"), "-res-usage", path], capture_output=True, text=True
    )
    lines = sass.splitlines()
    labels = {line.strip().rstrip(":"): i for i, line in enumerate(lines) if line.startswith(".L_x")}
    loops = []
    for i, line in enumerate(lines):
        match = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if match and labels.get(match.group(1), i) < i:
            loops.append(lines[labels[match.group(1)] : i + 1])
    body = max(loops, key=len)
    ops = collections.Counter(
        re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", "\n".join(body), re.M)
    )
    registers = re.search(r"REG:\d+", usage.stdout)
    print(
        weight,
        "prologue",
        prologue,
        block,
        registers.group(0) if registers else "?",
        "loop instructions",
        len(body),
    )
    print(ops.most_common(16))


if __name__ == "__main__":
    main(sys.argv[1:])
