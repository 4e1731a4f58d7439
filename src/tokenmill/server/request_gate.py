"""What a request must pass before any route reads its body: the API key, then a JSON Content-Type.

An ASGI middleware rather than a route dependency, because FastAPI parses a JSON body before it runs a
route's dependencies: a wrong key with a malformed body must be a 401, not a 400 that tells a stranger
how the body was wrong. ``/health``, ``/metrics`` and the API docs stay open for probes and scrapers.

A POST body must be sent as ``Content-Type: application/json``, as vLLM requires too: ``curl -d`` sends
``application/x-www-form-urlencoded`` by default, which gets a 415 naming the type it got and the
header to add, instead of a puzzling "the body must be a JSON object".
"""

import hmac
from http import HTTPStatus
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.server.errors import APIError

OPEN_PATHS = frozenset({"/health", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
JSON_MEDIA_TYPE = "application/json"


def check_api_key(expected: str | None, authorization: str) -> None:
    """APIError 401 unless ``authorization`` is ``Bearer <expected>`` (anything passes without a key)."""
    if expected is None:
        return
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise APIError(HTTPStatus.UNAUTHORIZED, "a valid API key is needed: send 'Authorization: Bearer KEY'")


def check_json_content_type(content_type: str) -> None:
    """APIError 415 unless the media type is ``application/json`` (parameters such as charset allowed)."""
    media_type = content_type.partition(";")[0].strip().lower()
    if media_type == JSON_MEDIA_TYPE:
        return
    got = f"'{content_type}'" if content_type else "no Content-Type"
    raise APIError(
        HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
        f"the request body must be JSON sent with 'Content-Type: application/json', got {got}; "
        "with curl, add -H 'Content-Type: application/json'",
    )


class RequestGate:
    """ASGI middleware: the API key (read from the app's settings at each request), then the body's
    Content-Type on POST, both answered in OpenAI's error format before the route runs."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        try:
            check_api_key(_api_key(scope), headers.get("authorization", ""))
            if scope["method"] == "POST":
                check_json_content_type(headers.get("content-type", ""))
        except APIError as error:
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _api_key(scope: Scope) -> str | None:
    app: Any = scope["app"]
    key: str | None = app.state.context.settings.api_key
    return key
