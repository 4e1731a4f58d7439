"""Table 4: a load test by concurrent users, in process (no HTTP): each user sends a request, waits for
its last token, and sends the next, until the level's requests are done. The sequential engine
(``batching="sequential"``: one request at a time, the others wait) against the default engine
(continuous batching over paged KV); requests/s, output tokens/s and each request's latency (from its
submission to its last token, waiting included)."""

import time
from dataclasses import dataclass

from tokenmill.benchmarks.measure import synchronize
from tokenmill.benchmarks.seeds.engines import SeedSetup, fixed_workload, run_on_engine
from tokenmill.benchmarks.seeds.published import SERVING_SPEEDUP
from tokenmill.benchmarks.stats import mean, percentile
from tokenmill.benchmarks.workload import Workload
from tokenmill.engine.llm_engine import LLMEngine

SEQUENTIAL, BATCHED = "sequential", "continuous"


@dataclass(frozen=True)
class LoadRun:
    users: int
    num_requests: int
    output_tokens: int
    elapsed_s: float
    latencies_s: list[float]

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def latency_mean_s(self) -> float:
        return mean(self.latencies_s)

    @property
    def latency_p99_s(self) -> float:
        return percentile(self.latencies_s, 99)


@dataclass(frozen=True)
class ServingRow:
    users: int
    sequential: LoadRun
    batched: LoadRun

    @property
    def speedup(self) -> float:
        return self.batched.requests_per_s / self.sequential.requests_per_s

    @property
    def seed_speedup(self) -> float | None:
        return SERVING_SPEEDUP.get(self.users)


def closed_loop(engine: LLMEngine, workload: Workload, users: int) -> LoadRun:
    """``users`` requests in flight at a time: each finished one makes room for the next."""
    engine.reset_prefix_cache()  # every level sends the same first prompts: none may find them cached
    pending = list(workload.requests)
    submitted: dict[str, float] = {}
    latencies: list[float] = []
    tokens = 0
    synchronize(engine.device)
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and len(submitted) < users:
            request = pending.pop(0)
            engine.add_request(
                request.request_id, request.prompt_token_ids, workload.params_by_id[request.request_id]
            )
            submitted[request.request_id] = time.perf_counter()
        for delta in engine.step():
            tokens += len(delta.new_token_ids)
            if delta.finished:
                latencies.append(time.perf_counter() - submitted.pop(delta.request_id))
    synchronize(engine.device)
    return LoadRun(users, workload.num_requests, tokens, time.perf_counter() - start, latencies)


def measure_serving(setup: SeedSetup) -> list[ServingRow]:
    sizes = setup.sizes
    runs: dict[str, list[LoadRun]] = {}
    for batching in (SEQUENTIAL, BATCHED):
        config = setup.config(batching=batching, max_num_seqs=max(sizes.users))
        runs[batching] = run_on_engine(
            setup,
            config,
            lambda engine: [closed_loop(engine, _workload(setup, users), users) for users in sizes.users],
        )
        print(f"serving table: {batching} done", flush=True)
    return [
        ServingRow(users, sequential, batched)
        for users, sequential, batched in zip(sizes.users, runs[SEQUENTIAL], runs[BATCHED], strict=True)
    ]


def _workload(setup: SeedSetup, users: int) -> Workload:
    sizes = setup.sizes
    num_requests = max(users, sizes.min_requests)
    return fixed_workload(setup, num_requests, sizes.serve_input_len, sizes.serve_output_len)
