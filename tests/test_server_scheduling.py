"""The server with prefix caching and priority scheduling, driven by the official ``openai`` client:
``usage.prompt_tokens_details.cached_tokens`` equals the block-aligned prefix shared with an earlier prompt,
the prefix-cache counters in ``/metrics`` add up to the responses' usage, and a high-priority request
overtakes a running low-priority one."""

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from engine_helpers import engine_for
from tokenmill.server import ServerSettings, ServerThread, create_app

MODEL = "smollm2-scheduling"
MAX_MODEL_LEN = 512
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def server(smollm2) -> Iterator[ServerThread]:  # type: ignore[no-untyped-def]
    engine = engine_for(
        smollm2,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=1,
        block_size=BLOCK_SIZE,
        prefix_caching=True,
        scheduling_policy="priority",
    )
    app = create_app(engine, ServerSettings(served_model_name=MODEL))
    with ServerThread(app) as thread:
        yield thread


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def metrics(server: ServerThread) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics").text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line[:1] != "#"}


def tokens(server: ServerThread, prompt: str) -> list[int]:
    ids: list[int] = httpx.post(f"{server.base_url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    return ids


def expected_cached(prompt: list[int], earlier: list[list[int]]) -> int:
    """The whole blocks of the longest prefix shared with an earlier prompt, leaving the last token to
    compute (the earlier requests' generated tokens never match: every prompt here diverges in its text)."""
    shared = max((_common_length(prompt, other) for other in earlier), default=0)
    return min(shared, len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


def _common_length(first: list[int], second: list[int]) -> int:
    length = 0
    while length < min(len(first), len(second)) and first[length] == second[length]:
        length += 1
    return length


def cached_tokens(usage: Any) -> int:
    assert usage is not None and usage.prompt_tokens_details is not None
    return int(usage.prompt_tokens_details.cached_tokens)


def complete(client: openai.OpenAI, prompt: str, stream: bool) -> Any:
    """The usage of a two-token greedy completion (of the final chunk when streamed)."""
    response = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=2,
        temperature=0,
        stream=stream,
        stream_options={"include_usage": True} if stream else None,
        extra_body={"ignore_eos": True},
    )
    if not stream:
        return response.usage
    return [chunk.usage for chunk in response if chunk.usage][-1]


def test_completions_report_the_cached_prefix_streamed_and_not(
    server: ServerThread, client: openai.OpenAI
) -> None:
    shared = "Completions prefix. You answer questions about rivers and mountains in one short line. " * 4
    questions = [
        "Which river is the longest?",
        "Which mountain is the highest?",
        "Which lake is the deepest?",
    ]
    before = metrics(server)
    sent: list[list[int]] = []
    usages = []
    for index, question in enumerate(questions):
        prompt = shared + question
        usage = complete(client, prompt, stream=index == 2)
        prompt_ids = tokens(server, prompt)
        assert usage.prompt_tokens == len(prompt_ids)
        assert cached_tokens(usage) == expected_cached(prompt_ids, sent), question
        sent.append(prompt_ids)
        usages.append(usage)
    assert cached_tokens(usages[0]) == 0 and cached_tokens(usages[1]) >= 4 * BLOCK_SIZE
    after = metrics(server)
    queries = after["tokenmill:prefix_cache_queries_total"] - before["tokenmill:prefix_cache_queries_total"]
    hits = after["tokenmill:prefix_cache_hits_total"] - before["tokenmill:prefix_cache_hits_total"]
    assert queries == sum(usage.prompt_tokens for usage in usages)
    assert hits == sum(cached_tokens(usage) for usage in usages)


def test_chat_reports_the_cached_prefix_streamed_and_not(client: openai.OpenAI) -> None:
    system = "Chat prefix. You are a travel guide who names one city per answer and nothing else. " * 4

    def conversation(question: str) -> list[ChatCompletionMessageParam]:
        return [{"role": "system", "content": system}, {"role": "user", "content": question}]

    first, second = (
        client.chat.completions.create(
            model=MODEL, messages=conversation(question), max_tokens=2, temperature=0
        )
        for question in ("A city in Peru?", "A city in Chile?")
    )
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=conversation("A city in Chile?"),
        max_tokens=2,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    final_usage = list(streamed)[-1].usage
    assert second.usage is not None and final_usage is not None
    assert cached_tokens(second.usage) >= cached_tokens(first.usage) + 4 * BLOCK_SIZE
    assert 0 < cached_tokens(second.usage) < second.usage.prompt_tokens
    assert cached_tokens(second.usage) % BLOCK_SIZE == 0
    # The same conversation again: every whole block but the one holding the last prompt token is cached.
    assert cached_tokens(final_usage) == (final_usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_a_high_priority_request_overtakes_a_running_low_priority_one(
    server: ServerThread, client: openai.OpenAI
) -> None:
    """One sequence at a time: the low-priority stream is running when the high-priority request comes,
    so it is preempted, and the high one is answered while the low one is still in flight."""
    preemptions_before = metrics(server)["tokenmill:num_preemptions_total"]
    low = client.completions.create(
        model=MODEL,
        prompt="Count slowly: one, two, three,",
        max_tokens=120,
        temperature=0,
        stream=True,
        extra_body={"priority": 5, "ignore_eos": True},
    )
    next(iter(low))  # the stream starts with the first token: the low request is running
    high = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0,
        extra_body={"priority": 0},
    )
    after = metrics(server)
    low.close()
    assert high.choices[0].finish_reason is not None
    assert after["tokenmill:num_requests_running"] + after["tokenmill:num_requests_waiting"] == 1, "low"
    assert after["tokenmill:num_preemptions_total"] == preemptions_before + 1
