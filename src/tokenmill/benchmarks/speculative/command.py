"""``tokenmill bench speculative``: decode speed with and without speculative decoding, in the same run.

**n-gram** (prompt lookup, on by default): batch-1 greedy decode tokens/s of chat prompts whose answers
copy from the prompt — code editing (rename, type hints, docstrings over a 30-line class) and a copy-heavy
mix (rewrites, summaries, QA over a given text, typo fixes, records to JSON) — speculation off and on,
each prompt alone, with acceptance and tokens per verification step; then a batch of open-ended prompts
(nothing to copy) all at once, output tokens/s off and on: what speculation costs where it cannot help.
Off and on must produce the same greedy tokens at batch 1 in float32 (checked; no numbers otherwise): a
16-bit run checks a float32 copy of the model first, then counts the prompts whose 16-bit tokens agree
(a verification step computes its tokens through the prefill kernels, which round differently from a
decode step's and may flip a near-tie). Each prompt runs off and then on before the next one, so load
from elsewhere on the machine hits both alike.

**draft model** (``--draft-model``): the cost of a round (k draft steps + one verification) against a plain
decode step of the target, and the speed-up that implies at acceptance 0.5 / 0.7 / 0.9; and the check of
that formula with the target drafting for itself (every greedy guess accepted). See ``draft_cost``.

    tokenmill bench speculative --dtype float32 --threads 2 --report-dir reports/speculative-cpu
    tokenmill bench speculative --dtype bfloat16 --skip-ngram --model llama-3.1-8b --load-format dummy \\
        --draft-model llama-3.2-1b --draft-load-format dummy
"""

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from tokenmill.benchmarks import common
from tokenmill.benchmarks.arguments import add_speculative_arguments as add_arguments
from tokenmill.benchmarks.report import (
    Hardware,
    describe_model,
    detect_hardware,
    header_lines,
    markdown_table,
    provenance,
    write_json,
)
from tokenmill.benchmarks.speculative import prompts
from tokenmill.benchmarks.speculative.draft_cost import draft_model_costs
from tokenmill.benchmarks.speculative.timing import TimedRun, all_at_once, merged, one_at_a_time
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.loading import LoadedModel
from tokenmill.sampling_params import SamplingParams

TARGETS = {"code editing": 2.0, "copy mix": 1.5, "open-ended": 0.95}  # on the 2-core CPU
GPU_TARGETS = {**TARGETS, "code editing": 2.5}  # on the H200


def run(args: argparse.Namespace) -> int:
    loaded = common.load_for_args(args)
    hardware = detect_hardware(loaded.device)
    print(f"hardware: {hardware.describe()}\nmodel: {describe_model(loaded)}", flush=True)
    lines: list[str] = []
    runs: list[TimedRun] = []
    if not args.skip_ngram:
        result = ngram_part(args, loaded)
        if result is None:
            return 1
        runs, ngram_lines = result
        lines += ngram_lines
    if args.draft_model is not None:
        lines += draft_model_costs(args, loaded, _engine_config(args, loaded, args.draft_max_model_len, 2))
    if args.report_dir is not None:
        save(args.report_dir, hardware, lines, runs)
    return 0


def _engine_config(
    args: argparse.Namespace, loaded: LoadedModel, max_model_len: int, num_seqs: int
) -> EngineConfig:
    """The measured config; on a GPU with a KV pool of its own size (room for ``num_seqs`` whole
    sequences), so the several engines of the run fit beside each other."""
    config = common.base_engine_config(args, loaded, max_model_len).with_options(
        **common.engine_options(args)
    )
    if loaded.device.type == "cuda" and config.kv.num_blocks is None:
        config = config.with_options(num_kv_blocks=-(-num_seqs * max_model_len // config.kv.block_size))
    return config


def ngram_part(args: argparse.Namespace, loaded: LoadedModel) -> tuple[list[TimedRun], list[str]] | None:
    base = _engine_config(args, loaded, args.max_model_len or 2048, args.batch_size)
    spec = base.speculative
    on = base.with_options(
        speculative_method="ngram", num_speculative_tokens=spec.num_speculative_tokens, speculative_model=None
    )
    off = base.with_options(speculative_method=None, speculative_model=None)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    exact = loaded.dtype == torch.float32
    if not exact and not float32_check(args, [_chat(loaded, text) for text in prompts.CODE_EDITING], greedy):
        return None
    engines = {"off": LLMEngine(off, loaded=loaded), "on": LLMEngine(on, loaded=loaded)}
    workloads = {"code editing": prompts.CODE_EDITING, "copy mix": prompts.COPY_MIX}
    runs: list[TimedRun] = []
    agreeing: list[str] = []
    for engine in engines.values():  # warm-up: oneDNN's first calls, the allocator
        one_at_a_time(
            "warm-up", engine, [_chat(loaded, "Say hi.")], SamplingParams(temperature=0, max_tokens=8)
        )
    for name, texts in workloads.items():
        chats = [_chat(loaded, text) for text in texts]
        pair = interleaved(name, engines, chats, greedy)
        print(describe_pair(name, *pair), flush=True)
        if exact and pair[0].outputs != pair[1].outputs:
            print(f"CORRECTNESS CHECK FAILED: {name}: greedy tokens differ with speculation", file=sys.stderr)
            return None
        same = sum(a == b for a, b in zip(pair[0].outputs, pair[1].outputs, strict=True))
        agreeing.append(f"{name} {same}/{len(chats)}")
        runs += pair
    open_chats = [_chat(loaded, text) for text in prompts.open_ended(args.batch_size)]
    batch = SamplingParams(temperature=0, max_tokens=args.batch_output_len, ignore_eos=True)
    batches = open_ended_rounds(engines, open_chats, batch, args.batch_rounds)
    pair = [merged(f"open-ended, {side}", side_runs) for side, side_runs in batches.items()]
    print(describe_pair("open-ended", *pair), flush=True)
    runs += pair
    per_round = ", ".join(f"{ratio:.2f}x" for ratio in round_ratios(batches))
    workload = (
        f"SmolLM2-style chat prompts, greedy; batch 1: {len(prompts.CODE_EDITING)} code-editing and "
        f"{len(prompts.COPY_MIX)} copy-heavy prompts, up to {args.max_tokens} tokens each; batch "
        f"{args.batch_size}: open-ended prompts, {args.batch_output_len} tokens each (EOS ignored), run "
        f"{2 * args.batch_rounds} times each, off-on-on-off x {args.batch_rounds}; "
        f"n-gram k={engines['on'].config.speculative.num_tokens}, n={spec.prompt_lookup_min}.."
        f"{spec.prompt_lookup_max}"
    )
    header = header_lines(
        "tokenmill speculative decoding (n-gram)",
        workload,
        describe_model(loaded),
        "the same engine with speculation off, same run",
    )
    check = "float32: greedy tokens off and on identical for every prompt"
    if not exact:
        check = (
            f"float32 copy: greedy tokens off and on identical for the code-editing prompts; {loaded.dtype}"
            f" prompts whose tokens off and on agree: {', '.join(agreeing)} (a verification step rounds as "
            "the prefill kernels do)"
        )
    table = render(runs, args.batch_size, loaded.device.type)
    rounds = f"- open-ended on / off, each off-on-on-off round apart: {per_round}"
    return runs, [*header, "", *table, rounds, f"- correctness: {check}"]


def open_ended_rounds(
    engines: dict[str, LLMEngine], chats: list[list[int]], params: SamplingParams, rounds: int
) -> dict[str, list[TimedRun]]:
    """Each engine's runs of the whole batch, ``rounds`` times off, on, on, off (load and order hit both
    sides alike; a run of a small model takes well under a second on a GPU, so one round is noisy)."""
    batches: dict[str, list[TimedRun]] = {side: [] for side in engines}
    for _ in range(rounds):
        for side in ("off", "on", "on", "off"):
            batches[side].append(all_at_once(f"open-ended, {side}", engines[side], chats, params))
    return batches


def round_ratios(batches: dict[str, list[TimedRun]]) -> list[float]:
    """On / off output tok/s of each off-on-on-off round."""
    ratios = []
    for start in range(0, len(batches["on"]), 2):
        on, off = (merged(side, batches[side][start : start + 2]) for side in ("on", "off"))
        ratios.append(on.output_tok_s / off.output_tok_s if off.output_tok_s else 0.0)
    return ratios


def float32_check(args: argparse.Namespace, chats: list[list[int]], params: SamplingParams) -> bool:
    """A float32 copy of the model must give the same greedy tokens with speculation off and on."""
    as_float32 = argparse.Namespace(**{**vars(args), "dtype": "float32"})
    loaded = common.load_for_args(as_float32)
    base = _engine_config(as_float32, loaded, args.max_model_len or 2048, 1)
    outputs = []
    for method in (None, "ngram"):
        config = base.with_options(speculative_method=method, speculative_model=None)
        engine = LLMEngine(config, loaded=loaded)
        outputs.append(one_at_a_time(f"float32 check, {method or 'off'}", engine, chats, params).outputs)
        del engine
    same = sum(a == b for a, b in zip(*outputs, strict=True))
    print(f"float32 check: greedy tokens off / on identical for {same}/{len(chats)} prompts", flush=True)
    if same != len(chats):
        print("CORRECTNESS CHECK FAILED: float32: greedy tokens differ with speculation", file=sys.stderr)
    return same == len(chats)


def interleaved(
    name: str, engines: dict[str, LLMEngine], chats: list[list[int]], params: SamplingParams
) -> list[TimedRun]:
    """Each prompt off, then on, before the next prompt: other load on the machine hits both alike."""
    runs: dict[str, list[TimedRun]] = {side: [] for side in engines}
    for chat in chats:
        for side, engine in engines.items():
            runs[side].append(one_at_a_time(f"{name}, {side}", engine, [chat], params))
    return [merged(f"{name}, {side}", side_runs) for side, side_runs in runs.items()]


def _chat(loaded: LoadedModel, text: str) -> list[int]:
    if loaded.tokenizer is None:
        raise ValueError(
            "the n-gram part needs a tokenizer with a chat template (add --tokenizer, or --skip-ngram)"
        )
    return loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}], True, tokenize=True)


def describe_pair(name: str, off: TimedRun, on: TimedRun) -> str:
    rate = "decode" if name != "open-ended" else "output"
    off_rate, on_rate = _rate(off, name), _rate(on, name)
    return (
        f"{name}: {rate} tok/s off {off_rate:.1f}, on {on_rate:.1f} ({on_rate / off_rate:.2f}x); acceptance "
        f"{on.spec.acceptance_rate:.2f}, tokens per verification step {on.spec.mean_accepted_length:.2f}"
    )


def _rate(run: TimedRun, name: str) -> float:
    return run.output_tok_s if name == "open-ended" else run.decode_tok_s


def render(runs: Sequence[TimedRun], batch_size: int, device_type: str = "cpu") -> list[str]:
    targets = GPU_TARGETS if device_type == "cuda" else TARGETS
    rows = []
    for off, on in zip(runs[::2], runs[1::2], strict=True):
        name = off.label.rsplit(",", 1)[0]
        ratio = _rate(on, name) / _rate(off, name)
        steps = on.num_decode_steps
        rows.append(
            [
                name,
                "1" if name != "open-ended" else str(batch_size),
                str(on.num_output_tokens),
                f"{_rate(off, name):.1f}",
                f"{_rate(on, name):.1f}",
                f"{ratio:.2f}x",
                f"{on.spec.acceptance_rate:.2f}",
                f"{on.spec.mean_accepted_length:.2f}",
                f"{on.num_decode_tokens / steps:.2f}" if steps else "-",
                f">= {targets[name]}x {'met' if ratio >= targets[name] else 'NOT met'}",
            ]
        )
    headers = ["workload", "batch", "output tokens", "tok/s off", "tok/s on", "on / off", "acceptance"]
    headers += ["tokens / verification step", "tokens / step", "target"]
    return [
        markdown_table(headers, rows),
        "",
        "- tok/s: decode tokens per second after each request's first token at batch 1; output tokens per "
        "second of the whole run at batch "
        f"{batch_size}",
        "- acceptance: accepted / proposed draft tokens; tokens / verification step: accepted drafts plus "
        "the model's own token, per step that verified drafts; tokens / step: per decode step of any kind",
        "- no step speculates while speculative_disable_by_batch_size or more sequences run (auto: 8 on "
        "CPU, 2 on a GPU); on a GPU, batch-1 verification steps run through the one-sequence prefill "
        "graphs, batched ones eagerly; decode steps are overlapped while no step can speculate or after a "
        "step without guesses, and guesses that come while such a started step is in flight wait for it",
    ]


def save(folder: Path, hardware: Hardware, lines: list[str], runs: list[TimedRun]) -> None:
    origin = provenance(hardware)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "speculative.md").write_text(origin.markdown() + "\n".join(lines) + "\n")
    payload = {
        "provenance": origin.to_json(),
        "runs": [
            {
                "label": run.label,
                "output_tokens": run.num_output_tokens,
                "decode_tokens": run.num_decode_tokens,
                "decode_s": run.decode_s,
                "elapsed_s": run.elapsed_s,
                "decode_steps": run.num_decode_steps,
                "spec_decode": dataclasses.asdict(run.spec),
            }
            for run in runs
        ],
    }
    write_json(folder / "speculative.json", payload)
    print(f"wrote speculative.md, speculative.json to {folder}")


def main(argv: list[str] | None = None) -> int:
    return common.run_as_script("speculative", __doc__, add_arguments, run, argv)
