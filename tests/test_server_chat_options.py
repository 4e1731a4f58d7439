"""Issue 19, vLLM's chat extras: ``continue_final_message`` and ``add_generation_prompt`` render the
conversation as transformers' ``apply_chat_template`` does with the same arguments (the reference), and
``echo`` starts the answer with the assistant's last message, whose continuation is what the offline
API generates from that rendering; ``chat_template_kwargs`` may not set what the request has fields for."""

from typing import Any

import openai
import pytest

from engine_helpers import in_thread, llm_for
from server_fixtures import MODEL, client_fixture, server_fixture  # noqa: F401
from tokenmill import SamplingParams
from tokenmill.llm import LLM
from tokenmill.server import ServerThread

PREFILL: list[Any] = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is"},
]
QUESTION: list[Any] = [{"role": "user", "content": "Name a fruit."}]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def offline(smollm2) -> LLM:  # type: ignore[no-untyped-def]
    return llm_for(smollm2, max_model_len=256)


def _reference_ids(server: ServerThread, messages: list[Any], **options: Any) -> list[int]:
    tokenizer = server.app.state.context.tokenizer
    text = tokenizer.hf_tokenizer.apply_chat_template(messages, tokenize=False, **options)
    ids: list[int] = tokenizer.encode(text)
    return ids


def _chat(client: openai.OpenAI, messages: list[Any], **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, **extra},
    )


@pytest.mark.parametrize("echo", [False, True])
def test_continue_final_message_continues_the_assistant(
    server: ServerThread, client: openai.OpenAI, offline: LLM, echo: bool
) -> None:
    answer = _chat(client, PREFILL, continue_final_message=True, add_generation_prompt=False, echo=echo)
    expected_ids = _reference_ids(server, PREFILL, continue_final_message=True)
    assert (answer.model_extra or {})["prompt_token_ids"] == expected_ids
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    continuation = in_thread(lambda: offline.generate({"prompt_token_ids": expected_ids}, params))[0]
    prefix = PREFILL[-1]["content"] if echo else ""
    assert answer.choices[0].message.content == prefix + continuation.outputs[0].text


def test_streamed_echo_starts_with_the_assistant_message(client: openai.OpenAI) -> None:
    whole = _chat(client, PREFILL, continue_final_message=True, add_generation_prompt=False, echo=True)
    pieces = [
        choice.delta.content or ""
        for chunk in client.chat.completions.create(
            model=MODEL,
            messages=PREFILL,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"continue_final_message": True, "add_generation_prompt": False, "echo": True},
        )
        for choice in chunk.choices
    ]
    assert "".join(pieces) == whole.choices[0].message.content
    assert PREFILL[-1]["content"] in pieces  # the echo arrives as a piece of its own, as vLLM sends it


def test_echo_needs_the_last_message_to_be_the_assistants(client: openai.OpenAI, offline: LLM) -> None:
    plain, echoed = _chat(client, QUESTION), _chat(client, QUESTION, echo=True)
    assert echoed.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_add_generation_prompt_renders_as_transformers_does(
    server: ServerThread, client: openai.OpenAI, add_generation_prompt: bool
) -> None:
    answer = _chat(client, QUESTION, add_generation_prompt=add_generation_prompt)
    expected = _reference_ids(server, QUESTION, add_generation_prompt=add_generation_prompt)
    assert (answer.model_extra or {})["prompt_token_ids"] == expected


@pytest.mark.parametrize(
    ("messages", "extra"),
    [
        (PREFILL, {"continue_final_message": True, "add_generation_prompt": True}),
        (QUESTION, {"continue_final_message": True, "add_generation_prompt": False}),
        (QUESTION, {"chat_template_kwargs": {"add_generation_prompt": False}}),
    ],
    ids=["both-prompts", "last-message-not-assistant", "reserved-template-kwarg"],
)
def test_contradictory_chat_options_are_refused(
    client: openai.OpenAI, messages: list[Any], extra: dict[str, Any]
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, messages, **extra)
    assert caught.value.body["param"] in ("continue_final_message", "chat_template_kwargs")  # type: ignore[index]
