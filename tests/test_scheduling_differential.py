"""Every scheduling feature at once, held to each request run alone.

A seeded random engine config (a pool small enough to preempt, block size, token budget and prompt chunks,
prefix caching, FCFS or priority, n-gram speculation on or off) serves a seeded random workload (shared
prompt prefixes, staggered arrivals, priorities, n > 1, greedy and seeded sampling, penalties, stop tokens
and strings, min_tokens, logprobs and prompt logprobs, requests too long for the context, aborts
mid-flight). The reference is each request alone on a plain engine (one request per run, everything else
off): every sequence must end exactly once with the same tokens, text, finish and stop reasons and
logprobs, an aborted one with a prefix of them, a refused request with the same message, and the pool,
the prefix tree's locks and the engine's books must be empty after, the counters agreeing with the
sequences'. The same driver over more seeds and requests found the bugs whose tests sit beside the
features they broke (prompt logprobs after a preemption, request ids like another request's sequence
ids, guesses kept by a preempted sequence).
"""

import dataclasses
import math
import random
from collections import Counter
from typing import Any

import pytest

from engine_helpers import engine_for, in_thread
from test_tokenizer import build_llama_style_hf_tokenizer
from tokenmill import SamplingParams
from tokenmill.engine.llm_engine import InvalidRequestError, LLMEngine
from tokenmill.loading import LoadedModel, load_model
from tokenmill.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from tokenmill.sequence import Sequence
from tokenmill.tokenizer import Tokenizer

MAX_MODEL_LEN = 48
VOCAB = 384


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    arrival_step: int
    abort_step: int | None


@dataclasses.dataclass
class Run:
    outputs: dict[str, RequestOutput] = dataclasses.field(default_factory=dict)
    refused: dict[str, str] = dataclasses.field(default_factory=dict)
    aborted: set[str] = dataclasses.field(default_factory=set)
    finishes: Counter[tuple[str, int]] = dataclasses.field(default_factory=Counter)
    sequences: list[Sequence] = dataclasses.field(default_factory=list)


@pytest.fixture(scope="module")
def tiny(tiny_llama_folder) -> LoadedModel:  # type: ignore[no-untyped-def]
    """The tiny Llama with a byte-level tokenizer, so that stop strings have text to match."""
    loaded = load_model(tiny_llama_folder, dtype="float32")
    return dataclasses.replace(loaded, tokenizer=Tokenizer(build_llama_style_hf_tokenizer()))


@pytest.fixture(scope="module")
def plain(tiny: LoadedModel) -> LLMEngine:
    return engine_for(
        tiny, max_model_len=MAX_MODEL_LEN, prefix_caching=False, chunked_prefill=False, warm_start=False
    )


def random_config(rng: random.Random) -> dict[str, Any]:
    block_size = rng.choice([1, 2, 4, 8])
    config: dict[str, Any] = {
        "max_model_len": MAX_MODEL_LEN,
        "block_size": block_size,
        "num_kv_blocks": math.ceil(MAX_MODEL_LEN / block_size) + rng.randint(0, 2),  # one long request
        "max_num_seqs": rng.randint(2, 6),
        "prefix_caching": rng.random() < 0.6,
        "scheduling_policy": rng.choice(["fcfs", "priority"]),
        "chunked_prefill": rng.random() < 0.6,
        "warm_start": False,
        "debug_checks": True,
    }
    if config["chunked_prefill"]:
        config["max_num_batched_tokens"] = rng.randint(6, 40)
        config["prefill_chunk_size"] = rng.choice([None, rng.randint(2, 12)])
    else:
        config["max_num_batched_tokens"] = MAX_MODEL_LEN
    if rng.random() < 0.5:
        speculative = {"method": "ngram", "num_speculative_tokens": rng.randint(1, 4), "prompt_lookup_min": 1}
        config["speculative_config"] = speculative | {"disable_by_batch_size": rng.choice([None, 3])}
    return config


def random_params(rng: random.Random, prompt_len: int) -> SamplingParams:
    sampled = rng.random() < 0.5
    room = MAX_MODEL_LEN - prompt_len
    max_tokens = room + 3 if rng.random() < 0.08 else rng.randint(1, min(room, 16))
    return SamplingParams(
        n=rng.choice([1, 1, 2, 3]),
        temperature=rng.choice([0.7, 1.3]) if sampled else 0.0,
        seed=rng.randint(0, 999) if sampled else None,
        top_k=rng.choice([0, 10]),
        repetition_penalty=rng.choice([1.0, 1.3]),
        presence_penalty=rng.choice([0.0, 0.5]),
        max_tokens=max_tokens,
        min_tokens=rng.randint(0, min(max_tokens, 4)),
        ignore_eos=rng.random() < 0.5,
        stop_token_ids=[rng.randrange(3, VOCAB) for _ in range(rng.choice([0, 0, 15]))],
        stop=rng.sample("abcdefghijklmnopqrstuvwxyz", rng.choice([0, 0, 3])),
        logprobs=rng.choice([None, None, 2]),
        prompt_logprobs=rng.choice([None, None, None, 1]),
    )


def random_workload(rng: random.Random, priority: bool) -> list[Request]:
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 16))] for _ in range(2)]
    requests, arrival = [], 0
    for index in range(rng.randint(7, 11)):
        pattern = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 4))]  # prompt lookup finds it
        body = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 6))] + pattern * rng.randint(1, 3)
        prompt = ((rng.choice(prefixes) if rng.random() < 0.6 else []) + body)[: MAX_MODEL_LEN - 2]
        arrival += rng.choice([0, 1, 2])
        abort_step = arrival + rng.randint(0, 8) if rng.random() < 0.15 else None
        request_priority = rng.randint(-1, 1) if priority else 0
        params = random_params(rng, len(prompt))
        request_id = f"r{index}"
        if index and rng.random() < 0.15:  # also the id of sequence 0 of request r{index - 1} if n > 1
            request_id = f"r{index - 1}[0]"
        requests.append(Request(request_id, prompt, params, request_priority, arrival, abort_step))
    return requests


def new_output(request: Request, prompt_ids: list[int]) -> RequestOutput:
    return RequestOutput(
        request.request_id, None, prompt_ids, [CompletionOutput(i) for i in range(request.params.n)]
    )


def serve(engine: LLMEngine, requests: list[Request]) -> Run:
    """Requests added at their arrival steps and aborted at theirs, between ``step()`` calls."""
    run, step = Run(), 0
    while step <= max(r.arrival_step for r in requests) or engine.has_unfinished_requests():
        for request in requests:
            if request.arrival_step == step:
                add(engine, request, run)
            if request.abort_step == step and request.request_id in engine.requests:
                run.aborted.add(request.request_id)
                engine.abort(request.request_id)
        for delta in engine.step():
            output = run.outputs[delta.request_id]
            assert not output.outputs[delta.index].finished, f"a delta after the end: {delta}"
            output.apply(delta)
            run.finishes[(delta.request_id, delta.index)] += delta.finished
        step += 1
        assert step < 1000, "a request is stuck"
    return run


def add(engine: LLMEngine, request: Request, run: Run) -> None:
    try:
        ids = engine.add_request(request.request_id, request.prompt, request.params, request.priority)
    except InvalidRequestError as error:
        run.refused[request.request_id] = str(error)
        return
    run.outputs[request.request_id] = new_output(request, ids)
    run.sequences += engine.requests[request.request_id]


def alone(engine: LLMEngine, request: Request) -> RequestOutput | str:
    """The request by itself on the plain engine; the error's message if it is refused."""
    run = serve(engine, [dataclasses.replace(request, priority=0, arrival_step=0, abort_step=None)])
    return run.refused.get(request.request_id) or run.outputs[request.request_id]


def assert_same_logprobs(
    got: list[PositionLogprobs | None] | None, want: list[PositionLogprobs | None] | None
) -> None:
    assert (got is None) == (want is None)
    for got_position, want_position in zip(got or [], want or [], strict=True):
        assert (got_position is None) == (want_position is None)
        for token, entry in (got_position or {}).items():
            if want_position is not None and token in want_position:
                assert entry.logprob == pytest.approx(want_position[token].logprob, abs=1e-4)


def assert_matches_alone(request: Request, run: Run, reference: RequestOutput) -> None:
    got = run.outputs[request.request_id]
    for index, (sequence, wanted) in enumerate(zip(got.outputs, reference.outputs, strict=True)):
        where = f"{request.request_id}[{index}]"
        assert run.finishes[(request.request_id, index)] == 1, f"{where} ended {run.finishes} times"
        if sequence.finish_reason == "abort":
            assert request.request_id in run.aborted
            assert sequence.token_ids == wanted.token_ids[: len(sequence.token_ids)], where
            continue
        assert (sequence.token_ids, sequence.text) == (wanted.token_ids, wanted.text), where
        assert (sequence.finish_reason, sequence.stop_reason) == (wanted.finish_reason, wanted.stop_reason), (
            where
        )
        assert_same_logprobs(sequence.logprobs, wanted.logprobs)
    if not all(sequence.finish_reason == "abort" for sequence in got.outputs):
        assert_same_logprobs(got.prompt_logprobs, reference.prompt_logprobs)


def assert_books_are_empty(engine: LLMEngine, run: Run, num_blocks: int) -> None:
    manager = engine.kv_cache.manager
    assert manager.num_used_blocks == 0 and manager.num_free_blocks == num_blocks
    tree = getattr(manager, "tree", None)
    if tree is not None:
        assert tree.extra_refs() == {}, "a prefix-tree lock outlived its sequence"
    assert not engine.requests and not engine.texts and not engine.has_unfinished_requests()
    stats = engine.scheduler_stats()
    assert stats.num_preemptions == sum(sequence.num_preemptions for sequence in run.sequences)
    assert stats.prefix_cache_hits == sum(sequence.num_cached_tokens for sequence in run.sequences)
    assert stats.spec_decode.num_emitted == sum(sequence.spec.num_emitted for sequence in run.sequences)
    assert all(not sequence.draft_token_ids and not sequence.num_draft_tokens for sequence in run.sequences)
    assert engine.step() == []
    engine.abort(next(iter(run.outputs)))  # finished: nothing to report
    engine.abort("unknown")
    assert engine.step() == []


@pytest.mark.parametrize("seed", range(16, 26))  # 17 and 24 lost prompt logprobs to a preemption
def test_outputs_with_every_scheduling_feature_equal_each_request_alone(tiny, plain, seed: int) -> None:  # type: ignore[no-untyped-def]
    in_thread(lambda: check_against_each_request_alone(tiny, plain, seed))


def check_against_each_request_alone(tiny: LoadedModel, plain: LLMEngine, seed: int) -> None:
    rng = random.Random(seed)
    config = random_config(rng)
    requests = random_workload(rng, config["scheduling_policy"] == "priority")
    engine = engine_for(tiny, **config)
    run = serve(engine, requests)
    for request in requests:
        reference = alone(plain, request)
        if isinstance(reference, str):
            assert run.refused[request.request_id] == reference
        else:
            assert_matches_alone(request, run, reference)
    assert_books_are_empty(engine, run, config["num_kv_blocks"])
