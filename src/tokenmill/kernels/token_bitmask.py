"""Structured outputs' token mask in one pass: ``[B, V]`` logits and a ``[B, ceil(V/32)]`` int32 bitmask in,
the logits with every token whose bit is clear set to -inf out.

One program per (row, block of columns): it loads its block's logits and the words that hold their bits
and writes the masked block, so the logits are read and written once (the PyTorch reference,
``tokenmill.structured.bitmask.apply_token_bitmask``, expands the bits into a ``[B, V]`` mask first).
The grid depends on B and V only.
"""

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import cdiv, require_unit_last_stride

BLOCK_V = 4096


@triton.jit(do_not_specialize=["num_rows"])
def _apply_bitmask_kernel(
    logits_ptr: tl.tensor,
    bitmask_ptr: tl.tensor,
    out_ptr: tl.tensor,
    num_rows: int,
    vocab: int,
    logits_stride: int,
    bitmask_stride: int,
    out_stride: int,
    block: tl.constexpr,
) -> None:
    row = tl.program_id(0)
    cols = tl.program_id(1) * block + tl.arange(0, block)
    in_row = cols < vocab
    words = tl.load(bitmask_ptr + row * bitmask_stride + cols // 32, mask=in_row, other=0)
    allowed = ((words >> (cols % 32)) & 1) != 0
    logits = tl.load(logits_ptr + row * logits_stride + cols, mask=in_row, other=0.0)
    masked = tl.where(allowed, logits, float("-inf"))
    tl.store(out_ptr + row * out_stride + cols, masked, mask=in_row)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[B, V]`` (float32) with the tokens whose bit is clear in ``bitmask`` ``[>= B, >=
    ceil(V/32)]`` (int32) set to -inf: a new tensor."""
    num_rows, vocab = logits.shape
    if bitmask.dtype != torch.int32 or bitmask.shape[0] < num_rows or bitmask.shape[1] < cdiv(vocab, 32):
        raise ValueError(
            f"a bitmask of {tuple(bitmask.shape)} {bitmask.dtype} cannot mask {num_rows} x {vocab}"
        )
    require_unit_last_stride("logits", logits)
    require_unit_last_stride("bitmask", bitmask)
    out = torch.empty_like(logits)
    if num_rows == 0 or vocab == 0:
        return out
    grid = (num_rows, cdiv(vocab, BLOCK_V))
    _apply_bitmask_kernel[grid](
        logits,
        bitmask,
        out,
        num_rows,
        vocab,
        logits.stride(0),
        bitmask.stride(0),
        out.stride(0),
        block=BLOCK_V,
        num_warps=4,
    )
    return out
