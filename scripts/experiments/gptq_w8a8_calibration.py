"""Exploration for issue 18: Gemma 3 270M's fp8 W8A8 agreement (88.8% with GPTQ weights calibrated on the
float model's inputs; >= 90% asked). Variants of where GPTQ's ``H = X^T X`` comes from, each scored like
`tokenmill bench accuracy` with every projection's input rounded per token to e4m3 (what the fp8 GEMM at
more than one row computes):

* ``float``: one pass over the float model (what ``tokenmill quantize`` does);
* ``rounded-inputs``: one pass, each projection's inputs rounded to e4m3 first (``X~``, what it will see);
* ``sequential``: layer by layer, ``X~`` gathered with the layers before already quantized (GPTQ paper's
  order), so later layers are rounded against the inputs they will really receive;
* ``skip-KIND``: diagnostics, the ``float`` weights with the activations of one projection kind left
  unrounded (which inputs cost the agreement).

    python scripts/experiments/gptq_w8a8_calibration.py [MODEL] [VARIANTS]
"""

import sys
from collections.abc import Callable

import torch

from tokenmill.benchmarks.accuracy.measure import score_text
from tokenmill.benchmarks.accuracy.text import evaluation_text
from tokenmill.export.calibration import sampled_calibration
from tokenmill.loading import load_model
from tokenmill.quantization.gptq import gptq_round
from tokenmill.quantization.rounding import FP8_DTYPE, fake_quantize_per_token
from tokenmill.reference import SingleSequenceRunner

KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def rounding_hooks(projections: dict[str, torch.nn.Module], skip: str = "") -> list:
    def hook(_m: torch.nn.Module, args: tuple) -> tuple:
        return (fake_quantize_per_token(args[0], FP8_DTYPE),)

    return [m.register_forward_pre_hook(hook) for n, m in projections.items() if not (skip and n.endswith(skip))]


class _Stop(Exception):
    pass


def gather(
    model: torch.nn.Module, modules: dict[str, torch.nn.Module], sequences, last_layer: int | None = None
) -> dict[str, torch.Tensor]:
    """``X^T X`` of each module's inputs as they arrive (after any rounding hook registered before); the
    forward stops after ``last_layer`` when given (no logits are computed)."""
    found: dict[str, torch.Tensor] = {}

    def stop(*_args: object) -> None:
        raise _Stop

    def make(name: str) -> Callable:
        def hook(_m: torch.nn.Module, args: tuple) -> None:
            rows = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            found[name] = rows.T @ rows + found.get(name, 0)

        return hook

    handles = [m.register_forward_pre_hook(make(n)) for n, m in modules.items()]
    if last_layer is not None:
        handles.append(model.model.layers[last_layer].register_forward_hook(stop))
    for sequence in sequences:
        try:
            SingleSequenceRunner(model, len(sequence)).hidden_states(list(sequence))
        except _Stop:
            pass
    for h in handles:
        h.remove()
    return found


def round_module(module: torch.nn.Module, hessian: torch.Tensor) -> None:
    codes, scale = gptq_round(module.weight.data, hessian.float(), "fp8")
    module.weight.data.copy_(codes.float() * scale[:, None])


def main(model_name: str = "gemma3-270m", variants: str = "float,rounded-inputs,sequential") -> None:
    torch.set_num_threads(2)
    loaded = load_model(model_name, device="cpu", dtype="float32", quantization="none")
    model = loaded.model
    tokens = loaded.tokenizer.encode(evaluation_text())[:4096]
    base = score_text(model, tokens, 1024)
    calibration = sampled_calibration(loaded, 4096, 0)
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}
    projections = {n: m for n, m in model.named_modules() if n.endswith(KINDS) and hasattr(m, "weight")}
    float_h = gather(model, projections, calibration)
    for variant in variants.split(","):
        for n, p in model.named_parameters():
            p.data.copy_(originals[n])
        skip = ""
        if variant == "float" or variant.startswith("skip-"):
            skip = variant.removeprefix("skip-") if variant.startswith("skip-") else ""
            for n, m in projections.items():
                round_module(m, float_h[n])
            handles = rounding_hooks(projections, skip)
        elif variant == "rounded-inputs":
            handles = rounding_hooks(projections)
            hessians = gather(model, projections, calibration)
            for n, m in projections.items():
                round_module(m, hessians[n])
        elif variant == "sequential":
            handles = rounding_hooks(projections)
            for i in range(len(model.model.layers)):
                prefix = f"model.layers.{i}."
                layer = {n: m for n, m in projections.items() if n.startswith(prefix)}
                # inside a layer too: o_proj after q/k/v are rounded, down after gate/up
                for group in (("qkv_proj",), ("o_proj",), ("gate_up_proj",), ("down_proj",)):
                    chosen = {n: m for n, m in layer.items() if n.endswith(group)}
                    hessians = gather(model, chosen, calibration, i)
                    for n, m in chosen.items():
                        round_module(m, hessians[n])
        else:
            raise SystemExit(f"unknown variant {variant}")
        scored = score_text(model, tokens, 1024)
        for h in handles:
            h.remove()
        print(
            f"{model_name} {variant}: fp8 W8A8 perplexity {scored.perplexity / base.perplexity - 1:+.2%}, "
            f"top-1 agreement {scored.agreement(base):.1%}",
            flush=True,
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
