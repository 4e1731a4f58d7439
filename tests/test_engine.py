"""The engine against independent references: the single-sequence greedy loop (itself checked against
transformers), each request run alone, and a naive allocator model."""

import dataclasses
import random
import re

import numpy as np
import pytest
import torch

from engine_helpers import engine_for, llm_for, run_to_completion
from tokenmill import LLM, SamplingParams
from tokenmill.engine.llm_engine import InvalidRequestError
from tokenmill.errors import TokenmillError
from tokenmill.loading import load_model
from tokenmill.reference import greedy_generate

LADDER = [
    ("none", "sequential"),
    ("contiguous", "sequential"),
    ("contiguous", "static"),
    ("contiguous", "continuous"),
    ("paged", "sequential"),
    ("paged", "static"),
    ("paged", "continuous"),
]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three colours:",
    "1, 2, 3, 4,",
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def references(smollm2):  # type: ignore[no-untyped-def]
    tokenizer = smollm2.tokenizer
    return [greedy_generate(smollm2.model, tokenizer.encode(p), GREEDY.max_tokens).token_ids for p in PROMPTS]


@pytest.mark.parametrize(("kv_cache", "batching"), LADDER)
def test_every_ladder_config_matches_the_reference_greedy_loop(
    smollm2, references, kv_cache, batching
) -> None:  # type: ignore[no-untyped-def]
    llm = llm_for(smollm2, kv_cache=kv_cache, batching=batching, max_num_seqs=3, max_model_len=256)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == references
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * len(PROMPTS)
    if llm.engine.kv_cache is not None:
        assert llm.engine.kv_cache.manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def tiny(tiny_llama_folder):  # type: ignore[no-untyped-def]
    return load_model(tiny_llama_folder, dtype="float32")


@pytest.mark.parametrize("chunked_prefill", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_continuous_batching_equals_each_request_alone(tiny, seed: int, chunked_prefill: bool) -> None:
    """Random arrivals and lengths, tight limits and a pool small enough to force preemption; with
    chunked prefill, prompts split at random chunk sizes and share steps with decodes."""
    rng = random.Random(seed)
    engine = engine_for(
        tiny,
        kv_cache="paged",
        block_size=4,
        num_kv_blocks=16,
        max_num_seqs=rng.choice([4, 8]),
        max_num_batched_tokens=rng.choice([16, 40]) if chunked_prefill else rng.choice([64, 128]),
        max_model_len=64,
        chunked_prefill=chunked_prefill,
        prefill_chunk_size=rng.choice([None, 3, 7]) if chunked_prefill else None,
    )
    workload = {
        f"r{i}": ([rng.randrange(3, 384) for _ in range(rng.randint(1, 30))], rng.randint(1, 24))
        for i in range(14)
    }
    arrivals = sorted(workload, key=lambda _: rng.random())
    texts: dict[str, list[int]] = {rid: [] for rid in workload}
    steps = 0
    while arrivals or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if arrivals:
                rid = arrivals.pop()
                prompt, max_tokens = workload[rid]
                engine.add_request(
                    rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                )
        for delta in engine.step():
            texts[delta.request_id] += delta.new_token_ids
        engine.kv_cache.manager.check_integrity()
        steps += 1
    assert engine.scheduler_stats().num_preemptions > 0, "the pool was meant to be small enough to preempt"
    assert engine.kv_cache.manager.num_used_blocks == 0
    for rid, (prompt, max_tokens) in workload.items():
        assert texts[rid] == greedy_generate(tiny.model, prompt, max_tokens).token_ids, rid


def test_abort_frees_blocks_at_once(tiny) -> None:  # type: ignore[no-untyped-def]
    engine = engine_for(tiny, kv_cache="paged", block_size=4, num_kv_blocks=64, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", list(range(5, 25)), params)
    engine.step()
    engine.step()
    used = engine.kv_cache.manager.num_used_blocks
    assert used > 0
    engine.abort("r1")
    assert engine.kv_cache.manager.num_used_blocks < used
    deltas = engine.step()
    aborted = [d for d in deltas if d.request_id == "r1"]
    assert len(aborted) == 1 and aborted[0].finish_reason == "abort"
    engine.abort("r0")
    engine.abort("r2")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache.manager.num_used_blocks == 0


def test_seeded_sampling_does_not_depend_on_the_batch(tiny) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    prompt = [5, 6, 7, 8]
    alone = run_to_completion(engine_for(tiny), {"x": (prompt, params)})["x"].outputs[0].token_ids
    crowd = {f"o{i}": ([9 + i, 10, 11], SamplingParams(temperature=1.0, max_tokens=15 + i)) for i in range(5)}
    crowd["x"] = (prompt, params)
    together = run_to_completion(engine_for(tiny), crowd)["x"].outputs[0].token_ids
    assert alone == together
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=20, ignore_eos=True)
    assert run_to_completion(engine_for(tiny), {"x": (prompt, other_seed)})["x"].outputs[0].token_ids != alone


def test_n_sequences_share_the_prompt_and_differ(tiny) -> None:  # type: ignore[no-untyped-def]
    out = run_to_completion(
        engine_for(tiny),
        {"x": ([5, 6, 7], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True))},
    )["x"]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 10 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_request_id_like_another_requests_sequence_id_keeps_its_own_kv(tiny, prefix_caching: bool) -> None:  # type: ignore[no-untyped-def]
    """Request "x" with n=2 runs sequences "x[0]" and "x[1]"; a request named "x[0]" beside it must not
    share their block tables."""
    engine = engine_for(
        tiny, kv_cache="paged", block_size=4, prefix_caching=prefix_caching, debug_checks=True
    )
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    workload = {
        "x": ([5, 6, 7, 8, 9, 10], dataclasses.replace(greedy, n=2)),
        "x[0]": (list(range(200, 213)), greedy),
    }
    outputs = run_to_completion(engine, workload)
    for rid, (prompt, params) in workload.items():
        expected = greedy_generate(tiny.model, prompt, 8).token_ids
        assert [o.token_ids for o in outputs[rid].outputs] == [expected] * params.n, rid
    assert engine.kv_cache.manager.num_used_blocks == 0


def test_stop_token_ids_min_tokens_and_max_tokens(tiny) -> None:  # type: ignore[no-untyped-def]
    prompt = [5, 6, 7]
    free_run = run_to_completion(
        engine_for(tiny), {"x": (prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))}
    )
    tokens = free_run["x"].outputs[0].token_ids
    stop_at = tokens[5]
    first = tokens.index(stop_at)
    out = run_to_completion(
        engine_for(tiny),
        {"x": (prompt, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_at]))},
    )
    completion = out["x"].outputs[0]
    assert completion.token_ids == tokens[: first + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_at)
    banned = run_to_completion(
        engine_for(tiny),
        {
            "x": (
                prompt,
                SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_at], min_tokens=first + 2),
            )
        },
    )["x"].outputs[0]
    assert stop_at not in banned.token_ids[: first + 2]


def test_request_validation_names_the_limit(tiny) -> None:  # type: ignore[no-untyped-def]
    engine = engine_for(tiny, max_model_len=64)
    with pytest.raises(InvalidRequestError, match=r"prompt \(60 tokens\) plus max_tokens \(10\) is 70 .* 64"):
        engine.add_request("a", list(range(60)), SamplingParams(max_tokens=10))
    with pytest.raises(InvalidRequestError, match="64 tokens, which leaves no room"):
        engine.add_request("b", [1] * 64, SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request("c", [10_000], SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("d", [], SamplingParams())
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        engine.add_request("e", "text", SamplingParams())
    engine.add_request("f", [1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("f", [1, 2], SamplingParams(max_tokens=1))
    assert not engine.requests.keys() - {"f"}


def test_request_ids_are_any_string_and_the_engine_api_edge_cases(tiny) -> None:  # type: ignore[no-untyped-def]
    """As vLLM: an id is any string ("" too, whose n sequences report under it and are forgotten when
    done), anything else is refused by name, as are params that are not SamplingParams; a step with
    nothing to do and aborting an unknown or finished id change nothing."""
    engine = engine_for(tiny, max_model_len=64)
    assert engine.step() == []
    for request_id in (5, None, ("a",)):
        with pytest.raises(
            InvalidRequestError, match=re.escape(f"request_id must be a string, got {request_id!r}")
        ):
            engine.add_request(request_id, [1, 2], SamplingParams(max_tokens=1))  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="params must be a SamplingParams"):
        engine.add_request("p", [1, 2], {"max_tokens": 1})  # type: ignore[arg-type]
    assert not engine.requests
    outputs = run_to_completion(engine, {"": ([1, 2, 3], SamplingParams(n=2, max_tokens=3, ignore_eos=True))})
    assert [len(output.token_ids) for output in outputs[""].outputs] == [3, 3]
    assert outputs[""].finished and not engine.requests and not engine.texts
    engine.abort("")  # finished
    engine.abort("unknown")
    assert engine.step() == [] and not engine.has_unfinished_requests()


def test_engine_option_errors_name_the_option(tiny) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="kv_cache"):
        engine_for(tiny, kv_cache="fancy")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine_for(tiny, max_model_len=128, max_num_batched_tokens=64, chunked_prefill=False)
    with pytest.raises(ValueError, match="admission_headroom"):
        engine_for(tiny, admission="lookahead", admission_headroom=0.5)


def test_offline_inputs_of_the_wrong_type_are_named(tiny) -> None:  # type: ignore[no-untyped-def]
    """What ``LLM.generate`` is handed is checked by name: no AttributeError from deep inside, and no
    token ids read out of floats or strings; numpy's integers are integers."""
    llm = LLM(engine=engine_for(tiny))
    ids = {"prompt_token_ids": [1, 2]}
    cases = [
        ((ids, {"temperature": 0}), "sampling_params must be a SamplingParams"),
        (([ids], [{"temperature": 0}]), "sampling_params must be a SamplingParams"),
        (({"prompt_token_ids": "hello"},), "prompt_token_ids must be a list of token ids, got 'hello'"),
        (({"prompt_token_ids": [1.7, 2.2]},), "prompt token ids must be integers, got 1.7"),
        (({"prompt_token_ids": ["12", "13"]},), "prompt token ids must be integers, got '12'"),
        (({"prompt_token_ids": [True]},), "prompt token ids must be integers, got True"),
        ((None,), "prompts must be a prompt or a list of prompts, got None"),
        (([7],), "a prompt must be a string or a dict"),
    ]
    for args, message in cases:
        with pytest.raises(TokenmillError, match=re.escape(message)):
            llm.generate(*args)  # type: ignore[arg-type]
        assert not llm.engine.has_unfinished_requests()
    for priority in (1.0, "12"):
        with pytest.raises(TokenmillError, match=f"priority must be an integer, .* got {priority!r}"):
            llm.generate([ids, ids], priority=priority)  # type: ignore[arg-type]
    out = llm.generate(
        {"prompt_token_ids": np.array([1, 2])}, SamplingParams(max_tokens=1, stop_token_ids=None)
    )
    assert out[0].prompt_token_ids == [1, 2] and len(out[0].outputs[0].token_ids) == 1


def test_stop_strings_cut_the_text_and_streams_add_up(smollm2) -> None:  # type: ignore[no-untyped-def]
    llm = llm_for(smollm2)
    base = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )[0]
    text = base.outputs[0].text
    stop = text[8:11]
    cut = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[
        0
    ]
    assert cut.outputs[0].text == text[: text.index(stop)]
    assert (cut.outputs[0].finish_reason, cut.outputs[0].stop_reason) == ("stop", stop)


def test_logprobs_match_log_softmax_of_the_reference_logits(smollm2) -> None:  # type: ignore[no-untyped-def]
    llm = llm_for(smollm2)
    prompt_ids = llm.get_tokenizer().encode("The quick brown fox")
    out = llm.generate(
        {"prompt_token_ids": prompt_ids},
        SamplingParams(temperature=0, max_tokens=1, logprobs=3, prompt_logprobs=2),
    )[0]
    reference = torch.log_softmax(greedy_generate(smollm2.model, prompt_ids, 1).prompt_logits, -1)
    token = out.outputs[0].token_ids[0]
    position = out.outputs[0].logprobs[0]  # vLLM's shape: {token id: Logprob}
    assert token == int(reference.argmax()) and position[token].rank == 1
    assert abs(position[token].logprob - float(reference.max())) < 1e-4
    top3 = reference.topk(3).indices.tolist()
    assert list(position) == top3 and [position[t].rank for t in top3] == [1, 2, 3]
    assert out.outputs[0].sampled_logprobs[0] is position[token]
    assert position[token].decoded_token == llm.get_tokenizer().decode([token], skip_special_tokens=False)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt_ids)
    first = out.prompt_logprobs[1]
    first_logits = torch.log_softmax(greedy_generate(smollm2.model, prompt_ids[:1], 1).prompt_logits, -1)
    assert abs(first[prompt_ids[1]].logprob - float(first_logits[prompt_ids[1]])) < 1e-4
    more_likely = int((first_logits > first_logits[prompt_ids[1]]).sum())
    assert len(first) <= 3 and first[prompt_ids[1]].rank == 1 + more_likely


def test_chat_uses_the_template(smollm2) -> None:  # type: ignore[no-untyped-def]
    llm = llm_for(smollm2)
    messages = [{"role": "user", "content": "Say hello."}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8))[0]
    expected = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert out.prompt_token_ids == expected
    assert out.outputs[0].text
