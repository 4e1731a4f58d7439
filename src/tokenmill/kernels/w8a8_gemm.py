"""The W8A8 GEMM for decode batches: ``(x_q @ w_q^T) * x_scale * w_scale^T (+ b)`` with float8 e4m3 or
int8 operands on the 8-bit tensor cores, for 2 to ``W8A8_GEMM_MAX_ROWS`` rows.

At such batches the product is bound by reading the weight once; ``torch._scaled_mm``'s rowwise-scaled
kernels read float8 weights at 1.2-1.8 TB/s on the H200 for Llama-3.1-8B's projections, this kernel at
1.5-3.7 (``reports/gpu/quantized-llama-3.1-8b/fp8-gemm/``). The programs that share a weight tile are
launched next to each other (the row tile varies fastest), so all but the first find it in L2. Beyond
``W8A8_GEMM_MAX_ROWS`` rows the GEMM becomes compute-bound and cuBLAS is as fast or faster. int8 products
accumulate exactly in int32, float8 ones in float32; the scales (and bias) are applied once, at the end.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

W8A8_GEMM_MAX_ROWS = 256
WIDE_OUTPUTS = 16384  # gate/up and LM-head widths: these take wider column tiles at larger batches


class W8A8GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def default_w8a8_gemm_config(rows: int, out_features: int) -> W8A8GemmConfig:
    """The fastest of eight tile configs measured on the H200 at Llama-3.1-8B's shapes and 16-256 rows
    (float8; int8 takes the same tiles, not swept apart):
    64 x 128 tiles with a deep pipeline, except where the grid of those would re-read each weight tile
    from L2 for three or four row tiles (wide outputs beyond 64 rows, q/k/v-sized ones beyond 128)."""
    if out_features >= WIDE_OUTPUTS and rows > 64:
        return W8A8GemmConfig(128, 256, 128, 8, 3)
    if out_features > 4096 and rows > 128:
        return W8A8GemmConfig(128, 128, 128, 8, 4)
    return W8A8GemmConfig(64, 128, 128, 4, 6 if out_features < WIDE_OUTPUTS else 4)


@triton.jit
def _w8a8_gemm_kernel(
    x_ptr: tl.tensor,  # [M, K] e4m3 or int8
    weight_ptr: tl.tensor,  # [N, K] of the same dtype
    x_scale_ptr: tl.tensor,  # [M] float32
    weight_scale_ptr: tl.tensor,  # [N] float32
    bias_ptr: tl.tensor,  # [N]
    out_ptr: tl.tensor,  # [M, N]
    rows: int,
    in_features: int,
    x_row_stride: int,
    weight_row_stride: int,
    out_row_stride: int,
    has_bias: tl.constexpr,
    integer: tl.constexpr,  # int8 operands: the products accumulate in int32
    block_m: tl.constexpr,
    block_n: tl.constexpr,
    block_k: tl.constexpr,
) -> None:
    row_tiles = tl.cdiv(rows, block_m)
    row_tile = tl.program_id(0) % row_tiles
    col_tile = tl.program_id(0) // row_tiles
    row_ids = row_tile * block_m + tl.arange(0, block_m)
    cols = col_tile * block_n + tl.arange(0, block_n)
    depth = tl.arange(0, block_k)
    row_ok = row_ids < rows
    x_ptrs = x_ptr + row_ids.to(tl.int64)[:, None] * x_row_stride + depth[None, :]
    weight_ptrs = weight_ptr + cols.to(tl.int64)[:, None] * weight_row_stride + depth[None, :]
    acc_dtype = tl.int32 if integer else tl.float32
    acc = tl.zeros([block_m, block_n], acc_dtype)
    for _ in range(0, in_features // block_k):
        x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(tl.load(weight_ptrs)), acc, out_dtype=acc_dtype)
        x_ptrs += block_k
        weight_ptrs += block_k
    x_scale = tl.load(x_scale_ptr + row_ids, mask=row_ok, other=0.0)
    out = acc.to(tl.float32) * x_scale[:, None] * tl.load(weight_scale_ptr + cols)[None, :]
    if has_bias:
        out += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    out_ptrs = out_ptr + row_ids.to(tl.int64)[:, None] * out_row_stride + cols[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def w8a8_gemm_fits(rows: int, weight: torch.Tensor, config: W8A8GemmConfig | None = None) -> bool:
    """Whether :func:`w8a8_gemm` takes ``rows`` rows through ``weight`` ``[N, K]``: 2 to
    ``W8A8_GEMM_MAX_ROWS`` rows, N and K whole tiles of the config, the weight's rows contiguous."""
    if not 1 < rows <= W8A8_GEMM_MAX_ROWS or weight.stride(-1) != 1:
        return False
    out_features, in_features = weight.shape
    config = config or default_w8a8_gemm_config(rows, out_features)
    return out_features % config.block_n == 0 and in_features % config.block_k == 0


def w8a8_gemm(
    x_q: torch.Tensor,
    weight: torch.Tensor,
    x_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: W8A8GemmConfig | None = None,
) -> torch.Tensor:
    """``(x_q @ weight^T) * x_scale * weight_scale^T + bias`` in ``out_dtype``, for e4m3 or int8 ``x_q``
    ``[M, K]`` (row-contiguous) with float32 ``x_scale`` ``[M]`` or ``[M, 1]``, and a ``weight`` ``[N, K]``
    of the same dtype with float32 ``weight_scale`` ``[N]``; needs :func:`w8a8_gemm_fits`."""
    rows, in_features = x_q.shape
    out_features = weight.shape[0]
    config = config or default_w8a8_gemm_config(rows, out_features)
    if not w8a8_gemm_fits(rows, weight, config) or x_q.stride(-1) != 1 or x_q.dtype != weight.dtype:
        raise ValueError(f"w8a8_gemm does not take {rows} rows through a {list(weight.shape)} weight")
    out = torch.empty(rows, out_features, dtype=out_dtype, device=x_q.device)
    grid = (triton.cdiv(rows, config.block_m) * (out_features // config.block_n),)
    _w8a8_gemm_kernel[grid](
        x_q,
        weight,
        x_scale.reshape(-1),
        weight_scale.reshape(-1),
        bias if bias is not None else weight_scale,
        out,
        rows,
        in_features,
        x_q.stride(0),
        weight.stride(0),
        out.stride(0),
        has_bias=bias is not None,
        integer=x_q.dtype == torch.int8,
        block_m=config.block_m,
        block_n=config.block_n,
        block_k=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
