"""Chunked prefill × prefix caching × preemption: greedy outputs must not change with any combination,
and the allocator + prefix tree stay consistent after every step (``debug_checks``)."""

import itertools
import random

import pytest
import torch

from engine_helpers import engine_for, run_to_completion
from tokenmill import SamplingParams
from tokenmill.loading import load_model
from tokenmill.reference import SingleSequenceRunner, greedy_generate
from tokenmill.scheduler.admission import peak_blocks

COMBINATIONS = list(itertools.product([False, True], repeat=3))  # chunked, prefix caching, tight pool


@pytest.fixture(scope="module")
def tiny(tiny_llama_folder):  # type: ignore[no-untyped-def]
    return load_model(tiny_llama_folder, dtype="float32")


def shared_prefix_workload(rng: random.Random) -> dict[str, tuple[list[int], int]]:
    """Requests built from a few shared system prompts and multi-turn histories, plus unrelated ones."""
    prefixes = [[rng.randrange(3, 384) for _ in range(rng.randint(9, 20))] for _ in range(3)]
    workload = {}
    for i in range(16):
        prefix = rng.choice(prefixes) if i % 4 else []
        suffix = [rng.randrange(3, 384) for _ in range(rng.randint(1, 8))]
        workload[f"r{i}"] = (prefix + suffix, rng.randint(1, 12))
    return workload


@pytest.mark.parametrize(("chunked", "prefix_caching", "tight_pool"), COMBINATIONS)
def test_greedy_outputs_do_not_depend_on_scheduling_features(
    tiny, chunked, prefix_caching, tight_pool
) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(7)
    workload = shared_prefix_workload(rng)
    engine = engine_for(
        tiny,
        kv_cache="paged",
        block_size=4,
        num_kv_blocks=10 if tight_pool else 200,
        max_num_seqs=6,
        max_num_batched_tokens=24 if chunked else 64,
        max_model_len=48,
        chunked_prefill=chunked,
        prefill_chunk_size=5 if chunked else None,
        prefix_caching=prefix_caching,
        debug_checks=True,
    )
    arrivals = list(workload)
    outputs: dict[str, list[int]] = {rid: [] for rid in workload}
    cached_tokens = dict.fromkeys(workload, 0)
    while arrivals or engine.has_unfinished_requests():
        for _ in range(rng.randint(1, 3)):
            if arrivals:
                rid = arrivals.pop(0)
                prompt, max_tokens = workload[rid]
                engine.add_request(
                    rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                )
        for delta in engine.step():
            outputs[delta.request_id] += delta.new_token_ids
            cached_tokens[delta.request_id] = max(cached_tokens[delta.request_id], delta.num_cached_tokens)
    for rid, (prompt, max_tokens) in workload.items():
        assert outputs[rid] == greedy_generate(tiny.model, prompt, max_tokens).token_ids, rid
    manager = engine.kv_cache.manager
    assert manager.num_used_blocks == 0
    assert (engine.scheduler_stats().num_preemptions > 0) == tight_pool
    # Counted once per request, at its first admission, however often it was preempted and readmitted.
    stats = engine.scheduler_stats()
    assert (stats.prefix_cache_hits > 0) == prefix_caching
    num_prompt_tokens = sum(len(prompt) for prompt, _ in workload.values())
    assert stats.prefix_cache_queries == (num_prompt_tokens if prefix_caching else 0)
    assert stats.prefix_cache_hits == sum(cached_tokens.values())
    assert all(cached_tokens[rid] < len(prompt) for rid, (prompt, _) in workload.items())
    assert all(cached % 4 == 0 for cached in cached_tokens.values())


def test_prefix_hit_reports_cached_tokens_and_skips_their_compute(tiny) -> None:  # type: ignore[no-untyped-def]
    engine = engine_for(tiny, kv_cache="paged", block_size=4, num_kv_blocks=64, prefix_caching=True)
    prompt = list(range(10, 31))  # 21 tokens: 5 full blocks
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("first", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("second", prompt, params)
    scheduled = engine.scheduler.schedule()
    (chunk,) = scheduled.chunks
    assert (chunk.start, chunk.end) == (20, 21), "all five full blocks come from the cache"
    assert chunk.seq.num_cached_tokens == 20


def test_prefix_cache_counters_count_prompt_tokens(tiny) -> None:  # type: ignore[no-untyped-def]
    engine = engine_for(tiny, kv_cache="paged", block_size=4, num_kv_blocks=64, prefix_caching=True)
    prompt = list(range(10, 31))  # 21 tokens: 5 full blocks can be shared
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    counters = []
    for request_id, request_params in [
        ("first", params),
        ("again", params),
        ("prompt-logprobs", SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1)),
    ]:
        engine.add_request(request_id, prompt, request_params)
        while engine.has_unfinished_requests():
            engine.step()
        stats = engine.scheduler_stats()
        counters.append((stats.prefix_cache_queries, stats.prefix_cache_hits))
    assert counters == [(21, 0), (42, 20), (42, 20)], "prompt logprobs skip the cache, so no lookup"


def test_prompt_logprobs_survive_a_preemption_in_the_middle_of_the_prompt(tiny) -> None:  # type: ignore[no-untyped-def]
    """A prompt computed in chunks is preempted (a decoding request outgrows the pool) and recomputed from
    its first token: its prompt logprobs are still one per prompt token, those of the model alone."""
    engine = engine_for(
        tiny,
        kv_cache="paged",
        block_size=4,
        num_kv_blocks=9,
        max_num_seqs=2,
        chunked_prefill=True,
        max_num_batched_tokens=3,
        max_model_len=64,
    )
    prompt = list(range(10, 34))
    outputs = run_to_completion(
        engine,
        {
            "grows": ([100, 101, 102, 103], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
            "asks": (prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)),
        },
    )
    assert engine.scheduler_stats().num_preemptions > 0
    logits = SingleSequenceRunner(tiny.model, len(prompt)).forward_all(prompt)
    expected = torch.log_softmax(logits.double(), dim=-1)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])
    got = outputs["asks"].prompt_logprobs
    assert got is not None and got[0] is None and len(got) == len(prompt)
    logprobs = [position[token].logprob for position, token in zip(got[1:], prompt[1:], strict=True)]
    torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.double), expected[:, 0], atol=1e-4, rtol=0)


def test_a_fully_cached_prompt_still_computes_its_last_token(tiny) -> None:  # type: ignore[no-untyped-def]
    engine = engine_for(tiny, kv_cache="paged", block_size=4, num_kv_blocks=64, prefix_caching=True)
    prompt = list(range(10, 26))  # exactly 4 blocks
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("a", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("b", prompt, params)
    (chunk,) = engine.scheduler.schedule().chunks
    assert (chunk.start, chunk.end) == (12, 16)


@pytest.mark.parametrize("headroom", [0.0, 0.5, 1.0])
def test_admission_headroom_trades_concurrency_for_preemptions(tiny, headroom) -> None:  # type: ignore[no-untyped-def]
    """Full headroom reserves every request's remaining output, so with known max_tokens nothing is ever
    preempted; none admits as soon as the prompt fits, so growth preempts. Outputs never change."""
    rng = random.Random(11)
    workload = {f"r{i}": ([rng.randrange(3, 384) for _ in range(rng.randint(4, 12))], 16) for i in range(10)}
    engine = engine_for(
        tiny,
        kv_cache="paged",
        block_size=4,
        num_kv_blocks=24,
        max_num_seqs=10,
        admission="headroom",
        admission_headroom=headroom,
    )
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for rid, (prompt, _) in workload.items():
        engine.add_request(rid, prompt, params)
    outputs: dict[str, list[int]] = {rid: [] for rid in workload}
    peak_running = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            outputs[delta.request_id] += delta.new_token_ids
        peak_running = max(peak_running, len(engine.scheduler.running))
    for rid, (prompt, max_tokens) in workload.items():
        assert outputs[rid] == greedy_generate(tiny.model, prompt, max_tokens).token_ids, rid
    preemptions = engine.scheduler_stats().num_preemptions
    if headroom == 1.0:
        assert preemptions == 0
        assert peak_running <= 24 * 4 // (4 + 16)  # whole requests (prompt 4+ and 16 outputs) that fit
    if headroom == 0.0:
        assert preemptions > 0 and peak_running > 24 * 4 // (12 + 16)


def test_peak_blocks_matches_a_step_by_step_simulation() -> None:
    rng = random.Random(5)
    for _ in range(200):
        block_size = rng.choice([1, 4, 16])
        growth = [(rng.randint(1, 60), rng.randint(1, 40)) for _ in range(rng.randint(1, 8))]
        simulated = max(
            sum(-(-(tokens + step) // block_size) for tokens, steps in growth if step < steps)
            for step in range(max(steps for _, steps in growth))
        )
        assert peak_blocks(growth, block_size) == simulated, (growth, block_size)


def test_admission_lookahead_never_preempts_and_admits_at_least_as_many_as_full_headroom(tiny) -> None:  # type: ignore[no-untyped-def]
    """Staggered max_tokens: requests finishing early free blocks that lookahead admission counts on, so it
    runs more at once than reserving every request's whole output, and still preempts nothing."""
    rng = random.Random(3)
    workload = {
        f"r{i}": ([rng.randrange(3, 384) for _ in range(rng.randint(4, 12))], rng.randint(2, 20))
        for i in range(12)
    }

    def serve(**options: object) -> tuple[dict[str, list[int]], int, int]:
        engine = engine_for(
            tiny, kv_cache="paged", block_size=4, num_kv_blocks=24, max_num_seqs=12, **options
        )
        for rid, (prompt, max_tokens) in workload.items():
            engine.add_request(
                rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            )
        outputs: dict[str, list[int]] = {rid: [] for rid in workload}
        peak_running = 0
        while engine.has_unfinished_requests():
            for delta in engine.step():
                outputs[delta.request_id] += delta.new_token_ids
            peak_running = max(peak_running, len(engine.scheduler.running))
        return outputs, engine.scheduler_stats().num_preemptions, peak_running

    outputs, preemptions, peak_running = serve(admission="lookahead")
    _, full_preemptions, full_peak_running = serve(admission="headroom", admission_headroom=1.0)
    for rid, (prompt, max_tokens) in workload.items():
        assert outputs[rid] == greedy_generate(tiny.model, prompt, max_tokens).token_ids, rid
    assert preemptions == full_preemptions == 0
    assert peak_running > full_peak_running
