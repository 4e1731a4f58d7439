"""The OpenAI-compatible server driven by the official ``openai`` client (sync and async) over a real
uvicorn server on 127.0.0.1: outputs equal the offline API's, streamed text equals non-streamed text."""

import asyncio
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from engine_helpers import engine_for, llm_for
from tokenmill import SamplingParams
from tokenmill.llm import LLM
from tokenmill.outputs import RequestOutput
from tokenmill.server import ServerSettings, ServerThread, create_app

MODEL = "smollm2-test"
MAX_MODEL_LEN = 256
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name three fruits."}]
UNICODE_PROMPTS = ["Emoji: 🙂🙂🙂 😀😀😀 🎉🎉", "日本語の文章を書いてください。日本は"]


@pytest.fixture(scope="module")
def server(smollm2) -> Iterator[ServerThread]:  # type: ignore[no-untyped-def]
    engine = engine_for(smollm2, max_model_len=MAX_MODEL_LEN, max_num_seqs=8)
    app = create_app(engine, ServerSettings(served_model_name=MODEL))
    with ServerThread(app) as thread:
        yield thread


T = TypeVar("T")


def in_thread(function: Callable[[], T]) -> T:
    """Run ``function`` in a fresh thread. With the CPU oversubscribed (other jobs on the machine), torch's
    OpenMP ran the model about 10x slower in pytest's main thread than in any other thread."""
    results: list[T] = []
    thread = threading.Thread(target=lambda: results.append(function()))
    thread.start()
    thread.join()
    return results[0]


@dataclass
class References:
    """Offline (``LLM``) outputs the server's must equal."""

    llm: LLM
    greedy: list[RequestOutput]
    chat: RequestOutput
    unicode_ids: list[list[int]]


@pytest.fixture(scope="module")
def offline(smollm2) -> References:  # type: ignore[no-untyped-def]
    llm = llm_for(smollm2, max_model_len=MAX_MODEL_LEN, max_num_seqs=8)

    def compute() -> References:
        greedy = llm.generate(PROMPTS, GREEDY)
        chat = llm.chat(CHAT, GREEDY)[0]
        unicode = llm.generate(UNICODE_PROMPTS, SamplingParams(temperature=0, max_tokens=16))
        return References(llm, greedy, chat, [out.outputs[0].token_ids for out in unicode])

    return in_thread(compute)


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _stream_texts(stream: openai.Stream[Any]) -> tuple[dict[int, list[str]], dict[int, str | None], Any]:
    """Pieces and finish reasons per choice index, and the usage of the final chunk."""
    pieces: dict[int, list[str]] = {}
    reasons: dict[int, str | None] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            pieces.setdefault(choice.index, []).append(text)
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    return pieces, reasons, usage


def test_completions_greedy_match_the_offline_api(client: openai.OpenAI, offline: References) -> None:
    expected = offline.greedy
    response = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    assert [choice.text for choice in response.choices] == [out.outputs[0].text for out in expected]
    assert (
        response.object == "text_completion" and response.model == MODEL and response.id.startswith("cmpl-")
    )
    num_prompt = sum(len(out.prompt_token_ids) for out in expected)
    num_output = sum(len(out.outputs[0].token_ids) for out in expected)
    assert response.usage is not None
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (num_prompt, num_output)
    assert response.usage.total_tokens == num_prompt + num_output
    assert response.usage.prompt_tokens_details is not None
    assert {choice.finish_reason for choice in response.choices} <= {"stop", "length"}


def test_streamed_completions_concatenate_to_the_non_streamed_text(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPTS,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, reasons, usage = _stream_texts(stream)
    assert ["".join(pieces[i]) for i in range(3)] == [choice.text for choice in whole.choices]
    assert [reasons[i] for i in range(3)] == [choice.finish_reason for choice in whole.choices]
    assert usage == whole.usage


def test_chat_matches_the_offline_chat_streamed_and_not(client: openai.OpenAI, offline: References) -> None:
    expected = offline.chat
    response = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_completion_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert response.usage is not None
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert response.usage.prompt_tokens_details is not None
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        response.usage.prompt_tokens,
        response.usage.completion_tokens,
    )
    # Prefix caching is on by default: the repeat reuses every full block of its prompt but the last token.
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16


def test_chat_accepts_content_as_a_list_of_text_parts(client: openai.OpenAI) -> None:
    as_parts: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": [{"type": "text", "text": "Name three fruits."}]}
    ]
    by_parts = client.chat.completions.create(model=MODEL, messages=as_parts, max_tokens=6, temperature=0)
    by_text = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    assert by_parts.choices[0].message.content == by_text.choices[0].message.content


def test_stop_strings_end_the_text_streamed_and_not(client: openai.OpenAI, offline: References) -> None:
    text = offline.greedy[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    kwargs = {
        "model": MODEL,
        "prompt": PROMPTS[0],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stop": [stop],
    }
    whole = client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert whole.choices[0].text == text[: text.index(stop)]
    assert whole.choices[0].finish_reason == "stop"
    pieces, reasons, _ = _stream_texts(client.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
    assert "".join(pieces[0]) == whole.choices[0].text and reasons[0] == "stop"


def test_n_choices_and_seeded_sampling_are_reproducible(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "prompt": PROMPTS[:2], "max_tokens": 8, "temperature": 1.0, "n": 3, "seed": 7}
    first = client.completions.create(**kwargs)  # type: ignore[call-overload]
    second = client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert [c.index for c in first.choices] == list(range(6))
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices[:3]}) > 1  # the n samples of one prompt differ
    pieces, _, _ = _stream_texts(client.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
    assert ["".join(pieces[i]) for i in range(6)] == [c.text for c in first.choices]


def test_completion_logprobs(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2
    )
    choice = response.choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.top_logprobs is not None
    assert len(logprobs.tokens) == response.usage.completion_tokens  # type: ignore[union-attr]
    assert "".join(logprobs.tokens) == choice.text
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs or [], logprobs.top_logprobs, strict=True
    ):
        assert logprob is not None and logprob <= 0
        assert token in top and top[token] == pytest.approx(max(top.values()))  # greedy: the best token
    offsets = logprobs.text_offset or []
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_echo_with_logprobs_scores_the_prompt(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=True, logprobs=1
    )
    choice = response.choices[0]
    assert choice.text.startswith(PROMPTS[0])
    usage = response.usage
    assert usage is not None and choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert len(choice.logprobs.token_logprobs) == usage.prompt_tokens + usage.completion_tokens
    assert choice.logprobs.token_logprobs[0] is None
    assert all(lp is not None for lp in choice.logprobs.token_logprobs[1:])


def test_chat_logprobs(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = response.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == response.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def _longest_clean_prefix(offline: References, index: int) -> int:
    """The most greedy tokens whose text ends on a whole character (16 may end inside an emoji)."""
    tokenizer, ids = offline.llm.get_tokenizer(), offline.unicode_ids[index]
    return max(n for n in range(1, len(ids) + 1) if "\ufffd" not in tokenizer.decode(ids[:n]))


@pytest.mark.parametrize("index", range(len(UNICODE_PROMPTS)))
def test_emoji_and_cjk_stream_without_replacement_characters(
    client: openai.OpenAI, offline: References, index: int
) -> None:
    prompt, max_tokens = UNICODE_PROMPTS[index], _longest_clean_prefix(offline, index)
    kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    whole = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    pieces, _, _ = _stream_texts(client.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
    assert any(ord(ch) > 0x2000 for ch in whole), "the model should write emoji / CJK here"
    assert all("\ufffd" not in piece for piece in pieces[0])
    assert "".join(pieces[0]) == whole


def test_token_id_prompts_equal_text_prompts(client: openai.OpenAI, offline: References) -> None:
    ids = offline.llm.get_tokenizer().encode(PROMPTS[0])
    by_text = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    by_id_lists = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=6, temperature=0)
    texts = [by_text.choices[0].text, by_ids.choices[0].text, *(c.text for c in by_id_lists.choices)]
    assert len(set(texts)) == 1


def test_engine_specific_parameters_reach_the_sampler(client: openai.OpenAI, offline: References) -> None:
    forced = offline.llm.get_tokenizer().encode(" banana")[0]
    response = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=4,
        logit_bias={str(forced): 100},
        extra_body={
            "ignore_eos": True,
            "min_tokens": 4,
            "top_k": 5,
            "min_p": 0.05,
            "repetition_penalty": 1.0,
        },
    )
    assert response.choices[0].text == " banana" * 4
    stopped = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=4, logit_bias={str(forced): 100},
        extra_body={"stop_token_ids": [forced]},
    )  # fmt: skip
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1  # type: ignore[union-attr]


def test_async_client_streams_concurrently(server: ServerThread, offline: References) -> None:
    expected = [out.outputs[0].text for out in offline.greedy]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120)
        async with client:
            return list(await asyncio.gather(*(one(client, p) for p in PROMPTS)))

    assert asyncio.run(main()) == expected


def test_models_tokenize_detokenize_generate_health(server: ServerThread, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    url = server.base_url
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    chat_tokens = httpx.post(f"{url}/tokenize", json={"messages": CHAT}).json()
    assert chat_tokens["count"] > tokens["count"]
    assert httpx.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}).json() == {
        "prompt": "Hello world"
    }
    generated = httpx.post(f"{url}/generate", json={"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
    expected = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert generated.json()["text"] == expected.choices[0].text
    assert generated.json()["usage"] == expected.usage.model_dump(exclude_none=True) | {
        "prompt_tokens_details": {"cached_tokens": 0}
    }
    assert httpx.get(f"{url}/health").status_code == 200


def test_metrics_count_tokens_and_latencies(server: ServerThread, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    text = httpx.get(f"{server.base_url}/metrics").text
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if not line.startswith("#")
    }
    assert values["tokenmill:num_requests_running"] == 0
    assert values["tokenmill:num_requests_waiting"] == 0
    assert values["tokenmill:kv_cache_usage_perc"] == 0
    assert "\ntokenmill:num_preemptions_total 0.0\n" in text
    queries, hits = (
        values["tokenmill:prefix_cache_queries_total"],
        values["tokenmill:prefix_cache_hits_total"],
    )
    assert queries > 0 and 0 <= hits <= queries, "prefix caching is on by default"
    assert values["tokenmill:prompt_tokens_total"] > 0 and values["tokenmill:generation_tokens_total"] >= 4
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert values[f"tokenmill:{name}_count"] > 0
