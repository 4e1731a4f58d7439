"""Issue 19, OpenAI's and vLLM's refusals: ``stream_options`` without ``stream: true`` and seeds outside
int64 are 400s naming the field, as both answer; the edges of int64 are still accepted."""

from typing import Any

import openai
import pytest

from server_fixtures import MODEL, client_fixture, server_fixture  # noqa: F401

INT64_MAX = 2**63 - 1
CHAT: list[Any] = [{"role": "user", "content": "Hi"}]


def _create(client: openai.OpenAI, route: str, **fields: Any) -> Any:
    if route == "chat":
        return client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, **fields)
    return client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, **fields)


def _refused(client: openai.OpenAI, route: str, param: str, **fields: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        _create(client, route, **fields)
    assert caught.value.status_code == 400
    body = caught.value.body
    assert isinstance(body, dict) and body.get("param") == param, body
    return caught.value


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, None])
def test_stream_options_without_streaming_is_refused(
    client: openai.OpenAI, route: str, stream: bool | None
) -> None:
    fields: dict[str, Any] = {"stream_options": {"include_usage": True}}
    if stream is not None:
        fields["stream"] = stream
    error = _refused(client, route, "stream_options", **fields)
    assert "stream" in error.message


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_stream_options_with_streaming_still_works(client: openai.OpenAI, route: str) -> None:
    chunks = list(_create(client, route, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("seed", [INT64_MAX + 1, -(2**63) - 1, 2**70])
def test_seeds_outside_int64_are_refused(client: openai.OpenAI, route: str, seed: int) -> None:
    _refused(client, route, "seed", seed=seed)


@pytest.mark.parametrize("seed", [INT64_MAX, -(2**63), 0])
def test_seeds_at_the_edges_of_int64_are_accepted(client: openai.OpenAI, seed: int) -> None:
    first = _create(client, "completions", seed=seed, temperature=1.0)
    again = _create(client, "completions", seed=seed, temperature=1.0)
    assert first.choices[0].text == again.choices[0].text  # and the seed is honoured
