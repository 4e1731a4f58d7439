"""Prometheus metrics of the server, in one registry per app (so several apps can live in one process).

The families are vLLM's, named ``tokenmill:`` where vLLM says ``vllm:`` (same suffixes, types and
buckets), so a vLLM dashboard ports by renaming the prefix; there is no ``model_name`` label (one model
per server). Token counters and histograms are fed by the engine side's observations (``StepMetrics``,
``record``) as steps run and deltas are routed (per-request ones when a request finishes); the engine's
state (running / waiting requests, KV
cache usage, preemptions, prefix-cache queries and hits in prompt tokens) is read when ``/metrics`` is
scraped. Counters are exposed with the ``_total`` suffix.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill.outputs import SpecDecodeCounts
from tokenmill.server.request_timeline import FinishedRequest, StepMetrics

# The *_created series only repeat the process start time; vLLM drops them too.
disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
_PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit``: vLLM's buckets for token counts."""
    buckets: list[int] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return tuple(buckets)
            buckets.append(step * scale)
        scale *= 10


@dataclass(frozen=True)
class EngineStats:
    """The engine's state after the last step, published by the engine side for readers elsewhere."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_decode: SpecDecodeCounts = field(default_factory=SpecDecodeCounts)


class _EngineStateCollector(Collector):
    def __init__(self, read_state: Callable[[], EngineStats]) -> None:
        self.read_state = read_state

    def collect(self) -> Iterator[Metric]:
        state = self.read_state()
        yield GaugeMetricFamily(
            "tokenmill:num_requests_running", "Sequences in the running batch.", value=state.num_running
        )
        yield GaugeMetricFamily(
            "tokenmill:num_requests_waiting", "Sequences waiting to be scheduled.", value=state.num_waiting
        )
        yield GaugeMetricFamily(
            "tokenmill:kv_cache_usage_perc", "Fraction of KV blocks in use (0 to 1).", state.kv_cache_usage
        )
        yield CounterMetricFamily(
            "tokenmill:num_preemptions_total",
            "Preemptions of running sequences.",
            value=state.num_preemptions,
        )
        yield CounterMetricFamily(
            "tokenmill:prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache at admission.",
            value=state.prefix_cache_queries,
        )
        yield CounterMetricFamily(
            "tokenmill:prefix_cache_hits_total",
            "Prompt tokens found in the prefix cache at admission.",
            value=state.prefix_cache_hits,
        )
        yield from _spec_decode_metrics(state.spec_decode)


def _spec_decode_metrics(spec: SpecDecodeCounts) -> Iterator[Metric]:
    """Speculative decoding's counters (zero while it is off); the acceptance rate is
    accepted / draft tokens, the mean accepted length emitted / num_drafts."""
    yield CounterMetricFamily(
        "tokenmill:spec_decode_num_drafts",
        "Verification steps of sequences with draft tokens.",
        spec.num_steps,
    )
    yield CounterMetricFamily(
        "tokenmill:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", spec.num_proposed
    )
    yield CounterMetricFamily(
        "tokenmill:spec_decode_num_accepted_tokens", "Draft tokens the model accepted.", spec.num_accepted
    )
    yield CounterMetricFamily(
        "tokenmill:spec_decode_num_emitted_tokens",
        "Tokens emitted by verification steps (accepted drafts plus the model's own).",
        spec.num_emitted,
    )


class ServerMetrics:
    def __init__(
        self,
        read_state: Callable[[], EngineStats],
        max_model_len: int = 2048,
        cache_config: dict[str, str] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.prompt_tokens = Counter(
            "tokenmill:prompt_tokens", "Prompt tokens of accepted requests.", registry=self.registry
        )
        self.generation_tokens = Counter(
            "tokenmill:generation_tokens", "Generated tokens.", registry=self.registry
        )
        self.request_success = Counter(
            "tokenmill:request_success",
            "Finished requests, by finish reason.",
            ["finished_reason"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "tokenmill:time_to_first_token_seconds",
            "From arrival to the first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "tokenmill:inter_token_latency_seconds",
            "Between consecutive tokens of one sequence.",
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e_request_latency = Histogram(
            "tokenmill:e2e_request_latency_seconds",
            "From arrival to the last token.",
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        )
        self.iteration_tokens = Histogram(
            "tokenmill:iteration_tokens_total",
            "Tokens computed per engine step.",
            buckets=_ITERATION_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self._add_request_histograms(one_two_five_buckets(max_model_len))
        self._add_cache_config_info(cache_config or {})
        self.registry.register(_EngineStateCollector(read_state))

    def _add_request_histograms(self, token_buckets: tuple[int, ...]) -> None:
        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"tokenmill:{name}", documentation, buckets=buckets, registry=self.registry)

        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per request.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request (over its n sequences).", token_buckets
        )
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Generated tokens of each request's longest sequence.",
            token_buckets,
        )
        self.request_params_n = histogram("request_params_n", "The n of each request.", _N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens of each request (resolved).", token_buckets
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "From arrival to first being scheduled.", _PHASE_BUCKETS
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "From first being scheduled to the first token.", _PHASE_BUCKETS
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "From the first token to the last.", _PHASE_BUCKETS
        )
        self.request_inference_time = histogram(
            "request_inference_time_seconds", "From first being scheduled to the last token.", _PHASE_BUCKETS
        )

    def _add_cache_config_info(self, cache_config: dict[str, str]) -> None:
        info = Gauge(
            "tokenmill:cache_config_info",
            "The KV cache's configuration, in the labels.",
            sorted(cache_config),
            registry=self.registry,
        )
        (info.labels(**cache_config) if cache_config else info).set(1)

    def record(self, observed: StepMetrics) -> None:
        """Apply one pass of the engine loop's observations."""
        if observed.prompt_tokens:
            self.prompt_tokens.inc(observed.prompt_tokens)
        if observed.generation_tokens:
            self.generation_tokens.inc(observed.generation_tokens)
        for tokens in observed.iteration_tokens:
            self.iteration_tokens.observe(tokens)
        for seconds in observed.time_to_first_token:
            self.time_to_first_token.observe(seconds)
        for seconds in observed.inter_token_latency:
            self.inter_token_latency.observe(seconds)
        for request in observed.finished:
            self.request_finished(request)

    def request_finished(self, request: FinishedRequest) -> None:
        self.request_success.labels(finished_reason=request.finish_reason).inc()
        self.e2e_request_latency.observe(request.e2e_s)
        self.request_prompt_tokens.observe(request.num_prompt_tokens)
        self.request_generation_tokens.observe(request.num_generation_tokens)
        self.request_max_num_generation_tokens.observe(request.max_num_generation_tokens)
        self.request_params_n.observe(request.n)
        self.request_params_max_tokens.observe(request.max_tokens)
        self.request_queue_time.observe(request.queue_s)
        self.request_prefill_time.observe(request.prefill_s)
        self.request_decode_time.observe(request.decode_s)
        self.request_inference_time.observe(request.inference_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
