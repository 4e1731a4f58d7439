"""Tiny random Hugging Face models of every supported architecture, saved as safetensors folders.

transformers builds and saves them; it is the independent reference tokenmill's own forward code is
compared against.
"""

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

VOCAB = 384
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def tiny_configs() -> dict[str, PretrainedConfig]:
    """One small config per architecture, each exercising that family's options."""
    llama3_scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return {
        "llama3": LlamaConfig(**_COMMON, rope_scaling=llama3_scaling, rope_theta=500000.0),
        "llama-tied": LlamaConfig(**_COMMON, tie_word_embeddings=True, attention_bias=True),
        "mistral": MistralConfig(**_COMMON, sliding_window=24),
        "qwen2": Qwen2Config(**_COMMON),
        "qwen3": Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=True),
        "gemma3": Gemma3TextConfig(
            **_COMMON,
            head_dim=32,
            sliding_window=16,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
        "gpt2": GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=512, bos_token_id=1, eos_token_id=2
        ),
    }


_SIX_HEADS: dict[str, Any] = {
    **_COMMON,
    "hidden_size": 96,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
}


def head_split_configs() -> dict[str, PretrainedConfig]:
    """Llama configs whose heads split over 3 tensor-parallel ranks: KV heads sharded (3) or, fewer than
    the ranks, replicated (1)."""
    return {
        "llama-6h-3kv": LlamaConfig(**{**_SIX_HEADS, "num_key_value_heads": 3}),
        "llama-6h-1kv": LlamaConfig(**{**_SIX_HEADS, "num_key_value_heads": 1}),
    }


def save_tiny_model(
    name: str, folder: Path, seed: int = 0, max_shard_size: str | None = None
) -> torch.nn.Module:
    """Build the tiny model (of :func:`tiny_configs` or :func:`head_split_configs`) with weights perturbed
    away from their init (norms included), save it."""
    config = {**tiny_configs(), **head_split_configs()}[name]
    return save_random_model(config, folder, seed, max_shard_size)


def save_random_model(
    config: PretrainedConfig,
    folder: Path,
    seed: int = 0,
    max_shard_size: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """A model of ``config`` with every weight (norms included) moved off its init, saved as safetensors in
    ``dtype``; returned in float32."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(dtype).save_pretrained(folder, **kwargs)
    return model.float()
