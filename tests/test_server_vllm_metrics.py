"""Issue 19, vLLM's metric families under the ``tokenmill:`` prefix: parsed with prometheus_client's own
parser, each has vLLM's type and suffixes, and the per-request histograms add up to what the responses
said (usage token counts, n, max_tokens, number of requests); phases are non-negative and the inference
time is the prefill plus the decode time."""

from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_fixtures import MODEL, client_fixture, server_fixture  # noqa: F401
from tokenmill.server import ServerThread

HISTOGRAMS = [
    "iteration_tokens_total",
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_max_num_generation_tokens",
    "request_params_n",
    "request_params_max_tokens",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_inference_time_seconds",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
]


def _samples(
    server: ServerThread,
) -> tuple[dict[str, str], dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """(family name -> type, (sample name, labels) -> value)."""
    text = httpx.get(f"{server.base_url}/metrics").text
    types: dict[str, str] = {}
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return types, values


def _value(values: dict[Any, float], name: str) -> float:
    return sum(value for (sample, _), value in values.items() if sample == f"tokenmill:{name}")


def test_the_families_have_vllms_names_and_types(server: ServerThread) -> None:
    types, values = _samples(server)
    for name in HISTOGRAMS:
        family = f"tokenmill:{name}"
        assert types.get(family) == "histogram", (family, types.get(family))
    for name in ("prompt_tokens", "generation_tokens", "request_success", "num_preemptions"):
        assert types.get(f"tokenmill:{name}") == "counter"  # exposed as ..._total
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "cache_config_info"):
        assert types.get(f"tokenmill:{name}") == "gauge"
    (labels, value), *_ = [
        (dict(k[1]), v) for k, v in values.items() if k[0] == "tokenmill:cache_config_info"
    ]
    engine = server.app.state.context.engine
    assert value == 1 and labels["block_size"] == str(engine.config.kv.block_size)
    assert labels["capacity_tokens"] == str(engine.kv_cache.manager.capacity_tokens)


@pytest.mark.parametrize("stream", [False, True])
def test_per_request_histograms_add_up_to_the_responses(
    server: ServerThread, client: openai.OpenAI, stream: bool
) -> None:
    _, before = _samples(server)
    prompts, n, max_tokens = ["The capital of France is", "def add(a, b):"], 2, 5
    usage: Any
    if stream:
        chunks = list(
            client.completions.create(
                model=MODEL,
                prompt=prompts,
                n=n,
                max_tokens=max_tokens,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        usage = chunks[-1].usage
    else:
        usage = client.completions.create(model=MODEL, prompt=prompts, n=n, max_tokens=max_tokens).usage
    _, after = _samples(server)

    def grew(name: str) -> float:
        return _value(after, name) - _value(before, name)

    assert grew("request_prompt_tokens_count") == len(prompts)  # one observation per prompt
    assert grew("request_prompt_tokens_sum") == usage.prompt_tokens
    assert grew("request_generation_tokens_sum") == usage.completion_tokens
    assert grew("request_params_n_sum") == n * len(prompts)
    assert grew("request_params_max_tokens_sum") == max_tokens * len(prompts)
    assert grew("request_max_num_generation_tokens_sum") <= max_tokens * len(prompts)
    # Every token the requests computed went through some step.
    assert (
        grew("iteration_tokens_total_sum") >= usage.prompt_tokens + usage.completion_tokens - len(prompts) * n
    )
    phases = {
        name: grew(f"request_{name}_time_seconds_sum") for name in ("queue", "prefill", "decode", "inference")
    }
    assert all(value >= 0 for value in phases.values()), phases
    assert phases["inference"] == pytest.approx(phases["prefill"] + phases["decode"], abs=1e-6)
    assert grew("request_queue_time_seconds_count") == len(prompts)
