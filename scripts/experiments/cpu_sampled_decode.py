"""Sampled decode on the CPU: the inverse-CDF draw and the candidates' top-p against what they replaced.

Two engines in one process, identical but for the PyTorch draw: the earlier one (``argmax(probs / E)``
with one Exp(1) number per vocabulary entry, top-p through a sort of the whole row) is rebuilt here as
the peer. Each round times greedy, temperature 1.0 and temperature 1.0 with top-p 0.9 on both,
alternating which engine goes first.

    python scripts/experiments/cpu_sampled_decode.py [MODEL|default] [BATCH] [ROUNDS] [MAX_TOKENS]
"""

import sys
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.benchmarks.report import detect_hardware, provenance_header
from tokenmill.runner.sampler import sampler as sampler_module
from tokenmill.runner.sampler.batch import DrawParams, SamplingBatch
from tokenmill.runner.sampler.draw import torch_draw
from tokenmill.runner.sampler.filters import apply_top_k_top_p_min_p, filter_sorted


def exponential_noise_draw(logits: torch.Tensor, batch: SamplingBatch, draw: DrawParams) -> torch.Tensor:
    """The draw before this change: ``argmax(probs / E)``, ``E ~ Exp(1)`` per token; top-p sorted."""
    scaled = logits / draw.temperature.unsqueeze(1)
    if batch.any_top_p:
        scaled = filter_sorted(scaled, batch)
    elif batch.needs_filtering:
        scaled = apply_top_k_top_p_min_p(scaled, batch)
    probs = torch.softmax(scaled, dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for row, key in draw.seeded_rows:
        generator = torch.Generator(device=probs.device)
        generator.manual_seed(key)
        noise[row].exponential_(generator=generator)
    token_ids = probs.div_(noise.clamp_min_(1e-20)).argmax(dim=-1)
    if batch.any_greedy:
        token_ids = torch.where(draw.greedy, logits.argmax(dim=-1), token_ids)
    return token_ids


def build(model: str | None, draw) -> LLM:  # type: ignore[no-untyped-def]
    sampler_module.torch_draw = draw  # read when the engine's Sampler is built
    return LLM(model) if model else LLM()


def rate(llm: LLM, prompts: list[str], params: SamplingParams) -> float:
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - started)


def main(model: str | None, batch: int, rounds: int, max_tokens: int) -> None:
    torch.set_num_threads(2)
    print(provenance_header(detect_hardware(torch.device("cpu"))), flush=True)
    engines = {
        "inverse-CDF, top-p over candidates": build(model, torch_draw),
        "Exp(1) noise, sorted top-p (before)": build(model, exponential_noise_draw),
    }
    prompts = [f"Tell me a story about a dragon, number {i}." for i in range(batch)]
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
    top_p = SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.9, ignore_eos=True)
    kinds = (("greedy", greedy), ("temperature 1.0", sampled), ("top-p 0.9", top_p))
    for llm in engines.values():
        rate(llm, prompts, sampled)  # warm up
    rates: dict[tuple[str, str], list[float]] = {}
    for round_ in range(rounds):
        order = list(engines.items()) if round_ % 2 == 0 else list(engines.items())[::-1]
        for name, llm in order:
            for kind, params in kinds:
                rates.setdefault((name, kind), []).append(rate(llm, prompts, params))
    label = model or "the default model (SmolLM2-135M, packed Q4_1)"
    print(f"- workload: {label}, batch {batch}, {max_tokens} tokens out (EOS ignored), {rounds} rounds")
    print("- figures: the best round of each\n")
    print("| draw | greedy tok/s | temperature 1.0 | top-p 0.9 | each / greedy |")
    print("| --- | --- | --- | --- | --- |")
    for name in engines:
        g, s, p = (max(rates[(name, kind)]) for kind, _ in kinds)
        print(f"| {name} | {g:.1f} | {s:.1f} | {p:.1f} | {s / g:.2f} / {p / g:.2f} |")
    for kind, _ in kinds[1:]:
        new, old = (max(rates[(name, kind)]) for name in engines)
        print(f"\n{kind}: this draw / the earlier one {new / old:.2f}x")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(
        None if not args or args[0] == "default" else args[0],
        int(args[1]) if len(args) > 1 else 1,
        int(args[2]) if len(args) > 2 else 3,
        int(args[3]) if len(args) > 3 else 96,
    )
