"""The packed projections put into a loaded float32 model, for measuring them end to end before the
``gguf`` quantization method exists: every linear layer of a GGUF model on one rank (llama and Gemma 3
naming) gets the packed copy of its weight, checked bit for bit against the float32 weight it replaces,
as its bound path. A benchmark device, not the integration: the float32 weights stay loaded beside the
codes.
"""

from functools import partial

import torch
from torch import nn

from tokenmill.loading.gguf_checkpoint import GGUFCheckpoint, unpermute_rotary_rows
from tokenmill.loading.gguf_file import GGUFFile
from tokenmill.models.layers.linear import LinearProjection
from tokenmill.quantization.gguf_blocks import GGUFBlocks
from tokenmill.quantization.gguf_packed import PackedRows, PackedWeight, pack_parts

# Module name suffix -> the GGUF tensor stems stacked into its weight.
_STEMS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


def _blocks(file: GGUFFile, name: str, heads: int | None) -> GGUFBlocks:
    info = file.tensors[name]
    blocks = GGUFBlocks(file.read_blocks(info), info.qtype, *info.shape)
    if heads is None:
        return blocks
    return blocks.take_rows(unpermute_rotary_rows(torch.arange(blocks.rows), heads))


def _tensor_names(module_name: str, file: GGUFFile) -> list[str]:
    if module_name == "lm_head":
        return ["output.weight" if "output.weight" in file.tensors else "token_embd.weight"]
    layer, suffix = module_name.removeprefix("model.layers.").split(".", 1)
    return [f"blk.{layer}.{stem}.weight" for stem in _STEMS[suffix]]


def _packed_forward(
    module: LinearProjection, packed: PackedWeight | PackedRows, x: torch.Tensor
) -> torch.Tensor:
    return packed.linear(x, module.local_bias())


def swap_in_packed(model: nn.Module, checkpoint: GGUFCheckpoint) -> int:
    """Bind every projection of ``model`` to its packed GGUF weight; returns how many were swapped."""
    file, config = checkpoint.file, checkpoint.hf_config()
    heads: dict[str, int] = {}
    if checkpoint.spec.permuted_qk:  # llama.cpp interleaved these rows for its rotary layout
        heads["attn_q"] = config["num_attention_heads"]
        heads["attn_k"] = config.get("num_key_value_heads", heads["attn_q"])
    swapped = 0
    for name, module in model.named_modules():
        if not isinstance(module, LinearProjection):
            continue
        names = _tensor_names(name, file)
        parts = [_blocks(file, n, heads.get(n.split(".")[-2])) for n in names]
        packed = pack_parts(parts)
        if not torch.equal(packed.dequantize(), module.weight):
            raise AssertionError(f"{name}: the packed weight is not the float32 weight it replaces")
        module._project = module._matmul = partial(_packed_forward, module, packed)
        swapped += 1
    return swapped
