"""The W8A8 GEMM for decode batches: ``(x_q @ w_q^T) * x_scale * w_scale^T (+ b)`` with float8 e4m3 or
int8 operands on the 8-bit tensor cores, for 2 to ``W8A8_GEMM_MAX_ROWS`` rows.

At such batches the product is bound by reading the weight once; ``torch._scaled_mm``'s rowwise-scaled
kernels read float8 weights at 1.2-1.8 TB/s on the H200 for Llama-3.1-8B's projections, this kernel at
1.5-3.7 (``reports/gpu/quantized-llama-3.1-8b/fp8-gemm/``). The programs that share a weight tile are
launched next to each other (the row tile varies fastest), so all but the first find it in L2. Beyond
``W8A8_GEMM_MAX_ROWS`` rows the GEMM becomes compute-bound and cuBLAS is as fast or faster. int8 products
accumulate exactly in int32, float8 ones in float32; the scales (and bias) are applied once, at the end.

Narrow projections at small batches make too few tiles to fill the GPU (o and down of Llama-3.1-8B at up
to 64 rows: 32 tiles of 64 x 128 for 132 SMs), so a config may split the input features ``split_k`` ways: each
split's program stores its partial sums, and the last of a tile's splits to arrive (an arrival counter,
as the split decode attention merges) adds them in split order, so the result does not depend on which
arrives last, and applies the epilogue.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import arrival_counters

W8A8_GEMM_MAX_ROWS = 256
WIDE_OUTPUTS = 16384  # gate/up and LM-head widths: these take wider column tiles at larger batches
SPLIT_MAX_ROWS = 64  # split the input features of narrow projections up to this many rows
SPLIT_MAX_OUTPUTS = 4096
SPLIT_MIN_FEATURES = 2048  # input features per split program at least
COUNTERS_OWNER = "the W8A8 GEMM"


class W8A8GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # programs per output tile, each over a contiguous share of the input features


def default_w8a8_gemm_config(rows: int, out_features: int, in_features: int) -> W8A8GemmConfig:
    """The fastest of eight tile configs measured on the H200 at Llama-3.1-8B's shapes and 16-256 rows
    (float8; int8 takes the same tiles, not swept apart):
    64 x 128 tiles with a deep pipeline, except where the grid of those would re-read each weight tile
    from L2 for three or four row tiles (wide outputs beyond 64 rows, q/k/v-sized ones beyond 128).
    Narrow outputs (o, down) at up to 64 rows make 32 such tiles: 64 x 64 tiles with the input features
    split over 2-4 programs, ~2,000 each, fill the GPU instead (down at 16-64 rows 29.5 -> 21.5 µs, int8 o
    13.1 -> 10.1; reports/gpu/quantized-llama-3.1-8b/w8a8-split-k/). With more rows the partial sums
    cost more than they save."""
    split = _input_splits(rows, out_features, in_features)
    if split > 1:
        return W8A8GemmConfig(64, 64, 128, 4, 4, split)
    if out_features >= WIDE_OUTPUTS and rows > 64:
        return W8A8GemmConfig(128, 256, 128, 8, 3)
    if out_features > 4096 and rows > 128:
        return W8A8GemmConfig(128, 128, 128, 8, 4)
    return W8A8GemmConfig(64, 128, 128, 4, 6 if out_features < WIDE_OUTPUTS else 4)


def _input_splits(rows: int, out_features: int, in_features: int) -> int:
    """Up to four splits of at least ``SPLIT_MIN_FEATURES`` whole 128-feature steps each, for narrow
    outputs at small batches; 1 elsewhere."""
    if rows > SPLIT_MAX_ROWS or out_features > SPLIT_MAX_OUTPUTS:
        return 1
    split = max(1, min(4, in_features // SPLIT_MIN_FEATURES))
    while split > 1 and in_features % (128 * split):
        split -= 1
    return split


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
    partials_ptr: tl.tensor,  # [tiles, split_k, block_m, block_n] of the accumulator's dtype (split_k > 1)
    arrivals_ptr: tl.tensor,  # [tiles] int32, zero between launches (split_k > 1)
    has_bias: tl.constexpr,
    integer: tl.constexpr,  # int8 operands: the products accumulate in int32
    block_m: tl.constexpr,
    block_n: tl.constexpr,
    block_k: tl.constexpr,
    split_k: tl.constexpr,
) -> None:
    tile = tl.program_id(0)
    split = tl.program_id(1)
    row_tiles = tl.cdiv(rows, block_m)
    row_tile = tile % row_tiles
    col_tile = tile // row_tiles
    row_ids = row_tile * block_m + tl.arange(0, block_m)
    cols = col_tile * block_n + tl.arange(0, block_n)
    steps = in_features // block_k // split_k
    depth = split * steps * block_k + tl.arange(0, block_k)
    row_ok = row_ids < rows
    x_ptrs = x_ptr + row_ids.to(tl.int64)[:, None] * x_row_stride + depth[None, :]
    weight_ptrs = weight_ptr + cols.to(tl.int64)[:, None] * weight_row_stride + depth[None, :]
    acc_dtype = tl.int32 if integer else tl.float32
    acc = tl.zeros([block_m, block_n], acc_dtype)
    for _ in range(0, steps):
        x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(tl.load(weight_ptrs)), acc, out_dtype=acc_dtype)
        x_ptrs += block_k
        weight_ptrs += block_k
    if split_k > 1:
        # Every split stores its sums; the acq_rel increment of the last to arrive comes after the others'
        # releases of their stores, so it reads them all (.cg: from L2), then zeroes the counter.
        inside = tl.arange(0, block_m)[:, None] * block_n + tl.arange(0, block_n)[None, :]
        tile_partials = partials_ptr + tile.to(tl.int64) * (split_k * block_m * block_n)
        tl.store(tile_partials + split * (block_m * block_n) + inside, acc, mask=row_ok[:, None])
        tl.debug_barrier()
        if tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel") != split_k - 1:
            return
        tl.atomic_xchg(arrivals_ptr + tile, 0)
        acc = tl.zeros([block_m, block_n], acc_dtype)
        for other in range(0, split_k):  # in split order: the same sums whichever split arrived last
            partial_ptrs = tile_partials + other * (block_m * block_n) + inside
            acc += tl.load(partial_ptrs, mask=row_ok[:, None], other=0, cache_modifier=".cg")
    x_scale = tl.load(x_scale_ptr + row_ids, mask=row_ok, other=0.0)
    out = acc.to(tl.float32) * x_scale[:, None] * tl.load(weight_scale_ptr + cols)[None, :]
    if has_bias:
        out += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    out_ptrs = out_ptr + row_ids.to(tl.int64)[:, None] * out_row_stride + cols[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def w8a8_gemm_fits(rows: int, weight: torch.Tensor, config: W8A8GemmConfig | None = None) -> bool:
    """Whether :func:`w8a8_gemm` takes ``rows`` rows through ``weight`` ``[N, K]``: 2 to
    ``W8A8_GEMM_MAX_ROWS`` rows, N and K whole tiles of the config (K of its splits), the weight's rows
    contiguous."""
    if not 1 < rows <= W8A8_GEMM_MAX_ROWS or weight.stride(-1) != 1:
        return False
    out_features, in_features = weight.shape
    config = config or default_w8a8_gemm_config(rows, out_features, in_features)
    return out_features % config.block_n == 0 and in_features % (config.block_k * config.split_k) == 0


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
    config = config or default_w8a8_gemm_config(rows, out_features, in_features)
    if not w8a8_gemm_fits(rows, weight, config) or x_q.stride(-1) != 1 or x_q.dtype != weight.dtype:
        raise ValueError(f"w8a8_gemm does not take {rows} rows through a {list(weight.shape)} weight")
    out = torch.empty(rows, out_features, dtype=out_dtype, device=x_q.device)
    tiles = triton.cdiv(rows, config.block_m) * (out_features // config.block_n)
    partials, arrivals = _split_buffers(tiles, config, x_q.dtype == torch.int8, x_q.device)
    _w8a8_gemm_kernel[(tiles, config.split_k)](
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
        partials,
        arrivals,
        has_bias=bias is not None,
        integer=x_q.dtype == torch.int8,
        block_m=config.block_m,
        block_n=config.block_n,
        block_k=config.block_k,
        split_k=config.split_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def _split_buffers(
    tiles: int, config: W8A8GemmConfig, integer: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial sums of a split launch (a fresh allocation: under a CUDA graph, from its pool) and the
    per-device arrival counters, zeroed once and left zero by every merge. Unsplit, the kernel touches
    neither: the counters stand in for both."""
    counters = arrival_counters(COUNTERS_OWNER, device, tiles)
    if config.split_k == 1:
        return counters, counters
    dtype = torch.int32 if integer else torch.float32
    partials = torch.empty(tiles, config.split_k, config.block_m, config.block_n, dtype=dtype, device=device)
    return partials, counters
