"""Issue 19, vLLM's prompt and stream options: ``truncate_prompt_tokens`` keeps the prompt's last tokens
(as ``/tokenize`` counts them), ``add_special_tokens``, ``/tokenize``'s ``return_token_strs`` (the
tokenizer's own token strings), ``stream_options.continuous_usage_stats`` (running usage in every chunk,
ending at the final usage) and ``request_id`` (the response's id)."""

import dataclasses
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from engine_helpers import engine_for
from server_fixtures import MODEL, client_fixture, server_fixture, tokenize  # noqa: F401
from tokenmill.server import ServerSettings, ServerThread, create_app
from tokenmill.tokenizer import Tokenizer

LONG = "One two three four five six seven eight nine ten eleven twelve."
CHAT: list[Any] = [{"role": "user", "content": LONG}]


def _ids(answer_part: Any) -> list[int]:
    ids: list[int] = (answer_part.model_extra or {})["prompt_token_ids"]
    return ids


@pytest.mark.parametrize("keep", [1, 5, -1])
def test_truncate_prompt_tokens_keeps_the_last_tokens(
    server: ServerThread, client: openai.OpenAI, keep: int
) -> None:
    full = tokenize(server, prompt=LONG)["tokens"]
    extra = {"truncate_prompt_tokens": keep, "return_token_ids": True}
    answer = client.completions.create(
        model=MODEL, prompt=LONG, max_tokens=2, temperature=0, extra_body=extra
    )
    expected = full if keep == -1 else full[-keep:]
    assert _ids(answer.choices[0]) == expected and answer.usage.prompt_tokens == len(expected)  # type: ignore[union-attr]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, extra_body=extra)
    chat_full = tokenize(server, messages=CHAT)["tokens"]
    assert _ids(chat) == (chat_full if keep == -1 else chat_full[-keep:])


@pytest.mark.parametrize("keep", [0, -2])
def test_a_truncation_that_keeps_nothing_is_refused(client: openai.OpenAI, keep: int) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model=MODEL, prompt=LONG, max_tokens=2, extra_body={"truncate_prompt_tokens": keep}
        )
    assert caught.value.body["param"] == "truncate_prompt_tokens"  # type: ignore[index]


@pytest.fixture(scope="module")
def bos_server(smollm2) -> Iterator[ServerThread]:  # type: ignore[no-untyped-def]
    """The default model with a tokenizer that starts every text with a BOS, as Gemma's does."""
    assert smollm2.tokenizer is not None and smollm2.tokenizer.bos_token_id is not None
    tokenizer = Tokenizer(smollm2.tokenizer.hf_tokenizer, add_bos=True)
    engine = engine_for(dataclasses.replace(smollm2, tokenizer=tokenizer), max_model_len=128, max_num_seqs=2)
    with ServerThread(create_app(engine, ServerSettings(served_model_name=MODEL))) as thread:
        yield thread


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_add_special_tokens_decides_the_bos(bos_server: ServerThread, add_special_tokens: bool) -> None:
    client = openai.OpenAI(base_url=f"{bos_server.base_url}/v1", api_key="unused", max_retries=0)
    extra = {"add_special_tokens": add_special_tokens, "return_token_ids": True}
    answer = client.completions.create(model=MODEL, prompt=LONG, max_tokens=1, extra_body=extra)
    hf = bos_server.app.state.context.tokenizer.hf_tokenizer
    plain = hf.encode(LONG, add_special_tokens=False)
    expected = [hf.bos_token_id, *plain] if add_special_tokens else plain
    assert _ids(answer.choices[0]) == expected
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_body=extra)
    rendered = hf.encode(
        hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    # SmolLM2's template starts with <|im_start|>, its BOS here: tokenmill never doubles a BOS.
    with_bos = rendered if rendered[:1] == [hf.bos_token_id] else [hf.bos_token_id, *rendered]
    assert _ids(chat) == (with_bos if add_special_tokens else rendered)


def test_tokenize_returns_the_token_strings(server: ServerThread) -> None:
    answer = tokenize(server, prompt=LONG, return_token_strs=True)
    hf = server.app.state.context.tokenizer.hf_tokenizer
    assert answer["token_strs"] == hf.convert_ids_to_tokens(answer["tokens"])
    assert "token_strs" not in tokenize(server, prompt=LONG)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_continuous_usage_stats_count_the_tokens_so_far(client: openai.OpenAI, route: str) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    if route == "chat":
        stream: Any = client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options=options,  # type: ignore[arg-type]
        )
    else:
        stream = client.completions.create(
            model=MODEL,
            prompt=LONG,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options=options,  # type: ignore[arg-type]
        )
    chunks = list(stream)
    final = chunks[-1].usage
    assert final is not None and not chunks[-1].choices
    running = [chunk.usage for chunk in chunks[:-1]]
    assert all(usage is not None for usage in running)  # every chunk carries it
    counts = [usage.completion_tokens for usage in running]
    assert counts == sorted(counts) and counts[-1] == final.completion_tokens == 6
    assert {usage.prompt_tokens for usage in running} == {final.prompt_tokens}
    assert all(usage.total_tokens == usage.prompt_tokens + usage.completion_tokens for usage in running)


def test_without_continuous_usage_stats_only_the_last_chunk_has_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=LONG, max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
    )
    assert [chunk.usage is not None for chunk in chunks] == [False] * (len(chunks) - 1) + [True]


def test_request_id_names_the_response(server: ServerThread, client: openai.OpenAI) -> None:
    answer = client.completions.create(
        model=MODEL, prompt=LONG, max_tokens=1, extra_body={"request_id": "abc-123"}
    )
    assert answer.id == "cmpl-abc-123"
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=1, extra_body={"request_id": "x9"}
    )
    assert chat.id == "chatcmpl-x9"
