"""The FastAPI app: routes, the request gate (API key, JSON Content-Type), error handlers, and the
engine's lifetime.

``create_app(engine, settings)`` builds the app over an ``EngineClient`` (the engine in its own process,
``EngineClient.launch(config)``) or an ``LLMEngine`` (stepped by a thread of this process); the engine
starts serving with the app's lifespan and stops with it. ``ServerThread`` runs uvicorn in a background
thread (tests, notebooks); ``serve`` runs it in the foreground (``tokenmill serve``).
"""

import logging
import socket
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.server import chat, completions
from tokenmill.server.chat import render_chat
from tokenmill.server.engine_handle import Engine, facts_of
from tokenmill.server.errors import bad_request, install_error_handlers
from tokenmill.server.generation import ClientDisconnectedError, ServerContext, ServerSettings
from tokenmill.server.metrics import CONTENT_TYPE
from tokenmill.server.prompts import encode
from tokenmill.server.protocol import DetokenizeRequest, ModelCard, ModelList, TokenizeRequest, as_dict
from tokenmill.server.request_checks import check_continue_final_message
from tokenmill.server.request_gate import RequestGate
from tokenmill.server.responses import client_disconnected_handler, context

logger = logging.getLogger(__name__)


def default_served_model_name(engine: Engine) -> str:
    """The ``--model`` argument as given, or the default model's file name without its suffixes."""
    facts = facts_of(engine)
    return facts.model or Path(facts.source).name.split(".")[0]


_ENGINE_WATCH_S = 0.5  # how often `serve` checks that its engine is alive

# Everything that uses the model needs the key, checked by RequestGate before the body is read;
# /health and /metrics stay open for probes and scrapers.
_protected = APIRouter()
_open = APIRouter()


@_protected.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    ctx = context(request)
    return as_dict(ModelList(data=[_model_card(ctx)]))


@_protected.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    ctx = context(request)
    ctx.check_model(model_id)
    return as_dict(_model_card(ctx))


def _model_card(ctx: ServerContext) -> ModelCard:
    name = ctx.settings.served_model_name
    return ModelCard(id=name, created=ctx.created, max_model_len=ctx.max_model_len)


@_protected.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    ctx = context(request)
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("send exactly one of 'prompt' and 'messages'", "prompt")
    messages, prompt = body.messages, body.prompt
    if messages is not None and body.continue_final_message:
        check_continue_final_message(body)

    def tokenized() -> list[int]:
        if messages is None:
            assert prompt is not None
            return encode(ctx, prompt, "prompt", body.add_special_tokens)
        continuing = {"continue_final_message": True} if body.continue_final_message else {}
        adds_prompt = body.add_generation_prompt and not body.continue_final_message
        text = render_chat(ctx, messages, adds_prompt, None, **continuing)
        return encode(ctx, text, "messages", body.add_special_tokens)

    tokens = await ctx.run_text_work(tokenized)
    answer: dict[str, Any] = {
        "tokens": tokens,
        "count": len(tokens),
        "max_model_len": ctx.max_model_len,
    }
    if body.return_token_strs:
        answer["token_strs"] = ctx.tokenizer.hf_tokenizer.convert_ids_to_tokens(tokens)
    return answer


@_protected.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    ctx = context(request)
    ctx.check_model(body.model)
    vocab_size = ctx.facts.vocab_size
    bad = [token for token in body.tokens if not 0 <= token < vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "tokens")
    return {"prompt": ctx.tokenizer.decode(body.tokens)}


@_open.get("/health")
async def health(request: Request) -> Response:
    engine_loop = context(request).engine_loop
    if engine_loop.is_healthy:
        return Response(status_code=HTTPStatus.OK)
    reason = repr(engine_loop.failure) if engine_loop.failure else "the engine loop is not running"
    return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=HTTPStatus.SERVICE_UNAVAILABLE)


@_open.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(context(request).metrics.render(), media_type=CONTENT_TYPE)


def create_app(engine: Engine, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings(served_model_name=default_served_model_name(engine))
    ctx = ServerContext(engine, settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        ctx.engine_loop.start()
        try:
            yield
        finally:
            ctx.engine_loop.stop()
            ctx.close()

    app = FastAPI(title="tokenmill", summary="OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.context = ctx
    install_error_handlers(app)
    app.add_exception_handler(ClientDisconnectedError, client_disconnected_handler)
    app.include_router(_protected)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(_open)
    app.add_middleware(RequestGate)
    return app


def _uvicorn_config(app: FastAPI, host: str, port: int, log_level: str) -> uvicorn.Config:
    # timeout_graceful_shutdown: open streams are cut after it instead of holding the shutdown forever.
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> str | None:
    """Run the server in the foreground until interrupted, or until its engine dies (a killed engine
    process, a lost tensor-parallel rank): then the requests in flight are answered with the reason, the
    server shuts down and the reason is returned (None after a normal stop)."""
    server = uvicorn.Server(_uvicorn_config(app, host, port, log_level))
    engine_loop: Any = app.state.context.engine_loop
    stopped, died = threading.Event(), []

    def watch_engine() -> None:
        while not stopped.wait(_ENGINE_WATCH_S):
            if server.started and not engine_loop.is_healthy and not server.should_exit:
                died.append(repr(engine_loop.failure) if engine_loop.failure else "the engine loop stopped")
                server.should_exit = True
                return

    threading.Thread(target=watch_engine, name="tokenmill-engine-watch", daemon=True).start()
    try:
        server.run()
    finally:
        stopped.set()
    return died[0] if died else None


class ServerThread:
    """uvicorn serving ``app`` from a background thread on ``host`` and a free port (``base_url``).

    Use as a context manager; leaving it shuts the server (and the engine loop) down.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", log_level: str = "warning") -> None:
        self.app = app
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, 0))
        self.host, self.port = self._socket.getsockname()[:2]
        self.server = uvicorn.Server(_uvicorn_config(app, self.host, self.port, log_level))
        self._thread = threading.Thread(target=self._run, name="tokenmill-uvicorn", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        self.server.run(sockets=[self._socket])

    def start(self, timeout_s: float = 30.0) -> "ServerThread":
        self._thread.start()
        stopped = threading.Event()
        for _ in range(int(timeout_s / 0.05)):
            if self.server.started or not self._thread.is_alive():
                break
            stopped.wait(0.05)
        if not self.server.started:
            raise RuntimeError(f"the server did not start within {timeout_s} s")
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self._socket.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
