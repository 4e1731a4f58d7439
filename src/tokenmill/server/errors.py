"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, for every failure.

Bad input is always a 4xx: FastAPI's 422 for a body that fails validation (malformed JSON, a missing field,
a wrong type) becomes a 400 naming the offending field, and unknown routes keep their 404 / 405.
"""

import logging
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    415: "invalid_request_error",
    500: "server_error",
    503: "overloaded_error",
    504: "timeout_error",
}


class APIError(Exception):
    """An error answered to the client as ``status_code`` with an OpenAI error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.status_code, self.message, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param)


def error_body(status_code: int, message: str, param: str | None = None) -> dict[str, Any]:
    fallback = "server_error" if status_code >= 500 else "invalid_request_error"
    error_type = _ERROR_TYPES.get(status_code, fallback)
    return {"error": {"message": message, "type": error_type, "param": param, "code": status_code}}


def validation_error_to_api_error(errors: Sequence[Any]) -> APIError:
    """The first pydantic error, as a 400 naming the field (``messages.0.content``) it is about; for a
    field of several allowed types, what each type said."""
    if not errors:
        return bad_request("the request body is invalid")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first.get('msg', '')}")
    param = _field_path(first.get("loc", ()))
    if param is None:
        return bad_request("the request body must be a JSON object with the request's fields")
    messages = [str(error.get("msg", "")) for error in errors if _field_path(error.get("loc", ())) == param]
    unique = list(dict.fromkeys(messages))
    return bad_request(f"'{param}': {'; or '.join(unique[:4])}", param)


def _field_path(location: Sequence[Any]) -> str | None:
    """``("body", "messages", 0, "content", "str")`` -> ``messages.0.content``: the path without the
    "body" root and the type tags pydantic adds inside unions (``str``, ``list[int]``, ...)."""
    parts = []
    for part in location[1:] if location[:1] == ("body",) else location:
        if isinstance(part, str) and (part in _TYPE_TAGS or "[" in part):
            break
        parts.append(str(part))
    return ".".join(parts) or None


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "function-after"})


async def _api_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _validation_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return validation_error_to_api_error(exc.errors()).response()


async def _http_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()


async def _unexpected_error_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error while serving %s %s", request.method, request.url.path)
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal server error: {exc}").response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(Exception, _unexpected_error_handler)
