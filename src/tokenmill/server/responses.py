"""Answering a generation: as one JSON body when it is done, or as server-sent events while it runs.

A stream starts only once the first output is there, so an engine failure or a timeout before it is still
answered with its own status; later ones arrive as an ``{"error": ...}`` event followed by ``[DONE]``.
However a response ends (done, failed, client gone), the generation is closed, which aborts what runs.
"""

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from tokenmill.server.errors import APIError
from tokenmill.server.generation import ChoiceResult, ClientDisconnectedError, Generation, ServerContext
from tokenmill.server.protocol import PromptTokensDetails, UsageInfo

# Not sent to anyone (the client is gone); nginx's code for it, shown in access logs.
CLIENT_CLOSED_REQUEST = 499
SSE_DONE = "data: [DONE]\n\n"


def context(request: Request) -> ServerContext:
    ctx: ServerContext = request.app.state.context
    return ctx


def usage_info(generation: Generation, completion_tokens: int) -> UsageInfo:
    """Token counts for ``usage``, once the generation is done (its cached tokens come with its deltas)."""
    prompt_tokens = generation.num_prompt_tokens
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=generation.num_cached_tokens),
    )


def sse(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


class _GenerationStream(StreamingResponse):
    """A streaming response that closes its generation however the response ends (even before its body
    iterator ever ran, when the client left at once)."""

    def __init__(self, generation: Generation, chunks: AsyncIterator[str]) -> None:
        super().__init__(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()


async def streaming_response(generation: Generation, chunks: AsyncIterator[str]) -> Response:
    try:
        await generation.wait_first_delta()
    except BaseException:
        generation.close()
        raise
    generation.stop_watching_client()
    return _GenerationStream(generation, _events(generation, chunks))


async def _events(generation: Generation, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as exc:
        yield sse(exc.body())
        yield SSE_DONE
    finally:
        generation.close()


async def json_response_when_done(
    generation: Generation, build: Callable[[list[ChoiceResult]], BaseModel | dict[str, Any]]
) -> Response:
    try:
        results = await generation.collect()
    finally:
        generation.close()
    body = build(results)
    return JSONResponse(body.model_dump(mode="json") if isinstance(body, BaseModel) else body)


async def client_disconnected_handler(_: Request, __: Exception) -> Response:
    assert isinstance(__, ClientDisconnectedError)
    return Response(status_code=CLIENT_CLOSED_REQUEST)
