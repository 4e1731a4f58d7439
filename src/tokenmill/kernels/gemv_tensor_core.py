"""Projections on the tensor cores: one row of 8-bit weights for the widest outputs (gate/up, the LM head;
the default there for int8 and e4m3 weights, ``kernels/gemv.py``'s ``default_gemv_config``), and 2-32 rows
of any weights (``rows_gemv_config``), each a tile of real rows against every weight tile.

The CUDA-core GEMV (``kernels/gemv.py``) converts each int8 / e4m3 weight to float32 and multiply-adds it:
per byte of weight that is twice the instructions of a bfloat16 weight, and at one token per step the
instruction issue, not the memory, bounds it (~2.7-3.3 TB/s on the H200 where bfloat16 streams ~4). Here
the input row is broadcast to a 16-row tile and each ``[block_n, block_k]`` weight tile, converted to the
input's dtype in registers, goes through ``tl.dot``: the tensor cores do the multiply-adds, and the
conversion is all the arithmetic left (for bfloat16 inputs a few packed bit operations per four weights,
below). Every row of the product holds the same sums; row 0 is kept. The prologues (RMSNorm with the
residual add) are computed as the CUDA-core kernel computes them (``kernels/gemv_tiles.py``), rounded to
the input dtype before the product. Measured on the H200 at Llama-3.1-8B's shapes, weights streamed from
memory (reports/gpu/quantized-llama-3.1-8b/gemv-occupancy/README.md): gate/up 44.1 -> 37.4 µs (int8)
and 43.6 -> 35.9 µs (e4m3) at four pipeline stages (at three: 45.9 / 43.8), the LM head 160.1 -> 140.4
µs (int8). Narrower outputs (q/k/v, o, down) are slower here at every tile tried (block_n 16-128,
block_k 256-512: too few programs, or too little per program) and stay on the CUDA cores. A split over
the input features (scripts/experiments/split_k_gemv_kernel.py) won only q/k/v, by ~2% of a token, and
lost o and down: not kept (reports/gpu/quantized-llama-3.1-8b/narrow-projections/README.md).

More rows load a ``[dot_rows, block_k]`` input tile (rows past the input masked to zero). The prologues
work for them too, but every program then recomputes one for all its rows over the whole input, which
costs more than the launch a fusion saves (reports/gpu/speculative-ngram-smollm2/gemv-rows-sweep/): the
layers send more than one row here without a prologue.
"""

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import next_power_of_2
from tokenmill.kernels.gemv_tiles import input_tile, weight_tile
from tokenmill.kernels.launch import launch_options, wait_for_previous_kernel

_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
DOT_ROWS = 16  # the smallest M of a tensor-core dot; one input row is repeated to fill it

# int8 -> bfloat16, four weights a call (bf16 has 7 mantissa bits: no single magic number covers the 256
# codes). prmt 0x4140 / 0x4342 with b = 0x43434343 puts the raw bytes b_i into 16-bit lanes 0x43b_i;
# lane & 0x437F is the bf16 128 + (b_i & 127), lane & 0x4380 the bf16 128 (sign bit clear) or 256 (set);
# their difference is the byte's two's-complement value, exactly. sub.rn.bf16x2 needs sm_90.
INT8_TO_BF16_PTX = tl.constexpr("""{
.reg .b32 a, b, c, lo, hi;
mov.b32 c, 0x43434343;
prmt.b32 a, $2, c, 0x4140;
prmt.b32 b, $2, c, 0x4342;
and.b32 lo, a, 0x437F437F;
and.b32 hi, a, 0x43804380;
sub.rn.bf16x2 $0, lo, hi;
and.b32 lo, b, 0x437F437F;
and.b32 hi, b, 0x43804380;
sub.rn.bf16x2 $1, lo, hi;
}""")

# e4m3 (s eeee mmm, bias 7) -> bfloat16, four weights a call. prmt 0x9180 / 0xB3A2 puts bytes 0, 1
# (2, 3) sign-extended into 16-bit lanes; shifted left 4 and masked with 0x87F0 each lane is the bf16
# with the sign, exponent field eeee and mantissa mmm0000: the e4m3 value times 2^-120 (biases 127 and 7),
# subnormals included. Multiplying by the bf16 2^120 (0x7B80) restores it exactly. mul.rn.bf16x2: sm_90.
E4M3_TO_BF16_PTX = tl.constexpr("""{
.reg .b32 a, b, z, k;
mov.b32 z, 0;
prmt.b32 a, $2, z, 0x9180;
prmt.b32 b, $2, z, 0xB3A2;
shl.b32 a, a, 4;
shl.b32 b, b, 4;
and.b32 a, a, 0x87F087F0;
and.b32 b, b, 0x87F087F0;
mov.b32 k, 0x7B807B80;
mul.rn.bf16x2 $0, a, k;
mul.rn.bf16x2 $1, b, k;
}""")


@triton.jit
def _converted(weight: tl.tensor, dtype: tl.constexpr, packed: tl.constexpr) -> tl.tensor:
    """The weight tile in ``dtype``: a tile already in it as it is; an 8-bit one by the packed PTX above for
    bfloat16 on the GPU (``packed``), else by Triton's own conversion (exact: every int8 and e4m3 value is
    a float16 / bfloat16 / float32)."""
    if weight.dtype == dtype:  # one chain: Triton compiles every branch after a return inside an if
        converted = weight
    elif packed and weight.dtype == tl.int8:
        converted = tl.inline_asm_elementwise(
            INT8_TO_BF16_PTX, "=r,=r,r", [weight], dtype=tl.bfloat16, is_pure=True, pack=4
        )
    elif packed:
        converted = tl.inline_asm_elementwise(
            E4M3_TO_BF16_PTX, "=r,=r,r", [weight.to(tl.int8, bitcast=True)], dtype=tl.bfloat16, is_pure=True,
            pack=4,
        )  # fmt: skip
    else:
        converted = weight.to(dtype)
    return converted


@triton.jit
def _tensor_core_gemv_kernel(
    x_ptr: tl.tensor,
    residual_ptr: tl.tensor,
    norm_weight_ptr: tl.tensor,
    weight_ptr: tl.tensor,
    weight_scale_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    out_ptr: tl.tensor,
    new_residual_ptr: tl.tensor,
    num_rows: int,
    x_row_stride: int,
    residual_row_stride: int,
    new_residual_row_stride: int,
    out_row_stride: int,
    out_features: int,
    in_features: int,
    weight_row_stride: int,
    eps: float,
    prologue: tl.constexpr,
    unit_offset: tl.constexpr,
    has_bias: tl.constexpr,
    has_weight_scale: tl.constexpr,
    single_row: tl.constexpr,
    dot_rows: tl.constexpr,
    block_n: tl.constexpr,
    block_k: tl.constexpr,
    packed: tl.constexpr,
    dot_dtype: tl.constexpr,
    precision: tl.constexpr,
    pdl: tl.constexpr,
) -> None:
    program = tl.program_id(0)
    features = program * block_n + tl.arange(0, block_n)
    feature_ok = features < out_features
    written_cols = tl.where(program == 0, in_features, 0)  # the first program writes the residual
    weight_rows = weight_ptr + features.to(tl.int64)[:, None] * weight_row_stride
    rows = tl.arange(0, dot_rows).to(tl.int64)[:, None]
    row_ok = rows < num_rows
    # No tile loaded ahead by hand (as the CUDA-core kernel does): at these tile sizes it would hold a
    # weight tile in registers; Triton's pipeliner stages the loads through shared memory instead.
    wait_for_previous_kernel(pdl)
    dtype = x_ptr.dtype.element_ty
    sums = tl.zeros([dot_rows, block_n], tl.float32)
    if single_row:  # noqa: SIM108  (one input row, loaded once and repeated to fill the dot's rows)
        squares = tl.zeros([block_k], tl.float32)
    else:  # summed every step: a [dot_rows, block_k] accumulator would take ~32 registers more
        squares = tl.zeros([dot_rows], tl.float32)
    for start in range(0, in_features, block_k):
        cols = start + tl.arange(0, block_k)
        col_ok = cols < in_features
        if single_row:
            x, x_squares = input_tile(
                x_ptr, residual_ptr, norm_weight_ptr, new_residual_ptr, cols, col_ok, written_cols,
                in_features, prologue, unit_offset,
            )  # fmt: skip
            tile = tl.broadcast_to(x.to(dtype)[None, :], (dot_rows, block_k))
        else:
            x, x_squares = input_tile(
                x_ptr + rows * x_row_stride, residual_ptr + rows * residual_row_stride, norm_weight_ptr,
                new_residual_ptr + rows * new_residual_row_stride, cols[None, :], row_ok & col_ok[None, :],
                written_cols, in_features, prologue, unit_offset,
            )  # fmt: skip
            tile = x.to(dtype)
            x_squares = tl.sum(x_squares, axis=1)
        weight = weight_tile(weight_rows, feature_ok, start, in_features, block_k)
        weight = _converted(weight, dot_dtype, packed)
        sums = tl.dot(tile.to(dot_dtype), tl.trans(weight), sums, input_precision=precision)
        squares += x_squares
    if single_row:  # every row of the product holds the same sums: row 0, and a 1-D epilogue
        first = tl.arange(0, dot_rows)[:, None] == 0
        out = tl.sum(tl.where(first, sums, 0.0), axis=0)  # adding zeros: row 0 exactly
        row_factor = tl.sqrt(tl.sum(squares, axis=0) / in_features + eps)
        out_ptrs, out_ok = out_ptr + features, feature_ok
    else:  # 2-D, each output row its own 1 / rms
        out, features, feature_ok = sums, features[None, :], feature_ok[None, :]
        row_factor = tl.sqrt(squares / in_features + eps)[:, None]
        out_ptrs, out_ok = out_ptr + rows * out_row_stride + features, row_ok & feature_ok
    if has_weight_scale:
        out *= tl.load(weight_scale_ptr + features, mask=feature_ok, other=0.0)
    if prologue == 1 or prologue == 2:
        out = out / row_factor
    if has_bias:
        out += tl.load(bias_ptr + features, mask=feature_ok, other=0.0).to(tl.float32)
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_ok)


def launch_tensor_core_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    block: tuple[int, int, int, int],
    prologue: int,
    pdl: bool,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    new_residual: torch.Tensor | None = None,
    eps: float = 0.0,
    unit_offset: bool = False,
) -> None:
    """``out`` ``[M, N]`` from ``x`` ``[M, K]`` (M <= 32) and ``weight`` (checked by the caller), 8-bit with
    its ``weight_scale`` or of x's dtype; ``block``: (block_n, block_k, num_warps, num_stages), made
    smaller for float32 inputs, whose dots take twice the registers."""
    block_n, block_k, num_warps, num_stages = block
    block_n, block_k = max(block_n, 16), max(block_k, 16)  # a dot's smallest N and K
    if x.dtype == torch.float32:
        block_n, block_k = min(block_n, 64), min(block_k, 64)
    num_rows = x.shape[0]
    _tensor_core_gemv_kernel[(triton.cdiv(weight.shape[0], block_n),)](
        x,
        residual if residual is not None else x,
        norm_weight if norm_weight is not None else x,
        weight,
        weight_scale if weight_scale is not None else weight,
        bias if bias is not None else weight,
        out,
        new_residual if new_residual is not None else out,
        num_rows,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        new_residual.stride(0) if new_residual is not None else 0,
        out.stride(0),
        weight.shape[0],
        weight.shape[1],
        weight.stride(0),
        eps,
        prologue=prologue,
        unit_offset=unit_offset,
        has_bias=bias is not None,
        has_weight_scale=weight_scale is not None,
        single_row=num_rows == 1,
        dot_rows=max(DOT_ROWS, next_power_of_2(num_rows)),
        block_n=block_n,
        block_k=block_k,
        packed=x.dtype == torch.bfloat16 and x.is_cuda,
        # Triton's interpreter (CPU tensors) multiplies 16-bit dots wrongly; it gets the rounded tiles in
        # float32, whose products and sums are exact there.
        dot_dtype=_DOT_DTYPES[x.dtype] if x.is_cuda else tl.float32,
        precision="ieee" if x.dtype == torch.float32 else "tf32",
        pdl=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch_options(pdl),
    )
