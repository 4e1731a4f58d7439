"""GGUF tensors a checkpoint yields packed under ``quantization="gguf"``, and llama.cpp's q/k row
permutation undone (on float rows, or on blocks by reordering whole rows).

Only projection weights (``*_proj.weight``: q/k/v, o, gate/up, down) in a format the packed kernel reads
stay as blocks; embeddings, norms, the LM head, and F32/F16 tensors are dequantized as before, since
their layers take float weights. GPT-2's projections are stored transposed for HF's Conv1D and stay float
too (a ``gguf`` layer then refuses them by name).
"""

import torch

from tokenmill.loading.gguf_file import GGUFFile, GGUFTensorInfo
from tokenmill.quantization.gguf_blocks import SUPPORTED_QTYPES, GGUFBlocks


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's q/k row permutation. Within each head it interleaves the two rotary halves
    (row ``i`` of the first half, then row ``i`` of the second); put the halves back one after the other."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def keeps_packed(hf_name: str, info: GGUFTensorInfo, transposed: bool) -> bool:
    """Whether the tensor ``info``, loaded as ``hf_name``, is yielded as blocks."""
    return (
        (hf_name.endswith("_proj.weight") or hf_name == "lm_head.weight")
        and not transposed
        and len(info.shape) == 2
        and info.qtype in SUPPORTED_QTYPES
    )


def projection_blocks(file: GGUFFile, info: GGUFTensorInfo, permuted_heads: int | None) -> GGUFBlocks:
    """The tensor's stored blocks in Hugging Face row order (``permuted_heads``: the heads of a q/k
    tensor llama.cpp permuted, whose rows are put back; None: as stored). No float copy is made."""
    rows, cols = info.shape
    blocks = GGUFBlocks(file.read_blocks(info), info.qtype, rows, cols)
    if permuted_heads is None:
        return blocks
    return blocks.take_rows(unpermute_rotary_rows(torch.arange(rows), permuted_heads))
