"""Compile tokenmill's Triton kernels for sm_90 on a machine without a GPU and count their SASS
instructions and registers: a stand-in driver names the target, kernels are compiled by ``warmup`` (never
launched), and the CUDA tools bundled with Triton read the cubin. Used on the decode kernel over a float8
pool (``reports/gpu/quantized-llama-3.1-8b/kv-fp8/``); Triton 3.6 matches the GPU host:

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36:src python scripts/experiments/sass_offline.py
"""

import collections
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


class Sm90Target:
    """Just enough of Triton's CUDA driver for ``JITFunction.warmup`` to compile for sm_90."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty: str) -> str:
        from triton.backends.nvidia.driver import ty_to_cpp

        return ty_to_cpp(ty)


def sass_summary(kernel: Any) -> tuple[str, collections.Counter[str]]:
    """Registers / stack / shared memory, and a count of each SASS instruction (with its modifiers)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run(
            [f"{TOOLS}/cuobjdump", "--dump-resource-usage", cubin.name], capture_output=True, text=True
        )
        sass = subprocess.run([f"{TOOLS}/cuobjdump", "-sass", cubin.name], capture_output=True, text=True)
    resources = " ".join(re.findall(r"(REG:\d+|STACK:\d+|SHARED:\d+)", usage.stdout))
    pattern = r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)"
    return resources, collections.Counter(re.findall(pattern, sass.stdout))


def decode_kernels() -> None:
    """The decode kernel at 178 sequences over a bf16 pool, a float8 pool converted to bf16 tile by tile,
    and a float8 pool read in float16 (the default)."""
    import tokenmill.kernels.attention.decode as decode
    from tokenmill.kernels.attention import DecodeConfig, DecodeSplit

    compiled = decode._decode_kernel

    class Compile:
        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            def run(*args: Any, **kwargs: Any) -> None:
                kwargs.pop("launch_cooperative_grid", None)
                resources, counts = sass_summary(compiled.warmup(*args, grid=grid, **kwargs))
                interesting = {
                    k: v for k, v in sorted(counts.items()) if re.match(r"(LDS|LDSM|F2F|PRMT|HMMA|STS|LDG|BAR)", k)
                }
                print(f"  {resources}, {sum(counts.values())} instructions: {interesting}")

            return run

    decode._decode_kernel = Compile()  # type: ignore[assignment]
    query = torch.randn(178, 32, 128, dtype=torch.bfloat16)
    tables, lens = torch.zeros(178, 8, dtype=torch.int32), torch.full((178,), 100, dtype=torch.int32)
    for pool_dtype, fp8_codes in (
        (torch.bfloat16, True),
        (torch.float8_e4m3fn, False),
        (torch.float8_e4m3fn, True),
    ):
        print(f"decode kernel, {pool_dtype} pool, fp8_codes={fp8_codes}")
        pool = torch.zeros(100, 16, 8, 128).to(pool_dtype)
        decode.paged_decode_attention(
            query, pool, pool.clone(), tables, lens, 128, 0.1,
            config=DecodeConfig(64, 4, 3), split=DecodeSplit(1, 64), fp8_codes=fp8_codes,
        )  # fmt: skip
    decode._decode_kernel = compiled


if __name__ == "__main__":
    driver.set_active(Sm90Target())  # type: ignore[arg-type]
    print("triton", triton.__version__)
    decode_kernels()
