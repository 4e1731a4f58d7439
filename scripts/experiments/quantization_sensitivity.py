"""Exploration for issue 18: where Gemma 3 270M's int8 top-1 disagreement comes from. Every projection
weight rounded per output row as ``quantization="int8"`` rounds it, except one kind of projection, or
one layer, kept in float32; scored on the teacher-forced text of `tokenmill bench accuracy` against the
float model.

    PYTHONPATH=src:scripts/experiments python scripts/experiments/quantization_sensitivity.py
"""

from collections.abc import Callable

import torch
from quantization_granularity import rounded_in_groups

from tokenmill.benchmarks.accuracy.measure import score_text
from tokenmill.benchmarks.accuracy.text import evaluation_text
from tokenmill.loading import load_model


def main() -> None:
    torch.set_num_threads(2)
    loaded = load_model("gemma3-270m", device="cpu", dtype="float32", quantization="none")
    assert loaded.tokenizer is not None
    tokens = loaded.tokenizer.encode(evaluation_text())[:4096]
    base = score_text(loaded.model, tokens, 1024)
    originals = {
        name: p.detach().clone()
        for name, p in loaded.model.named_parameters()
        if p.dim() == 2 and "embed" not in name
    }

    def run(label: str, keep: Callable[[str], bool]) -> None:
        for name, parameter in loaded.model.named_parameters():
            if name in originals:
                weight = originals[name]
                kept = weight if keep(name) else rounded_in_groups(weight, weight.shape[1], "int8")
                parameter.data.copy_(kept)
        scored = score_text(loaded.model, tokens, 1024)
        change = scored.perplexity / base.perplexity - 1
        print(
            f"{label:28s} perplexity {change:+.2%}, top-1 agreement {scored.agreement(base):.1%}", flush=True
        )

    run("all int8", lambda name: False)
    for kind in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        run(f"{kind} kept float", lambda name, kind=kind: kind in name)
    last = len(loaded.model.model.layers) - 1  # type: ignore[union-attr]
    for index in (0, 1, last - 1, last):
        run(f"layer {index} kept float", lambda name, index=index: f"layers.{index}." in name)


if __name__ == "__main__":
    main()
