"""The model's generation config as the server's default sampling parameters, as vLLM serves them: a field
the request leaves out takes the file's value, a field it sends wins; ``max_new_tokens`` is the default
``max_tokens``, within what the context leaves after the prompt. Sent with the official ``openai`` client
to servers on the tiny Llama (its engine in a thread, and in a process of its own); outputs are held to
the offline engine's for the file's values passed explicitly (tests/test_generation_config.py holds the
offline side)."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine_helpers import engine_for, llm_for
from generation_config_files import FROM_FILE, PLAIN_GREEDY
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.loading import LoadedModel
from tokenmill.server import EngineClient, ServerSettings, ServerThread, create_app
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.server.sampling import chat_params, completion_params

MODEL = "tiny-genconfig"
PROMPT = "once upon a time"
CHAT: list[Any] = [{"role": "user", "content": "tell me a story"}]
MAX_MODEL_LEN = 64
DEFAULTS = {"temperature": 0.0, "top_p": 0.9, "top_k": 7, "min_p": 0.05, "repetition_penalty": 1.5}
DEFAULTS |= {"max_tokens": 8}


@pytest.fixture(scope="module")
def offline(genconfig_model: LoadedModel) -> LLM:
    """The reference: the same model without defaults, given the parameters explicitly."""
    return llm_for(genconfig_model, generation_config="vllm", max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(genconfig_model: LoadedModel) -> Iterator[ServerThread]:
    engine = engine_for(genconfig_model, max_model_len=MAX_MODEL_LEN, max_num_seqs=4)
    with ServerThread(create_app(engine, ServerSettings(served_model_name=MODEL))) as thread:
        yield thread


def openai_client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai_client(server)


def offline_text(offline: LLM, params: SamplingParams, prompt: str = PROMPT) -> str:
    return offline.generate(prompt, params)[0].outputs[0].text


def test_a_completion_without_max_tokens_takes_the_files_defaults(
    client: openai.OpenAI, offline: LLM
) -> None:
    answer = client.completions.create(model=MODEL, prompt=PROMPT)
    assert answer.usage is not None and answer.usage.completion_tokens == 8
    assert answer.choices[0].text == offline_text(offline, FROM_FILE)
    assert answer.choices[0].text != offline_text(offline, PLAIN_GREEDY), "the penalty changes these tokens"
    short = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert short.usage is not None and short.usage.completion_tokens == 2


def test_a_chat_without_max_tokens_takes_the_files_defaults(client: openai.OpenAI, offline: LLM) -> None:
    answer = client.chat.completions.create(model=MODEL, messages=CHAT)
    assert answer.usage is not None and answer.usage.completion_tokens == 8
    expected = offline.chat(CHAT, FROM_FILE)[0].outputs[0].text
    assert answer.choices[0].message.content == expected
    for limit in ({"max_tokens": 3}, {"max_completion_tokens": 4}):
        short = client.chat.completions.create(model=MODEL, messages=CHAT, **limit)
        assert short.usage is not None and short.usage.completion_tokens == next(iter(limit.values()))


def test_the_fields_a_request_sends_win(client: openai.OpenAI, offline: LLM) -> None:
    answer = client.completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, extra_body={"repetition_penalty": 1.0}
    )
    assert answer.choices[0].text == offline_text(offline, PLAIN_GREEDY)
    answer = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, extra_body={"repetition_penalty": 1.0}
    )
    assert answer.choices[0].message.content == offline.chat(CHAT, PLAIN_GREEDY)[0].outputs[0].text


def test_the_default_max_tokens_stays_within_the_context(client: openai.OpenAI) -> None:
    long_prompt = list(range(3, 3 + MAX_MODEL_LEN - 4))  # leaves 4 tokens of the 8
    answer = client.completions.create(model=MODEL, prompt=long_prompt)
    assert answer.usage is not None and answer.usage.completion_tokens == 4
    assert answer.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="context limit"):
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=8)


def test_generate_route_takes_the_defaults_too(server: ServerThread, offline: LLM) -> None:
    response = httpx.post(f"{server.base_url}/generate", json={"prompt": PROMPT}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["text"] == offline_text(offline, FROM_FILE)


def test_request_params_take_the_defaults_for_the_fields_left_out() -> None:
    defaults = {**DEFAULTS, "temperature": 0.3}
    chat = chat_params(ChatCompletionRequest(messages=CHAT), defaults)
    sampled = (chat.temperature, chat.top_p, chat.top_k, chat.min_p, chat.repetition_penalty)
    assert sampled == (0.3, 0.9, 7, 0.05, 1.5)
    assert chat.max_tokens is None  # fitted to each prompt when the request starts
    sent = ChatCompletionRequest(messages=CHAT, temperature=0.0, top_p=0.5, top_k=-1, max_tokens=5)
    chat = chat_params(sent, defaults)
    assert (chat.temperature, chat.top_p, chat.top_k, chat.max_tokens, chat.is_greedy) == (
        0.0,
        0.5,
        -1,
        5,
        True,
    )
    assert completion_params(CompletionRequest(prompt="x"), 1, defaults).max_tokens is None
    assert completion_params(CompletionRequest(prompt="x", max_tokens=5), 1, defaults).max_tokens == 5
    plain = completion_params(CompletionRequest(prompt="x"), 1)
    assert (plain.max_tokens, plain.temperature, plain.top_p) == (16, 1.0, 1.0)


def test_the_defaults_reach_a_server_whose_engine_runs_in_its_own_process(
    genconfig_folder: Path, offline: LLM
) -> None:
    options = {"model": str(genconfig_folder), "device": "cpu", "dtype": "float32", "cpu_kv_cache_gib": 0.25}
    engine = EngineClient.launch(EngineConfig().with_options(**options, max_model_len=MAX_MODEL_LEN))
    assert engine.facts.sampling_defaults == DEFAULTS
    with ServerThread(create_app(engine, ServerSettings(served_model_name=MODEL))) as thread:
        answer = openai_client(thread).completions.create(model=MODEL, prompt=PROMPT)
    assert answer.choices[0].text == offline_text(offline, FROM_FILE)
