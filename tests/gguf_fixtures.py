"""Tiny Hugging Face models written out as GGUF files the way llama.cpp's converter writes them.

The GGUF loader must undo each llama.cpp convention; this writer applies them, independently of the loader:
q/k rows permuted for interleaved rotary on the ``llama`` architecture, Gemma norm weights stored as
``1 + w``, GPT-2's Conv1D weights transposed (and its tied output head written out), and Llama 3 rope
scaling stored as a ``rope_freqs`` tensor of per-frequency divisors. Metadata keys come from gguf-py's
writer helpers, so their spelling is gguf-py's, not the loader's.
"""

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from transformers import PretrainedConfig

from tiny_models import save_random_model, tiny_configs

# tiny model name → GGUF architecture; Mistral is left out (its sliding window has no GGUF llama key).
GGUF_ARCH = {
    "llama3": "llama",
    "llama-tied": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3",
    "gpt2": "gpt2",
}

_GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "transformer.wte": "token_embd",
    "transformer.wpe": "position_embd",
    "transformer.ln_f": "output_norm",
}
_LLAMA_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_LAYER_NAMES = {
    "llama": _LLAMA_LAYER_NAMES,
    "qwen2": _LLAMA_LAYER_NAMES,
    "qwen3": _LLAMA_LAYER_NAMES,
    "gemma3": {
        **_LLAMA_LAYER_NAMES,
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
    "gpt2": {
        "ln_1": "attn_norm",
        "attn.c_attn": "attn_qkv",
        "attn.c_proj": "attn_output",
        "ln_2": "ffn_norm",
        "mlp.c_fc": "ffn_up",
        "mlp.c_proj": "ffn_down",
    },
}
_GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def tiny_gguf_config(name: str) -> PretrainedConfig:
    """The tiny config, restricted to what GGUF can state."""
    config = tiny_configs()[name]
    if name == "llama3":  # llama.cpp's rope_freqs only encodes Llama 3.x's own band edges
        config.rope_parameters["original_max_position_embeddings"] = 8192
        config.max_position_embeddings = 16384
    if name == "gemma3":  # GGUF has no query_pre_attn_scalar; llama.cpp uses the head dim
        config.query_pre_attn_scalar = config.head_dim
    return config


def save_hf_model(config: PretrainedConfig, folder: Path, seed: int = 0) -> torch.nn.Module:
    """A random model with every weight (norms included) moved off its init, saved as safetensors."""
    return save_random_model(config, folder, seed)


_PROJECTIONS = re.compile(r"blk\.\d+\.(attn_(q|k|v|output)|ffn_(gate|up|down))\.weight")
_HEADS = ("token_embd.weight", "output.weight")


def write_gguf(
    model: torch.nn.Module,
    arch: str,
    path: Path,
    qtype: gguf.GGMLQuantizationType | None = None,
    head_qtype: gguf.GGMLQuantizationType | None = None,
    extra_metadata: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    """``qtype``: store the projection weights in that format (gguf-py quantizes them), as llama.cpp's
    quantized files do; ``head_qtype``: the embedding and output head too (llama.cpp's files keep them
    in Q8_0 / Q6_K); everything else stays float32. ``extra_metadata`` adds keys of its own."""
    config: Any = model.config
    writer = gguf.GGUFWriter(path, arch)
    _write_metadata(writer, arch, config)
    if extra_metadata is not None:
        extra_metadata(writer)
    for name, array in _gguf_tensors(model, arch):
        wanted = qtype if _PROJECTIONS.fullmatch(name) else head_qtype if name in _HEADS else None
        if wanted is not None:
            raw = gguf.quants.quantize(np.ascontiguousarray(array), wanted)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=wanted)
            continue
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_metadata(writer: gguf.GGUFWriter, arch: str, config: Any) -> None:
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    if arch == "gpt2":
        writer.add_embedding_length(config.n_embd)
        writer.add_feed_forward_length(config.n_inner or 4 * config.n_embd)
        writer.add_block_count(config.n_layer)
        writer.add_head_count(config.n_head)
        writer.add_context_length(config.n_positions)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
        return
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    if getattr(config, "head_dim", None):  # as llama.cpp: only when the HF config states it
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    _write_rope(writer, config.rope_parameters)
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config.layer_types])
        writer.add_rope_freq_base_swa(config.rope_parameters["sliding_attention"]["rope_theta"])


def _write_rope(writer: gguf.GGUFWriter, rope: dict[str, Any]) -> None:
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope["rope_type"] == "yarn":  # as llama.cpp's converter writes Qwen's yarn
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def _gguf_tensors(model: torch.nn.Module, arch: str) -> list[tuple[str, np.ndarray]]:
    config: Any = model.config
    tensors = []
    for hf_name, tensor in model.state_dict().items():
        name = _gguf_name(hf_name, arch)
        if name is None or (name == "output.weight" and config.tie_word_embeddings):
            continue
        tensors.append((name, _llama_cpp_layout(hf_name, tensor.float(), arch, config).numpy()))
    if arch == "gpt2":  # llama.cpp's converter writes GPT-2's tied head out as its own tensor
        tensors.append(("output.weight", model.state_dict()["transformer.wte.weight"].numpy()))
    if getattr(config, "rope_parameters", {}).get("rope_type") == "llama3":
        tensors.append(("rope_freqs.weight", llama3_rope_divisors(config.rope_parameters, config.head_dim)))
    return tensors


def _gguf_name(hf_name: str, arch: str) -> str | None:
    module, kind = hf_name.rsplit(".", 1)
    if module in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[module]}.{kind}"
    match = re.fullmatch(r"(?:model\.layers|transformer\.h)\.(\d+)\.(.+)", module)
    if match is None or match[2] not in _LAYER_NAMES[arch]:
        return None  # buffers such as GPT-2's causal mask
    return f"blk.{match[1]}.{_LAYER_NAMES[arch][match[2]]}.{kind}"


def _llama_cpp_layout(hf_name: str, tensor: torch.Tensor, arch: str, config: Any) -> torch.Tensor:
    if arch == "llama" and re.search(r"\.(q|k)_proj\.", hf_name):
        heads = config.num_attention_heads if ".q_proj." in hf_name else config.num_key_value_heads
        return _interleave_rotary_rows(tensor, heads)
    if arch == "gemma3" and hf_name.endswith("norm.weight"):
        return tensor + 1
    if arch == "gpt2" and hf_name.endswith(_GPT2_CONV1D):
        return tensor.t().contiguous()
    return tensor


def _interleave_rotary_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's permutation: per head, the rows of the two rotary halves are interleaved."""
    head_dim = weight.shape[0] // heads
    halves = weight.reshape(heads, 2, head_dim // 2, *weight.shape[1:])
    return halves.transpose(1, 2).reshape(weight.shape)


def llama3_rope_divisors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """What llama.cpp's converter stores as ``rope_freqs``: each rotary frequency's Llama 3 divisor."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    divisors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelength < old_context / high:
            divisors.append(1.0)
        elif wavelength > old_context / low:
            divisors.append(factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)
