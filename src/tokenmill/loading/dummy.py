"""Random weights of a real model's shape, for benchmarks that need the shapes but not the weights."""

import torch

from tokenmill.models.base import CausalLM
from tokenmill.models.layers.norm import LayerNorm, RMSNorm


@torch.no_grad()
def init_dummy_weights(model: CausalLM, seed: int = 0, std: float = 0.02) -> None:
    """Matrices ~ N(0, std); norm scales at identity and biases at zero, so activations stay in range.
    Quantized layers draw their weights a chunk of rows at a time, straight into their format."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    done = _init_quantized(model, generator, std)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.weight.fill_(0.0 if module.unit_offset else 1.0)
            done.add(id(module.weight))
        elif isinstance(module, LayerNorm):
            module.weight.fill_(1.0)
            done.add(id(module.weight))
    for param in model.parameters():
        if id(param) in done:
            continue
        if param.dim() == 1:
            param.zero_()
        else:
            param.normal_(0.0, std, generator=generator)


def _init_quantized(model: CausalLM, generator: torch.Generator, std: float) -> set[int]:
    """Random weights for the layers a quantization method stores; the ids of the parameters it filled."""
    done: set[int] = set()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None or not method.quantized:
            continue
        method.init_dummy(module, generator, std)
        done.update(id(param) for name, param in module.named_parameters(recurse=False) if name != "bias")
    return done
