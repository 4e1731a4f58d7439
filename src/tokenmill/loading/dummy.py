"""Random weights of a real model's shape, for benchmarks that need the shapes but not the weights."""

import torch

from tokenmill.models.base import CausalLM
from tokenmill.models.layers.norm import LayerNorm, RMSNorm


@torch.no_grad()
def init_dummy_weights(model: CausalLM, seed: int = 0, std: float = 0.02) -> None:
    """Matrices ~ N(0, std); norm scales at identity and biases at zero, so activations stay in range."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    norm_weights = set()
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.weight.fill_(0.0 if module.unit_offset else 1.0)
            norm_weights.add(id(module.weight))
        elif isinstance(module, LayerNorm):
            module.weight.fill_(1.0)
            norm_weights.add(id(module.weight))
    for param in model.parameters():
        if id(param) in norm_weights:
            continue
        if param.dim() == 1:
            param.zero_()
        else:
            param.normal_(0.0, std, generator=generator)
