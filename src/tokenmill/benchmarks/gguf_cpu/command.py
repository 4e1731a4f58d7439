"""Runs the three measurements of this benchmark (see the package docstring) and prints them."""

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import torch

from tokenmill.benchmarks.argument_types import report_dir
from tokenmill.benchmarks.gguf_cpu.layers import LayerTiming, time_projections
from tokenmill.benchmarks.gguf_cpu.peer import DecodeRun, LlamaCpp
from tokenmill.benchmarks.report import detect_hardware, markdown_table, provenance_header, write_json
from tokenmill.loading.default_model import default_model_path
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
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=("auto", "torch", "cpu"),
        help="tokenmill's (default: auto)",
    )
    parser.add_argument("--no-engine", action="store_true", help="skip the decode runs (layer timings only)")
    parser.add_argument("--json", type=Path, default=None, help="write every figure to this file")
    parser.add_argument("--report-dir", type=report_dir, default=None, help="write gguf-cpu.md / .json here")


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
    print(f"{'projection':>10} {'qtype':>6} {'shape':>11} {'rows':>4} {'packed us':>9} {'int16 us':>8} "
          f"{'int8 us':>8} {'f32 us':>8} {'speedup':>7} {'int16 x':>7} {'int8 x':>7} "
          f"{'B/weight':>8}")  # fmt: skip
    for t in timings:
        shape, per_weight = (
            f"{t.out_features}x{t.in_features}",
            t.packed_bytes / t.out_features / t.in_features,
        )
        print(f"{t.name:>10} {t.qtype:>6} {shape:>11} {t.rows:>4} {t.packed_s * 1e6:>9.1f} "
              f"{t.packed_int16_s * 1e6:>8.1f} {t.packed_int8_s * 1e6:>8.1f} {t.float32_s * 1e6:>8.1f} "
              f"{t.speedup:>7.2f} {t.int16_speedup:>7.2f} {t.int8_speedup:>7.2f} "
              f"{per_weight:>8.3f}")  # fmt: skip


def _first_divergence(ours: DecodeRun, reference: DecodeRun) -> int | None:
    """The first output position where some sequence's greedy token differs; None when all agree."""
    positions = [
        next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b), None)
        for mine, theirs in zip(ours.tokens, reference.tokens, strict=True)
    ]
    found = [p for p in positions if p is not None]
    return min(found) if found else None


def _engine(path: Path, quantization: str, args: argparse.Namespace, **options: Any) -> object:
    from tokenmill.llm import LLM

    max_len = args.prompt_len + args.new_tokens
    return LLM(
        str(path),
        max_model_len=max_len + 16,
        max_num_seqs=max(args.sequences),
        quantization=quantization,
        attention_backend=args.attention_backend,
        **options,
    )


def _weight_bytes(llm: object) -> int:
    """Bytes of the weights a decode step reads once: packed projections and head, float parameters
    (norms; the float32 embedding is read by row, not whole, so it is left out where the head is packed)."""
    from tokenmill.llm import LLM
    from tokenmill.quantization.gguf_method import packed_nbytes

    assert isinstance(llm, LLM)
    model = llm.engine.runner.model
    packed = sum(packed_nbytes(module) for module in model.modules())
    floats = sum(p.numel() * p.element_size() for p in model.parameters())
    if packed_nbytes(model.lm_head):
        floats -= model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    return packed + floats


def copy_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second of the best of ``repeats`` copies of a ``megabytes`` float32 tensor (read + write
    counted), at torch's thread count: the machine's practical memory bandwidth."""
    source = torch.ones(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() * 4 / best


# tokenmill's engines on the file, each against float32 weights' greedy tokens: (key, label, quantization,
# gguf_activations); the default is what a user gets with no flags.
VARIANTS = (
    ("float32", "float32 weights", "none", "float32"),
    ("default", "default (gguf, float32 inputs)", "auto", "float32"),
    ("gguf_int16_inputs", "gguf, int16 inputs", "gguf", "int16"),
    ("gguf_int8_inputs", "gguf, int8 inputs", "gguf", "int8"),
)
RATIOS = ("default", "gguf_int16_inputs", "gguf_int8_inputs")  # engines whose ratio to llama.cpp is shown


def _decode_runs(args: argparse.Namespace, path: Path) -> list[dict[str, Any]]:
    """Per batch size: each of tokenmill's ``VARIANTS`` and llama.cpp on the same file, greedy tokens
    compared with tokenmill float32 weights'."""
    runs: dict[str, dict[int, DecodeRun]] = {}
    prompts: dict[int, list[list[int]]] = {}
    step_bytes = 0
    for key, _, quantization, activations in VARIANTS:
        llm = _engine(path, quantization, args, gguf_activations=activations)
        if not prompts:
            token_ids = llm.get_tokenizer().encode(TEXT)  # type: ignore[attr-defined]
            prompts = {count: _prompts(token_ids, count, args.prompt_len) for count in args.sequences}
        generate = partial(_tokenmill_run, llm, new_tokens=args.new_tokens)
        runs[key] = {c: _best(generate, prompts[c], args.repeats) for c in args.sequences}
        if key == "default":
            step_bytes = _weight_bytes(llm)
            print(f"default: {_describe(llm)}", flush=True)
    peer = None if args.no_peer else LlamaCpp(path, max(args.sequences), args.prompt_len + args.new_tokens,
                                              args.threads)  # fmt: skip
    lines: list[dict] = []
    for count in args.sequences:
        line: dict[str, Any] = {"sequences": count, "gguf_weight_bytes_per_step": step_bytes}
        for key, *_ in VARIANTS:
            line[f"tokenmill_{key}"] = runs[key][count].decode_tokens_per_s
            line[f"{key}_first_divergence"] = _first_divergence(runs[key][count], runs["float32"][count])
        if peer is not None:
            theirs = _best(partial(peer.generate, new_tokens=args.new_tokens), prompts[count], args.repeats)
            line["llama_cpp"] = theirs.decode_tokens_per_s
            line["llama_cpp_first_divergence"] = _first_divergence(theirs, runs["float32"][count])
        lines.append(line)
        print("decode tok/s: " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in line.items()), flush=True)  # fmt: skip
    if peer is not None:
        peer.close()
    return lines


def _best(
    generate: Callable[[list[list[int]]], DecodeRun], prompts: list[list[int]], repeats: int
) -> DecodeRun:
    """The fastest decode of ``repeats`` runs of ``prompts``."""
    return min((generate(prompts) for _ in range(repeats)), key=lambda run: run.decode_s)


def _describe(llm: object) -> str:
    """The default engine's weights and inputs as resolved on this machine."""
    from tokenmill.llm import LLM

    assert isinstance(llm, LLM)
    options = llm.engine.kernel_options
    if not options.gguf_packed:
        return "float32 weights"
    return f"gguf packed, {options.gguf_activations} inputs, decode blocks {options.gguf_decode_blocks}"


def _report(args: argparse.Namespace, path: Path, lines: list[dict[str, Any]], bandwidth: float) -> str:
    """Two tables: each engine's decode tok/s with the packed engines' ratios to llama.cpp and the
    default's weight bytes per second as a share of the copy bandwidth; then each engine's first greedy
    divergence from float32 weights."""
    speed_rows, greedy_rows = [], []
    for line in lines:
        peer = line.get("llama_cpp")
        share = line["tokenmill_default"] / line["sequences"] * line["gguf_weight_bytes_per_step"] / bandwidth
        speeds = [f"{line[f'tokenmill_{key}']:.1f}" for key, *_ in VARIANTS]
        ratios = ["-" if peer is None else f"{line[f'tokenmill_{key}'] / peer:.2f}x" for key in RATIOS]
        peer_speed = "-" if peer is None else f"{peer:.1f}"
        speed_rows.append([str(line["sequences"]), *speeds, peer_speed, *ratios, f"{share:.0%}"])
        greedy = [_divergence(line.get(f"{key}_first_divergence")) for key, *_ in VARIANTS[1:]]
        peer_greedy = _divergence(line.get("llama_cpp_first_divergence"))
        greedy_rows.append([str(line["sequences"]), *greedy, peer_greedy])
    labels = {key: label for key, label, *_ in VARIANTS}
    speed_headers = [
        "sequences",
        *(f"tokenmill {label}" for label in labels.values()),
        "llama.cpp",
        *(f"{labels[key]} / llama.cpp" for key in RATIOS),
        "default's weight bytes / copy bandwidth",
    ]
    greedy_headers = ["sequences", *(labels[key] for key, *_ in VARIANTS[1:]), "llama.cpp"]
    return "\n".join([
        f"# tokenmill GGUF on the CPU vs llama.cpp ({path.name})", "",
        f"- workload: {args.prompt_len}-token prompts (windows of one text), {args.new_tokens} new tokens, "
        f"greedy, EOS ignored, decode tok/s after the first token (best of {args.repeats}); {args.threads} "
        "threads for every engine",
        "- peer: llama.cpp (llama-cpp-python) on the same file, in the same process",
        f"- copy bandwidth (torch, {args.threads} threads, 512 MiB): {bandwidth / 1e9:.1f} GB/s", "",
        markdown_table(speed_headers, speed_rows), "",
        "Greedy tokens: the first output position where a sequence's tokens differ from tokenmill float32 "
        "weights' (= where none do):", "",
        markdown_table(greedy_headers, greedy_rows), "",
        "- tokenmill float32 weights: `quantization=\"none\"` (the file dequantized, oneDNN); default: no "
        "flags (`quantization` auto keeps a .gguf file's codes packed on the CPU; float32 inputs times the "
        "exact float32 weights); int16 / int8 inputs: `gguf_activations`, each input row rounded per block "
        "of 32 and multiplied as integers (int8 is llama.cpp's rounding); every gguf engine runs decode "
        "steps through the plain Llama blocks in one C call (`gguf_decode_blocks`)",
        "- weight bytes / copy bandwidth: the default engine's weight bytes read per step times steps per "
        "second, over the copy bandwidth",
    ])  # fmt: skip


def _divergence(position: object) -> str:
    return "=" if position is None else f"differs at {position}"


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
        bandwidth = copy_bandwidth()
        report["copy_bandwidth"] = bandwidth
        report["decode"] = lines = _decode_runs(args, path)
        if args.report_dir is not None:
            hardware = detect_hardware(torch.device("cpu"))
            args.report_dir.mkdir(parents=True, exist_ok=True)
            text = provenance_header(hardware) + "\n" + _report(args, path, lines, bandwidth) + "\n"
            (args.report_dir / "gguf-cpu.md").write_text(text)
            write_json(args.report_dir / "gguf-cpu.json", report)
            print(f"wrote gguf-cpu.md, gguf-cpu.json to {args.report_dir}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    from tokenmill.benchmarks.common import run_as_script

    return run_as_script("gguf-cpu", __doc__, add_arguments, run, argv)
