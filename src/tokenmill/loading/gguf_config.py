"""GGUF metadata as a Hugging Face config: the keys llama.cpp's converter writes under an architecture prefix
(``llama.embedding_length`` ...) read back, typed and checked, into the ``config.json`` fields tokenmill's
config parsers take, per architecture (Llama family and Qwen, Gemma 3, GPT-2). Llama 3 rope scaling,
which llama.cpp stores as a tensor of frequency divisors, is recovered from that tensor."""

from pathlib import Path
from typing import Any

import torch

from tokenmill.errors import ModelLoadError
from tokenmill.loading.gguf_file import GGUFFile
from tokenmill.models.config import RopeConfig
from tokenmill.models.layers.rotary import inverse_frequencies

ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's encoding of Llama 3 rope scaling, read into the config
# Llama 3.x rope scaling: only ``factor`` differs between models, and rope_freqs carries it.
_LLAMA3_ROPE_BANDS: dict[str, Any] = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_GEMMA3_27B_LAYERS = 62
_YARN_UNREAD = ("attn_factor", "yarn_attn_factor", "yarn_ext_factor", "yarn_log_multiplier")


class GGUFMetadata:
    """Typed access to GGUF metadata; ``arch_*`` read keys under the architecture prefix (``llama.``)."""

    def __init__(self, values: dict[str, Any], path: Path) -> None:
        self.values = values
        self.path = path
        self.arch = str(self.require("general.architecture"))

    def error(self, message: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: {message}")

    def require(self, key: str) -> Any:
        if key not in self.values:
            raise self.error(f"GGUF metadata lacks the required key '{key}'")
        return self.values[key]

    def get(self, key: str) -> Any:
        return self.values.get(key)

    def arch_int(self, key: str) -> int:
        full_key = f"{self.arch}.{key}"
        value = self.require(full_key)
        if isinstance(value, list) and value and all(v == value[0] for v in value):
            value = value[0]  # a per-layer list that is uniform
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.error(f"GGUF metadata '{full_key}' must be a positive integer, got {value!r}")
        return value

    def arch_float(self, key: str) -> float:
        full_key = f"{self.arch}.{key}"
        value = self.require(full_key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(f"GGUF metadata '{full_key}' must be a number, got {value!r}")
        return float(value)

    def optional_arch_int(self, key: str) -> int | None:
        return self.arch_int(key) if f"{self.arch}.{key}" in self.values else None

    def optional_arch_float(self, key: str) -> float | None:
        return self.arch_float(key) if f"{self.arch}.{key}" in self.values else None

    def token_id(self, name: str) -> int | None:
        value = self.get(f"tokenizer.ggml.{name}_token_id")
        return value if isinstance(value, int) else None


def present(config: dict[str, Any]) -> dict[str, Any]:
    """Drop absent optional values, so the config parser applies its own defaults."""
    return {key: value for key, value in config.items() if value is not None}


def _decoder_config(meta: GGUFMetadata, file: GGUFFile) -> dict[str, Any]:
    """Fields shared by the rotary, RMSNorm decoders (Llama family, Qwen, Gemma)."""
    hidden = meta.arch_int("embedding_length")
    heads = meta.arch_int("attention.head_count")
    head_dim = meta.optional_arch_int("attention.key_length") or hidden // heads
    theta = meta.optional_arch_float("rope.freq_base")
    rotary_dim = meta.optional_arch_int("rope.dimension_count")
    if rotary_dim is not None and rotary_dim != head_dim:
        raise meta.error(
            f"partial rotary embeddings ({rotary_dim} of {head_dim} head dims) are not supported"
        )
    return present(
        {
            "hidden_size": hidden,
            "intermediate_size": meta.arch_int("feed_forward_length"),
            "num_hidden_layers": meta.arch_int("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": meta.optional_arch_int("attention.head_count_kv"),
            "head_dim": head_dim,
            "max_position_embeddings": meta.arch_int("context_length"),
            "rms_norm_eps": meta.arch_float("attention.layer_norm_rms_epsilon"),
            "rope_theta": theta,
            "rope_scaling": _rope_scaling(meta, file, theta or 10000.0, head_dim),
        }
    )


def _rope_scaling(meta: GGUFMetadata, file: GGUFFile, theta: float, head_dim: int) -> dict[str, Any] | None:
    if ROPE_FREQS in file.tensors:
        return _llama3_rope_scaling(meta, file, theta, head_dim)
    rope_type = meta.get(f"{meta.arch}.rope.scaling.type")
    if rope_type in (None, "none"):
        return None
    # Types the config parser does not run are passed on for it to reject by name.
    scaling = {"rope_type": rope_type, "factor": meta.arch_float("rope.scaling.factor")}
    return scaling | _yarn_scaling(meta) if rope_type == "yarn" else scaling


def _yarn_scaling(meta: GGUFMetadata) -> dict[str, Any]:
    """YaRN's context and band edges; llama.cpp's further YaRN knobs have no transformers equivalent here."""
    for key in _YARN_UNREAD:
        if f"{meta.arch}.rope.scaling.{key}" in meta.values:
            raise meta.error(f"YaRN rope scaling with '{meta.arch}.rope.scaling.{key}' is not supported")
    return present(
        {
            "original_max_position_embeddings": meta.optional_arch_int(
                "rope.scaling.original_context_length"
            ),
            "beta_fast": meta.optional_arch_float("rope.scaling.yarn_beta_fast"),
            "beta_slow": meta.optional_arch_float("rope.scaling.yarn_beta_slow"),
        }
    )


def _llama3_rope_scaling(meta: GGUFMetadata, file: GGUFFile, theta: float, head_dim: int) -> dict[str, Any]:
    """llama.cpp stores Llama 3 rope scaling as the divisor of each rotary frequency; recover the
    parameters (only ``factor`` varies across Llama 3.x) and check they reproduce every divisor."""
    divisors = torch.from_numpy(file.read_float32(file.tensors[ROPE_FREQS]))
    rope = RopeConfig(theta, "llama3", float(divisors.max()), **_LLAMA3_ROPE_BANDS)
    plain = inverse_frequencies(RopeConfig(theta), head_dim)
    scaled = inverse_frequencies(rope, head_dim)
    if divisors.shape != plain.shape or not torch.allclose(plain / scaled, divisors, rtol=1e-4):
        raise meta.error(f"tensor '{ROPE_FREQS}' is not a Llama 3 rope scaling this loader can reproduce")
    return {"rope_type": "llama3", "factor": rope.factor, **_LLAMA3_ROPE_BANDS}


def llama_config(meta: GGUFMetadata, file: GGUFFile) -> dict[str, Any]:
    return {
        **_decoder_config(meta, file),
        "attention_bias": "blk.0.attn_q.bias" in file.tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in file.tensors,
    }


# Gemma 3 settings that GGUF files may not carry (llama.cpp hard-codes them); metadata wins where present.
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "sliding_window_pattern": 6,  # five sliding-window layers, then one global layer
    "rope_local_base_freq": 10000.0,
    "hidden_activation": "gelu_pytorch_tanh",
}


def gemma3_config(meta: GGUFMetadata, file: GGUFFile) -> dict[str, Any]:
    config = _decoder_config(meta, file)
    # Gemma 3 27B scales attention by hidden/heads (168) rather than by the head dim (128).
    is_27b = config["num_hidden_layers"] == _GEMMA3_27B_LAYERS
    scalar = config["hidden_size"] // config["num_attention_heads"] if is_27b else config["head_dim"]
    config |= {
        "query_pre_attn_scalar": scalar,
        "sliding_window": meta.arch_int("attention.sliding_window"),
        "rope_local_base_freq": meta.optional_arch_float("rope.freq_base_swa"),
        "final_logit_softcapping": meta.optional_arch_float("final_logit_softcapping"),
        **_sliding_layout(meta),
    }
    return {**_GEMMA3_DEFAULTS, **present(config)}


def _sliding_layout(meta: GGUFMetadata) -> dict[str, Any]:
    """``{arch}.attention.sliding_window_pattern``: every n-th layer global, or one flag per layer."""
    pattern = meta.get(f"{meta.arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        return {"layer_types": ["sliding_attention" if sliding else "full_attention" for sliding in pattern]}
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        return {"sliding_window_pattern": pattern}
    return {}


def gpt2_config(meta: GGUFMetadata, file: GGUFFile) -> dict[str, Any]:
    return {
        "n_embd": meta.arch_int("embedding_length"),
        "n_inner": meta.arch_int("feed_forward_length"),
        "n_layer": meta.arch_int("block_count"),
        "n_head": meta.arch_int("attention.head_count"),
        "n_positions": meta.arch_int("context_length"),
        "layer_norm_epsilon": meta.arch_float("attention.layer_norm_epsilon"),
    }
