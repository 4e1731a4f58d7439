"""Model architectures: tokenmill's own forward code for each supported family."""

from tokenmill.models.base import CausalLM
from tokenmill.models.config import ModelConfig, RopeConfig
from tokenmill.models.registry import GGUF_ARCHITECTURES, MODEL_REGISTRY, resolve_architecture

__all__ = [
    "GGUF_ARCHITECTURES",
    "MODEL_REGISTRY",
    "CausalLM",
    "ModelConfig",
    "RopeConfig",
    "resolve_architecture",
]
