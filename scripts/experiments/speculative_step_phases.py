"""Exploration for issue 17: where a batch-1 speculative step's time goes on the GPU, and what the overlap
policy buys. Runs `bench speculative`'s code-editing and copy-mix prompts one at a time (greedy) through
engines with speculation off and on (n-gram, each k given), every prompt off then on before the next:

* ``on`` starts plain decode steps ahead after a step without guesses, and defers guesses that meet such a
  started step (the engine's policy, ``speculative/guessing.py``);
* ``on-no-deferral`` drops the started step and verifies the guesses at once (the policy before);

then, with ``--phases``, times the engine's methods in one more ``on`` run, per kind of step (verifying
guesses or plain; with ``--fine`` also the graph runners' input building, copies and replays), and times
the replay of a decode graph and of the prefill graph a verification step uses, alone on the GPU.

    python scripts/experiments/speculative_step_phases.py --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --ks 4,8 [--phases]
"""

import argparse
import collections
import statistics
import time
from pathlib import Path
from typing import Any

import phase_timers
import torch
from graph_timing import replay_micros

from tokenmill.benchmarks import common, kernel_profile
from tokenmill.benchmarks.speculative import prompts
from tokenmill.benchmarks.speculative.timing import TimedRun, merged, one_at_a_time
from tokenmill.config import EngineConfig
from tokenmill.engine import llm_engine
from tokenmill.loading import LoadedModel
from tokenmill.runner import cuda_graphs, decode_inputs, model_runner, prefill_graphs, step_inputs
from tokenmill.runner.sampler import batch as sampler_batch
from tokenmill.runner.sampler import sampler
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler import scheduler
from tokenmill.speculative import guessing, verification

PHASES: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
STEP_KIND = {"verify": False}
TIMED: list[tuple[Any, str]] = [
    *phase_timers.engine_step_targets(),
    (guessing, "propose_drafts"),
    (model_runner.ModelRunner, "_compute_logits"),
    (model_runner, "verify_step"),
    (verification, "accepted_prefixes"),
    (verification, "_draft_tensors"),
    (prefill_graphs.PrefillGraphRunner, "run"),
]


FINE: list[tuple[Any, str]] = [
    (cuda_graphs.DecodeGraphRunner, "run"),
    (cuda_graphs.DecodeGraphRunner, "run_arrays"),
    (cuda_graphs.DecodeGraphRunner, "start_next_step"),
    (decode_inputs.DecodeInputs, "step_arrays"),
    (decode_inputs.DecodeInputs, "write_arrays"),
    (prefill_graphs.PrefillGraphRunner, "_write"),
    (prefill_graphs.PrefillGraphRunner, "run_arrays"),
    (torch.cuda.CUDAGraph, "replay"),
    (sampler_batch.SamplingBatch, "build"),
    (sampler.Sampler, "__call__"),
    (llm_engine.LLMEngine, "_can_start_next_step"),
    (guessing.GuessingRounds, "propose"),
]


def wrap_phases(fine: bool = False) -> None:
    phase_timers.wrap(TIMED + (FINE if fine else []))
    schedule = scheduler.Scheduler.schedule

    def classified(self: Any) -> Any:
        out = schedule(self)
        STEP_KIND["verify"] = any(chunk.num_draft_tokens for chunk in out.chunks)
        return out

    scheduler.Scheduler.schedule = classified  # type: ignore[method-assign]


def without_deferral(engine: llm_engine.LLMEngine) -> None:
    """The policy before ``GuessingRounds`` deferred guesses: a started step they meet is dropped."""
    propose = engine.guessing.propose

    def propose_at_once(proposer: Any, running: Any, started: Any) -> None:
        propose(proposer, running, None)

    engine.guessing.propose = propose_at_once  # type: ignore[method-assign]


def engines(
    base: EngineConfig, loaded: LoadedModel, ks: list[int], old_policy: bool
) -> dict[str, llm_engine.LLMEngine]:
    out = {"off": llm_engine.LLMEngine(base.with_options(speculative_method=None), loaded=loaded)}
    for k in ks:
        config = base.with_options(speculative_method="ngram", num_speculative_tokens=k)
        out[f"on k={k}"] = llm_engine.LLMEngine(config, loaded=loaded)
        if not old_policy:
            continue
        old = llm_engine.LLMEngine(config, loaded=loaded)
        without_deferral(old)
        out[f"on-no-deferral k={k}"] = old
    return out


def compare(loaded: LoadedModel, named: dict[str, llm_engine.LLMEngine], max_tokens: int) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    chat = loaded.tokenizer.apply_chat_template  # type: ignore[union-attr]
    hello = chat([{"role": "user", "content": "Say hi."}], True, tokenize=True)
    for engine in named.values():
        one_at_a_time("warm-up", engine, [hello], SamplingParams(temperature=0, max_tokens=8))
    for workload, texts in {"code editing": prompts.CODE_EDITING, "copy mix": prompts.COPY_MIX}.items():
        runs: dict[str, list[TimedRun]] = {name: [] for name in named}
        for text in texts:
            tokens = chat([{"role": "user", "content": text}], True, tokenize=True)
            for name, engine in named.items():
                runs[name].append(one_at_a_time(name, engine, [tokens], greedy))
        off = merged("off", runs["off"])
        for name in named:
            run = merged(name, runs[name])
            same = sum(a == b for a, b in zip(run.outputs, off.outputs, strict=True))
            rate, steps = run.decode_tok_s, max(run.num_decode_steps, 1)
            print(
                f"{workload:12s} {name:22s} {rate:8.1f} tok/s ({rate / off.decode_tok_s:.2f}x) step "
                f"{run.step_s * 1e3:.3f} ms, acceptance {run.spec.acceptance_rate:.2f}, per verification "
                f"{run.spec.mean_accepted_length:.2f}, per step {run.num_decode_tokens / steps:.2f}, "
                f"verifications {run.spec.num_steps}/{steps} steps, same tokens as off {same}/{len(texts)}",
                flush=True,
            )


def phases(loaded: LoadedModel, engine: llm_engine.LLMEngine, max_tokens: int, fine: bool = False) -> None:
    """Host timers per kind of step: verifying guesses, plain from a step started ahead, plain run at
    once; and the count of started steps dropped."""
    wrap_phases(fine)
    chat = loaded.tokenizer.apply_chat_template  # type: ignore[union-attr]
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    graphs = engine.runner.decode_graphs
    steps: dict[str, list[float]] = {"verify": [], "plain, started ahead": [], "plain, at once": []}
    dropped = 0
    for index, text in enumerate(prompts.CODE_EDITING):
        tokens = chat([{"role": "user", "content": text}], True, tokenize=True)
        engine.add_request(f"phases-{index}", tokens, greedy)
        first = True
        while engine.has_unfinished_requests():
            phase_timers.clear()
            reused = graphs.num_reused if graphs is not None else 0
            pending = graphs is not None and graphs.started_sequences() is not None
            started = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - started
            now_reused = graphs.num_reused if graphs is not None else 0
            dropped += pending and now_reused == reused
            if first:  # the prefill
                first = False
                continue
            kind = "verify" if STEP_KIND["verify"] else "plain, at once"
            if not STEP_KIND["verify"] and now_reused > reused:
                kind = "plain, started ahead"
            steps[kind].append(elapsed)
            for label, seconds in phase_timers.SECONDS.items():
                PHASES[kind][label] += seconds
    print(f"started steps dropped: {dropped}")
    for kind, times in steps.items():
        if not times:
            continue
        print(f"{kind}: {len(times)} steps, mean {statistics.mean(times) * 1e3:.3f} ms, median "
              f"{statistics.median(times) * 1e3:.3f}")  # fmt: skip
        for label, seconds in sorted(PHASES[kind].items(), key=lambda item: -item[1]):
            print(f"  {label:36s} {seconds / len(times) * 1e3:7.3f} ms a step")


def verification_gpu_split(loaded: LoadedModel, engine: llm_engine.LLMEngine, max_tokens: int) -> None:
    """A verification step's GPU timeline from CUDA events: from the graph runner's start (the host builds
    the inputs meanwhile, the GPU idle) to the end of the prefill graph, then the logits and the argmax
    the verification reads back."""
    runner = engine.runner
    graphs = runner.prefill_graphs
    run_graph, verify = graphs.run, model_runner.verify_step
    marks: list[torch.cuda.Event] = []
    spans: list[tuple[float, float]] = []

    def mark() -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append(event)

    def timed_graph(chunk: Any) -> Any:
        marks.clear()
        mark()
        out = run_graph(chunk)
        mark()
        return out

    def timed_verify(*args: Any) -> Any:
        out = verify(*args)
        mark()
        torch.cuda.synchronize()
        if len(marks) == 3:
            spans.append((marks[0].elapsed_time(marks[1]), marks[1].elapsed_time(marks[2])))
        return out

    graphs.run = timed_graph  # type: ignore[method-assign]
    model_runner.verify_step = timed_verify  # type: ignore[assignment]
    try:
        chat = loaded.tokenizer.apply_chat_template  # type: ignore[union-attr]
        greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
        for index, text in enumerate(prompts.CODE_EDITING):
            tokens = chat([{"role": "user", "content": text}], True, tokenize=True)
            engine.add_request(f"split-{index}", tokens, greedy)
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        graphs.run = run_graph  # type: ignore[method-assign]
        model_runner.verify_step = verify
    if spans:
        graph_ms = statistics.median(a for a, _ in spans)
        rest_ms = statistics.median(b for _, b in spans)
        print(f"verification GPU split over {len(spans)} steps (median): runner start to graph end "
              f"{graph_ms:.3f} ms, logits + argmax after it {rest_ms:.3f} ms")  # fmt: skip


def replay_times(engine: llm_engine.LLMEngine) -> None:
    runner = engine.runner
    sets = [("decode", runner.decode_graphs), ("prefill", runner.prefill_graphs)]
    for name, graphs in sets:
        if graphs is None:
            continue
        for size, graph in sorted(graphs.graphs.items())[:4]:
            print(f"{name} graph of {size}: {replay_micros(graph):.1f} µs a replay (GPU, back to back)")


def profile_graphs(engine: llm_engine.LLMEngine, folder: Path) -> None:
    """Kernels of 20 replays of the one-row decode graph and of the 16- and 32-token prefill graphs."""
    runner = engine.runner
    cases = [("decode-1", runner.decode_graphs, 1), ("prefill-16", runner.prefill_graphs, 16)]
    cases.append(("prefill-32", runner.prefill_graphs, 32))
    for label, graphs, size in cases:
        if graphs is None or size not in graphs.graphs:
            continue
        graph = graphs.graphs[size]
        graph.replay()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
            for _ in range(20):
                graph.replay()
            torch.cuda.synchronize()
        path = folder / f"{label}.json"
        profiler.export_chrome_trace(str(path))
        summary = kernel_profile.summarize(kernel_profile.read_kernels(path), 0, top=15)
        print("\n".join(kernel_profile.profile_tables([summary], 20, label)), flush=True)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--ks", default="4,8")
    parser.add_argument("--max-tokens", type=int, default=320)
    parser.add_argument("--phases", action="store_true")
    parser.add_argument("--fine", action="store_true", help="with --phases: the graph runners' parts too")
    parser.add_argument("--profile-dir", type=Path, help="trace graph replays into this folder")
    parser.add_argument("--dummy", action="store_true", help="random weights (--model names a preset)")
    parser.add_argument("--quantization", help="e.g. none: a GGUF model's weights as float (default: auto)")
    parser.add_argument("--gpu-split", action="store_true", help="CUDA-event split of verification steps")
    parser.add_argument("--no-old-policy", action="store_true", help="skip the on-no-deferral engines")
    parser.add_argument("--tokenizer", help="a tokenizer folder or model (with --dummy weights)")
    parser.add_argument("--off", action="append", default=[], help="an engine toggle to switch off")
    parser.add_argument(
        "--general-inputs", action="store_true", help="graphs build their inputs as eager steps do"
    )
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    load_args = argparse.Namespace(
        threads=None, device=device, model=args.model, dtype="bfloat16" if device == "cuda" else "float32",
        load_format="dummy" if args.dummy else "auto", seed=0, tokenizer=args.tokenizer,
        quantization=args.quantization,
    )  # fmt: skip
    loaded = common.load_for_args(load_args)
    base = EngineConfig().with_options(model=args.model, device=device, max_model_len=2048, num_kv_blocks=512)
    if args.quantization is not None:
        base = base.with_options(quantization=args.quantization)
    base = base.with_options(**dict.fromkeys(args.off, False))
    if args.general_inputs:  # batch-1 steps built as batches (the builder before one_chunk_arrays)

        def general(chunk: Any, kv: Any, width: int | None, with_token_ids: bool = True) -> Any:
            return step_inputs.batch_step_arrays([chunk], kv, None, width, with_token_ids)

        step_inputs.one_chunk_arrays = general  # type: ignore[assignment]
    named = engines(base, loaded, [int(k) for k in args.ks.split(",")], not args.no_old_policy)
    if args.profile_dir is not None:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
        one_at_a_time(
            "warm-up", named["off"], [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=4)
        )
        profile_graphs(named["off"], args.profile_dir)
        return
    compare(loaded, named, args.max_tokens)
    first_on = next(name for name in named if name.startswith("on k="))
    if device == "cuda":
        replay_times(named[first_on])
    if args.phases:
        phases(loaded, named[first_on], args.max_tokens, args.fine)
    if args.gpu_split and device == "cuda":
        verification_gpu_split(loaded, named[first_on], args.max_tokens)


if __name__ == "__main__":
    main()
