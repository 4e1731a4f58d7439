"""Exploration for issue 18: calibrated (GPTQ) rounding of Gemma 3 270M / SmolLM2 against round-to-nearest,
in the same per-row formats, for a few calibration sizes and dampings (the library's code:
``tokenmill.export.calibration``, ``tokenmill.quantization.gptq``). Scored like `tokenmill bench accuracy`
(4,096 teacher-forced tokens of its text, windows of 1,024); the weights are rounded in place.

    python scripts/experiments/quantization_gptq.py MODEL FMT TOKENS[,TOKENS...] DAMPING[,DAMPING...] [SEED]
"""

import sys
import time

import torch

from tokenmill.benchmarks.accuracy.measure import score_text
from tokenmill.benchmarks.accuracy.text import evaluation_text
from tokenmill.export.calibration import projection_hessians, sampled_calibration
from tokenmill.loading import load_model
from tokenmill.quantization.gptq import gptq_round


def main(model: str, fmt: str, sizes: str, dampings: str, seed: str = "0") -> None:
    torch.set_num_threads(2)
    loaded = load_model(model, device="cpu", dtype="float32", quantization="none")
    assert loaded.tokenizer is not None
    tokens = loaded.tokenizer.encode(evaluation_text())[:4096]
    base = score_text(loaded.model, tokens, 1024)
    modules = {name: m for name, m in loaded.model.named_modules() if name in projection_names(loaded.model)}
    originals = {name: m.weight.detach().clone() for name, m in modules.items()}
    for size in map(int, sizes.split(",")):
        for name, module in modules.items():
            module.weight.data.copy_(originals[name])
        started = time.time()
        hessians = projection_hessians(loaded.model, sampled_calibration(loaded, size, int(seed)))
        calibrated = time.time() - started
        for damping in map(float, dampings.split(",")):
            for name, module in modules.items():
                codes, scale = gptq_round(originals[name], hessians[name], fmt, damping)  # type: ignore[arg-type]
                module.weight.data.copy_(codes.float() * scale[:, None])
            scored = score_text(loaded.model, tokens, 1024)
            print(
                f"{model} {fmt} gptq, {size} calibration tokens (seed {seed}, {calibrated:.0f} s), damping "
                f"{damping}: perplexity {scored.perplexity / base.perplexity - 1:+.2%}, top-1 agreement "
                f"{scored.agreement(base):.1%}",
                flush=True,
            )


def projection_names(model: torch.nn.Module) -> set[str]:
    from tokenmill.models.layers.linear import LinearBase

    return {name for name, module in model.named_modules() if isinstance(module, LinearBase)}


if __name__ == "__main__":
    main(*sys.argv[1:])
