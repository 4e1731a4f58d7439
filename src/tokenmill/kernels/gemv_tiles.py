"""The tiles the one-row GEMV kernels share (``kernels/gemv.py`` on CUDA cores,
``kernels/gemv_tensor_core.py`` on tensor cores): the input transformed by the projection's prologue as it
is loaded, and the weight rows streamed one step ahead of their use."""

import triton
import triton.language as tl


@triton.jit
def input_tile(
    x_ptr: tl.tensor,
    residual_ptr: tl.tensor,
    norm_weight_ptr: tl.tensor,
    new_residual_ptr: tl.tensor,
    cols: tl.tensor,
    col_ok: tl.tensor,
    written_cols: tl.tensor,
    in_features: int,
    prologue: tl.constexpr,
    unit_offset: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    """Columns ``cols`` of the transformed input in float32 (before the ``1 / rms`` factor for the norm
    prologues), and their squares' contribution to the sum of squares (zero without a norm)."""
    x = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
    dtype = x.dtype
    squares = tl.zeros(cols.shape, tl.float32)
    if prologue == 1 or prologue == 2:
        if prologue == 2:
            x = (x.to(tl.float32) + tl.load(residual_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)).to(
                dtype
            )
            tl.store(new_residual_ptr + cols, x, mask=col_ok & (cols < written_cols))
        x32 = x.to(tl.float32)
        squares = x32 * x32
        weight = tl.load(norm_weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        out = x32 * (1.0 + weight) if unit_offset else x32 * weight
    elif prologue == 3 or prologue == 4:
        up = tl.load(x_ptr + in_features + cols, mask=col_ok, other=0.0)
        g = x.to(tl.float32)
        if prologue == 3:
            activated = g * tl.sigmoid(g)
        else:  # gelu_tanh(g) = g * sigmoid(2u), u = sqrt(2/pi) * (g + 0.044715 g^3)
            activated = g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
        out = (activated.to(dtype).to(tl.float32) * up.to(tl.float32)).to(dtype).to(tl.float32)
    else:
        out = x.to(tl.float32)
    return out, squares


@triton.jit
def as_float32(weight: tl.tensor) -> tl.tensor:
    """The weight tile in float32, for e4m3 weights times ``2**-120`` (a sum of their products is multiplied
    by :func:`float32_factor` once). 8-bit weights convert through integer and float operations, not the
    conversion instructions, which run at 16 per clock per SM on Hopper, below the ~18 bytes per clock per
    SM the memory delivers (on the H200 this took the int8 GEMV from 3.0 to 3.1 TB/s on gate/up and from
    9.7 to 8.7 µs on q/k/v of Llama-3.1-8B; the 8-bit GEMV stays below bfloat16's 4 TB/s all the same).

    int8 ``v``: the float with bits ``0x4B000000 + (v + 128)`` is ``2**23 + v + 128``, exactly.
    float8 e4m3 (bias 7): the code sign-extended to 32 bits and shifted left by 20 has the sign at bit 31
    and the exponent and mantissa bits at float32's places (bits 26-20) once the sign's copies at bits
    27-30 are masked off: the value times ``2**-120`` (float32's bias is 127), subnormals included."""
    if weight.dtype == tl.int8:
        biased = weight.to(tl.int32) + 0x4B000080
        return biased.to(tl.float32, bitcast=True) - 8388736.0
    elif weight.dtype == tl.float8e4nv:
        extended = weight.to(tl.int8, bitcast=True).to(tl.int32)
        return ((extended << 20) & -0x78100000).to(tl.float32, bitcast=True)  # mask 0x87F00000
    else:
        return weight.to(tl.float32)


@triton.jit
def float32_factor(weight_dtype: tl.constexpr) -> tl.constexpr:
    """The factor of a sum of :func:`as_float32` products: ``2**120`` for e4m3 weights, else 1 (a power of
    two: multiplying by it once rounds nothing)."""
    if weight_dtype == tl.float8e4nv:
        return 1.329227995784916e36
    else:
        return 1.0


@triton.jit
def weight_tile(
    weight_rows: tl.tensor, feature_ok: tl.tensor, start: int, in_features: int, block_k: tl.constexpr
) -> tl.tensor:
    """Columns ``[start, start + block_k)`` of the program's weight rows (past the last column the mask
    reads nothing); the CUDA-core kernel loads each one a step ahead of its use."""
    cols = start + tl.arange(0, block_k)
    return tl.load(
        weight_rows + cols[None, :],
        mask=feature_ok[:, None] & (cols < in_features)[None, :],
        other=0.0,
        eviction_policy="evict_first",  # read once; keep the activations in cache instead
    )
