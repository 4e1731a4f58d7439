"""Issue 19, the echo bug: an echoed completion's ``text`` and its ``logprobs`` (``tokens``, ``text_offset``)
agree, streamed or not, for token-id prompts of special tokens and for text prompts. The reference for the
echoed text is the tokenizer's own decode with special tokens shown (what vLLM echoes for token ids), and
for the prompt's logprobs the offline API's ``prompt_logprobs``."""

from typing import Any

import openai
import pytest

from engine_helpers import in_thread, llm_for
from server_fixtures import MODEL, client_fixture, server_fixture  # noqa: F401
from tokenmill import SamplingParams
from tokenmill.llm import LLM
from tokenmill.server import ServerThread

PROMPTS: list[str | list[int]] = [[0, 0, 0, 0, 0], "Hello, my name is", "<|im_start|>user\nHi<|im_end|>"]
IDS = ["special-token-ids", "text", "text-with-special-tokens"]


def _tokenizer(server: ServerThread):  # type: ignore[no-untyped-def]
    return server.app.state.context.tokenizer


def _prompt_ids(server: ServerThread, prompt: str | list[int]) -> list[int]:
    return prompt if isinstance(prompt, list) else _tokenizer(server).encode(prompt)


def _echoed(server: ServerThread, prompt: str | list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    return str(_tokenizer(server).hf_tokenizer.decode(prompt, skip_special_tokens=False))


def _assert_offsets_index_the_text(text: str, tokens: list[str], offsets: list[int], upto: int) -> None:
    """The first ``upto`` tokens lie in ``text`` where their offsets say."""
    position = 0
    for token, offset in zip(tokens[:upto], offsets[:upto], strict=True):
        assert offset == position and text[offset : offset + len(token)] == token, (token, offset)
        position += len(token)


def _request(prompt: str | list[int]) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0, "echo": True, "logprobs": 1}


@pytest.mark.parametrize("prompt", PROMPTS, ids=IDS)
def test_echoed_text_and_logprobs_agree(server: ServerThread, client: openai.OpenAI, prompt) -> None:  # type: ignore[no-untyped-def]
    choice = client.completions.create(**_request(prompt)).choices[0]
    echoed, prompt_ids = _echoed(server, prompt), _prompt_ids(server, prompt)
    assert choice.text.startswith(echoed)
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.text_offset is not None
    assert "".join(logprobs.tokens[: len(prompt_ids)]) == echoed
    _assert_offsets_index_the_text(choice.text, logprobs.tokens, logprobs.text_offset, len(prompt_ids))
    assert logprobs.text_offset[len(prompt_ids)] == len(echoed)  # the first generated token starts after it
    assert logprobs.token_logprobs is not None and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs is not None and logprobs.top_logprobs[0] is None
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs[1:] if top is not None)


@pytest.mark.parametrize("prompt", PROMPTS, ids=IDS)
def test_streamed_echo_equals_the_whole_answer(server: ServerThread, client: openai.OpenAI, prompt) -> None:  # type: ignore[no-untyped-def]
    whole = client.completions.create(**_request(prompt)).choices[0]
    text, tokens, offsets = "", [], []
    for chunk in client.completions.create(**_request(prompt), stream=True):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens or []
                offsets += choice.logprobs.text_offset or []
    assert whole.logprobs is not None
    assert (text, tokens, offsets) == (whole.text, whole.logprobs.tokens, whole.logprobs.text_offset)
    _assert_offsets_index_the_text(text, tokens, offsets, len(_prompt_ids(server, prompt)))


@pytest.fixture(scope="module")
def offline(smollm2) -> LLM:  # type: ignore[no-untyped-def]
    return llm_for(smollm2, max_model_len=256)


@pytest.mark.parametrize("stream", [False, True])
def test_echoed_prompt_logprobs_are_the_offline_ones(
    client: openai.OpenAI, offline: LLM, stream: bool
) -> None:
    prompt = [0, 0, 0, 0, 0]
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    reference = in_thread(lambda: offline.generate({"prompt_token_ids": prompt}, params))[0].prompt_logprobs
    assert reference is not None and reference[0] is None
    got: list[float | None] = []
    for chunk in (
        client.completions.create(**_request(prompt), stream=stream)
        if stream
        else [client.completions.create(**_request(prompt))]
    ):
        for choice in chunk.choices:
            got += (choice.logprobs.token_logprobs or []) if choice.logprobs else []
    assert got[0] is None
    for position in range(1, len(prompt)):
        expected = reference[position]
        assert expected is not None
        assert abs(got[position] - expected[prompt[position]].logprob) < 1e-4  # type: ignore[operator]
