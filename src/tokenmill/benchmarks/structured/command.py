"""``tokenmill bench structured``: what structured outputs cost, per grammar backend.

Two parts, both on by default. **Masks** (no model run): building each backend's token tables for the
model's vocabulary, compiling four constraints, and per decode step filling the bitmasks of a batch
following the nested schema (at each ``--mask-batch-sizes``), advancing its matchers, applying the masks
to the logits on the device. **End to end**: ``--num-requests`` concurrent requests unconstrained, all
under the nested schema per backend, and unconstrained again; output tokens/s and the ratio, after the
structured correctness check (measured config vs plain path, identical tokens; outputs valid by
``jsonschema``) and the usual fast-path check.

A model without a tokenizer (``--load-format dummy``) gets the one of ``--tokenizer`` (default: the
embedded SmolLM2's), its vocabulary padded to the model's with ids no grammar allows.

    tokenmill bench structured --model llama-3.2-1b --load-format dummy --dtype bfloat16 \\
        --num-requests 64 --input-len 128 --output-len 256 --cuda-graphs --attention-backend triton
"""

import argparse
import dataclasses
import sys
from pathlib import Path

from tokenmill.benchmarks import common
from tokenmill.benchmarks.arguments import add_structured_arguments as add_arguments
from tokenmill.benchmarks.correctness import FastPathCheck, check_fast_path
from tokenmill.benchmarks.measure import RunResult
from tokenmill.benchmarks.report import (
    Hardware,
    describe_model,
    detect_hardware,
    header_lines,
    markdown_table,
    provenance,
    write_json,
)
from tokenmill.benchmarks.structured.masks import MaskTimings, time_masks
from tokenmill.benchmarks.structured.overhead import (
    StructuredCheck,
    check_structured,
    measure_overhead,
)
from tokenmill.benchmarks.workload import WorkloadSpec
from tokenmill.loading import LoadedModel
from tokenmill.loading.loader import load_tokenizer
from tokenmill.loading.source import DummySource, resolve_source
from tokenmill.structured.manager import BACKENDS
from tokenmill.tokenizer import Tokenizer


def run(args: argparse.Namespace) -> int:
    backends = [name.strip() for name in args.backends.split(",") if name.strip()]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown or not backends:
        raise ValueError(f"--backends must name some of {sorted(BACKENDS)}, got {args.backends!r}")
    loaded = with_tokenizer(common.load_for_args(args), args.tokenizer)
    assert loaded.tokenizer is not None
    hardware = detect_hardware(loaded.device)
    print(f"hardware: {hardware.describe()}\nmodel: {describe_model(loaded)}", flush=True)
    lines: list[str] = []
    masks: list[MaskTimings] = []
    if not args.skip_masks:
        sizes = [int(size) for size in args.mask_batch_sizes.split(",")]
        vocab, eos = loaded.config.vocab_size, loaded.eos_token_ids
        masks = [time_masks(name, loaded.tokenizer, vocab, eos, loaded.device, sizes) for name in backends]
        lines += render_masks(masks)
        print("\n".join(lines), flush=True)
    runs: list[RunResult] = []
    if not args.skip_e2e:
        result = end_to_end(args, loaded, backends)
        if result is None:
            return 1
        runs, e2e_lines = result
        lines += e2e_lines
        print("\n".join(e2e_lines), flush=True)
    if args.report_dir is not None:
        save(args.report_dir, hardware, lines, masks, runs)
    return 0


def with_tokenizer(loaded: LoadedModel, tokenizer_model: str | None) -> LoadedModel:
    if loaded.tokenizer is not None and tokenizer_model is None:
        return loaded
    tokenizer: Tokenizer | None
    if tokenizer_model is not None and Path(tokenizer_model).is_dir():
        tokenizer = load_tokenizer(tokenizer_model)  # a folder's tokenizer needs no weights beside it
    else:
        source = resolve_source(tokenizer_model)
        tokenizer = None if isinstance(source, DummySource) else source.tokenizer()
    if tokenizer is None:
        raise ValueError(f"{tokenizer_model or 'the embedded model'} has no tokenizer")
    if tokenizer.vocab_size > loaded.config.vocab_size:
        raise ValueError(
            f"the tokenizer's {tokenizer.vocab_size} ids exceed the model's {loaded.config.vocab_size}"
        )
    # A dummy model's EOS ids are its own vocabulary's: the borrowed tokenizer knows only its own EOS.
    eos = tuple(t for t in loaded.eos_token_ids if t < tokenizer.vocab_size)
    if not eos and tokenizer.eos_token_id is not None:
        eos = (tokenizer.eos_token_id,)
    return dataclasses.replace(loaded, tokenizer=tokenizer, eos_token_ids=eos)


def end_to_end(
    args: argparse.Namespace, loaded: LoadedModel, backends: list[str]
) -> tuple[list[RunResult], list[str]] | None:
    spec = WorkloadSpec(args.num_requests, (args.input_len,) * 2, (args.output_len,) * 2, args.seed, True)
    workload = common.workload_for(spec, loaded)
    max_model_len = common.fit_max_model_len(workload, loaded, args.max_model_len)
    config = common.base_engine_config(args, loaded, max_model_len).with_options(
        **common.engine_options(args)
    )
    prompts = workload.prompts()[: args.check_prompts]
    checks: list[FastPathCheck | StructuredCheck] = [check_fast_path(config, loaded, prompts)]
    for name in backends:
        backend_config = config.with_options(structured_output_backend=name)
        checks.append(
            check_structured(backend_config, loaded, _tokenizer(loaded), prompts, args.check_tokens)
        )
    for check in checks:
        print(check.describe(), flush=True)
    if not all(check.passed for check in checks):
        print("CORRECTNESS CHECK FAILED: no numbers reported.", file=sys.stderr)
        return None
    runs = measure_overhead(config, loaded, workload, backends, not args.no_progress)
    header = header_lines("tokenmill structured outputs", workload.describe(), describe_model(loaded), "none")
    lines = [*header, "", *[check.describe() for check in checks], "", *render_runs(runs)]
    return runs, lines


def _tokenizer(loaded: LoadedModel) -> Tokenizer:
    assert loaded.tokenizer is not None
    return loaded.tokenizer


def render_masks(masks: list[MaskTimings]) -> list[str]:
    lines = ["", "### Grammar backends (host)", ""]
    compile_rows = [
        [m.backend, f"{m.vocab_size}", f"{m.tables_s:.2f}", *(f"{ms:.1f}" for ms in m.compile_ms.values())]
        for m in masks
    ]
    labels = list(masks[0].compile_ms) if masks else []
    headers = ["backend", "vocab", "token tables (s)", *(f"compile {label} (ms)" for label in labels)]
    lines += [markdown_table(headers, compile_rows), ""]
    step_rows = [
        [
            m.backend,
            str(batch),
            f"{t.fill[0]:.0f} / {t.fill[1]:.0f}",
            f"{t.fill[0] / batch:.1f}",
            f"{t.advance[0]:.0f} / {t.advance[1]:.0f}",
            f"{t.apply:.0f}",
            str(t.steps),
        ]
        for m in masks
        for batch, t in m.steps.items()
    ]
    headers = ["backend", "batch", "fill µs (p50 / p99)", "fill µs per row", "advance µs (p50 / p99)"]
    headers += ["apply on device µs", "steps"]
    return [*lines, markdown_table(headers, step_rows)]


def render_runs(runs: list[RunResult]) -> list[str]:
    base = runs[0].output_tokens_per_s
    rows = [
        [
            r.label,
            str(r.num_output_tokens),
            f"{r.elapsed_s:.2f}",
            f"{r.output_tokens_per_s:.1f}",
            f"{r.output_tokens_per_s / base:.3f}x",
        ]
        for r in runs
    ]
    headers = ["run", "output tokens", "seconds", "out tok/s", "vs unconstrained"]
    noise = abs(runs[-1].output_tokens_per_s / base - 1)
    return [
        markdown_table(headers, rows),
        "",
        f"- run-to-run noise (the two unconstrained runs): {noise:.1%}",
    ]


def save(
    folder: Path, hardware: Hardware, lines: list[str], masks: list[MaskTimings], runs: list[RunResult]
) -> None:
    origin = provenance(hardware)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "structured.md").write_text(origin.markdown() + "\n".join(lines) + "\n")
    payload = {
        "provenance": origin.to_json(),
        "masks": [dataclasses.asdict(m) for m in masks],
        "runs": [
            {"label": r.label, "output_tokens": r.num_output_tokens, "elapsed_s": r.elapsed_s} for r in runs
        ],
    }
    write_json(folder / "structured.json", payload)
    print(f"wrote structured.md, structured.json to {folder}")


def main(argv: list[str] | None = None) -> int:
    return common.run_as_script("structured", __doc__, add_arguments, run, argv)
