"""Projections of one row (batch-1 decode), and of up to 32 (small batches, speculative verification):
``y = f(x) W^T (+ b)`` as a Triton GEMV, with the step before the projection fused into its input loads.

At one token per step a projection reads the whole weight matrix to do one multiply-add per element, so
it is bound by memory bandwidth, and at a 1B model's sizes the launches around it cost as much as the
small norm and activation kernels themselves. Here every program streams ``block_n`` weight rows once,
accumulating products in a ``[block_n, block_k]`` tile that is summed once at the end (no reduction per
step), and recomputes the cheap input transform from the (L2-resident) activations as it goes:

* ``gemv``: no transform (o_proj);
* ``rms_norm_gemv``: RMSNorm, with the residual add, before q/k/v or gate/up. ``1 / rms`` is a factor of
  every output, so the sum of squares is accumulated in the same pass and applied at the end (no pre-pass
  that would leave the memory idle at the start); the normalized input is therefore not rounded to the
  activation dtype before the product, as the PyTorch layers do (a difference below that rounding).
  Program 0 also writes the new residual stream (out of place: the other programs still read the old one);
* ``gated_gemv``: SwiGLU / GeGLU of a fused ``[gate | up]`` row before down_proj, rounded where
  ``models/layers/activation.py`` rounds.

Products accumulate in float32. Inputs of 2-32 rows go to the tensor-core kernel
(``kernels/gemv_tensor_core.py``), a tile of rows against each weight tile; the layers send them there
without a prologue, for small weights only (``KernelOptions.gemv_rows``). More rows go to cuBLAS.

8-bit weights (int8 or float8 e4m3, ``weight_scale`` per output row) are read as they are and converted in
registers: a row's scale is a factor of its whole sum, so it is applied once, at the end. Reading half the
bytes of bfloat16 is the point: batch-1 decode is bound by the weight bytes read per token.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import next_power_of_2, require_unit_last_stride
from tokenmill.kernels.gemv_tensor_core import launch_tensor_core_gemv
from tokenmill.kernels.gemv_tiles import as_float32, float32_factor, input_tile, weight_tile
from tokenmill.kernels.launch import launch_options, register_limit, wait_for_previous_kernel
from tokenmill.kernels.options import GEMV_MAX_ROWS as MAX_ROWS

PLAIN = 0
RMS_NORM = 1
ADD_RMS_NORM = 2
SILU_AND_MUL = 3
GELU_TANH_AND_MUL = 4
GATED_ACTIVATIONS = {"silu": SILU_AND_MUL, "gelu_tanh": GELU_TANH_AND_MUL}
GEMV_MIN_PROGRAMS = 1024  # about 8 per SM of an H200 (132 SMs)
# Rows per program at least, on CPU tensors (TRITON_INTERPRET=1, tests): the interpreter runs a program at
# a time in Python, so the GPU's many narrow programs cost it ~20x the time of a few wide ones.
INTERPRETER_BLOCK_N = 32
QUANTIZED_WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)


TENSOR_CORE_MIN_FEATURES = 16384  # 8-bit weights of at least this many rows go to the tensor cores


class GemvConfig(NamedTuple):
    block_n: int  # weight rows (output features) per program
    block_k: int  # input features per step of the loop
    num_warps: int
    num_stages: int
    tensor_cores: bool = False  # 8-bit weights through kernels/gemv_tensor_core.py (no gated prologue)
    max_registers: int | None = None  # per thread on the GPU (``maxnreg``; the rest spills), for occupancy


def default_gemv_config(out_features: int, in_features: int, weight_bytes: int = 2) -> GemvConfig:
    """From H200 sweeps at Llama-3.2-1B's shapes (``tokenmill bench kernels --gemv-sweep``, then batch-1
    decode in the engine with PDL): long contiguous row segments, 8 warps on long rows; as many rows
    per program (2, 4 or 8) as still leave ``GEMV_MIN_PROGRAMS`` programs (in the engine, 8 rows for
    gate/up and the LM head and 2 for q/k/v were each 1-4% faster than 4). 8-bit weights (int8 or e4m3):
    the widest projections go to the tensor cores."""
    if weight_bytes == 1 and out_features >= TENSOR_CORE_MIN_FEATURES:
        return _one_byte_tensor_core_config(out_features)
    if weight_bytes == 1:
        return _one_byte_config(out_features, in_features)
    if in_features >= 8192:
        return GemvConfig(4, 2048, 8, 1)
    block_n = max([2] + [rows for rows in (4, 8) if out_features // rows >= GEMV_MIN_PROGRAMS])
    return GemvConfig(block_n, min(1024, next_power_of_2(in_features)), 4, 1)


def rows_gemv_config(num_rows: int) -> GemvConfig:
    """2-32 rows (small-batch decode, speculative verification) on the tensor cores: 32 output features
    by 256 inputs a step, three stages, two warps up to 16 rows and four above (the best plain projection
    at 8 and 25 rows in an H200 sweep of SmolLM2, Llama-3.2-1B and Llama-3.1-8B shapes over block_n
    32-128, block_k 128-256, 2-4 warps, 2-3 stages:
    reports/gpu/speculative-ngram-smollm2/gemv-rows-sweep/). The layers give it no prologue: fused into
    more than one row, every program recomputes the prologue for all of them, which costs more than the
    launch it saves (same report)."""
    return GemvConfig(32, 256, 2 if num_rows <= 16 else 4, 3, True)


def _one_byte_config(out_features: int, in_features: int) -> GemvConfig:
    """8-bit weights, from H200 sweeps at Llama-3.1-8B's shapes with each prologue (block_n 4-16, block_k
    1024-2048, 4 or 8 warps): 8 rows of 1024 columns, 4 warps, two stages. More rows per program than
    for bfloat16 spread the prologue's work (the gated activation is recomputed by every program) over
    more weight bytes: down_proj's took 21 µs at 8 rows, 33 µs at 4. At most 128 registers: Triton 3.6
    gives the kernel 164 (Nsight Compute, gate/up), three programs per SM issuing on 56% of cycles; at
    128 four fit (batch-1 decode of Llama-3.1-8B on the H200: int8 348.0 -> 352.3 tok/s, fp8 353.0 ->
    356.6 in another run)."""
    return GemvConfig(8, min(1024, next_power_of_2(in_features)), 4, 2, max_registers=128)


def _one_byte_tensor_core_config(out_features: int) -> GemvConfig:
    """The widest 8-bit projections on the tensor cores: 128 rows of 256 columns, four stages for gate/up,
    64 rows and three stages for the LM head (H200 sweep at Llama-3.1-8B's shapes, weights streamed from
    memory: gate/up int8 44.1 µs on the CUDA cores, 45.9 at three stages, 37.4 at four; e4m3 43.6 -> 35.9;
    LM head int8 160.1 -> 140.4. Batch-1 decode, same run: int8 318.4 -> 348.0, fp8 292.3 -> 321.1
    tok/s; reports/gpu/quantized-llama-3.1-8b/gemv-occupancy/README.md)."""
    if out_features < 4 * TENSOR_CORE_MIN_FEATURES:
        return GemvConfig(128, 256, 4, 4, True)
    return GemvConfig(64, 256, 4, 3, True)


@triton.jit
def _gemv_kernel(
    x_ptr: tl.tensor,
    residual_ptr: tl.tensor,
    norm_weight_ptr: tl.tensor,
    weight_ptr: tl.tensor,
    weight_scale_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    out_ptr: tl.tensor,
    new_residual_ptr: tl.tensor,
    out_features: int,
    in_features: int,
    weight_row_stride: int,
    eps: float,
    prologue: tl.constexpr,
    unit_offset: tl.constexpr,
    has_bias: tl.constexpr,
    has_weight_scale: tl.constexpr,
    block_n: tl.constexpr,
    block_k: tl.constexpr,
    pdl: tl.constexpr,
) -> None:
    program = tl.program_id(0)
    features = program * block_n + tl.arange(0, block_n)
    feature_ok = features < out_features
    written_cols = tl.where(program == 0, in_features, 0)  # the first program writes the residual
    weight_rows = weight_ptr + features.to(tl.int64)[:, None] * weight_row_stride
    weight = weight_tile(weight_rows, feature_ok, 0, in_features, block_k)
    wait_for_previous_kernel(pdl)  # the weights are constants: only the activations wait for it
    products = tl.zeros([block_n, block_k], tl.float32)
    squares = tl.zeros([block_k], tl.float32)
    for start in range(0, in_features, block_k):
        cols = start + tl.arange(0, block_k)
        x, x_squares = input_tile(
            x_ptr,
            residual_ptr,
            norm_weight_ptr,
            new_residual_ptr,
            cols,
            cols < in_features,
            written_cols,
            in_features,
            prologue,
            unit_offset,
        )
        products += as_float32(weight) * x[None, :]
        squares += x_squares
        weight = weight_tile(weight_rows, feature_ok, start + block_k, in_features, block_k)
    out = tl.sum(products, axis=1) * float32_factor(weight_ptr.dtype.element_ty)
    if has_weight_scale:
        out *= tl.load(weight_scale_ptr + features, mask=feature_ok, other=0.0)
    if prologue == 1 or prologue == 2:
        out = out / tl.sqrt(tl.sum(squares, axis=0) / in_features + eps)
    if has_bias:
        out += tl.load(bias_ptr + features, mask=feature_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + features, out.to(out_ptr.dtype.element_ty), mask=feature_ok)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    pdl: bool = False,
    out_dtype: torch.dtype | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x W^T + b`` for ``x`` ``[1, K]`` and ``weight`` ``[N, K]``, in ``out_dtype`` (default: x's; the
    float32 sum is rounded once, to it). An 8-bit ``weight`` comes with ``weight_scale`` ``[N]``."""
    return _launch(
        x, weight, bias, PLAIN, x.shape[-1], config, pdl, out_dtype=out_dtype, weight_scale=weight_scale
    )[0]


def rms_norm_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    unit_offset: bool = False,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    pdl: bool = False,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm(x + residual) W^T + b`` (Llama style, or Gemma's ``1 + w`` with ``unit_offset``) and the
    new residual ``x + residual`` (``x`` itself when there is no residual); ``residual`` is left unchanged."""
    if norm_weight.shape != (x.shape[-1],) or norm_weight.dtype != x.dtype:
        raise ValueError(f"norm weight {norm_weight.dtype}{list(norm_weight.shape)} does not fit x {x.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {residual.dtype}{list(residual.shape)} != x {x.dtype}{list(x.shape)}")
    prologue = RMS_NORM if residual is None else ADD_RMS_NORM
    out, new_residual = _launch(
        x,
        weight,
        bias,
        prologue,
        x.shape[-1],
        config,
        pdl,
        residual,
        norm_weight,
        eps,
        unit_offset,
        weight_scale=weight_scale,
    )
    return out, x if new_residual is None else new_residual


def gated_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    activation: str,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    pdl: bool = False,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(act(x[:, :I]) * x[:, I:]) W^T + b`` for a fused ``[gate | up]`` ``x`` ``[M, 2I]``;
    ``activation`` is ``silu`` or ``gelu_tanh``."""
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(
            f"unknown gated activation {activation!r}; expected one of {sorted(GATED_ACTIVATIONS)}"
        )
    if x.shape[-1] % 2:
        raise ValueError(f"the fused [gate | up] dimension must be even, got {x.shape[-1]}")
    prologue = GATED_ACTIVATIONS[activation]
    return _launch(x, weight, bias, prologue, x.shape[-1] // 2, config, pdl, weight_scale=weight_scale)[0]


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    prologue: int,
    in_features: int,
    config: GemvConfig | None,
    pdl: bool,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    unit_offset: bool = False,
    out_dtype: torch.dtype | None = None,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    num_rows = x.shape[0]
    out_features = weight.shape[0]
    if x.dim() != 2 or num_rows > MAX_ROWS:
        raise ValueError(f"gemv takes [M, K] inputs of at most {MAX_ROWS} rows, got {list(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != in_features:
        raise ValueError(f"weight {weight.dtype}{list(weight.shape)} does not fit x {x.dtype}{list(x.shape)}")
    _check_weight_dtype(x, weight, weight_scale)
    if bias is not None and bias.shape != (out_features,):
        raise ValueError(f"bias shape {list(bias.shape)} != ({out_features},)")
    for name, tensor in (("x", x), ("weight", weight), ("residual", residual)):
        if tensor is not None:
            require_unit_last_stride(name, tensor)
    out = torch.empty(num_rows, out_features, dtype=out_dtype or x.dtype, device=x.device)
    new_residual = torch.empty_like(x) if residual is not None else None
    if num_rows == 0:
        return out, new_residual
    if config is None:
        if num_rows > 1:
            config = rows_gemv_config(num_rows)
        else:
            config = default_gemv_config(out_features, in_features, weight.element_size())
        if x.device.type == "cpu":  # the interpreter: its cost is per program, so fewer, wider ones
            config = config._replace(block_n=max(config.block_n, INTERPRETER_BLOCK_N))
    if num_rows > 1 or (config.tensor_cores and prologue in (PLAIN, RMS_NORM, ADD_RMS_NORM)):
        launch_tensor_core_gemv(
            x, weight, weight_scale, bias, out, config[:4], prologue, pdl, residual, norm_weight,
            new_residual, eps, unit_offset,
        )  # fmt: skip
        return out, new_residual
    _gemv_kernel[(triton.cdiv(out_features, config.block_n),)](
        x,
        residual if residual is not None else x,
        norm_weight if norm_weight is not None else weight,
        weight,
        weight_scale if weight_scale is not None else weight,
        bias if bias is not None else weight,
        out,
        new_residual if new_residual is not None else out,
        out_features,
        in_features,
        weight.stride(0),
        eps,
        prologue=prologue,
        unit_offset=unit_offset,
        has_bias=bias is not None,
        has_weight_scale=weight_scale is not None,
        block_n=config.block_n,
        block_k=config.block_k,
        pdl=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(pdl),
        **register_limit(config.max_registers, x.is_cuda),
    )
    return out, new_residual


def _check_weight_dtype(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None) -> None:
    """A weight of x's dtype, or an 8-bit one with a float32 scale per output row."""
    if weight.dtype in QUANTIZED_WEIGHT_DTYPES:
        if (
            weight_scale is None
            or weight_scale.shape != (weight.shape[0],)
            or weight_scale.dtype != torch.float32
        ):
            scale = "none" if weight_scale is None else f"{weight_scale.dtype}{list(weight_scale.shape)}"
            raise ValueError(
                f"an {weight.dtype} weight needs a float32 scale per row [{weight.shape[0]}], got {scale}"
            )
    elif weight.dtype != x.dtype or weight_scale is not None:
        raise ValueError(
            f"weight {weight.dtype} does not fit x {x.dtype} (a scale goes with 8-bit weights only)"
        )
