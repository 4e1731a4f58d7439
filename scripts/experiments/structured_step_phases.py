"""Exploration for issue 16: where a decode step's host time goes, unconstrained vs every row under the
nested schema. Serves the `bench structured` workload (64 requests, 128 prompt tokens, 256 outputs, dummy
weights, the SmolLM2 tokenizer) through one engine per run and times decode steps 20-180; with
``--phases`` the engine's own methods are wrapped by timers (which add their own cost: compare runs of
one kind only), and the totals per step are printed, longest first.

    python scripts/experiments/structured_step_phases.py --model llama-3.2-1b --tokenizer TOK_FOLDER \
        --runs plain,constrained,plain,constrained [--phases] [--no-masks-ahead]
"""

import argparse
import statistics
import time
from typing import Any

import phase_timers
import torch

from tokenmill.benchmarks.common import load_for_args
from tokenmill.benchmarks.structured.command import with_tokenizer
from tokenmill.benchmarks.structured.schemas import NESTED, endless
from tokenmill.benchmarks.workload import WorkloadSpec, build_workload, greedy_params
from tokenmill.config import EngineConfig
from tokenmill.engine import llm_engine
from tokenmill.loading import LoadedModel
from tokenmill.runner.sampler import batch, sampler
from tokenmill.structured import bitmask, manager
from tokenmill.structured.params import StructuredOutputsParams

FIRST_STEP, LAST_STEP = 20, 180  # decode steps timed (the first ones include prefill)
TIMED: list[tuple[Any, str]] = [
    *phase_timers.engine_step_targets(),
    (llm_engine.LLMEngine, "step"),
    (llm_engine, "advance_grammars"),
    (llm_engine.LLMEngine, "_fill_masks_ahead"),
    (manager.StructuredOutputs, "bitmask"),
    (bitmask.BitmaskStaging, "_take_ahead"),
    (sampler.Sampler, "__call__"),
    (batch.SamplingBatch, "build"),
]


def run(label: str, loaded: LoadedModel, args: argparse.Namespace) -> None:
    constraint = StructuredOutputsParams(json=endless(NESTED)) if label == "constrained" else None
    spec = WorkloadSpec(num_requests=args.num_requests, input_len=(128, 128), output_len=(256, 256))
    workload = build_workload(spec, loaded.tokenizer, loaded.config.vocab_size)
    config = EngineConfig().with_options(
        model=args.model,
        device=str(loaded.device),
        dtype=args.dtype,
        load_format="dummy",
        max_model_len=512,
        structured_masks_ahead=not args.no_masks_ahead,
    )
    engine = llm_engine.LLMEngine(config, loaded=loaded)
    for request in workload.requests:
        engine.add_request(request.request_id, request.prompt_token_ids, greedy_params(256, True, constraint))
    steps: list[float] = []
    while len(steps) < LAST_STEP and engine.has_unfinished_requests():
        if len(steps) == FIRST_STEP:
            phase_timers.clear()
        started = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - started)
    if loaded.device.type == "cuda":
        torch.cuda.synchronize()
    timed_steps = steps[FIRST_STEP:]
    print(
        f"{label}: {sum(timed_steps) / len(timed_steps) * 1e3:.3f} ms a step on average, median "
        f"{statistics.median(timed_steps) * 1e3:.3f} (decode steps {FIRST_STEP}-{LAST_STEP})"
    )
    for name, seconds in sorted(phase_timers.SECONDS.items(), key=lambda item: -item[1]):
        per_step = phase_timers.CALLS[name] / len(timed_steps)
        print(f"  {name:36s} {seconds / len(timed_steps) * 1e3:7.3f} ms a step ({per_step:.0f} calls)")


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--runs", default="plain,constrained,plain,constrained")
    parser.add_argument("--phases", action="store_true")
    parser.add_argument("--no-masks-ahead", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = "bfloat16" if device == "cuda" else "float32"
    load_args = argparse.Namespace(
        threads=None, device=device, model=args.model, dtype=args.dtype, load_format="dummy", seed=0,
        tokenizer=args.tokenizer, quantization=None,
    )  # fmt: skip
    loaded = with_tokenizer(load_for_args(load_args), args.tokenizer)
    if args.phases:
        phase_timers.wrap(TIMED)
    for label in args.runs.split(","):
        run(label, loaded, args)


if __name__ == "__main__":
    main()
