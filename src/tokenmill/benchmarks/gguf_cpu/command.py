"""Runs the three measurements of this benchmark (see the package docstring) and prints them."""

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

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
    parser.add_argument("--report-dir", type=Path, default=None, help="write gguf-cpu.md / .json here")


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
    print(f"{'projection':>10} {'qtype':>6} {'shape':>11} {'rows':>4} {'packed us':>9} {'int8 us':>8} "
          f"{'f32 us':>8} {'speedup':>7} {'int8 x':>7} {'B/weight':>8}")  # fmt: skip
    for t in timings:
        shape, per_weight = (
            f"{t.out_features}x{t.in_features}",
            t.packed_bytes / t.out_features / t.in_features,
        )
        print(f"{t.name:>10} {t.qtype:>6} {shape:>11} {t.rows:>4} {t.packed_s * 1e6:>9.1f} "
              f"{t.packed_int8_s * 1e6:>8.1f} {t.float32_s * 1e6:>8.1f} {t.speedup:>7.2f} "
              f"{t.int8_speedup:>7.2f} {per_weight:>8.3f}")  # fmt: skip


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


def _decode_runs(args: argparse.Namespace, path: Path) -> list[dict[str, Any]]:
    """Per batch size: tokenmill float32 (the dequantized weights), tokenmill ``quantization="gguf"`` and
    llama.cpp on the same file; greedy tokens compared with tokenmill float32."""
    engines: dict[str, Any] = {"float32": _engine(path, "none", args)}
    tokenizer = engines["float32"].get_tokenizer()
    token_ids = tokenizer.encode(TEXT)
    prompts = {count: _prompts(token_ids, count, args.prompt_len) for count in args.sequences}

    def best(runs: "Callable[[list[list[int]]], DecodeRun]", count: int) -> DecodeRun:
        return min((runs(prompts[count]) for _ in range(args.repeats)), key=lambda run: run.decode_s)

    float32 = {
        c: best(lambda b: _tokenmill_run(engines["float32"], b, args.new_tokens), c) for c in args.sequences
    }
    del engines["float32"]
    float_inputs_llm = _engine(path, "auto", args)  # the default: packed codes, float32 inputs
    float_inputs = {
        c: best(lambda b: _tokenmill_run(float_inputs_llm, b, args.new_tokens), c) for c in args.sequences
    }
    packed_llm = _engine(path, "gguf", args, gguf_int8_activations=True)
    packed = {c: best(lambda b: _tokenmill_run(packed_llm, b, args.new_tokens), c) for c in args.sequences}
    step_bytes = _weight_bytes(packed_llm)
    peer = None if args.no_peer else LlamaCpp(path, max(args.sequences), args.prompt_len + args.new_tokens,
                                              args.threads)  # fmt: skip
    lines: list[dict] = []
    for count in args.sequences:
        line: dict[str, Any] = {
            "sequences": count,
            "tokenmill_float32": float32[count].decode_tokens_per_s,
            "tokenmill_gguf_float_inputs": float_inputs[count].decode_tokens_per_s,
            "gguf_float_inputs_first_divergence": _first_divergence(float_inputs[count], float32[count]),
            "tokenmill_gguf": packed[count].decode_tokens_per_s,
            "gguf_first_divergence": _first_divergence(packed[count], float32[count]),
            "gguf_weight_bytes_per_step": step_bytes,
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


def _report(args: argparse.Namespace, path: Path, lines: list[dict[str, Any]], bandwidth: float) -> str:
    """The decode table as markdown: each engine's tok/s, the ratio to llama.cpp, the first greedy
    divergence from float32, and the packed engine's weight bytes per second as a share of the copy
    bandwidth."""
    rows = []
    for line in lines:
        peer, gguf = line.get("llama_cpp"), line["tokenmill_gguf"]
        share = gguf / line["sequences"] * line["gguf_weight_bytes_per_step"] / bandwidth
        default = line["tokenmill_gguf_float_inputs"]
        rows.append([
            str(line["sequences"]), f"{line['tokenmill_float32']:.1f}", f"{default:.1f}", f"{gguf:.1f}",
            "-" if peer is None else f"{peer:.1f}", "-" if peer is None else f"{default / peer:.2f}x",
            "-" if peer is None else f"{gguf / peer:.2f}x",
            _divergence(line.get("gguf_float_inputs_first_divergence")),
            _divergence(line.get("gguf_first_divergence")),
            _divergence(line.get("llama_cpp_first_divergence")), f"{share:.0%}",
        ])  # fmt: skip
    headers = [
        "sequences",
        "tokenmill float32 weights",
        "tokenmill default (gguf, float32 inputs)",
        "tokenmill gguf, int8 inputs",
        "llama.cpp",
        "default / llama.cpp",
        "int8 inputs / llama.cpp",
        "default vs float32 greedy",
        "int8 inputs vs float32 greedy",
        "llama.cpp vs float32 greedy",
        "weight bytes / copy bandwidth",
    ]
    return "\n".join([
        f"# tokenmill GGUF on the CPU vs llama.cpp ({path.name})", "",
        f"- workload: {args.prompt_len}-token prompts (windows of one text), {args.new_tokens} new tokens, "
        f"greedy, EOS ignored, decode tok/s after the first token (best of {args.repeats}); {args.threads} "
        "threads for every engine",
        "- peer: llama.cpp (llama-cpp-python) on the same file, in the same process",
        f"- copy bandwidth (torch, {args.threads} threads, 512 MiB): {bandwidth / 1e9:.1f} GB/s", "",
        markdown_table(headers, rows), "",
        "- greedy: the first output position where a sequence's tokens differ from tokenmill float32's "
        "(= where none do)",
        "- tokenmill float32 weights: `quantization=\"none\"` (the file dequantized, oneDNN); default: "
        "`quantization` auto, which keeps a .gguf file's codes packed on the CPU, float32 inputs times the "
        "exact float32 weights; int8 inputs: `gguf_int8_activations=True`, each input row rounded to int8 "
        "per block of 32 and multiplied as integers, as llama.cpp does; both gguf engines run decode steps "
        "through the plain Llama blocks in one C call (`gguf_decode_blocks`)",
        "- weight bytes / copy bandwidth: the packed engine's weight bytes read per step times steps per "
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
