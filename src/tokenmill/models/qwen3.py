"""Qwen3: the Llama block with an RMSNorm over each query and key head before rotary embedding."""

from typing import Any

from tokenmill.models.config import ModelConfig
from tokenmill.models.llama import LlamaForCausalLM, QKNormAttention, parse_llama_config


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = QKNormAttention
    architecture_name = "Qwen3ForCausalLM"

    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], source: str) -> ModelConfig:
        return parse_llama_config(raw, source, cls.architecture_name)
