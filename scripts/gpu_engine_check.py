"""The GPU decode step on a CUDA host: correctness of CUDA graphs, decode speed, KV sizing, a profile.

One engine (dummy weights of a preset, bf16, Triton attention, CUDA graphs, KV pool sized from free
memory) is run in three modes by switching its runner in place: ``graphs`` (decode steps replayed from
CUDA graphs), ``eager`` (same Triton kernels, launched one by one) and ``torch`` (the PyTorch attention
backend, eager). Checks: greedy tokens and chosen-token logprobs agree across modes on a batch that
needs padding; a graph replay equals the eager forward over the same static buffers bit for bit, and
the eager step closely. Timings: batch-1 and batch-64 decode tok/s per mode, a graph replay alone, and
the memory-bandwidth bound (weights + KV read per token over a measured device copy). Prints the
start-up log (KV sizing, capture), a profiler summary of batch-1 decode steps, and a table last.

    PYTHONPATH=src python scripts/gpu_engine_check.py [--preset llama-3.2-1b] [--out DIR]
    TRITON_INTERPRET=1 PYTHONPATH=src python scripts/gpu_engine_check.py --dry-run --preset PATH
      (CPU, tiny sizes, the graph runner running its static buffers eagerly: checks the script itself)
"""

import argparse
import contextlib
import json
import logging
import random
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill import SamplingParams
from tokenmill.attention import ForwardContext, TorchAttentionBackend, forward_context
from tokenmill.benchmarks.latency import decode_bytes_per_token, measure_copy_bandwidth
from tokenmill.config import EngineConfig
from tokenmill.runner.cuda_graphs import DecodeGraphRunner, cuda_graph_batch_sizes, padded_batch_size
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.loading import load_model

MODES = ("overlap", "graphs", "eager", "torch")
SUMMARY: dict[str, Any] = {}


@dataclass(frozen=True)
class Sizes:
    prompt_len: int = 128
    batch1_tokens: int = 512
    big_batch: int = 64
    big_batch_tokens: int = 256
    check_batch: int = 13  # padded to 16; the batch then shrinks through 8, 4, 2, 1
    check_tokens: int = 64
    replay_batches: tuple[int, ...] = (3, 13, 64)
    profile_steps: int = 20


DRY_RUN = Sizes(16, 6, 5, 4, 5, 6, (3,), 3)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def mode(engine: LLMEngine, name: str) -> Iterator[None]:
    """Run ``engine`` as ``name``: decode graphs with or without the overlapped next step, or eager
    with Triton or PyTorch attention."""
    runner = engine.runner
    graphs, backend = runner.decode_graphs, runner.backend
    overlap = graphs.overlap if graphs is not None else False
    if graphs is not None:
        graphs.overlap = name == "overlap"
    if name in ("eager", "torch"):
        runner.decode_graphs = None
    if name == "torch":
        runner.backend = TorchAttentionBackend()
    try:
        yield
    finally:
        runner.decode_graphs, runner.backend = graphs, backend
        if graphs is not None:
            graphs.overlap = overlap


def section(title: str, body: Callable[[], None]) -> None:
    print(f"\n== {title}", flush=True)
    start = time.perf_counter()
    try:
        body()
    except Exception:  # report and go on: one call of the device has to bring back everything it can
        traceback.print_exc()
        SUMMARY.setdefault("failed", []).append(title)
    print(f"({title}: {time.perf_counter() - start:.1f} s)", flush=True)


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab // 8, vocab - vocab // 8) for _ in range(length)]


def run_requests(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[list[list[int]], list[list[float]], list[tuple[float, int]]]:
    """Tokens and chosen-token logprobs per request, and (time, tokens) of every step."""
    tag = f"{time.perf_counter_ns()}"
    ids = [f"{tag}-{index}" for index in range(len(prompts))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    logprobs: dict[str, list[float]] = {rid: [] for rid in ids}
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, p)
    steps = []
    sync(engine.device)
    while engine.has_unfinished_requests():
        deltas = engine.step()
        steps.append((time.perf_counter(), sum(len(d.new_token_ids) for d in deltas)))
        for delta in deltas:
            tokens[delta.request_id] += delta.new_token_ids
            logprobs[delta.request_id] += [entry.logprob for entry in delta.new_logprobs or []]
    return [tokens[rid] for rid in ids], [logprobs[rid] for rid in ids], steps


def check_correctness(engine: LLMEngine, sizes: Sizes) -> None:
    rng = random.Random(0)
    vocab, count = engine.model_config.vocab_size, sizes.check_batch
    prompts = [random_prompt(rng, rng.randint(5, 300), vocab) for _ in range(count)]
    params = [
        SamplingParams(
            temperature=0, max_tokens=rng.randint(2, sizes.check_tokens), ignore_eos=True, logprobs=0
        )
        for _ in range(count)
    ]
    results = {}
    for name in MODES:
        with mode(engine, name):
            tokens, logprobs, _ = run_requests(engine, prompts, params)
        results[name] = (tokens, logprobs)
    for a, b in (("overlap", "graphs"), ("graphs", "eager"), ("eager", "torch"), ("graphs", "torch")):
        same, prefix, total, worst = 0, 0, 0, 0.0
        for ta, la, tb, lb in zip(*results[a], *results[b], strict=True):
            agree = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), len(ta))
            same += ta == tb
            prefix += agree
            total += len(ta)
            worst = max([worst, *(abs(x - y) for x, y in zip(la[:agree], lb[:agree], strict=True))])
        print(f"{a} vs {b}: {same}/{count} sequences identical, {prefix}/{total} tokens before the first "
              f"difference; max |logprob diff| on the common prefix {worst:.2e}")  # fmt: skip
        SUMMARY[f"identical {a} vs {b}"] = f"{same}/{count} seqs, {prefix}/{total} tokens"
        SUMMARY[f"max logprob diff {a} vs {b}"] = f"{worst:.2e}"


def check_replay(engine: LLMEngine, sizes: Sizes) -> None:
    """One decode step three ways over the same inputs: replay, eager over the static buffers, eager."""
    graphs = engine.runner.decode_graphs
    assert graphs is not None and engine.kv_cache is not None
    rng = random.Random(1)
    vocab = engine.model_config.vocab_size
    for batch in sizes.replay_batches:
        tag = f"replay{batch}"
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        for index in range(batch):
            engine.add_request(f"{tag}-{index}", random_prompt(rng, rng.randint(5, 200), vocab), params)
        while engine.num_waiting:
            engine.step()  # prefills
        chunks = engine.scheduler.schedule().chunks
        rows = padded_batch_size(len(chunks), graphs.sizes)
        assert rows is not None and graphs.can_run(chunks)
        with torch.inference_mode():
            model = engine.runner.model
            replayed = graphs.run(chunks).logits.clone()
            static_outputs = graphs.forward_static(rows)
            static = (
                static_outputs[0] if graphs.computes_logits(rows) else model.compute_logits(static_outputs[0])
            )
            static = static[: len(chunks)]
            inputs = engine.runner.prepare(chunks)
            context = ForwardContext(inputs.metadata, engine.runner.backend, engine.kv_cache.layers)
            with forward_context(context):
                eager = model.compute_logits(model(inputs.input_ids, inputs.positions))
            torch_context = ForwardContext(inputs.metadata, TorchAttentionBackend(), engine.kv_cache.layers)
            with forward_context(torch_context):
                reference = model.compute_logits(model(inputs.input_ids, inputs.positions))
        exact = torch.equal(replayed, static)
        rel = float((replayed - eager).norm() / eager.norm())
        rel_torch = float((eager - reference).norm() / reference.norm())
        print(f"batch {batch} (graph of {rows}): replay == eager over static buffers: {exact}; "
              f"relative difference from the eager step {rel:.2e} (eager Triton vs eager torch "
              f"attention, the bf16 noise of this model: {rel_torch:.2e})")  # fmt: skip
        SUMMARY[f"replay bitwise == static eager (batch {batch})"] = exact
        SUMMARY[f"replay vs eager step rel err (batch {batch})"] = (
            f"{rel:.2e} (triton vs torch {rel_torch:.2e})"
        )
        for index in range(batch):
            engine.abort(f"{tag}-{index}")
        while engine.has_unfinished_requests():
            engine.step()


def decode_tok_s(
    engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int, staggered: bool = False
) -> float:
    """Output tokens per second over the steps after the first (which prefills every prompt).
    ``staggered``: prompt lengths spread over [prompt_len / 4, prompt_len * 5 / 4], so the sequences
    cross KV block boundaries at different steps."""
    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    low, high = (prompt_len // 4, prompt_len * 5 // 4) if staggered else (prompt_len, prompt_len)
    prompts = [random_prompt(rng, rng.randint(low, high), vocab) for _ in range(batch)]
    params = [SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)] * batch
    _, _, steps = run_requests(engine, prompts, params)
    (first_time, _), rest = steps[0], steps[1:]
    return sum(n for _, n in rest) / (rest[-1][0] - first_time)


def time_decode(engine: LLMEngine, sizes: Sizes, bytes_per_token: int, bandwidth: float) -> None:
    for name in MODES:
        with mode(engine, name):
            decode_tok_s(engine, 1, sizes.prompt_len, 16)  # warm-up
            one = max(decode_tok_s(engine, 1, sizes.prompt_len, sizes.batch1_tokens) for _ in range(2))
            big = decode_tok_s(engine, sizes.big_batch, sizes.prompt_len, sizes.big_batch_tokens)
        SUMMARY[f"batch 1 decode tok/s ({name})"] = round(one, 1)
        SUMMARY[f"batch {sizes.big_batch} decode tok/s ({name})"] = round(big, 1)
        print(f"{name}: batch 1 {one:.1f} tok/s, batch {sizes.big_batch} {big:.1f} tok/s", flush=True)
    for name in ("overlap", "graphs"):
        with mode(engine, name):
            big = decode_tok_s(engine, sizes.big_batch, sizes.prompt_len, sizes.big_batch_tokens, True)
        SUMMARY[f"batch {sizes.big_batch} staggered decode tok/s ({name})"] = round(big, 1)
        print(f"{name}: batch {sizes.big_batch}, staggered prompts: {big:.1f} tok/s", flush=True)
    graphs = engine.runner.decode_graphs
    if graphs is not None:
        SUMMARY["overlap: next steps started / used (whole run)"] = (
            f"{graphs.num_started} / {graphs.num_reused}"
        )
    limit = bandwidth / bytes_per_token
    SUMMARY["bandwidth-bound batch-1 tok/s"] = round(limit, 1)
    SUMMARY["batch 1 graphs / bandwidth bound"] = round(SUMMARY["batch 1 decode tok/s (graphs)"] / limit, 3)


def time_replay(engine: LLMEngine) -> None:
    """The device side of a batch-1 decode step, no host in the way: graph replay alone, and replay plus
    logits and argmax, timed with events over many back-to-back iterations."""
    graphs = engine.runner.decode_graphs
    assert graphs is not None
    assert engine.kv_cache is not None
    graphs.inputs.write([], engine.kv_cache.manager, 1)  # a padding row: writes no live KV
    graph, outputs = graphs.graphs[1], graphs.outputs[1]
    model = engine.runner.model
    steps = [("replay", graph.replay)]
    if not graphs.computes_logits(1):  # the replay computes only the hidden states
        steps.append(
            (
                "replay + logits + argmax",
                lambda: (graph.replay(), model.compute_logits(outputs[0]).argmax(-1)),
            )
        )
    for label, body in steps:
        for _ in range(10):
            body()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(200):
            body()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 200
        SUMMARY[f"batch-1 {label} ms"] = round(ms, 4)
        print(f"batch-1 {label}: {ms:.4f} ms ({1000 / ms:.0f} steps/s)")


@contextmanager
def timed(obj: Any, attribute: str, label: str, totals: dict[str, list[float]]) -> Iterator[None]:
    """Record the host time of each call of ``obj.attribute`` under ``label``."""
    original = getattr(obj, attribute)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals.setdefault(label, []).append(time.perf_counter() - start)

    setattr(obj, attribute, wrapped)
    try:
        yield
    finally:
        setattr(obj, attribute, original)


def host_parts(engine: LLMEngine) -> list[tuple[Any, str, str]]:
    runner = engine.runner
    parts = [
        (engine, "step", "engine.step"),
        (engine.scheduler, "schedule", "  scheduler.schedule"),
        (runner, "execute", "  runner.execute"),
        (runner, "_sample", "    runner._sample (sampling, read of the ids: waits for the GPU)"),
        (runner.model, "compute_logits", "    model.compute_logits (launch)"),
    ]
    graphs = runner.decode_graphs
    if graphs is not None:
        parts += [
            (graphs, "run", "    graphs.run"),
            (graphs.inputs, "write", "      DecodeInputs.write"),
            (graphs, "_forward", "      graphs._forward (replay launch)"),
            (graphs, "start_next_step", "      graphs.start_next_step"),
        ]
    return parts


def time_host(engine: LLMEngine, name: str, steps: int) -> None:
    """Host time of each part of a batch-1 decode step, no profiler attached (it slows the host)."""
    rng = random.Random(8)
    totals: dict[str, list[float]] = {}
    with mode(engine, name), contextlib.ExitStack() as stack:
        prompt = random_prompt(rng, 128, engine.model_config.vocab_size)
        params = SamplingParams(temperature=0, max_tokens=steps + 30, ignore_eos=True)
        engine.add_request("host", prompt, params)
        for _ in range(8):
            engine.step()
        sync(engine.device)
        for obj, attribute, label in host_parts(engine):
            stack.enter_context(timed(obj, attribute, label, totals))
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - start) / steps
    engine.abort("host")
    engine.step()
    print(f"{name}: {wall * 1e6:.0f} us per step ({1 / wall:.0f} tok/s); host time per step of:")
    for label, times in totals.items():
        print(f"  {label:70s} {sum(times) / steps * 1e6:8.1f} us ({len(times) / steps:.2f} calls)")
    SUMMARY[f"batch-1 step us, timed loop ({name})"] = round(wall * 1e6)


def profile_steps(engine: LLMEngine, name: str, steps: int, out: Path) -> None:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    rng = random.Random(7)
    with mode(engine, name):
        prompt = random_prompt(rng, 128, engine.model_config.vocab_size)
        engine.add_request(
            "prof", prompt, SamplingParams(temperature=0, max_tokens=steps + 20, ignore_eos=True)
        )
        for _ in range(8):
            engine.step()
        sync(engine.device)
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            sync(engine.device)
            wall = (time.perf_counter() - start) / steps
        engine.abort("prof")
        engine.step()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / steps
    print(f"{name}: wall {wall * 1e6:.0f} us per step, GPU busy {gpu_us:.0f} us per step "
          f"({gpu_us / (wall * 1e6):.0%})")  # fmt: skip
    SUMMARY[f"batch-1 step wall us ({name})"] = round(wall * 1e6)
    SUMMARY[f"batch-1 step GPU busy us ({name})"] = round(gpu_us)
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    print(f"{'kernel':60s} {'per step':>8s} {'us/step':>9s} {'us each':>8s}")
    for event in kernels[:24]:
        total = event.self_device_time_total
        print(
            f"{event.key[:60]:60s} {event.count / steps:8.1f} {total / steps:9.1f} {total / event.count:8.2f}"
        )
    prof.export_chrome_trace(str(out / f"trace_{name}.json"))


def install_static_decode(engine: LLMEngine, max_num_seqs: int) -> None:
    """Dry run on CPU: the graph runner over its static buffers, eagerly (no capture without CUDA)."""
    kv = engine.kv_cache
    assert kv is not None
    engine.runner.decode_graphs = DecodeGraphRunner(
        engine.runner.model,
        engine.runner.backend,
        kv.layers,
        kv.manager,
        cuda_graph_batch_sizes(max_num_seqs),
        engine.max_model_len,
        engine.device,
        overlap=True,
        requests_waiting=lambda: bool(engine.scheduler.waiting),
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="llama-3.2-1b", help="a dummy-weight preset or config folder")
    parser.add_argument("--out", type=Path, default=Path())
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, graphs run eagerly")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.dry_run else "cuda")
    sizes = DRY_RUN if args.dry_run else Sizes()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}", flush=True)
    bandwidth = measure_copy_bandwidth(device, 4 * 2**30 if device.type == "cuda" else None)
    SUMMARY["device"] = name
    SUMMARY["copy bandwidth TB/s"] = round(bandwidth / 1e12, 3)
    start = time.perf_counter()
    dtype = "float32" if args.dry_run else "bfloat16"
    loaded = load_model(args.preset, device=device, dtype=dtype, load_format="dummy")
    print(f"loaded {args.preset} (dummy, {dtype}) in {time.perf_counter() - start:.1f} s")
    config = EngineConfig(
        device=device.type, attention_backend="triton", cuda_graphs=True, overlap_decode=True,
        max_num_seqs=args.max_num_seqs,
        max_model_len=512 if args.dry_run else None, cpu_kv_cache_gib=0.5,
    )  # fmt: skip
    start = time.perf_counter()
    engine = LLMEngine(config, loaded=loaded)
    SUMMARY["engine start-up s (profile + KV pool + capture)"] = round(time.perf_counter() - start, 1)
    if args.dry_run:
        install_static_decode(engine, args.max_num_seqs)
    kv_cache = engine.kv_cache
    assert kv_cache is not None
    SUMMARY["KV pool"] = f"{kv_cache.manager.num_blocks} blocks, {kv_cache.capacity_tokens} tokens"
    SUMMARY["KV pool GiB"] = round(kv_cache.pool_bytes() / 2**30, 2)
    weights, kv = decode_bytes_per_token(loaded, sizes.prompt_len + sizes.batch1_tokens // 2)
    SUMMARY["bytes read per batch-1 token (weights + KV at the mean context)"] = f"{weights} + {kv}"
    section("correctness across modes", lambda: check_correctness(engine, sizes))
    section("graph replay vs eager", lambda: check_replay(engine, sizes))
    section("decode timings", lambda: time_decode(engine, sizes, weights + kv, bandwidth))
    if device.type == "cuda":
        section("device time of a batch-1 step", lambda: time_replay(engine))
    for mode_name in ("overlap", "graphs"):
        title = f"host time of batch-1 decode steps ({mode_name})"
        section(title, lambda m=mode_name: time_host(engine, m, 10 * sizes.profile_steps))
    title = "profile of batch-1 decode steps (graphs)"
    section(title, lambda: profile_steps(engine, "graphs", sizes.profile_steps, args.out))
    (args.out / "summary.json").write_text(json.dumps(SUMMARY, indent=1))
    print("\n== summary")
    for key, value in SUMMARY.items():
        print(f"{key:62s} {value}")
    return 1 if SUMMARY.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
