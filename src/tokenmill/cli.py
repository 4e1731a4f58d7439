"""The ``tokenmill`` command: ``generate``, ``chat``, ``serve``, ``bench`` and ``quantize``.

Every flag is parsed and checked before torch, transformers or a model is loaded, so ``--help`` and a typo
answer at once: this module imports neither; the commands (``cli_commands``, the benchmarks' modules)
import them once the command line is known to be good. Bad input (an unknown flag value, a prompt longer
than the context, ...) ends with one clear line on stderr and a non-zero exit status, never a traceback.
"""

import argparse
import functools
import importlib
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from tokenmill.benchmarks.arguments import BENCHMARK_ARGUMENTS
from tokenmill.cli_checks import check_before_loading, parse_token_ids
from tokenmill.cli_quantize import add_quantize_arguments, run_quantize
from tokenmill.config import EngineConfig
from tokenmill.config_flags import add_engine_config_arguments, engine_options_from
from tokenmill.errors import TokenmillError
from tokenmill.sampling_params import SamplingParams

EXIT_BAD_INPUT = 2
# name -> (the module that runs it, what it measures)
BENCHMARKS = {
    "ladder": ("tokenmill.benchmarks.ladder.command", "every optimization rung on one workload, HF as peer"),
    "latency": ("tokenmill.benchmarks.latency", "batch-1 decode latency, HF generate as peer"),
    "throughput": ("tokenmill.benchmarks.throughput", "offline throughput of many requests"),
    "load-memory": ("tokenmill.benchmarks.load_memory", "peak memory while loading a model"),
    "serve": ("tokenmill.benchmarks.serve.command", "load test of a running OpenAI-compatible server"),
    "kernels": ("tokenmill.benchmarks.kernels.command", "each Triton kernel against its PyTorch code"),
    "scenarios": ("tokenmill.benchmarks.scenarios.command", "scheduling features off / on, per workload"),
    "structured": (
        "tokenmill.benchmarks.structured.command",
        "structured outputs: mask cost per grammar backend, overhead",
    ),
    "speculative": (
        "tokenmill.benchmarks.speculative.command",
        "speculative decoding off / on: n-gram at batch 1 and 64, a draft model's round cost",
    ),
    "seeds": ("tokenmill.benchmarks.seeds.command", "the seed engines' result tables, on this machine"),
    "accuracy": (
        "tokenmill.benchmarks.accuracy.command",
        "quantized modes against the unquantized model: perplexity, top-1 agreement, greedy tokens",
    ),
    "tensor-parallel": (
        "tokenmill.benchmarks.tensor_parallel.command",
        "tensor parallelism against one GPU: greedy tokens, batch-1 decode, all-reduce latency, throughput",
    ),
}
# The command line's own temperature: milder than SamplingParams' (and OpenAI's) 1.0, for text that reads
# well in a terminal from a small model; the server and LLM.generate keep 1.0.
CLI_TEMPERATURE = 0.7
CLI_MAX_TOKENS = 256
# The sampling flags a model's generation config may set (EngineConfig.generation_config) where they are
# not given, with the command line's defaults where it does not.
_GENERATION_CONFIG_FLAGS: dict[str, Any] = {
    "max_tokens": CLI_MAX_TOKENS,
    "temperature": CLI_TEMPERATURE,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, not the whole usage text."""
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


# --seed is the sampling seed here (the engine's own only seeds dummy weights).
_NOT_ENGINE_FLAGS = frozenset({"seed"})


def add_engine_arguments(parser: argparse.ArgumentParser, one_sequence: bool = False) -> None:
    """EngineConfig's flags; ``one_sequence``: the command runs one sequence at a time (generate, chat),
    so ``--max-num-seqs`` defaults to 1 there, which also sizes the CPU KV pool for one."""
    add_engine_config_arguments(parser.add_argument_group("model and engine"), exclude=_NOT_ENGINE_FLAGS)
    if one_sequence:
        action = next(action for action in parser._actions if action.dest == "max_num_seqs")
        action.help = "sequences running at once (default: 1 for this command, which runs one at a time)"


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "sampling",
        "--max-tokens, --temperature, --top-p, --top-k, --min-p and --repetition-penalty, where left out, "
        "take the model's generation config's values (see --generation-config), else the defaults below",
    )
    group.add_argument("--max-tokens", type=int, help=f"most tokens to generate (default: {CLI_MAX_TOKENS})")
    group.add_argument(
        "--temperature",
        type=float,
        help="0 is greedy, higher is more random (default: 0.7 on the command line, for readable text "
        "from a small model; LLM.generate and the server default to 1.0, as OpenAI does)",
    )
    group.add_argument(
        "--top-p",
        type=float,
        help="keep the most likely tokens up to this total probability (default: 1.0, off)",
    )
    group.add_argument("--top-k", type=int, help="keep only the K most likely tokens (default: 0, off)")
    group.add_argument(
        "--min-p",
        type=float,
        help="drop tokens less likely than this share of the most likely one's probability (default: 0, off)",
    )
    group.add_argument(
        "--repetition-penalty",
        type=float,
        help="divide the scores of tokens already in the prompt or output by this (HF; default: 1.0, off)",
    )
    group.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="lower the logits of tokens already generated by this, -2 to 2 (OpenAI; default: 0)",
    )
    group.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="lower each token's logit by this times its count so far, -2 to 2 (OpenAI; default: 0)",
    )
    group.add_argument(
        "--seed", type=int, default=None, help="sampling seed, for repeatable output (default: none)"
    )
    group.add_argument(
        "--stop", action="append", default=None, help="stop before this text (repeatable; default: none)"
    )
    group.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens"
    )


def sampling_params_from(
    args: argparse.Namespace, model_defaults: Mapping[str, Any] | None = None
) -> SamplingParams:
    """The sampling flags as SamplingParams; ``model_defaults``: the engine's ``sampling_defaults`` (the
    model's generation config), for the flags left out."""
    model_defaults = model_defaults or {}
    chosen = {
        name: getattr(args, name) if getattr(args, name) is not None else model_defaults.get(name, default)
        for name, default in _GENERATION_CONFIG_FLAGS.items()
    }
    return SamplingParams(
        **chosen,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    options = engine_options_from(args, exclude=_NOT_ENGINE_FLAGS)
    if args.command in ("generate", "chat") and options.get("max_num_seqs") is None:
        options["max_num_seqs"] = 1  # one sequence at a time: a KV pool (on CPU) sized for one
    return EngineConfig().with_options(**options)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    group.add_argument(
        "--api-key",
        default=os.environ.get("TOKENMILL_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $TOKENMILL_API_KEY, else no key)",
    )
    group.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="sequences allowed to wait for a slot; more get a 503 (default: no bound)",
    )
    group.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds before a request is aborted with a 504 (default: no limit)",
    )
    group.add_argument(
        "--served-model-name", default=None, help="the model name clients send (default: --model's)"
    )
    group.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="tokens per streamed chunk after the first (default 1: every token as it comes)",
    )
    group.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine in its own process, so its steps never wait for the HTTP side's GIL "
        "(default: on; --no-engine-process steps it in a thread of the server's process)",
    )
    levels = ["critical", "error", "warning", "info", "debug"]
    group.add_argument("--log-level", default="info", choices=levels, help="uvicorn's (default: info)")


def check_server_arguments(args: argparse.Namespace) -> None:
    if args.max_waiting is not None and args.max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if args.stream_interval < 1:
        raise ValueError(f"--stream-interval must be >= 1, got {args.stream_interval}")
    if args.request_timeout is not None and not args.request_timeout > 0:  # NaN fails too
        raise ValueError(f"--request-timeout must be a number of seconds > 0, got {args.request_timeout}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tokenmill", description="An LLM inference engine, from scratch.")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="complete one prompt, streaming tokens to the terminal")
    generate.add_argument("prompt", nargs="?", default=None, help="the text to complete")
    generate.add_argument(
        "--prompt-token-ids",
        type=parse_token_ids,
        default=None,
        metavar="IDS",
        help="the prompt as token ids instead of text, e.g. 1,2,3 (for a model without a tokenizer; "
        "the output is then token ids too)",
    )
    add_engine_arguments(generate, one_sequence=True)
    add_sampling_arguments(generate)
    chat = commands.add_parser("chat", help="chat with the model's chat template (reads lines from stdin)")
    chat.add_argument("--system", default=None, help="system message (default: none)")
    add_engine_arguments(chat, one_sequence=True)
    add_sampling_arguments(chat)
    server = commands.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, ...)")
    add_server_arguments(server)
    add_engine_arguments(server)
    quantize = commands.add_parser(
        "quantize", help="write a float checkpoint as a pre-quantized int8 / fp8 one (GPTQ rounding)"
    )
    add_quantize_arguments(quantize)
    bench = commands.add_parser("bench", help="benchmarks (tokenmill bench NAME --help)")
    names = bench.add_subparsers(dest="benchmark", required=True)
    for name, (_, summary) in BENCHMARKS.items():
        # No -h of its own: --help reaches the benchmark's parser, which knows the options.
        names.add_parser(name, help=summary, add_help=False)
    return parser


def parse_benchmark_arguments(name: str, argv: list[str]) -> argparse.Namespace:
    parser = _Parser(prog=f"tokenmill bench {name}", description=BENCHMARKS[name][1])
    BENCHMARK_ARGUMENTS[name](parser)
    return parser.parse_args(argv)


def run_benchmark(name: str, args: argparse.Namespace) -> int:
    module: Any = importlib.import_module(BENCHMARKS[name][0])
    return int(module.run(args))


def run_command(args: argparse.Namespace) -> int:
    """Check everything that can be checked without torch, then run the command."""
    config = engine_config_from(args)
    if args.command == "serve":
        check_server_arguments(args)
        check_before_loading(config, args.command, has_text_prompt=False)
        from tokenmill.cli_commands import run_serve

        return run_serve(args, config)
    sampling_params_from(args)  # checked before loading; the model's defaults are known after
    text_prompt = args.command == "chat" or args.prompt is not None
    if args.command == "generate" and args.prompt is None and args.prompt_token_ids is None:
        raise ValueError("give a prompt, or --prompt-token-ids")
    if args.command == "generate" and args.prompt is not None and args.prompt_token_ids is not None:
        raise ValueError("give a prompt or --prompt-token-ids, not both")
    check_before_loading(config, args.command, has_text_prompt=text_prompt)
    from tokenmill.cli_commands import run_chat, run_generate

    params_for = functools.partial(sampling_params_from, args)
    if args.command == "chat":
        return run_chat(config, params_for, args.system)
    return run_generate(config, params_for, args.prompt if args.prompt is not None else args.prompt_token_ids)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "bench":
        bench_args = parse_benchmark_arguments(args.benchmark, extra)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.command == "bench":
            return run_benchmark(args.benchmark, bench_args)
        if args.command == "quantize":
            return run_quantize(args)
        return run_command(args)
    except (TokenmillError, ValueError) as exc:
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
