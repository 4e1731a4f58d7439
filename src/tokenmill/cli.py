"""The ``tokenmill`` command: ``generate``, ``chat``, ``serve`` and ``bench``.

Bad input (an unknown flag value, a prompt longer than the context, ...) ends with one clear line on
stderr and a non-zero exit status, never a traceback.
"""

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from tokenmill.config import EngineConfig
from tokenmill.config_flags import add_engine_config_arguments, engine_options_from
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.errors import TokenmillError
from tokenmill.sampling_params import SamplingParams

EXIT_BAD_INPUT = 2
BENCHMARKS = {
    "ladder": "tokenmill.benchmarks.ladder",
    "latency": "tokenmill.benchmarks.latency",
    "throughput": "tokenmill.benchmarks.throughput",
    "load-memory": "tokenmill.benchmarks.load_memory",
    "serve": "tokenmill.benchmarks.serve",
    "kernels": "tokenmill.benchmarks.kernels",
    "scenarios": "tokenmill.benchmarks.scenarios",
    "structured": "tokenmill.benchmarks.structured",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, not the whole usage text."""
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


# --seed is the sampling seed here (the engine's own only seeds dummy weights); --model has its own help.
_NOT_ENGINE_FLAGS = frozenset({"model", "seed"})


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model and engine")
    group.add_argument(
        "--model", default=None, help="HF folder, .gguf file, hub id or preset (default: SmolLM2)"
    )
    add_engine_config_arguments(group, exclude=_NOT_ENGINE_FLAGS)


def add_sampling_arguments(parser: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens)
    group.add_argument("--temperature", type=float, default=0.7)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--seed", type=int, default=None)
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model).with_options(**engine_options_from(args, exclude=_NOT_ENGINE_FLAGS))


def sampling_params_from(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def stream(engine: LLMEngine, request_id: str, prompt: str | list[int], params: SamplingParams) -> str:
    """Run one request, printing its text as it is generated; returns the whole text."""
    engine.add_request(request_id, prompt, params)
    pieces = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            print(delta.new_text, end="", flush=True)
            pieces.append(delta.new_text)
    print()
    return "".join(pieces)


def run_generate(args: argparse.Namespace) -> int:
    params = sampling_params_from(args)
    engine = LLMEngine(engine_config_from(args))
    stream(engine, "generate", args.prompt, params)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    params = sampling_params_from(args)
    engine = LLMEngine(engine_config_from(args))
    if engine.tokenizer is None:
        raise TokenmillError("this model has no tokenizer, so it cannot chat")
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    print(
        "tokenmill chat: type a message; /reset clears the history, /exit (or Ctrl-D) quits.", file=sys.stderr
    )
    for turn in range(sys.maxsize):
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        prompt_ids = engine.tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
        print("assistant> ", end="", flush=True)
        reply = stream(engine, f"chat-{turn}", prompt_ids, params)
        history.append({"role": "assistant", "content": reply})
    return 0


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument(
        "--api-key",
        default=os.environ.get("TOKENMILL_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $TOKENMILL_API_KEY, else no key)",
    )
    group.add_argument(
        "--max-waiting", type=int, default=None, help="sequences allowed to wait for a slot; more get a 503"
    )
    group.add_argument(
        "--request-timeout", type=float, default=None, help="seconds before a request is aborted with a 504"
    )
    group.add_argument("--served-model-name", default=None, help="the model name clients send")
    levels = ["critical", "error", "warning", "info", "debug"]
    group.add_argument("--log-level", default="info", choices=levels)


def run_serve(args: argparse.Namespace) -> int:
    from tokenmill.server import ServerSettings, create_app, default_served_model_name, serve

    if args.max_waiting is not None and args.max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if args.request_timeout is not None and args.request_timeout <= 0:
        raise ValueError(f"--request-timeout must be > 0, got {args.request_timeout}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    engine = LLMEngine(engine_config_from(args))
    settings = ServerSettings(
        served_model_name=args.served_model_name or default_served_model_name(engine),
        api_key=args.api_key or None,
        max_waiting=args.max_waiting,
        request_timeout_s=args.request_timeout,
    )
    url = f"http://{args.host}:{args.port}"
    print(f"tokenmill: serving '{settings.served_model_name}' on {url}", file=sys.stderr)
    serve(create_app(engine, settings), args.host, args.port, args.log_level)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tokenmill", description="An LLM inference engine, from scratch.")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="complete one prompt, streaming tokens to the terminal")
    generate.add_argument("prompt")
    add_engine_arguments(generate)
    add_sampling_arguments(generate)
    generate.set_defaults(handler=run_generate)
    chat = commands.add_parser("chat", help="interactive chat with the model's chat template")
    chat.add_argument("--system", default=None, help="system message")
    add_engine_arguments(chat)
    add_sampling_arguments(chat)
    chat.set_defaults(handler=run_chat)
    server = commands.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, ...)")
    add_server_arguments(server)
    add_engine_arguments(server)
    server.set_defaults(handler=run_serve)
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="benchmark", required=True)
    for name, module in BENCHMARKS.items():
        # No -h of its own: --help reaches the benchmark's parser, which knows the options.
        sub = bench.add_parser(name, help=f"the {name} benchmark", add_help=False)
        sub.set_defaults(handler=_lazy_benchmark(module), bench_parser=sub, bench_module=module)
    return parser


def _lazy_benchmark(module_name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        module: Any = importlib.import_module(module_name)
        parser = _Parser(prog=f"tokenmill bench {args.benchmark}")
        module.add_arguments(parser)
        return int(module.run(parser.parse_args(args.bench_args)))

    return run


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "bench":
        args.bench_args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.handler(args))
    except (TokenmillError, ValueError) as exc:
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
