"""Issue 19, vLLM's ``prompt_logprobs`` and ``return_token_ids`` on both routes, read with the official
client: each prompt position's logprob equals log-softmax of the reference model's logits there (the
tokenmill-free loop in ``tokenmill.reference``), and the returned ids are those of ``/tokenize`` and of
the offline API's output."""

from typing import Any

import openai
import pytest
import torch

from engine_helpers import in_thread
from server_fixtures import MODEL, client_fixture, server_fixture, tokenize  # noqa: F401
from tokenmill.reference import greedy_generate
from tokenmill.server import ServerThread

PROMPT = "The capital of France is"
CHAT: list[Any] = [{"role": "user", "content": "Name a fruit."}]


def _reference_logprobs(smollm2, ids: list[int]) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """Log-softmax of the next-token logits after each prefix ``ids[:i]``, i = 1 .. len - 1."""
    return in_thread(
        lambda: [
            torch.log_softmax(greedy_generate(smollm2.model, ids[:i], 1).prompt_logits, -1)
            for i in range(1, len(ids))
        ]
    )


def _check_prompt_logprobs(smollm2, ids: list[int], found: list[Any], num_top: int) -> None:  # type: ignore[no-untyped-def]
    assert len(found) == len(ids) and found[0] is None
    for position, reference in enumerate(_reference_logprobs(smollm2, ids), start=1):
        entries = {int(token): entry for token, entry in found[position].items()}
        token = ids[position]
        assert abs(entries[token]["logprob"] - float(reference[token])) < 1e-3
        assert entries[token]["rank"] == 1 + int((reference > reference[token]).sum())
        top = reference.topk(num_top).indices.tolist()
        assert set(top) <= set(entries) and len(entries) <= num_top + 1
        assert [entries[t]["rank"] for t in top] == list(range(1, num_top + 1))
        assert all(isinstance(entry["decoded_token"], str) for entry in entries.values())


@pytest.mark.parametrize("num_top", [0, 2])
def test_completion_prompt_logprobs_match_the_reference_model(
    smollm2, server: ServerThread, client: openai.OpenAI, num_top: int
) -> None:  # type: ignore[no-untyped-def]
    answer = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": num_top}
    )
    ids = tokenize(server, prompt=PROMPT)["tokens"]
    _check_prompt_logprobs(smollm2, ids, answer.choices[0].model_extra["prompt_logprobs"], num_top)  # type: ignore[index]


def test_chat_prompt_logprobs_cover_the_rendered_conversation(
    smollm2, server: ServerThread, client: openai.OpenAI
) -> None:  # type: ignore[no-untyped-def]
    answer = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    ids = tokenize(server, messages=CHAT)["tokens"]
    _check_prompt_logprobs(smollm2, ids, answer.model_extra["prompt_logprobs"], 1)  # type: ignore[index]


def test_prompt_logprobs_are_refused_when_streaming(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, stream=True, extra_body={"prompt_logprobs": 1})
    assert caught.value.body["param"] == "prompt_logprobs"  # type: ignore[index]


def test_completion_returns_prompt_and_output_token_ids(server: ServerThread, client: openai.OpenAI) -> None:
    prompts = [PROMPT, "def fibonacci(n):"]
    answer = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=5, temperature=0, extra_body={"return_token_ids": True}
    )
    tokenizer = server.app.state.context.tokenizer
    for prompt, choice in zip(prompts, answer.choices, strict=True):
        extra = choice.model_extra or {}
        assert extra["prompt_token_ids"] == tokenize(server, prompt=prompt)["tokens"]
        assert len(extra["token_ids"]) == answer.usage.completion_tokens // 2  # type: ignore[union-attr]
        assert tokenizer.decode(extra["token_ids"]) == choice.text
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert (plain.choices[0].model_extra or {}).get("token_ids") is None  # only when asked for


def test_streamed_token_ids_add_up_to_the_whole_answer(server: ServerThread, client: openai.OpenAI) -> None:
    fields: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 6,
        "temperature": 0,
        "extra_body": {"return_token_ids": True},
    }
    whole = client.completions.create(prompt=PROMPT, **fields).choices[0].model_extra or {}
    ids: list[int] = []
    prompt_ids = None
    for chunk in client.completions.create(prompt=PROMPT, stream=True, **fields):
        extra = chunk.choices[0].model_extra or {}
        ids += extra.get("token_ids") or []
        prompt_ids = prompt_ids or extra.get("prompt_token_ids")
    assert ids == whole["token_ids"] and prompt_ids == whole["prompt_token_ids"]


def test_chat_returns_prompt_and_output_token_ids(server: ServerThread, client: openai.OpenAI) -> None:
    fields: dict[str, Any] = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0}
    answer = client.chat.completions.create(**fields, extra_body={"return_token_ids": True})
    assert (answer.model_extra or {})["prompt_token_ids"] == tokenize(server, messages=CHAT)["tokens"]
    token_ids = (answer.choices[0].model_extra or {})["token_ids"]
    assert server.app.state.context.tokenizer.decode(token_ids) == answer.choices[0].message.content
    streamed: list[int] = []
    prompt_ids = None
    for chunk in client.chat.completions.create(**fields, stream=True, extra_body={"return_token_ids": True}):
        prompt_ids = prompt_ids or (chunk.model_extra or {}).get("prompt_token_ids")
        for choice in chunk.choices:
            streamed += (choice.model_extra or {}).get("token_ids") or []
    assert streamed == token_ids and prompt_ids == (answer.model_extra or {})["prompt_token_ids"]
