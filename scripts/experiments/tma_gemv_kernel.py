"""Exploration for issue 18 (batch-1 decode of 8-bit weights): the one-row GEMV of ``kernels/gemv.py`` with
its weight tiles fetched by the tensor memory accelerator (a host-side tensor descriptor) into shared
memory, several stages ahead, instead of by each thread's loads into registers.

Why: the landed kernel keeps one 8 KB int8 tile per program in flight (registers hold it), 3-4 programs per
SM; bfloat16's tiles are twice the bytes at the same shape and stream at 3.5-3.9 TB/s where the 8-bit
ones reach 2.2-3.2. With TMA the bytes in flight are shared memory, not registers: ``stages`` tiles per
program, whatever the conversion's register needs.

    python scripts/experiments/tma_gemv_kernel.py [i8|fp8e4nv] [prologue] [block_n block_k warps stages]

compiles it for sm_90 on the CPU machine and prints whether the loop's loads became asynchronous copies.
"""

import os
import pathlib
import re
import sys
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from sass_offline import sass_summary

from tokenmill.kernels.gemv_tiles import as_float32, float32_factor, input_tile
from tokenmill.kernels.launch import launch_options, wait_for_previous_kernel


@triton.jit
def _step(
    weight, start, products, squares, x_ptr, residual_ptr, norm_weight_ptr, new_residual_ptr, written_cols,
    in_features, prologue: tl.constexpr, unit_offset: tl.constexpr, block_k: tl.constexpr,
):  # fmt: skip
    """One weight tile's products with the prologue's input columns ``[start, start + block_k)``."""
    cols = start + tl.arange(0, block_k)
    x, x_squares = input_tile(
        x_ptr, residual_ptr, norm_weight_ptr, new_residual_ptr, cols, cols < in_features, written_cols,
        in_features, prologue, unit_offset,
    )  # fmt: skip
    return products + as_float32(weight) * x[None, :], squares + x_squares


@triton.jit
def tma_gemv_kernel(
    x_ptr,
    residual_ptr,
    norm_weight_ptr,
    weight_desc,
    weight_scale_ptr,
    out_ptr,
    new_residual_ptr,
    out_features: int,
    in_features: int,
    eps: float,
    prologue: tl.constexpr,
    unit_offset: tl.constexpr,
    block_n: tl.constexpr,
    block_k: tl.constexpr,
    pdl: tl.constexpr,
    stages: tl.constexpr,
    peel: tl.constexpr = False,
):
    program = tl.program_id(0)
    row0 = program * block_n
    features = row0 + tl.arange(0, block_n)
    feature_ok = features < out_features
    written_cols = tl.where(program == 0, in_features, 0)
    products = tl.zeros([block_n, block_k], tl.float32)
    squares = tl.zeros([block_k], tl.float32)
    first = 0
    if peel:  # the first tile loaded before waiting for the previous kernel, the rest pipelined after
        first_weight = weight_desc.load([row0, 0])
        wait_for_previous_kernel(pdl)
        products, squares = _step(
            first_weight, 0, products, squares, x_ptr, residual_ptr, norm_weight_ptr, new_residual_ptr,
            written_cols, in_features, prologue, unit_offset, block_k,
        )  # fmt: skip
        first = block_k
    else:
        wait_for_previous_kernel(pdl)
    for start in tl.range(first, in_features, block_k, num_stages=stages):
        products, squares = _step(
            weight_desc.load([row0, start]), start, products, squares, x_ptr, residual_ptr, norm_weight_ptr,
            new_residual_ptr, written_cols, in_features, prologue, unit_offset, block_k,
        )  # fmt: skip
    out = tl.sum(products, axis=1) * float32_factor(weight_desc.dtype)
    out *= tl.load(weight_scale_ptr + features, mask=feature_ok, other=0.0)
    if prologue == 1 or prologue == 2:
        out = out / tl.sqrt(tl.sum(squares, axis=0) / in_features + eps)
    tl.store(out_ptr + features, out.to(out_ptr.dtype.element_ty), mask=feature_ok)


def tma_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    config: tuple[int, int, int, int],
    prologue: int = 0,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-5,
    pdl: bool = False,
    descriptor: TensorDescriptor | None = None,
    peel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    block_n, block_k, warps, stages = config
    out_features = weight.shape[0]
    if descriptor is None:
        descriptor = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    out = torch.empty(1, out_features, dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(x) if residual is not None else None
    tma_gemv_kernel[(triton.cdiv(out_features, block_n),)](
        x,
        residual if residual is not None else x,
        norm_weight if norm_weight is not None else x,
        descriptor,
        weight_scale,
        out,
        new_residual if new_residual is not None else out,
        out_features,
        weight.shape[1],
        eps,
        prologue=prologue,
        unit_offset=False,
        block_n=block_n,
        block_k=block_k,
        pdl=pdl,
        stages=stages,
        peel=peel,
        num_warps=warps,
        num_stages=stages,
        **launch_options(pdl),
    )
    return out, new_residual


def compile_for_sm90(weight: str, prologue: int, block: tuple[int, int, int, int]) -> Any:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    block_n, block_k, warps, stages = block
    signature = {
        "x_ptr": "*bf16", "residual_ptr": "*bf16", "norm_weight_ptr": "*bf16",
        "weight_desc": f"tensordesc<{weight}[{block_n}, {block_k}]>",
        "weight_scale_ptr": "*fp32", "out_ptr": "*bf16", "new_residual_ptr": "*bf16",
        "out_features": "i32", "in_features": "i32", "eps": "fp32",
        "prologue": "constexpr", "unit_offset": "constexpr", "block_n": "constexpr", "block_k": "constexpr",
        "pdl": "constexpr", "stages": "constexpr",
    }  # fmt: skip
    constants = {"prologue": prologue, "unit_offset": False, "block_n": block_n, "block_k": block_k,
                 "pdl": True, "stages": stages}  # fmt: skip
    divisible = [
        i for i, (name, kind) in enumerate(signature.items()) if kind.startswith("*") or name == "in_features"
    ]
    source = ASTSource(
        tma_gemv_kernel, signature, constants, {(i,): [["tt.divisibility", 16]] for i in divisible}
    )
    kernel = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )
    return kernel


def main(argv: list[str]) -> None:
    weight = argv[0] if argv else "i8"
    prologue = int(argv[1]) if len(argv) > 1 else 0
    block = tuple(int(v) for v in argv[2:6]) if len(argv) > 5 else (32, 256, 4, 4)
    kernel = compile_for_sm90(weight, prologue, block)  # type: ignore[arg-type]
    ttgir = kernel.asm["ttgir"]
    print(weight, prologue, block, "triton", triton.__version__)
    for pattern in (
        "async_tma_copy_global_to_local",
        "wait_barrier",
        "local_alloc",
        "tt.descriptor_load",
        "async_copy_global_to_local",
    ):
        print(f"  {pattern}: {len(re.findall(pattern, ttgir))}")
    print(" ", sass_summary(kernel)[0])
    if os.environ.get("SHOW_TTGIR"):
        print(ttgir)


if __name__ == "__main__":
    main(sys.argv[1:])
