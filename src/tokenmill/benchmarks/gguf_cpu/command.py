"""Runs the three measurements of this benchmark (see the package docstring) and prints them."""

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from tokenmill.benchmarks.gguf_cpu.layers import PROJECTIONS, LayerTiming, time_projections
from tokenmill.benchmarks.gguf_cpu.peer import DecodeRun, LlamaCpp
from tokenmill.benchmarks.gguf_cpu.swap import swap_in_packed
from tokenmill.loading.default_model import default_model_path
from tokenmill.loading.gguf_checkpoint import GGUFCheckpoint
from tokenmill.loading.gguf_file import GGUFFile
from tokenmill.loading.packaged_models import packaged_model_path

# Prompts are windows of this text, 8 tokens apart, so that no two sequences share a prefix of KV.
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a wooden press adapted from those used for wine. Within "
    "decades, printers had set up shops across Europe, and the price of books fell sharply. Scholars could "
    "compare identical copies of a text for the first time, which changed how knowledge was checked and "
    "shared. Pamphlets spread news and arguments quickly, and literacy rose as reading material became "
    "cheaper. Governments and churches soon tried to license printers and censor what they produced."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a GGUF file or packaged model name (default: smollm2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="layer timings: rows per call")
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 8], help="decode: batch sizes")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="decode runs per engine and batch (best kept)")
    parser.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    parser.add_argument("--no-engine", action="store_true", help="skip the decode runs (layer timings only)")
    parser.add_argument("--json", type=Path, default=None, help="write every figure to this file")


def _model_path(name: str | None) -> Path:
    if name is None:
        return default_model_path()
    return packaged_model_path(name) or Path(name)


def _prompts(token_ids: list[int], count: int, length: int) -> list[list[int]]:
    if len(token_ids) < length + 8 * (count - 1):
        raise SystemExit(f"the prompt text has {len(token_ids)} tokens, too few for {count} x {length}")
    return [token_ids[8 * i : 8 * i + length] for i in range(count)]


def _tokenmill_run(llm: object, prompts: list[list[int]], new_tokens: int) -> DecodeRun:
    """Decode time as the difference of a 1-token and a ``new_tokens`` run (both prefill the same)."""
    from tokenmill.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    assert isinstance(llm, LLM)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    times, outputs = [], []
    for tokens in (1, new_tokens):
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(inputs, params)
        times.append(time.perf_counter() - start)
    ids = tuple(tuple(o.outputs[0].token_ids) for o in outputs)
    return DecodeRun("tokenmill float32", len(prompts), new_tokens, times[0], times[1] - times[0], ids)


def _print_layers(timings: list[LayerTiming]) -> None:
    print(f"{'projection':>10} {'qtype':>6} {'shape':>11} {'rows':>4} {'packed us':>9} {'f32 us':>8} "
          f"{'speedup':>7} {'B/weight':>8}")  # fmt: skip
    for t in timings:
        shape, per_weight = (
            f"{t.out_features}x{t.in_features}",
            t.packed_bytes / t.out_features / t.in_features,
        )
        print(f"{t.name:>10} {t.qtype:>6} {shape:>11} {t.rows:>4} {t.packed_s * 1e6:>9.1f} "
              f"{t.float32_s * 1e6:>8.1f} {t.speedup:>7.2f} {per_weight:>8.3f}")  # fmt: skip


def estimate_packed_step(run: DecodeRun, timings: list[LayerTiming], layers: int) -> float:
    """Seconds per decode step with packed projections: the float32 step minus its projections' float32
    time plus their packed time (the rest of the step, attention, norms, sampling, host, unchanged)."""
    rows = [t for t in timings if t.rows == run.sequences]
    if len(rows) != len(PROJECTIONS):
        raise ValueError(f"no layer timings at {run.sequences} rows")
    saved = sum((t.float32_s - t.packed_s) * (1 if t.name == "lm_head" else layers) for t in rows)
    return run.decode_s / (run.new_tokens - 1) - saved


def _first_divergence(ours: DecodeRun, reference: DecodeRun) -> int | None:
    """The first output position where some sequence's greedy token differs; None when all agree."""
    positions = [
        next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b), None)
        for mine, theirs in zip(ours.tokens, reference.tokens, strict=True)
    ]
    found = [p for p in positions if p is not None]
    return min(found) if found else None


def _decode_runs(args: argparse.Namespace, path: Path, timings: list[LayerTiming], layers: int) -> list[dict]:
    """Per batch size: tokenmill float32, the same engine with packed projections swapped in, the packed
    estimate from the layer timings, and llama.cpp; greedy tokens compared with tokenmill float32."""
    from tokenmill.llm import LLM

    max_len = args.prompt_len + args.new_tokens
    llm = LLM(str(path), max_model_len=max_len + 16, max_num_seqs=max(args.sequences))
    token_ids = llm.get_tokenizer().encode(TEXT)
    prompts = {count: _prompts(token_ids, count, args.prompt_len) for count in args.sequences}

    def best(runs: "Callable[[list[list[int]]], DecodeRun]", count: int) -> DecodeRun:
        return min((runs(prompts[count]) for _ in range(args.repeats)), key=lambda run: run.decode_s)

    def tokenmill(batch: list[list[int]]) -> DecodeRun:
        return _tokenmill_run(llm, batch, args.new_tokens)

    float32 = {count: best(tokenmill, count) for count in args.sequences}
    swap_in_packed(llm.engine.runner.model, GGUFCheckpoint(path))
    packed = {count: best(tokenmill, count) for count in args.sequences}
    lines: list[dict] = []
    peer = None if args.no_peer else LlamaCpp(path, max(args.sequences), max_len, args.threads)
    for count in args.sequences:
        line: dict[str, object] = {
            "sequences": count,
            "tokenmill_float32": float32[count].decode_tokens_per_s,
            "tokenmill_packed": packed[count].decode_tokens_per_s,
            "tokenmill_packed_estimate": count / estimate_packed_step(float32[count], timings, layers),
            "packed_first_divergence": _first_divergence(packed[count], float32[count]),
        }
        if peer is not None:
            theirs = best(lambda batch: peer.generate(batch, args.new_tokens), count)
            line["llama_cpp"] = theirs.decode_tokens_per_s
            line["llama_cpp_first_divergence"] = _first_divergence(theirs, float32[count])
        lines.append(line)
        print("decode tok/s: " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in line.items()), flush=True)  # fmt: skip
    if peer is not None:
        peer.close()
    return lines


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    path = _model_path(args.model)
    file = GGUFFile(path)
    layers = int(file.metadata[f"{file.metadata['general.architecture']}.block_count"])
    print(f"{path.name}: {layers} layers, {args.threads} threads", flush=True)
    timings = time_projections(file, layers, tuple(args.rows))
    _print_layers(timings)
    report: dict[str, object] = {"model": str(path), "threads": args.threads}
    report["layers"] = [asdict(t) for t in timings]
    if not args.no_engine:
        report["decode"] = _decode_runs(args, path, timings, layers)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    from tokenmill.benchmarks.common import run_as_script

    return run_as_script("gguf-cpu", __doc__, add_arguments, run, argv)
