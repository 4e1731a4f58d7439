"""vLLM's sampling extras on the server, sent as vLLM users send them (the official ``openai`` client's
``extra_body``) to a server on the tiny Llama with a character tokenizer: ``include_stop_str_in_output``,
``allowed_token_ids``, ``bad_words``, ``spaces_between_special_tokens``, ``return_tokens_as_token_ids`` and
``cache_salt``, on completions and chat, streamed or not. Outputs are held to the offline API's for the
same parameters (tests/test_sampling_fields.py holds that to independent references), token texts to the
Hugging Face tokenizer's."""

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from transformers import PreTrainedTokenizerBase

from engine_helpers import engine_for, llm_for
from tiny_tokenizers import text_model_fixtures
from tokenmill import LLM, SamplingParams
from tokenmill.loading import LoadedModel
from tokenmill.server import ServerSettings, ServerThread, create_app
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.server.sampling import chat_params, completion_params

MODEL = "tiny-text"
PROMPT = "once upon a time"
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "tell me a story"}]
CACHE = {"kv_cache": "paged", "block_size": 4, "prefix_caching": True, "max_model_len": 256}


folder, model, hf_tokenizer = text_model_fixtures("tiny-text-server")


@pytest.fixture(scope="module")
def offline(model: LoadedModel) -> LLM:
    return llm_for(model, **CACHE)


@pytest.fixture(scope="module")
def client(model: LoadedModel) -> Iterator[openai.OpenAI]:
    app = create_app(engine_for(model, **CACHE), ServerSettings(served_model_name=MODEL))
    with ServerThread(app) as thread:
        yield openai.OpenAI(base_url=f"{thread.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def complete(client: openai.OpenAI, stream: bool = False, **fields: Any) -> Any:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, **fields}
    extra = {name: body.pop(name) for name in list(body) if name not in _OPENAI_COMPLETION_FIELDS}
    return client.completions.create(stream=stream, extra_body=extra, **body)


def chat(client: openai.OpenAI, stream: bool = False, **fields: Any) -> Any:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 24, "temperature": 0, **fields}
    extra = {name: body.pop(name) for name in list(body) if name not in _OPENAI_CHAT_FIELDS}
    return client.chat.completions.create(stream=stream, extra_body=extra, **body)


# The fields the openai client takes as keyword arguments (the rest go in ``extra_body``).
_OPENAI_SHARED_FIELDS = {"model", "max_tokens", "temperature", "n", "seed", "stop", "logprobs"}
_OPENAI_COMPLETION_FIELDS = _OPENAI_SHARED_FIELDS | {"prompt", "echo"}
_OPENAI_CHAT_FIELDS = _OPENAI_SHARED_FIELDS | {"messages", "top_logprobs"}


def streamed(chunks: Any, chat_route: bool = False) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            piece = (choice.delta.content if chat_route else choice.text) or ""
            texts[choice.index] = texts.get(choice.index, "") + piece
    return texts


@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output_on_both_routes_streamed_or_not(
    client: openai.OpenAI, offline: LLM, include: bool
) -> None:
    uncut = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    stop = uncut.outputs[0].text[10:13]
    fields = {"stop": [stop], "ignore_eos": True, "include_stop_str_in_output": include}
    params = SamplingParams(temperature=0, max_tokens=24, **fields)  # type: ignore[arg-type]
    expected = offline.generate(PROMPT, params)[0].outputs[0]
    assert expected.text.endswith(stop) == include and expected.finish_reason == "stop"
    whole = complete(client, **fields).choices[0]
    assert (whole.text, whole.finish_reason, whole.stop_reason) == (expected.text, "stop", stop)
    assert streamed(complete(client, stream=True, **fields)) == {0: expected.text}
    chat_stop = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    chat_fields = {**fields, "stop": [chat_stop[0].outputs[0].text[6:8]]}
    chat_expected = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=24, **chat_fields))[
        0
    ].outputs[0]  # type: ignore[arg-type]
    assert chat(client, **chat_fields).choices[0].message.content == chat_expected.text
    assert streamed(chat(client, stream=True, **chat_fields), chat_route=True) == {0: chat_expected.text}


def test_allowed_token_ids_and_bad_words_as_offline(client: openai.OpenAI, offline: LLM) -> None:
    """Seeded samples under both fields (n = 2) take the offline API's tokens, on both routes."""
    uncut = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    fields = {
        "allowed_token_ids": list(range(3, 200)),
        "bad_words": [uncut.outputs[0].text[3:6], uncut.outputs[0].text[12:13]],
        "n": 2,
        "seed": 4,
        "temperature": 0.9,
    }
    params = SamplingParams(max_tokens=24, **fields)  # type: ignore[arg-type]
    expected = [output.token_ids for output in offline.generate(PROMPT, params)[0].outputs]
    assert all(max(tokens) < 200 for tokens in expected) and expected[0] != uncut.outputs[0].token_ids
    answer = complete(client, return_token_ids=True, **fields)
    assert [choice.token_ids for choice in answer.choices] == expected
    chat_expected = [output.token_ids for output in offline.chat(CHAT, params)[0].outputs]
    answer = chat(client, return_token_ids=True, **fields)
    assert [choice.token_ids for choice in answer.choices] == chat_expected


BAD_FIELDS = [
    ({"allowed_token_ids": [5, 384]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": "5"}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ({"spaces_between_special_tokens": 0}, "spaces_between_special_tokens"),
    ({"return_tokens_as_token_ids": "no"}, "return_tokens_as_token_ids"),
    ({"cache_salt": ""}, "cache_salt"),
    ({"cache_salt": 7}, "cache_salt"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_FIELDS)
def test_bad_values_are_a_400_naming_the_field(
    client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:
    for create in (complete, chat):
        with pytest.raises(openai.BadRequestError) as caught:
            create(client, **fields)
        body = caught.value.body
        assert isinstance(body, dict) and body.get("param") == param, body


def test_detokenizing_fields_reach_the_sampling_params() -> None:
    """The server hands vLLM's detokenizing fields to ``SamplingParams`` as sent (their effect on text is
    checked offline, tests/test_tokenizer.py)."""
    for spaces in (False, True):
        fields = {"skip_special_tokens": not spaces, "spaces_between_special_tokens": spaces}
        completion = completion_params(CompletionRequest(prompt="x", **fields), 1)  # type: ignore[arg-type]
        answer = chat_params(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields))  # type: ignore[arg-type,list-item]
        for params in (completion, answer):
            assert (params.skip_special_tokens, params.spaces_between_special_tokens) == (not spaces, spaces)


def token_offsets(hf_tokenizer: PreTrainedTokenizerBase, token_ids: list[int], start: int = 0) -> list[int]:
    offsets, at = [], start
    for token in token_ids:
        offsets.append(at)
        at += len(hf_tokenizer.decode([token]))
    return offsets


@pytest.mark.parametrize("stream", [False, True])
def test_return_tokens_as_token_ids_names_every_token_by_id(
    client: openai.OpenAI, hf_tokenizer: PreTrainedTokenizerBase, stream: bool
) -> None:
    """Completions (echo too): ``tokens`` and the ``top_logprobs`` keys are "token_id:<id>", the offsets
    still count the tokens' texts; chat: ``token`` and the alternatives' too, ``bytes`` the text's."""
    fields = {"logprobs": 2, "echo": True, "return_tokens_as_token_ids": True, "return_token_ids": True}
    if stream:
        chunks = list(complete(client, stream=True, **fields))
        tokens = [token for chunk in chunks for token in chunk.choices[0].logprobs.tokens if chunk.choices]
        tops = [top for chunk in chunks for top in chunk.choices[0].logprobs.top_logprobs if chunk.choices]
        offsets = [o for chunk in chunks for o in chunk.choices[0].logprobs.text_offset if chunk.choices]
        ids = [t for chunk in chunks if chunk.choices for t in (chunk.choices[0].token_ids or [])]
        prompt_ids = chunks[0].choices[0].prompt_token_ids
    else:
        choice = complete(client, **fields).choices[0]
        tokens, tops, offsets = (
            choice.logprobs.tokens,
            choice.logprobs.top_logprobs,
            choice.logprobs.text_offset,
        )
        ids, prompt_ids = choice.token_ids, choice.prompt_token_ids
    every = [*prompt_ids, *ids]
    assert tokens == [f"token_id:{token}" for token in every]
    assert tops[0] is None and all(name in top for name, top in zip(tokens[1:], tops[1:], strict=True))
    assert all(key.startswith("token_id:") for top in tops[1:] for key in top)
    assert offsets == token_offsets(hf_tokenizer, every)
    if stream:
        entries = [
            e
            for chunk in chat(
                client, stream=True, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True
            )
            if chunk.choices and chunk.choices[0].logprobs
            for e in chunk.choices[0].logprobs.content
        ]
    else:
        answer = chat(
            client, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True, return_token_ids=True
        )
        entries = answer.choices[0].logprobs.content
    for entry in entries:
        token_id = int(entry.token.removeprefix("token_id:"))
        assert entry.bytes == list(hf_tokenizer.decode([token_id]).encode())
        assert len(entry.top_logprobs) == 2
        for top in entry.top_logprobs:
            assert top.token.startswith("token_id:")
            assert top.bytes == list(hf_tokenizer.decode([int(top.token.removeprefix("token_id:"))]).encode())


def test_cache_salt_keeps_prefix_cache_hits_within_a_salt(client: openai.OpenAI) -> None:
    prompt = "in a tiny house there lived a tiny model"  # no other test sends it: nothing cached yet

    def cached(salt: str | None) -> int:
        fields = {"prompt": prompt, "max_tokens": 2} | ({} if salt is None else {"cache_salt": salt})
        usage = complete(client, **fields).usage
        return usage.prompt_tokens_details.cached_tokens

    first = [cached("s1"), cached("s1"), cached("s2"), cached(None), cached("s2"), cached(None)]
    assert first[0] == first[2] == first[3] == 0
    assert first[1] == first[4] == first[5] > 0
