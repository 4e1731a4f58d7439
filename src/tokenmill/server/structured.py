"""Structured outputs from a request body: ``response_format``, ``structured_outputs`` or ``guided_*``.

A request sets at most one of them (two are a 400 naming the second). :func:`structured_outputs_of` turns
it into ``StructuredOutputsParams`` and the request field it came from; :func:`check_grammar` compiles it
on a worker thread of the HTTP process (with the engine in a thread, its own compiler, which caches it
for the engine; with the engine in its process, a compiler of this process), so a bad schema, regex or
grammar is a 400 naming that field before the request is queued.
"""

import asyncio
import dataclasses
import json
from typing import Any, NamedTuple

from tokenmill.sampling_params import SamplingParams
from tokenmill.server.errors import bad_request
from tokenmill.server.protocol import ResponseFormat, SamplingRequest, StructuredOutputsRequest
from tokenmill.structured.backend import StructuredOutputError
from tokenmill.structured.manager import StructuredOutputs
from tokenmill.structured.params import StructuredOutputsParams


class StructuredRequest(NamedTuple):
    params: StructuredOutputsParams
    field: str  # the request field it came from, named in errors


def structured_outputs_of(
    body: SamplingRequest, *others: StructuredRequest | None
) -> StructuredRequest | None:
    """The body's structured-output constraint, if it sets one (``others``: constraints the route found
    elsewhere in the body, such as a forcing ``tool_choice``)."""
    candidates = (
        *others,
        _from_response_format(body.response_format),
        _from_structured_outputs(body.structured_outputs),
        *_from_guided(body),
    )
    found = [request for request in candidates if request is not None]
    if len(found) > 1:
        fields = ", ".join(request.field for request in found)
        raise bad_request(f"set one structured-output constraint at most, got {fields}", found[1].field)
    return found[0] if found else None


def build(field: str, **constraint: Any) -> StructuredRequest:
    """``StructuredOutputsParams(**constraint)``; a bad value is a 400 naming ``field``."""
    try:
        return StructuredRequest(StructuredOutputsParams(**constraint), field)
    except ValueError as exc:
        message = str(exc).replace("structured_outputs.", f"{field}: ", 1)
        raise bad_request(message, field) from None


def _from_response_format(response_format: ResponseFormat | None) -> StructuredRequest | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return build("response_format", json_object=True)
    field = "response_format.json_schema"
    if response_format.json_schema is None or response_format.json_schema.json_schema is None:
        raise bad_request(f"{field}.schema is needed with response_format type json_schema", field)
    return build(f"{field}.schema", json=response_format.json_schema.json_schema)


# vLLM's structured_outputs keys that are not constraints, and the values that ask for nothing here (any
# value of disable_fallback: there is no fallback backend to disable).
_VLLM_OPTIONS: dict[str, tuple[Any, ...] | None] = {
    "disable_fallback": None,
    "disable_additional_properties": (None, False),
    "whitespace_pattern": (None,),
    "structural_tag": (None,),
}


def _from_structured_outputs(request: StructuredOutputsRequest | None) -> StructuredRequest | None:
    if request is None:
        return None
    for name, value in (request.model_extra or {}).items():
        field = f"structured_outputs.{name}"
        if name not in _VLLM_OPTIONS:
            raise bad_request(f"structured_outputs has no field '{name}'", field)
        no_ops = _VLLM_OPTIONS[name]
        if no_ops is not None and value not in no_ops:
            raise bad_request(f"'{field}' is not supported by this server (got {value!r})", field)
    fields = request.model_dump(exclude_none=True, by_alias=True, exclude=set(request.model_extra or {}))
    if fields.get("json_object") is False:
        del fields["json_object"]
    kinds = [name for name in ("json", "regex", "choice", "grammar", "json_object") if name in fields]
    return build(f"structured_outputs.{kinds[0]}" if len(kinds) == 1 else "structured_outputs", **fields)


def _from_guided(body: SamplingRequest) -> list[StructuredRequest | None]:
    guided_json = body.guided_json
    if isinstance(guided_json, str):
        try:
            guided_json = json.loads(guided_json)
        except json.JSONDecodeError as exc:
            raise bad_request(f"guided_json is not valid JSON: {exc}", "guided_json") from None
    return [
        None if guided_json is None else build("guided_json", json=guided_json),
        None if body.guided_regex is None else build("guided_regex", regex=body.guided_regex),
        None if body.guided_choice is None else build("guided_choice", choice=body.guided_choice),
        None if body.guided_grammar is None else build("guided_grammar", grammar=body.guided_grammar),
    ]


async def check_grammar(grammars: StructuredOutputs, request: StructuredRequest) -> None:
    """Compile the constraint off the event loop (cached for the engine); a 400 naming its field if it
    does not compile or cannot be served (a model without a tokenizer)."""
    try:
        await asyncio.to_thread(grammars.compile, request.params, request.field)
    except StructuredOutputError as exc:
        raise bad_request(str(exc), request.field) from None


async def constrained(
    grammars: StructuredOutputs, params: SamplingParams, request: StructuredRequest | None
) -> SamplingParams:
    """``params`` with the request's constraint, once it has compiled; unchanged without one."""
    if request is None:
        return params
    await check_grammar(grammars, request)
    return dataclasses.replace(params, structured_outputs=request.params)
