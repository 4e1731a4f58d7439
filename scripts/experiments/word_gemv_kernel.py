"""Exploration for issue 18, not used by the engine (``word_gemv_ab.py`` patches it in): the one-row GEMV
of 8-bit weights (``kernels/gemv.py``) reading the weights four to a 32-bit word. Measured on the H200 it
was no faster (plain GEMVs) or slower (with prologues) than the byte-wise kernel; see
reports/gpu/quantized-llama-3.1-8b/gemv-variants/README.md.

Loaded as int8, the weights reach the kernel's arithmetic one per register: Triton sign-extends each byte
(a byte permute), then the conversion to float32 adds and subtracts a magic number, so every weight costs
two integer instructions and two float ones, and at one token per step the integer pipe, not the memory,
bounds the kernel (H200, Llama-3.1-8B's shapes: 2.2-3.0 TB/s where bfloat16 weights stream at 3.1-3.9).
Read as int32 words, the four weights of a word become four floats by one xor and four byte permutes
(the PTX below): a quarter of the integer work. Word ``j`` of a row holds input features ``4j .. 4j + 3``,
so the program keeps four product tiles, one per byte position, and loads the input at stride 4 for each
(the input is small and cached; the weights are streamed once).

The products, the prologues (``kernels/gemv_tiles.py``'s ``input_tile``), the scale per output row at the
end and PDL are those of ``_gemv_kernel``; only the order in which a row's products are summed differs.
"""

import torch
import triton
import triton.language as tl

from tokenmill.kernels.gemv_tiles import input_tile, weight_tile
from tokenmill.kernels.launch import launch_options, wait_for_previous_kernel

# Byte i of the word, its top bit flipped (the code plus 128, unsigned), put under the exponent bits of
# 2**23: the float 2**23 + 128 + code, exactly; the kernel subtracts 2**23 + 128.
INT8_WORD_TO_FLOATS_PTX = tl.constexpr("""{
.reg .b32 u, m;
xor.b32 u, $4, 0x80808080;
mov.b32 m, 0x4B000000;
prmt.b32 $0, u, m, 0x7440;
prmt.b32 $1, u, m, 0x7441;
prmt.b32 $2, u, m, 0x7442;
prmt.b32 $3, u, m, 0x7443;
}""")
BIAS = tl.constexpr(8388736.0)  # 2**23 + 128

# e4m3 (s eeee mmm, bias 7), two bytes at a time: prmt 0x9180 / 0xB3A2 sign-extends bytes 0, 1 (2, 3) into
# 16-bit lanes; shifted left 4 and masked with 0x87F0 each lane holds the sign, eeee in the low bits of
# an 8-bit exponent field and mmm0000: the bfloat16 of the value times 2**-120 (biases 7 and 127),
# subnormals included, whose float32 is the lane moved to the top half. The kernel multiplies by 2**120.
E4M3_WORD_TO_FLOATS_PTX = tl.constexpr("""{
.reg .b32 a, b, z;
mov.b32 z, 0;
prmt.b32 a, $4, z, 0x9180;
prmt.b32 b, $4, z, 0xB3A2;
shl.b32 a, a, 4;
shl.b32 b, b, 4;
and.b32 a, a, 0x87F087F0;
and.b32 b, b, 0x87F087F0;
shl.b32 $0, a, 16;
and.b32 $1, a, 0xFFFF0000;
shl.b32 $2, b, 16;
and.b32 $3, b, 0xFFFF0000;
}""")
E4M3_SCALE = tl.constexpr(1.329227995784916e36)  # 2**120


@triton.jit
def _biased_byte(words: tl.tensor, byte: tl.constexpr) -> tl.tensor:
    """What the PTX forms for byte ``byte``, in plain Triton (the CPU interpreter runs no PTX)."""
    code = (words >> (8 * byte)) & 0xFF
    return ((code ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _scaled_e4m3_byte(words: tl.tensor, byte: tl.constexpr) -> tl.tensor:
    """What the e4m3 PTX forms for byte ``byte`` (the value times 2**-120), in plain Triton."""
    code = (words >> (8 * byte)) & 0xFF
    return (((code & 0x80) << 24) | ((code & 0x7F) << 20)).to(tl.float32, bitcast=True)


@triton.jit
def _words_to_floats(
    words: tl.tensor, float8: tl.constexpr, packed: tl.constexpr
) -> tuple[tl.tensor, tl.tensor, tl.tensor, tl.tensor]:
    """The four weights of each word (int8, or e4m3 with ``float8``) in float32, exactly."""
    if packed:
        b0, b1, b2, b3 = tl.inline_asm_elementwise(
            E4M3_WORD_TO_FLOATS_PTX if float8 else INT8_WORD_TO_FLOATS_PTX,
            "=r,=r,=r,=r,r",
            [words],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
    elif float8:
        b0 = _scaled_e4m3_byte(words, 0)
        b1 = _scaled_e4m3_byte(words, 1)
        b2 = _scaled_e4m3_byte(words, 2)
        b3 = _scaled_e4m3_byte(words, 3)
    else:
        b0 = _biased_byte(words, 0)
        b1 = _biased_byte(words, 1)
        b2 = _biased_byte(words, 2)
        b3 = _biased_byte(words, 3)
    if float8:
        return b0 * E4M3_SCALE, b1 * E4M3_SCALE, b2 * E4M3_SCALE, b3 * E4M3_SCALE
    return b0 - BIAS, b1 - BIAS, b2 - BIAS, b3 - BIAS


@triton.jit
def _word_gemv_kernel(
    x_ptr: tl.tensor,
    residual_ptr: tl.tensor,
    norm_weight_ptr: tl.tensor,
    word_ptr: tl.tensor,
    weight_scale_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    out_ptr: tl.tensor,
    new_residual_ptr: tl.tensor,
    out_features: int,
    in_features: int,
    word_row_stride: int,
    eps: float,
    prologue: tl.constexpr,
    unit_offset: tl.constexpr,
    has_bias: tl.constexpr,
    block_n: tl.constexpr,
    block_words: tl.constexpr,
    float8: tl.constexpr,
    packed: tl.constexpr,
    pdl: tl.constexpr,
) -> None:
    program = tl.program_id(0)
    features = program * block_n + tl.arange(0, block_n)
    feature_ok = features < out_features
    written_cols = tl.where(program == 0, in_features, 0)  # the first program writes the residual
    word_rows = word_ptr + features.to(tl.int64)[:, None] * word_row_stride
    in_words = in_features // 4
    words = weight_tile(word_rows, feature_ok, 0, in_words, block_words)
    wait_for_previous_kernel(pdl)  # the weights are constants: only the activations wait for it
    p0 = tl.zeros([block_n, block_words], tl.float32)
    p1 = tl.zeros([block_n, block_words], tl.float32)
    p2 = tl.zeros([block_n, block_words], tl.float32)
    p3 = tl.zeros([block_n, block_words], tl.float32)
    squares = tl.zeros([block_words], tl.float32)
    for start in range(0, in_words, block_words):
        index = start + tl.arange(0, block_words)
        ok = index < in_words
        w0, w1, w2, w3 = _words_to_floats(words, float8, packed)
        x0, s0 = input_tile(x_ptr, residual_ptr, norm_weight_ptr, new_residual_ptr, 4 * index, ok,
                            written_cols, in_features, prologue, unit_offset)  # fmt: skip
        x1, s1 = input_tile(x_ptr, residual_ptr, norm_weight_ptr, new_residual_ptr, 4 * index + 1, ok,
                            written_cols, in_features, prologue, unit_offset)  # fmt: skip
        x2, s2 = input_tile(x_ptr, residual_ptr, norm_weight_ptr, new_residual_ptr, 4 * index + 2, ok,
                            written_cols, in_features, prologue, unit_offset)  # fmt: skip
        x3, s3 = input_tile(x_ptr, residual_ptr, norm_weight_ptr, new_residual_ptr, 4 * index + 3, ok,
                            written_cols, in_features, prologue, unit_offset)  # fmt: skip
        p0 += w0 * x0[None, :]
        p1 += w1 * x1[None, :]
        p2 += w2 * x2[None, :]
        p3 += w3 * x3[None, :]
        squares += (s0 + s1) + (s2 + s3)
        words = weight_tile(word_rows, feature_ok, start + block_words, in_words, block_words)
    out = tl.sum((p0 + p1) + (p2 + p3), axis=1)
    out *= tl.load(weight_scale_ptr + features, mask=feature_ok, other=0.0)
    if prologue == 1 or prologue == 2:
        out = out / tl.sqrt(tl.sum(squares, axis=0) / in_features + eps)
    if has_bias:
        out += tl.load(bias_ptr + features, mask=feature_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + features, out.to(out_ptr.dtype.element_ty), mask=feature_ok)


def reads_words(weight: torch.Tensor) -> bool:
    """Whether an 8-bit weight can be read as int32 words: whole words per row, rows word-aligned."""
    return (
        weight.dtype in (torch.int8, torch.float8_e4m3fn)
        and weight.shape[1] % 4 == 0
        and weight.stride(0) % 4 == 0
        and weight.data_ptr() % 4 == 0
    )


def launch_word_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    block: tuple[int, int, int, int],
    prologue: int,
    in_features: int,
    pdl: bool,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    new_residual: torch.Tensor | None = None,
    eps: float = 0.0,
    unit_offset: bool = False,
) -> None:
    """``out`` ``[1, N]`` from ``x`` and an 8-bit ``weight`` that :func:`reads_words` (checked by the
    caller); ``block``: ``(block_n, block_k, num_warps, num_stages)``, ``block_k`` in weights."""
    block_n, block_k, num_warps, num_stages = block
    words = weight.view(torch.int32)
    _word_gemv_kernel[(triton.cdiv(weight.shape[0], block_n),)](
        x,
        residual if residual is not None else x,
        norm_weight if norm_weight is not None else x,
        words,
        weight_scale,
        bias if bias is not None else weight_scale,
        out,
        new_residual if new_residual is not None else out,
        weight.shape[0],
        in_features,
        words.stride(0),
        eps,
        prologue=prologue,
        unit_offset=unit_offset,
        has_bias=bias is not None,
        block_n=block_n,
        block_words=max(block_k // 4, 1),
        float8=weight.dtype == torch.float8_e4m3fn,
        packed=x.is_cuda,
        pdl=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch_options(pdl),
    )
