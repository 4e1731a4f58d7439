"""What ``tokenmill generate``, ``chat`` and ``serve`` do once their flags are known to be good (see
``tokenmill.cli``): this is where torch, transformers and the model are loaded."""

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.errors import TokenmillError
from tokenmill.sampling_params import SamplingParams


def stream(engine: LLMEngine, request_id: str, prompt: str | Sequence[int], params: SamplingParams) -> str:
    """Run one request, printing its text as it is generated (its token ids, for a model without a
    tokenizer); returns the whole text."""
    engine.add_request(request_id, prompt, params)
    pieces = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if engine.tokenizer is None:
                print("".join(f" {token}" for token in delta.new_token_ids), end="", flush=True)
            else:
                print(delta.new_text, end="", flush=True)
            pieces.append(delta.new_text)
    print()
    return "".join(pieces)


# The sampling flags as SamplingParams, given the model's defaults (the engine's ``sampling_defaults``).
ParamsFor = Callable[[Mapping[str, Any]], SamplingParams]


def run_generate(config: EngineConfig, params_for: ParamsFor, prompt: str | list[int]) -> int:
    engine = LLMEngine(config)
    stream(engine, "generate", prompt, params_for(engine.sampling_defaults))
    return 0


def run_chat(config: EngineConfig, params_for: ParamsFor, system: str | None) -> int:
    """A conversation read line by line from stdin. At a terminal it prompts (``you>``, ``assistant>``)
    and explains itself; with piped input it prints the replies alone, one after the other."""
    engine = LLMEngine(config)
    params = params_for(engine.sampling_defaults)
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise TokenmillError("this model has no tokenizer, so it cannot chat (add --tokenizer)")
    interactive = sys.stdin.isatty()
    first: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    history = list(first)
    if interactive:
        print(
            "tokenmill chat: type a message; /reset clears the history, /exit (or Ctrl-D) quits.",
            file=sys.stderr,
        )
    for turn in range(sys.maxsize):
        try:
            line = input("you> " if interactive else "").strip()
        except EOFError:
            break
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history = list(first)
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        reply = _chat_turn(engine, f"chat-{turn}", history, params, interactive)
        if reply is None:  # the turn failed or was interrupted: the conversation goes on without it
            history.pop()
        else:
            history.append({"role": "assistant", "content": reply})
    return 0


def _chat_turn(
    engine: LLMEngine,
    request_id: str,
    history: list[dict[str, str]],
    params: SamplingParams,
    interactive: bool,
) -> str | None:
    """One reply, or None where it could not be given (an error for this turn only, e.g. a conversation
    grown past the context, is printed) or Ctrl-C stopped it (the session goes on)."""
    assert engine.tokenizer is not None
    try:
        prompt_ids = engine.tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
        if interactive:
            print("assistant> ", end="", flush=True)
        return stream(engine, request_id, prompt_ids, params)
    except TokenmillError as error:
        print(f"tokenmill: error: {error} (/reset starts the conversation again)", file=sys.stderr)
    except KeyboardInterrupt:
        engine.abort(request_id)
        while engine.has_unfinished_requests():
            engine.step()
        print("\n(stopped)", file=sys.stderr)
    return None


def run_serve(args: argparse.Namespace, config: EngineConfig) -> int:
    from tokenmill.server import EngineClient, ServerSettings, create_app, default_served_model_name, serve

    engine = EngineClient.launch(config) if args.engine_process else LLMEngine(config)
    settings = ServerSettings(
        served_model_name=args.served_model_name or default_served_model_name(engine),
        api_key=args.api_key or None,
        max_waiting=args.max_waiting,
        request_timeout_s=args.request_timeout,
        stream_interval=args.stream_interval,
    )
    url = f"http://{args.host}:{args.port}"
    print(f"tokenmill: serving '{settings.served_model_name}' on {url}", file=sys.stderr)
    died = serve(create_app(engine, settings), args.host, args.port, args.log_level)
    if died is not None:
        print(f"tokenmill: error: the engine died, the server stopped: {died}", file=sys.stderr)
        return 1
    return 0
