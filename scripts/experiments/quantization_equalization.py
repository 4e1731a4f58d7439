"""Exploration for issue 18: does data-free cross-layer equalization bring Gemma 3 270M's int8 (per output
channel) within the accuracy targets (top-1 agreement >= 96%, perplexity within 1%)?

Before rounding, each input column j of a projection is multiplied by s_j and the operator before it
divided by s_j, which leaves the float model unchanged (Nagel et al. 2019, "Data-Free Quantization Through
Weight Equalization and Bias Correction"): the RMSNorm weight before q/k/v and gate/up (Gemma's 1 + w),
v_proj's output rows before o_proj (one KV head serves a group of query heads: o's columns of every head
of the group), and up_proj's rows before down_proj (act(gate) * up is linear in up). Then every projection
weight is rounded per output row as ``quantization="int8"`` (or "fp8") rounds it, and the teacher-forced
text of `tokenmill bench accuracy` is scored (windows of 1,024) against the float model.

Variants of s: ``fold`` the norm weight into the projection (s = norm weight; pairs of projections not
touched), ``cle`` s_j = sqrt(r1_j / r2_j) for every pair (r1: the range of channel j's producer, the norm
weight's magnitude or the row's absolute max; r2: column j's absolute max in the consumer), and
``cle-proj`` the same for the projection pairs only.

    PYTHONPATH=src:scripts/experiments \
        python scripts/experiments/quantization_equalization.py gemma3-270m 4096 [int8|fp8]
"""

import sys

import torch
from quantization_granularity import print_scored, rounded_in_groups

from tokenmill.benchmarks.accuracy.measure import score_text
from tokenmill.benchmarks.accuracy.text import evaluation_text
from tokenmill.loading import load_model


def balance(producer_range: torch.Tensor, consumer: torch.Tensor) -> torch.Tensor:
    """s_j = sqrt(r1_j / r2_j), bounded, for a consumer weight [out, in] whose column j reads channel j."""
    columns = consumer.abs().amax(0).clamp(min=1e-8)
    return (producer_range.clamp(min=1e-8) / columns).sqrt().clamp(1e-2, 1e2)


def equalize(model: torch.nn.Module, variant: str, unit_offset: bool, q_size: int, kv_size: int, heads: int,
             kv_heads: int) -> None:  # fmt: skip
    for layer in model.model.layers:  # type: ignore[union-attr]
        attn, mlp = layer.self_attn, layer.mlp
        pairs = [(layer.input_layernorm, attn.qkv_proj), (_pre_mlp_norm(layer), mlp.gate_up_proj)]
        if variant in ("fold", "cle"):
            for norm, proj in pairs:
                gamma = norm.weight.data + 1 if unit_offset else norm.weight.data
                s = (
                    gamma.abs().clamp(min=1e-2)
                    if variant == "fold"
                    else balance(gamma.abs(), proj.weight.data)
                )
                proj.weight.data *= s[None, :]
                new_gamma = gamma / s
                norm.weight.data.copy_(new_gamma - 1 if unit_offset else new_gamma)
        if variant in ("cle", "cle-proj"):
            _equalize_v_o(attn, q_size, kv_size, heads, kv_heads)
            _equalize_up_down(mlp)


def _pre_mlp_norm(layer: torch.nn.Module) -> torch.nn.Module:
    return getattr(layer, "pre_feedforward_layernorm", None) or layer.post_attention_layernorm


def _equalize_v_o(attn: torch.nn.Module, q_size: int, kv_size: int, heads: int, kv_heads: int) -> None:
    qkv, o = attn.qkv_proj.weight.data, attn.o_proj.weight.data
    head_dim = kv_size // kv_heads
    v = qkv[q_size + kv_size :]  # [kv_heads * d, hidden]
    group = heads // kv_heads
    o_cols = o.abs().amax(0).view(heads, head_dim)  # per query head and dim
    consumer = o_cols.view(kv_heads, group, head_dim).amax(1).reshape(-1)  # per kv head and dim
    s = (v.abs().amax(1).clamp(min=1e-8) / consumer.clamp(min=1e-8)).sqrt().clamp(1e-2, 1e2)
    v /= s[:, None]
    o_scale = s.view(kv_heads, 1, head_dim).expand(kv_heads, group, head_dim).reshape(-1)
    o *= o_scale[None, :]


def _equalize_up_down(mlp: torch.nn.Module) -> None:
    gate_up, down = mlp.gate_up_proj.weight.data, mlp.down_proj.weight.data
    inter = down.shape[1]
    up = gate_up[inter:]
    s = balance(up.abs().amax(1), down)
    up /= s[:, None]
    down *= s[None, :]


VARIANTS = ("none", "fold", "cle-proj", "cle")


def main(model_name: str, num_tokens: int, kind: str = "int8") -> None:
    torch.set_num_threads(2)
    loaded = load_model(model_name, device="cpu", dtype="float32", quantization="none")
    assert loaded.tokenizer is not None
    config = loaded.config
    tokens = loaded.tokenizer.encode(evaluation_text())[:num_tokens]
    base = score_text(loaded.model, tokens, 1024)
    base_short = score_text(loaded.model, tokens[:256], 256).perplexity
    print(f"float32: perplexity {base.perplexity:.3f} (first 256 tokens: {base_short:.4f})", flush=True)
    state = {name: p.detach().clone() for name, p in loaded.model.named_parameters()}
    unit_offset = config.architecture.startswith("Gemma")
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for variant in VARIANTS:
        for name, parameter in loaded.model.named_parameters():
            parameter.data.copy_(state[name])
        if variant != "none":
            equalize(
                loaded.model, variant, unit_offset, q_size, kv_size, config.num_heads, config.num_kv_heads
            )
            check = score_text(loaded.model, tokens[:256], 256)
            print(
                f"  {variant}: float model after equalization, 256 tokens: perplexity {check.perplexity:.4f}"
            )
        for name, parameter in loaded.model.named_parameters():
            if parameter.dim() == 2 and "embed" not in name:
                parameter.data.copy_(rounded_in_groups(parameter.data, parameter.shape[1], kind))
        print_scored(f"{kind} per-channel, equalization {variant}", loaded.model, tokens, base)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:4])
