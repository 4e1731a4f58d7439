"""What a draft model costs and what it would buy: a round (k draft steps + one verification of 1 + k
tokens) against a plain decode step of the target, and the speed-up at a given acceptance rate.

With acceptance rate ``a`` per draft token (independent), a round emits ``E(a) = (1 - a^(k+1)) / (1 - a)``
tokens, so speculation runs ``E(a) * t_plain / t_round`` times as fast as plain decoding, where
``t_round = k * t_draft_step + t_verify``. Every part is measured here at batch 1 on random-token prompts:
``t_plain`` (the target's plain decode step, its fast path), ``t_draft_step`` (a decode step of the draft
on the path the proposer runs it: CUDA graphs where the engine has them, each step read before the next
starts), ``t_verify`` (a round's time less its draft steps, from a run with the draft). The formula is
then checked where the acceptance is known: the target drafting for itself, whose greedy guesses are all
accepted in float32 (``E = k + 1``; in 16 bits its decode and verification steps round differently, so
``E`` is the measured tokens per round), and its measured speed-up is compared with
``E * t_plain / (k * t_target_step + t_verify)``, ``t_target_step`` being the target's step on the draft's
path.
"""

import argparse
import gc
import random
from collections.abc import Callable

import torch

from tokenmill.benchmarks.report import describe_model, header_lines, markdown_table
from tokenmill.benchmarks.speculative.timing import TimedRun, one_at_a_time
from tokenmill.config import EngineConfig
from tokenmill.engine.hardware_defaults import auto_speculative_tokens
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.loading import LoadedModel, load_model
from tokenmill.sampling_params import SamplingParams

ACCEPTANCE_RATES = (0.5, 0.7, 0.9)


def tokens_per_round(acceptance: float, k: int) -> float:
    if acceptance >= 1.0:
        return float(k + 1)
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def draft_model_costs(args: argparse.Namespace, target: LoadedModel, base: EngineConfig) -> list[str]:
    draft = load_model(
        args.draft_model,
        device=target.device,
        dtype=target.dtype,
        load_format=args.draft_load_format,
        seed=args.seed,
    )
    k = base.speculative.num_speculative_tokens or auto_speculative_tokens("draft_model", target.device)
    rng = random.Random(args.seed)
    vocab = min(target.config.vocab_size, draft.config.vocab_size)
    prompts = [
        [rng.randrange(10, vocab) for _ in range(args.draft_input_len)] for _ in range(args.draft_num_prompts)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.draft_output_len, ignore_eos=True)
    off = base.with_options(speculative_method=None, speculative_model=None)
    sequential = off.with_options(overlap_decode=False)  # the path a draft's steps take
    drafted = off.with_options(
        speculative_method="draft_model",
        speculative_model=args.draft_model,
        speculative_load_format=args.draft_load_format,
        num_speculative_tokens=k,
    )
    runs = {
        "target plain": _timed("target plain", lambda: LLMEngine(off, loaded=target), prompts, params),
        "target step": _timed("target step", lambda: LLMEngine(sequential, loaded=target), prompts, params),
        "draft step": _timed(
            "draft step",
            lambda: LLMEngine(sequential.with_options(model=args.draft_model), loaded=draft),
            prompts,
            params,
        ),
        "with draft": _timed(
            "with draft", lambda: LLMEngine(drafted, loaded=target, draft=draft), prompts, params
        ),
        "self-draft": _timed(
            "self-draft", lambda: LLMEngine(drafted, loaded=target, draft=target), prompts, params
        ),
    }
    for run in runs.values():
        print(f"{run.label}: step {run.step_s * 1e3:.2f} ms, decode {run.decode_tok_s:.1f} tok/s", flush=True)
    workload = (
        f"batch 1, {args.draft_num_prompts} random-token prompts of {args.draft_input_len} tokens, "
        f"{args.draft_output_len} greedy tokens each (EOS ignored); k={k}"
    )
    header = header_lines(
        "tokenmill speculative decoding (draft model)",
        workload,
        f"{describe_model(target)}; draft {describe_model(draft)}",
        "the target's plain decode, same run",
    )
    return ["", *header, "", *render_costs(runs, k)]


def _timed(
    label: str, make_engine: Callable[[], LLMEngine], prompts: list[list[int]], params: SamplingParams
) -> TimedRun:
    """Build the engine, warm it up, time the prompts, and free the engine before the next one is built."""
    engine = make_engine()
    one_at_a_time(
        "warm-up", engine, prompts[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    run = one_at_a_time(label, engine, prompts, params)
    del engine
    gc.collect()  # the engine's KV pool (and graphs) go before the next engine sizes its own
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return run


def render_costs(runs: dict[str, TimedRun], k: int) -> list[str]:
    plain, drafted, selfed = runs["target plain"], runs["with draft"], runs["self-draft"]
    t_plain, t_draft = plain.step_s, runs["draft step"].step_s
    t_round = drafted.step_s
    t_verify = t_round - drafted.propose_s / max(drafted.num_decode_steps, 1)
    t_formula_round = k * t_draft + t_verify
    cost_rows = [
        ["target plain decode step (t_plain)", f"{t_plain * 1e3:.2f}"],
        ["target decode step, not overlapped (t_target_step)", f"{runs['target step'].step_s * 1e3:.2f}"],
        ["draft decode step, not overlapped (t_draft_step)", f"{t_draft * 1e3:.2f}"],
        ["verification of 1 + k tokens (t_verify)", f"{t_verify * 1e3:.2f}"],
        ["round, measured (t_round)", f"{t_round * 1e3:.2f}"],
        ["round, k * t_draft_step + t_verify", f"{t_formula_round * 1e3:.2f}"],
        ["round / plain step", f"{t_round / t_plain:.2f}x"],
    ]
    speed_rows = [
        [
            f"{rate:.1f}",
            f"{tokens_per_round(rate, k):.2f}",
            f"{tokens_per_round(rate, k) * t_plain / t_round:.2f}x",
            f"{tokens_per_round(rate, k) * t_plain / t_formula_round:.2f}x",
        ]
        for rate in ACCEPTANCE_RATES
    ]
    per_round = selfed.spec.mean_accepted_length
    predicted = per_round * t_plain / (k * runs["target step"].step_s + t_verify)
    measured = selfed.decode_tok_s / plain.decode_tok_s
    off_by = measured / predicted - 1
    verdict = "within" if abs(off_by) <= 0.10 else "NOT within"
    return [
        markdown_table(["cost", "ms"], cost_rows),
        "",
        markdown_table(
            ["acceptance", "tokens / round", "speed-up (measured round)", "speed-up (formula round)"],
            speed_rows,
        ),
        "",
        f"- measured with the draft: acceptance {drafted.spec.acceptance_rate:.2f} (random weights: "
        f"meaningless), {drafted.spec.mean_accepted_length:.2f} tokens per round",
        f"- self-draft check: acceptance {selfed.spec.acceptance_rate:.2f} "
        f"({selfed.spec.mean_accepted_length:.2f} tokens per round), measured speed-up {measured:.2f}x, "
        f"formula {predicted:.2f}x at the measured {per_round:.2f} tokens per round, {verdict} 10% "
        f"({off_by:+.1%})",
        "- on a GPU the draft's one-token steps run through its decode graphs and a lone sequence's "
        "catch-up and the batch-1 verification through one-sequence prefill graphs; no overlapped "
        "decoding while speculating",
    ]
