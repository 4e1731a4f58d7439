"""Qwen3: the Llama block with an RMSNorm over each query and key head before rotary embedding."""

from typing import Any

import torch

from tokenmill.models.config import ModelConfig
from tokenmill.models.layers import RMSNorm, RotaryEmbedding
from tokenmill.models.llama import LlamaAttention, LlamaForCausalLM, parse_llama_config


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__(config, layer_idx, rotary)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().split_qkv(qkv)
        head_dim = self.attn.spec.head_dim
        q = self.q_norm(q.reshape(-1, head_dim)).view(q.shape)
        k = self.k_norm(k.reshape(-1, head_dim)).view(k.shape)
        return q, k, v


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
    architecture_name = "Qwen3ForCausalLM"

    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], source: str) -> ModelConfig:
        return parse_llama_config(raw, source, cls.architecture_name)
