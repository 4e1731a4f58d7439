"""One HTTP request's generation: its prompts × n sequences, from admission to the last delta.

``ServerContext.start`` admits a request (model name, the waiting bound), hands its prompts to the engine
loop and waits until they are queued (or refused: a 400 with the engine's message). ``Generation`` then
yields ``(choice index, delta)`` pairs; it raises ``APIError`` on a timeout (504), an engine failure (500),
or, while a watched client is gone, ``ClientDisconnectedError``. Whatever way it ends, ``close()`` aborts the
sequences still running, so their KV blocks are freed at once.
"""

import asyncio
import dataclasses
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TypeVar

from starlette.requests import Request

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.outputs import RequestDelta, RowLogprobs
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.engine_handle import Engine, EngineHandle, connect, facts_of
from tokenmill.server.engine_loop import EngineLoopStoppedError
from tokenmill.server.engine_messages import Accepted, Failed, PromptSpec, StreamItem
from tokenmill.server.errors import APIError
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.streams import RequestStream
from tokenmill.tokenizer import Tokenizer

T = TypeVar("T")

# How often a waiting handler checks its client and deadline.
_POLL_S = 0.1
RETRY_AFTER_S = 1


class ClientDisconnectedError(Exception):
    """The client went away before its answer was ready."""


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_waiting: int | None = None  # sequences allowed to wait for a slot; None: no bound
    request_timeout_s: float | None = None  # None: no limit
    # Tokens per streamed chunk after the first (SGLang's and vLLM's stream interval). Fewer chunks cost
    # the event loop less; on the H200 a larger interval did not raise throughput at 256 streams
    # (reports/gpu/serve-llama-3.2-1b), so the default streams every token.
    stream_interval: int = 1


@dataclass
class ChoiceResult:
    """One choice's whole output, accumulated from its deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[RowLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[RowLogprobs | None] | None = None

    def apply(self, delta: RequestDelta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.text += delta.new_text
        self.token_ids.extend(delta.new_token_ids)
        self.logprobs.extend(delta.new_logprobs or [])
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason


class ServerContext:
    """What the routes share: the engine handle, its settings and metrics, the engine's facts (limits,
    tokenizer) and a grammar compiler. ``engine`` is the ``LLMEngine`` when it runs in a thread of this
    process (tests reach into it), None when it runs in its own process."""

    def __init__(self, engine: Engine, settings: ServerSettings) -> None:
        self.engine: LLMEngine | None = engine if isinstance(engine, LLMEngine) else None
        self.facts = facts_of(engine)
        self.settings = settings
        self.metrics = ServerMetrics(
            lambda: self.engine_loop.stats(), self.facts.max_model_len, self.facts.cache_labels
        )
        self.engine_loop, self.grammars = connect(engine, self.metrics)
        self.created = int(time.time())
        self._ids = itertools.count()
        # One thread: a fast tokenizer is not to be used from two threads at once.
        self._text_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-text")

    async def run_text_work(self, work: Callable[[], T]) -> T:
        """Run ``work`` (rendering a chat template, tokenizing) in the server's text thread: the event loop
        goes on streaming the other requests' tokens meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._text_thread, work)

    def close(self) -> None:
        self._text_thread.shutdown(wait=False, cancel_futures=True)

    @property
    def max_model_len(self) -> int:
        return self.facts.max_model_len

    @property
    def has_tokenizer(self) -> bool:
        return self.facts.tokenizer is not None

    @property
    def tokenizer(self) -> Tokenizer:
        if self.facts.tokenizer is None:
            raise APIError(HTTPStatus.BAD_REQUEST, "this model has no tokenizer: send token ids")
        return self.facts.tokenizer

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.served_model_name:
            raise APIError(
                HTTPStatus.NOT_FOUND,
                f"the model '{model}' does not exist; this server serves '{self.settings.served_model_name}'",
                "model",
            )

    def new_id(self, prefix: str, request_id: str | None = None) -> str:
        """A response id; from the client's ``request_id`` where it sent one, as vLLM builds it."""
        return f"{prefix}-{request_id or uuid.uuid4().hex[:24]}"

    async def start(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams,
        client: Request,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> "Generation":
        """Admit and queue the prompts; returns once the engine has accepted all of them. ``params``'
        ``max_tokens`` None (the request gave none) takes the generation config's default for each prompt
        (see :meth:`fit_default_max_tokens`)."""
        self._check_capacity(len(prompts) * params.n)
        base = f"req-{next(self._ids)}"
        specs = [
            PromptSpec(
                f"{base}-{i}", prompt, self.fit_default_max_tokens(params, prompt), priority, cache_salt
            )
            for i, prompt in enumerate(prompts)
        ]
        generation = Generation(
            self.engine_loop, specs, params.n, self._deadline(), client, self._chunk_tokens
        )
        try:
            self.engine_loop.submit(specs, generation.stream)
        except EngineLoopStoppedError as exc:
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc)) from None
        try:
            await generation.wait_accepted()
        except BaseException:
            generation.close()
            raise
        return generation

    def fit_default_max_tokens(self, params: SamplingParams, prompt: str | list[int]) -> SamplingParams:
        """``params`` with ``max_tokens`` None given the generation config's ``max_new_tokens``, at most
        what the context leaves after ``prompt`` (and at least ``min_tokens``); unchanged without a
        default, or where the prompt leaves no room (the engine refuses it with its own message)."""
        default = self.facts.sampling_defaults.get("max_tokens")
        if params.max_tokens is not None or default is None:
            return params
        room = self.max_model_len - len(prompt) if isinstance(prompt, list) else default
        if room < 1:
            return params
        return dataclasses.replace(params, max_tokens=max(min(default, room), params.min_tokens))

    def _check_capacity(self, num_sequences: int) -> None:
        if not self.engine_loop.is_healthy:
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "the engine loop is not running")
        max_waiting = self.settings.max_waiting
        if max_waiting is None:
            return
        stats, queued = self.engine_loop.load()
        in_flight = stats.num_running + stats.num_waiting + queued
        would_wait = in_flight + num_sequences - self.facts.max_running
        if would_wait > max_waiting:
            raise APIError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"the server is at capacity ({stats.num_waiting + queued} sequences waiting, "
                f"bound {max_waiting}); retry later",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )

    def _chunk_tokens(self) -> int:
        return self.settings.stream_interval

    def _deadline(self) -> float | None:
        timeout = self.settings.request_timeout_s
        return None if timeout is None else asyncio.get_running_loop().time() + timeout


class Generation:
    def __init__(
        self,
        engine_loop: EngineHandle,
        specs: list[PromptSpec],
        n: int,
        deadline: float | None,
        client: Request | None,
        chunk_tokens: Callable[[], int] = lambda: 1,
    ) -> None:
        self.engine_loop = engine_loop
        self.chunk_tokens = chunk_tokens
        self.n = n
        self.created = int(time.time())  # the responses' "created"
        self.deadline = deadline
        self.client = client  # watched for a disconnect while set
        self.stream = RequestStream()
        self.prompt_index = {spec.request_id: index for index, spec in enumerate(specs)}
        self.prompt_token_ids: list[list[int]] = []
        self.num_choices = len(specs) * n
        self._cached_tokens = [0] * len(specs)  # per prompt, the most any of its n sequences reported
        self._num_finished = 0
        self._buffered: list[tuple[int, RequestDelta]] = []
        self._held: StreamItem | None = None  # taken from the queue while merging, not yet answered
        self._closed = False
        self._next_poll = 0.0  # event loop time of the next client / engine liveness check

    @property
    def finished(self) -> bool:
        return self._num_finished == self.num_choices

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompt_token_ids)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, over the deltas seen so far."""
        return sum(self._cached_tokens)

    async def wait_accepted(self) -> None:
        item = await self._next_item()
        if not isinstance(item, Accepted):
            raise _unexpected(item)
        self.prompt_token_ids = item.prompt_token_ids

    async def wait_first_delta(self) -> None:
        """Wait for the first output, so that an early failure can still be answered with its status."""
        if not self._buffered and not self.finished:
            self._buffered.append(await self._next_delta())

    def stop_watching_client(self) -> None:
        """From now on a disconnect is noticed by the response (a streaming one is cancelled)."""
        self.client = None

    async def deltas(self) -> AsyncIterator[tuple[int, RequestDelta]]:
        """``(choice index, delta)`` pairs until every sequence has finished.

        Deltas that piled up while the handler was busy come merged, one per choice: when the engine
        outpaces the HTTP side (many streams, a fast GPU), each chunk then carries several tokens instead
        of the event loop falling further behind one token per chunk. After its first token, a single
        choice also waits for ``chunk_tokens()`` tokens (or its end) before it is sent."""
        while self._buffered:
            yield self._buffered.pop(0)
        while not self.finished:
            first = await self._next_delta()
            merged = self._merged_with_ready(first)
            if self.num_choices == 1 and merged[0][1].num_output_tokens > 1:
                merged = await self._filled(merged[0], self.chunk_tokens())
            for item in merged:
                yield item

    async def _filled(self, merged: tuple[int, RequestDelta], tokens: int) -> list[tuple[int, RequestDelta]]:
        index, delta = merged
        while len(delta.new_token_ids) < tokens and not self.finished and self._held is None:
            item = await self._next_item()
            if not isinstance(item, RequestDelta):
                self._held = item  # a failure: answered after the tokens gathered so far
                break
            delta = join_deltas(delta, self._accept(item)[1])
        return [(index, delta)]

    def _merged_with_ready(self, first: tuple[int, RequestDelta]) -> list[tuple[int, RequestDelta]]:
        merged = {first[0]: first[1]}
        queue = self.stream.queue
        while self._held is None and not self.finished and not queue.empty():
            item = queue.get_nowait()
            if not isinstance(item, RequestDelta):
                self._held = item  # a failure: answered after the tokens before it
                break
            index, delta = self._accept(item)
            merged[index] = join_deltas(merged[index], delta) if index in merged else delta
        return list(merged.items())

    async def collect(self) -> list[ChoiceResult]:
        results = [ChoiceResult() for _ in range(self.num_choices)]
        async for index, delta in self.deltas():
            results[index].apply(delta)
        return results

    def close(self) -> None:
        """Abort whatever is still running (no-op once finished); safe to call more than once."""
        if not self._closed and not self.finished:
            self.engine_loop.abort(list(self.prompt_index))
        self._closed = True

    async def _next_delta(self) -> tuple[int, RequestDelta]:
        item = await self._next_item()
        if not isinstance(item, RequestDelta):
            raise _unexpected(item)
        return self._accept(item)

    def _accept(self, item: RequestDelta) -> tuple[int, RequestDelta]:
        if item.finished:
            self._num_finished += 1
        prompt_index = self.prompt_index[item.request_id]
        self._cached_tokens[prompt_index] = max(self._cached_tokens[prompt_index], item.num_cached_tokens)
        return prompt_index * self.n + item.index, item

    async def _next_item(self) -> StreamItem:
        if self._held is not None:
            held, self._held = self._held, None
            return held
        queue = self.stream.queue
        while True:
            # Checked on a clock, not only when the queue is idle: a busy engine never lets it idle.
            await self._check_still_wanted()
            if not queue.empty():
                return queue.get_nowait()
            try:
                return await asyncio.wait_for(queue.get(), self._poll_interval())
            except TimeoutError:
                pass

    def _poll_interval(self) -> float:
        if self.deadline is None:
            return _POLL_S
        return max(0.0, min(_POLL_S, self.deadline - asyncio.get_running_loop().time()))

    async def _check_still_wanted(self) -> None:
        now = asyncio.get_running_loop().time()
        if self.deadline is not None and now >= self.deadline:
            raise APIError(HTTPStatus.GATEWAY_TIMEOUT, "the request took longer than the server's timeout")
        if now < self._next_poll:
            return
        self._next_poll = now + _POLL_S
        if self.client is not None and await self.client.is_disconnected():
            raise ClientDisconnectedError()
        if not self.engine_loop.is_healthy and self.stream.queue.empty():
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "the engine loop is not running")


def join_deltas(earlier: RequestDelta, later: RequestDelta) -> RequestDelta:
    """One delta for two consecutive ones of the same sequence."""
    logprobs = None
    if earlier.new_logprobs is not None or later.new_logprobs is not None:
        logprobs = [*(earlier.new_logprobs or []), *(later.new_logprobs or [])]
    prompt_logprobs = earlier.prompt_logprobs
    return dataclasses.replace(
        later,
        new_token_ids=earlier.new_token_ids + later.new_token_ids,
        new_text=earlier.new_text + later.new_text,
        new_logprobs=logprobs,
        num_cached_tokens=max(earlier.num_cached_tokens, later.num_cached_tokens),
        prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else later.prompt_logprobs,
    )


def _unexpected(item: StreamItem) -> APIError:
    if isinstance(item, Failed):
        return APIError(item.status_code, item.message, item.param)
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"unexpected engine output {type(item).__name__}")
