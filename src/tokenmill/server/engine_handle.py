"""The one interface the HTTP side has to the engine, whichever way it runs: ``EngineLoop`` (a thread of
this process, over an ``LLMEngine``) or ``EngineClient`` (the engine's own process). ``connect`` picks
by what it is given and returns what the routes need besides: the engine's facts and a grammar compiler
to check a request's constraint before it is queued (the engine's own one in a thread; a second one here
with the engine in its process, so a bad schema is a 400 without a trip to the engine)."""

from collections.abc import Sequence
from typing import Protocol, TypeAlias

import torch

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.engine_client import EngineClient
from tokenmill.server.engine_core import engine_facts
from tokenmill.server.engine_loop import EngineLoop
from tokenmill.server.engine_messages import EngineFacts, PromptSpec
from tokenmill.server.metrics import EngineStats, ServerMetrics
from tokenmill.server.streams import RequestStream
from tokenmill.structured.manager import StructuredOutputs

Engine: TypeAlias = LLMEngine | EngineClient


class EngineHandle(Protocol):
    failure: BaseException | None

    def start(self) -> None: ...

    def stop(self, timeout_s: float = 10.0) -> None: ...

    @property
    def is_healthy(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def load(self) -> tuple[EngineStats, int]: ...

    def submit(self, specs: Sequence[PromptSpec], stream: RequestStream) -> None: ...

    def abort(self, request_ids: Sequence[str]) -> None: ...


def facts_of(engine: Engine) -> EngineFacts:
    return engine.facts if isinstance(engine, EngineClient) else engine_facts(engine)


def connect(engine: Engine, metrics: ServerMetrics) -> tuple[EngineHandle, StructuredOutputs]:
    """The handle that feeds ``metrics``, and the grammar compiler for request checks."""
    if isinstance(engine, LLMEngine):
        return EngineLoop(engine, metrics), engine.structured_outputs
    engine.metrics = metrics
    facts = engine.facts
    compiler = StructuredOutputs(
        facts.structured_output_backend,
        facts.tokenizer,
        facts.vocab_size,
        facts.eos_token_ids,
        torch.device("cpu"),
    )
    return engine, compiler
