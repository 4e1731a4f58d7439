"""Priority scheduling: admission order and preemption victims against a naive reference scheduler, a
high-priority request overtaking a full batch, and outputs equal to each request run alone."""

import random
from dataclasses import dataclass
from typing import Any

import pytest

from engine_helpers import engine_for, llm_for, run_to_completion
from tokenmill import SamplingParams
from tokenmill.cache.kv_cache_manager import PagedKVCacheManager
from tokenmill.config import EngineConfig, SchedulerConfig
from tokenmill.engine.llm_engine import InvalidRequestError, LLMEngine
from tokenmill.errors import TokenmillError
from tokenmill.loading import load_model
from tokenmill.reference import greedy_generate
from tokenmill.scheduler.output import StepResult
from tokenmill.scheduler.scheduler import Scheduler
from tokenmill.sequence import Sequence


@pytest.fixture(scope="module")
def tiny(tiny_llama_folder):  # type: ignore[no-untyped-def]
    return load_model(tiny_llama_folder, dtype="float32")


# --- the scheduler against a naive reference ----------------------------------------------------------


@dataclass(eq=False)
class RefRequest:
    request_id: str
    priority: int
    arrival: float
    num_tokens: int
    max_tokens: int
    generated: int = 0
    blocks: int = 0

    @property
    def key(self) -> tuple[int, float]:
        return self.priority, self.arrival


class NaiveScheduler:
    """The priority policy written as plainly as possible: sets, min / max over them, and block counts.
    Every scheduled request runs all its uncomputed tokens (the token budget never binds here)."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int) -> None:
        self.num_blocks, self.block_size, self.max_num_seqs = num_blocks, block_size, max_num_seqs
        self.waiting: set[RefRequest] = set()
        self.running: set[RefRequest] = set()
        self.preempted_for_admission = 0

    def free_blocks(self) -> int:
        return self.num_blocks - sum(request.blocks for request in self.running)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def step(self) -> tuple[list[str], list[str]]:
        """(ids scheduled, in serving then admission order; ids preempted, in order)."""
        scheduled: list[RefRequest] = []
        preempted: list[RefRequest] = []
        for request in sorted(self.running, key=lambda r: r.key):
            while request in self.running and self.blocks_for(request.num_tokens) - request.blocks > (
                self.free_blocks()
            ):
                preempted.append(self.preempt(max(self.running, key=lambda r: r.key)))
            if request in self.running:
                request.blocks = self.blocks_for(request.num_tokens)
                scheduled.append(request)
        pool_exhausted = bool(preempted)  # then nothing is admitted this step
        while not pool_exhausted and self.waiting:
            head = min(self.waiting, key=lambda r: r.key)
            if (
                len(self.running) < self.max_num_seqs
                and self.blocks_for(head.num_tokens) <= self.free_blocks()
            ):
                self.waiting.remove(head)
                self.running.add(head)
                head.blocks = self.blocks_for(head.num_tokens)
                scheduled.append(head)
                continue
            worse = [request for request in self.running if request.priority > head.priority]
            if not worse:
                break
            victim = max(worse, key=lambda r: r.key)
            preempted.append(self.preempt(victim))
            self.preempted_for_admission += 1
            if victim in scheduled:
                scheduled.remove(victim)
        for request in scheduled:
            request.num_tokens += 1
            request.generated += 1
            if request.generated == request.max_tokens:
                self.running.remove(request)
        return [r.request_id for r in scheduled], [r.request_id for r in preempted]

    def preempt(self, request: RefRequest) -> RefRequest:
        self.running.remove(request)
        request.blocks = 0
        self.waiting.add(request)
        return request


def _step_scheduler(scheduler: Scheduler) -> tuple[list[str], list[str]]:
    """One engine step without a model: every scheduled chunk computes, sampling appends a dummy token."""
    out = scheduler.schedule()
    sampled = {chunk.seq: [(1, None)] for chunk in out.chunks if chunk.samples_next_token}
    scheduler.update(out, StepResult(sampled=sampled))
    return [c.seq.seq_id for c in out.chunks], [seq.seq_id for seq in out.preempted]


def _compare_with_reference(seed: int) -> tuple[int, int]:
    """Random arrivals into a small pool and batch, stepped in lockstep with the reference; returns the
    preemptions (pool exhausted, admission of a better request)."""
    rng = random.Random(seed)
    block_size, num_blocks, max_num_seqs = 4, rng.randint(8, 14), rng.randint(2, 5)
    config = SchedulerConfig(policy="priority", max_num_seqs=max_num_seqs, max_num_batched_tokens=100_000)
    scheduler = Scheduler(config, PagedKVCacheManager(num_blocks, block_size), max_model_len=100_000)
    reference = NaiveScheduler(num_blocks, block_size, max_num_seqs)
    arrivals = list(range(40))
    preemptions = 0
    for step in range(2000):
        for _ in range(rng.choice([0, 0, 1, 2])):
            if arrivals:
                index = arrivals.pop(0)
                prompt_len = rng.randint(1, 16)
                max_tokens = rng.randint(1, num_blocks * block_size - prompt_len)
                priority = rng.randint(0, 3)
                request_id, params = f"r{index}", SamplingParams(max_tokens=max_tokens)
                request = Sequence(
                    request_id,
                    [7] * prompt_len,
                    params,
                    max_tokens,
                    arrival_time=float(index),
                    priority=priority,
                )
                scheduler.add(request)
                reference.waiting.add(RefRequest(request_id, priority, float(index), prompt_len, max_tokens))
        expected = reference.step()
        assert _step_scheduler(scheduler) == expected, f"seed {seed}, step {step}"
        preemptions += len(expected[1])
        if not arrivals and not scheduler.has_unfinished:
            break
    assert not scheduler.has_unfinished and not reference.running and not reference.waiting
    return preemptions - reference.preempted_for_admission, reference.preempted_for_admission


def test_admission_order_and_victims_match_a_naive_priority_scheduler() -> None:
    pool_preemptions, admission_preemptions = 0, 0
    for seed in range(8):
        pool, admission = _compare_with_reference(seed)
        pool_preemptions += pool
        admission_preemptions += admission
    assert pool_preemptions > 0 and admission_preemptions > 0, "both kinds of preemption were meant to happen"


# --- the engine ---------------------------------------------------------------------------------------


def _finish_order(engine: LLMEngine) -> tuple[list[str], dict[str, list[int]]]:
    order: list[str] = []
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            if delta.finished:
                order.append(delta.request_id)
    return order, tokens


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_high_priority_request_arriving_into_a_full_batch_preempts_a_low_one_and_finishes_first(
    tiny, policy: str
) -> None:  # type: ignore[no-untyped-def]
    engine = engine_for(
        tiny, kv_cache="paged", block_size=4, num_kv_blocks=64, max_num_seqs=2, scheduling_policy=policy
    )
    low_priority = 5 if policy == "priority" else 0
    prompts = {"low-early": [11, 12, 13, 14, 15], "low-late": [21, 22, 23], "high": [31, 32, 33, 34]}
    max_tokens = {"low-early": 30, "low-late": 30, "high": 4}
    requests = {}
    for request_id in ("low-early", "low-late"):
        params = SamplingParams(temperature=0, max_tokens=max_tokens[request_id], ignore_eos=True)
        engine.add_request(request_id, prompts[request_id], params, priority=low_priority)
        requests[request_id] = engine.requests[request_id][0]
    early_tokens: dict[str, list[int]] = {"low-early": [], "low-late": []}
    for _ in range(3):
        for delta in engine.step():
            early_tokens[delta.request_id] += delta.new_token_ids
    engine.add_request("high", prompts["high"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    requests["high"] = engine.requests["high"][0]

    order, tokens = _finish_order(engine)

    if policy == "priority":
        assert order[0] == "high"
        assert [requests[r].num_preemptions for r in ("low-early", "low-late", "high")] == [0, 1, 0]
    else:
        assert order[-1] == "high"
        assert engine.scheduler_stats().num_preemptions == 0
    for request_id, prompt in prompts.items():
        generated = early_tokens.get(request_id, []) + tokens[request_id]
        assert generated == greedy_generate(tiny.model, prompt, max_tokens[request_id]).token_ids, request_id


def test_equal_priority_never_preempts(tiny) -> None:  # type: ignore[no-untyped-def]
    engine = engine_for(
        tiny, kv_cache="paged", block_size=4, num_kv_blocks=64, max_num_seqs=2, scheduling_policy="priority"
    )
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params, priority=2)
    engine.add_request("b", [8, 9], params, priority=2)
    engine.step()
    engine.add_request(
        "c", [10, 11], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), priority=2
    )
    engine.add_request(
        "worse", [12], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), priority=3
    )
    order, _ = _finish_order(engine)
    assert engine.scheduler_stats().num_preemptions == 0
    assert order[-2:] == ["c", "worse"]


def test_the_pool_victim_is_the_worst_priority_not_the_newest(tiny) -> None:  # type: ignore[no-untyped-def]
    """Three requests fill a pool too small for all to grow: under fcfs the newest is preempted, under
    priority the one of the worst priority, here the oldest."""
    victims = {}
    for policy, priorities in (("fcfs", [0, 0, 0]), ("priority", [9, 1, 1])):
        engine = engine_for(
            tiny, kv_cache="paged", block_size=4, num_kv_blocks=6, max_num_seqs=3, scheduling_policy=policy
        )
        for index, priority in enumerate(priorities):
            params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            engine.add_request(f"r{index}", [20 + index] * 4, params, priority=priority)
        requests = [engine.requests[f"r{index}"][0] for index in range(3)]
        _finish_order(engine)
        victims[policy] = [request.request_id for request in requests if request.num_preemptions]
    assert victims == {"fcfs": ["r2"], "priority": ["r0"]}


@pytest.mark.parametrize(("seed", "chunked_prefill", "prefix_caching"), [(0, False, False), (1, True, True)])
def test_outputs_under_priority_scheduling_equal_each_request_alone(
    tiny, seed: int, chunked_prefill: bool, prefix_caching: bool
) -> None:  # type: ignore[no-untyped-def]
    """Random arrivals and priorities into a tight pool and batch; greedy requests must equal the greedy
    reference loop, seeded sampled ones a sequential engine that runs each request alone."""
    rng = random.Random(seed)
    options: dict[str, Any] = {"kv_cache": "paged", "block_size": 4, "max_model_len": 64}
    engine = engine_for(
        tiny,
        **options,
        num_kv_blocks=16,
        max_num_seqs=3,
        max_num_batched_tokens=24 if chunked_prefill else 64,
        chunked_prefill=chunked_prefill,
        prefix_caching=prefix_caching,
        scheduling_policy="priority",
        debug_checks=True,
    )
    shared = [rng.randrange(3, 384) for _ in range(9)]
    workload = {}
    for index in range(14):
        prompt = (shared if index % 3 == 0 else []) + [
            rng.randrange(3, 384) for _ in range(rng.randint(1, 20))
        ]
        seeded = index % 4 == 1
        params = SamplingParams(
            temperature=1.0 if seeded else 0,
            seed=index if seeded else None,
            max_tokens=rng.randint(1, 20),
            ignore_eos=True,
        )
        workload[f"r{index}"] = (prompt, params, rng.randint(0, 3))
    arrivals = list(workload)
    outputs: dict[str, list[int]] = {request_id: [] for request_id in workload}
    while arrivals or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 2)):
            if arrivals:
                request_id = arrivals.pop(0)
                prompt, params, priority = workload[request_id]
                engine.add_request(request_id, prompt, params, priority=priority)
        for delta in engine.step():
            outputs[delta.request_id] += delta.new_token_ids
    assert engine.scheduler_stats().num_preemptions > 0, "the pool was meant to be small enough to preempt"
    alone = run_to_completion(
        engine_for(tiny, **options, batching="sequential"),
        {request_id: (prompt, params) for request_id, (prompt, params, _) in workload.items()},
    )
    for request_id, (prompt, params, _) in workload.items():
        expected = alone[request_id].outputs[0].token_ids
        if params.temperature == 0:
            assert expected == greedy_generate(tiny.model, prompt, params.max_tokens).token_ids, request_id
        assert outputs[request_id] == expected, request_id


# --- the API ------------------------------------------------------------------------------------------


def test_priority_needs_the_priority_policy(tiny) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig().with_options(scheduling_policy="lottery")
    fcfs = engine_for(tiny)
    with pytest.raises(InvalidRequestError, match="Got priority 3 but Priority scheduling is not enabled"):
        fcfs.add_request("a", [1, 2], SamplingParams(max_tokens=1), priority=3)
    fcfs.add_request("b", [1, 2], SamplingParams(max_tokens=1), priority=0)
    with pytest.raises(InvalidRequestError, match="priority must be an integer"):
        engine_for(tiny, scheduling_policy="priority").add_request("c", [1], priority=1.5)  # type: ignore[arg-type]


def test_llm_generate_takes_one_priority_or_one_per_prompt(tiny) -> None:  # type: ignore[no-untyped-def]
    llm = llm_for(tiny, scheduling_policy="priority", max_num_seqs=1)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outputs = llm.generate(prompts, params, priority=[1, 0])
    for prompt, output in zip(prompts, outputs, strict=True):
        assert (
            output.outputs[0].token_ids
            == greedy_generate(tiny.model, prompt["prompt_token_ids"], 3).token_ids
        )
    assert len(llm.generate(prompts, params, priority=2)) == 2
    with pytest.raises(TokenmillError, match="got 3 priorities for 2 prompts"):
        llm.generate(prompts, params, priority=[0, 1, 2])


def test_llm_chat_passes_one_priority_per_conversation(smollm2) -> None:  # type: ignore[no-untyped-def]
    conversations = [[{"role": "user", "content": "Hi!"}], [{"role": "user", "content": "Name a color."}]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain = llm_for(smollm2).chat(conversations, params)
    llm = llm_for(smollm2, scheduling_policy="priority", max_num_seqs=1)
    ranked = llm.chat(conversations, params, priority=[1, 0])
    assert [o.outputs[0].token_ids for o in ranked] == [o.outputs[0].token_ids for o in plain]
    with pytest.raises(TokenmillError, match="got 1 priorities for 2 prompts"):
        llm.chat(conversations, params, priority=[0])
