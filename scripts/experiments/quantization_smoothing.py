"""Exploration for issue 18: Gemma 3 270M's fp8 W8A8 agreement (88.8% with GPTQ weights, 87.1% rounded to
nearest; >= 90% asked). Per-token e4m3 activations lose where a few input channels are much larger than
the rest; SmoothQuant (Xiao et al., 2022) divides each input channel by ``s_j = max|x_j|^a / max|W_j|^(1-a)``
and multiplies the weight's column by it, the float model unchanged: the division folds into the RMSNorm
before q/k/v and gate/up (Gemma's ``1 + w``), and into the up rows before down (the gated product is
linear in up). Then fp8 per-row weights (nearest, or GPTQ on the smoothed model's inputs) with every
projection's input rounded per token to e4m3, scored like `tokenmill bench accuracy`.

    python scripts/experiments/quantization_smoothing.py [ALPHAS]
"""

import sys

import torch

from tokenmill.benchmarks.accuracy.measure import score_text
from tokenmill.benchmarks.accuracy.text import evaluation_text
from tokenmill.export.calibration import projection_hessians, sampled_calibration
from tokenmill.loading import load_model
from tokenmill.quantization.gptq import gptq_round
from tokenmill.quantization.rounding import FP8_DTYPE, fake_quantize_per_token
from tokenmill.reference import SingleSequenceRunner


def input_maxima(model, sequences) -> dict[str, torch.Tensor]:
    maxima: dict[str, torch.Tensor] = {}
    names = {"self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"}
    handles = []
    for name, module in model.named_modules():
        if any(name.endswith(n) for n in names):

            def hook(_m, args, name=name):
                top = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0).float()
                maxima[name] = top if name not in maxima else torch.maximum(maxima[name], top)

            handles.append(module.register_forward_pre_hook(hook))
    for sequence in sequences:
        SingleSequenceRunner(model, len(sequence)).forward_all(sequence)
    for handle in handles:
        handle.remove()
    return maxima


def smooth(model, maxima: dict[str, torch.Tensor], alpha: float) -> None:
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        pairs = (
            (layer.input_layernorm, layer.self_attn.qkv_proj),
            (layer.pre_feedforward_layernorm, layer.mlp.gate_up_proj),
        )
        for norm, proj in pairs:
            name = prefix + ("self_attn.qkv_proj" if proj is layer.self_attn.qkv_proj else "mlp.gate_up_proj")
            s = scales(maxima[name], proj.weight.data, alpha)
            norm.weight.data.copy_((1 + norm.weight.data) / s - 1)
            proj.weight.data.mul_(s[None, :])
        down, gate_up = layer.mlp.down_proj, layer.mlp.gate_up_proj
        s = scales(maxima[prefix + "mlp.down_proj"], down.weight.data, alpha)
        half = gate_up.weight.shape[0] // 2
        gate_up.weight.data[half:].div_(s[:, None])
        down.weight.data.mul_(s[None, :])


def scales(x_max: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    w_max = weight.abs().amax(0).clamp(min=1e-5)
    return (x_max.clamp(min=1e-5) ** alpha / w_max ** (1 - alpha)).clamp(min=1e-2, max=1e2)


def main(alphas: str = "0.0,0.3,0.5") -> None:
    torch.set_num_threads(2)
    loaded = load_model("gemma3-270m", device="cpu", dtype="float32", quantization="none")
    tokens = loaded.tokenizer.encode(evaluation_text())[:4096]
    base = score_text(loaded.model, tokens, 1024)
    calibration = sampled_calibration(loaded, 4096, 0)
    maxima = input_maxima(loaded.model, calibration)
    originals = {n: p.detach().clone() for n, p in loaded.model.named_parameters()}
    projections = {
        n: m
        for n, m in loaded.model.named_modules()
        if hasattr(m, "weight") and n.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    }
    handles = [
        m.register_forward_pre_hook(lambda _m, a: (fake_quantize_per_token(a[0], FP8_DTYPE),))
        for m in projections.values()
    ]
    for alpha in map(float, alphas.split(",")):
        for rounding in ("nearest", "gptq"):
            for n, p in loaded.model.named_parameters():
                p.data.copy_(originals[n])
            if alpha > 0:
                smooth(loaded.model, maxima, alpha)
            for h in handles:
                h.remove()
            hessians = projection_hessians(loaded.model, calibration) if rounding == "gptq" else {}
            handles = [
                m.register_forward_pre_hook(lambda _m, a: (fake_quantize_per_token(a[0], FP8_DTYPE),))
                for m in projections.values()
            ]
            for n, m in projections.items():
                w = m.weight.data
                if rounding == "gptq":
                    codes, scale = gptq_round(w, hessians[n], "fp8")
                else:
                    scale = w.abs().amax(1).clamp(min=1e-12) / 448
                    codes = (w / scale[:, None]).to(FP8_DTYPE)
                m.weight.data.copy_(codes.float() * scale[:, None])
            scored = score_text(loaded.model, tokens, 1024)
            print(
                f"alpha {alpha} {rounding}: fp8 W8A8 perplexity {scored.perplexity / base.perplexity - 1:+.2%}, top-1 agreement {scored.agreement(base):.1%}",
                flush=True,
            )


if __name__ == "__main__":
    main(*sys.argv[1:])
