"""Issue 19, no silent 200s: every field OpenAI or vLLM defines that tokenmill does not implement is a 400
naming it when it asks for something, and accepted when it holds its no-op value; a field neither defines
is ignored with a debug log. Sent through the official client's ``extra_body``, as a vLLM user sends them."""

import logging
from typing import Any

import openai
import pytest

from server_fixtures import MODEL, client_fixture, post, server_fixture  # noqa: F401
from tokenmill.server import ServerThread

CHAT: list[Any] = [{"role": "user", "content": "Hi"}]

# (field, a value that asks for something, its no-op value) for both routes.
BOTH = [
    ("use_beam_search", True, False),
    ("length_penalty", 0.5, 1.0),
    ("logits_processors", ["my.Processor"], None),
    ("kv_transfer_params", {"do_remote_prefill": True}, None),
    ("vllm_xargs", {"a": 1}, None),
    ("guided_decoding_backend", "outlines", None),
    ("guided_whitespace_pattern", " ", None),
]
CHAT_ONLY = [
    ("reasoning_effort", "low", None),
    ("parallel_tool_calls", False, True),
    ("documents", [{"title": "t", "text": "x"}], None),
    ("chat_template", "{{ messages }}", None),
    ("mm_processor_kwargs", {"a": 1}, None),
    ("structural_tag", "{}", None),
    ("audio", {"voice": "alloy", "format": "wav"}, None),
    ("modalities", ["text", "audio"], ["text"]),
    ("prediction", {"type": "content", "content": "x"}, None),
    ("functions", [{"name": "f"}], None),
    ("function_call", "auto", None),
    ("web_search_options", {}, None),
    ("store", True, False),
    ("metadata", {"a": "b"}, None),
    ("service_tier", "flex", "auto"),
    ("verbosity", "low", None),
]
COMPLETIONS_ONLY = [("prompt_embeds", "AAAA", None), ("suffix", "!", None)]


def _create(client: openai.OpenAI, route: str, extra: dict[str, Any]) -> Any:
    if route == "chat":
        return client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, extra_body=extra)
    return client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, extra_body=extra)


CASES = [(route, *case) for route in ("completions", "chat") for case in BOTH]
CASES += [("chat", *case) for case in CHAT_ONLY] + [("completions", *case) for case in COMPLETIONS_ONLY]


@pytest.mark.parametrize(("route", "field", "asking", "no_op"), CASES)
def test_an_unimplemented_field_is_refused_by_name(
    client: openai.OpenAI, route: str, field: str, asking: Any, no_op: Any
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _create(client, route, {field: asking})
    body = caught.value.body
    assert isinstance(body, dict) and body.get("param") == field and field in body["message"], body
    answer = _create(client, route, {field: no_op})  # asking for nothing is fine
    assert answer.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_fields_no_one_defines_are_ignored_with_a_debug_log(
    client: openai.OpenAI, route: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="tokenmill.server.request_checks"):
        answer = _create(client, route, {"my_own_field": 1, "prompt_cache_key": "k"})
    assert answer.choices[0].finish_reason in ("length", "stop")
    logged = [record.getMessage() for record in caplog.records]
    assert any("my_own_field" in message for message in logged), logged
    assert not any("prompt_cache_key" in message for message in logged)  # an OpenAI hint, not unknown


GENERATE_REFUSES = {
    "prompt_logprobs": 1,
    "return_token_ids": True,
    "truncate_prompt_tokens": 2,
    "request_id": "r",
    "stream": True,
    "logprobs": 2,
    "echo": True,
    "best_of": 2,
    "suffix": "!",
}


@pytest.mark.parametrize("field", list(GENERATE_REFUSES))
def test_generate_refuses_the_extras_it_cannot_answer(server: ServerThread, field: str) -> None:
    """/generate's answer is one plain JSON object: the completions route's extras (streaming,
    logprobs, echo, ...) are refused by name, not ignored; their no-op values are fine."""
    response = post(server, "/generate", {"prompt": "Hello", "max_tokens": 2, field: GENERATE_REFUSES[field]})
    assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text
    assert post(server, "/generate", {"prompt": "Hello", "max_tokens": 2}).status_code == 200
    no_ops = {"prompt": "Hello", "max_tokens": 2, "stream": False, "echo": False, "logprobs": None}
    assert post(server, "/generate", no_ops).status_code == 200
