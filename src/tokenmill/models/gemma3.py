"""Gemma 3 (text): Llama-like blocks with these differences, each visible below:

- embeddings scaled by ``sqrt(hidden_size)``; RMSNorm scales by ``1 + w``; GeGLU (GELU-tanh) MLP;
- norms before *and after* attention and the MLP (four per block), plus RMSNorm on each q and k head;
- softmax scale ``query_pre_attn_scalar ** -0.5``;
- sliding-window layers (window 512 on the small models) interleaved with global ones, five to one,
  the local layers using their own rope base (10k) and the global ones 1M (optionally scaled).
"""

from typing import Any

import torch
from torch import nn

from tokenmill.models.base import CausalLM
from tokenmill.models.config import ConfigReader, ModelConfig, RopeConfig
from tokenmill.models.layers import (
    GATED_ACTIVATIONS,
    ParallelLMHead,
    PreNormLinear,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
)
from tokenmill.models.llama import FUSED_QKV_GATE_UP, GatedMLP, QKNormAttention, gated_activation_name


def gemma3_layer_is_sliding(reader: ConfigReader, num_layers: int) -> list[bool]:
    types = reader.layer_types(num_layers)
    if types is not None:
        return [t == "sliding_attention" for t in types]
    pattern = reader.int_or("sliding_window_pattern", reader.int_or("_sliding_window_pattern", 6))
    return [(i + 1) % pattern != 0 for i in range(num_layers)]


def gemma3_ropes(reader: ConfigReader) -> tuple[RopeConfig, RopeConfig]:
    """(global rope, local rope): transformers 5's ``rope_parameters`` keyed by layer type, or transformers
    4's ``rope_theta`` (1M by default) and ``rope_scaling`` for the global layers and
    ``rope_local_base_freq`` (10k) for the local ones."""
    params = reader.raw.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:
        full, local = reader.rope_parameters(), {}
    local_theta = reader.float_or("rope_local_base_freq", 10000.0)
    return (
        reader.rope(full, default_theta=1000000.0, nested=True),
        reader.rope({"rope_theta": local_theta, **local}, default_theta=local_theta, nested=True),
    )


def parse_gemma3_config(raw: dict[str, Any], source: str) -> ModelConfig:
    r = ConfigReader(raw, source)
    if r.has("attn_logit_softcapping"):
        raise r.error(f"attn_logit_softcapping {raw['attn_logit_softcapping']!r} is not supported")
    if r.bool_or("use_bidirectional_attention", False):
        raise r.error(
            "use_bidirectional_attention (an encoder's attention) is not supported: attention is causal"
        )
    layers = r.require_int("num_hidden_layers")
    window = r.int_or("sliding_window", 4096)
    sliding = gemma3_layer_is_sliding(r, layers)
    rope, local_rope = gemma3_ropes(r)
    return ModelConfig(
        architecture="Gemma3ForCausalLM",
        vocab_size=r.require_int("vocab_size"),
        hidden_size=r.require_int("hidden_size"),
        intermediate_size=r.require_int("intermediate_size"),
        num_layers=layers,
        num_heads=r.require_int("num_attention_heads"),
        num_kv_heads=r.require_int("num_key_value_heads"),
        head_dim=r.int_or("head_dim", 256),
        max_position_embeddings=rope.context_length(r.int_or("max_position_embeddings", 131072)),
        norm_eps=r.float_or("rms_norm_eps", 1e-6),
        hidden_act=gated_activation_name(r, "hidden_activation", "gelu_pytorch_tanh"),
        tie_word_embeddings=r.bool_or("tie_word_embeddings", True),
        rope=rope,
        local_rope=local_rope,
        attention_scale=r.float_or("query_pre_attn_scalar", 256) ** -0.5,
        sliding_windows=tuple(window if s else None for s in sliding),
        qkv_bias=r.bool_or("attention_bias", False),
        output_bias=r.bool_or("attention_bias", False),
        bos_token_id=r.int_or("bos_token_id", 2),
        eos_token_ids=r.token_ids("eos_token_id"),
        raw=raw,
    )


class Gemma3Attention(QKNormAttention):
    """Per-head q and k norms, as Qwen3's, scaling by ``1 + w`` as every Gemma norm does."""

    norm_unit_offset = True


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.norm_eps
        self.self_attn = Gemma3Attention(config, layer_idx, rotary)
        self.mlp = GatedMLP(dim, config.intermediate_size, False, GATED_ACTIVATIONS[config.hidden_act]())
        self.input_layernorm = RMSNorm(dim, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(dim, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(dim, eps, unit_offset=True)
        # Each pre-norm runs with the projection after it, so that the two can run as one kernel. The
        # residual adds come after the post-norms, so no residual is fused into the pre-norms.
        self.norm_qkv_proj = PreNormLinear(self.input_layernorm, self.self_attn.qkv_proj)
        self.norm_gate_up_proj = PreNormLinear(self.pre_feedforward_layernorm, self.mlp.gate_up_proj)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.norm_qkv_proj(hidden, None)
        hidden = hidden + self.post_attention_layernorm(self.self_attn(positions, qkv))
        gate_up, _ = self.norm_gate_up_proj(hidden, None)
        return hidden + self.post_feedforward_layernorm(self.mlp(gate_up))


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        assert config.rope is not None and config.local_rope is not None
        global_rope = RotaryEmbedding(config.head_dim, max_positions, config.rope)
        local_rope = RotaryEmbedding(config.head_dim, max_positions, config.local_rope)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, local_rope if config.sliding_windows[i] else global_rope)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.norm_eps, unit_offset=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # The scale is rounded to the activations' dtype first, as the reference does; computed on the host
        # so that no tensor is copied to the device per call (which a CUDA graph could not capture).
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype).item()
        for layer in self.layers:
            hidden = layer(positions, hidden)
        out: torch.Tensor = self.norm(hidden)
        return out


class Gemma3ForCausalLM(CausalLM):
    stacked_params = FUSED_QKV_GATE_UP

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(config)
        self.model = Gemma3Model(config, max_positions or config.max_position_embeddings)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_logit_softcapping = ConfigReader(config.raw, "").float_or("final_logit_softcapping", 0.0)

    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], source: str) -> ModelConfig:
        return parse_gemma3_config(raw, source)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden: torch.Tensor = self.model(input_ids, positions)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits
