"""Maps checkpoint architecture names (HF ``architectures``, GGUF ``general.architecture``) to models."""

from tokenmill.errors import UnsupportedArchitectureError
from tokenmill.models.base import CausalLM
from tokenmill.models.gemma3 import Gemma3ForCausalLM
from tokenmill.models.gpt2 import GPT2LMHeadModel
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
}

# GGUF ``general.architecture`` → the HF architecture name whose implementation runs it.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


def resolve_architecture(name: str, source: str) -> type[CausalLM]:
    if name in MODEL_REGISTRY:
        return MODEL_REGISTRY[name]
    raise UnsupportedArchitectureError(
        f"{source}: architecture '{name}' is not supported by tokenmill; "
        f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )
