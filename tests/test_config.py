"""EngineConfig: settings grouped by concern, each with one flat name for flags and keyword options."""

import dataclasses
import re

import pytest

from tokenmill.config import FLAT_OPTIONS, CudaGraphConfig, EngineConfig, KVCacheConfig, SchedulerConfig


def test_flat_names_reach_their_group() -> None:
    config = EngineConfig().with_options(
        kv_cache="contiguous", num_kv_blocks=7, scheduling_policy="priority", cuda_graph_logits=False, seed=3
    )
    assert config.kv == KVCacheConfig(mode="contiguous", num_blocks=7)
    assert config.scheduler == SchedulerConfig(policy="priority")
    assert config.graphs == CudaGraphConfig(logits=False)
    assert config.seed == 3
    changed = {"kv_cache": "contiguous", "num_kv_blocks": 7, "scheduling_policy": "priority"}
    changed |= {"cuda_graph_logits": False, "seed": 3}
    assert config.options() == {**EngineConfig().options(), **changed}


def test_every_flat_name_reads_back_what_it_set() -> None:
    default = EngineConfig()
    for name in FLAT_OPTIONS:
        value = default.option(name)
        assert EngineConfig().with_options(**{name: value}) == default, name


def test_unknown_and_invalid_options_are_named() -> None:
    with pytest.raises(ValueError, match=r"unknown engine option\(s\) \['max_seqs'\]"):
        EngineConfig().with_options(max_seqs=3)
    with pytest.raises(ValueError, match=r"EngineConfig.max_num_seqs must be at least 1, got 0"):
        EngineConfig().with_options(max_num_seqs=0)
    with pytest.raises(
        ValueError, match=r"EngineConfig.prefix_caching must be off unless kv_cache is 'paged'"
    ):
        EngineConfig().with_options(kv_cache="none", prefix_caching=True)
    with pytest.raises(ValueError, match=r"EngineConfig.admission_headroom must be 0 unless admission"):
        EngineConfig().with_options(admission_headroom=0.5)
    with pytest.raises(ValueError, match=r"EngineConfig.overlap_decode must be off unless cuda_graphs"):
        EngineConfig().with_options(cuda_graphs=False, overlap_decode=True)
    with pytest.raises(ValueError, match=r"prefill_chunk_size must be unset when chunked_prefill"):
        EngineConfig().with_options(chunked_prefill=False, prefill_chunk_size=16)
    with pytest.raises(ValueError, match=r"gguf_activations must be .float32. unless quantization"):
        EngineConfig().with_options(quantization="none", gguf_activations="int8")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_num_seqs": "4"}, "max_num_seqs must be an integer or None, got '4'"),
        ({"block_size": 2.5}, "block_size must be an integer, got 2.5"),
        ({"seed": "x"}, "seed must be an integer, got 'x'"),
        ({"num_kv_blocks": True}, "num_kv_blocks must be an integer or None, got True"),
        ({"cuda_graphs": 1}, "cuda_graphs must be a bool or None, got 1"),
        ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization must be a number, got '0.5'"),
        (
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": "4"}},
            "num_speculative_tokens must be an integer or None, got '4'",
        ),
    ],
)
def test_option_types_are_checked_before_their_values(options: dict[str, object], message: str) -> None:
    """A value of the wrong type is named with its setting, not left to fail a comparison (or the model's
    loading) later."""
    with pytest.raises(ValueError, match=f"EngineConfig.{re.escape(message)}"):
        EngineConfig().with_options(**options)
    config = EngineConfig().with_options(gpu_memory_utilization=1, max_num_seqs=4)  # an int is a number
    assert config.kv.gpu_memory_utilization == 1 and config.scheduler.max_num_seqs == 4


@pytest.mark.parametrize(
    "options",
    [
        {"num_speculative_tokens": 4},
        {"speculative_config": {"num_speculative_tokens": 4}},
        {"prompt_lookup_max": 8},
        {"speculative_disable_by_batch_size": 3},
    ],
)
def test_speculative_settings_without_a_method_are_refused(options: dict[str, object]) -> None:
    """As vLLM refuses them: they would otherwise be ignored, speculation staying off."""
    with pytest.raises(ValueError, match="must be left unset without a speculative method"):
        EngineConfig().with_options(**options)
    method = {"speculative_method": "ngram"}
    if "speculative_config" in options:
        method = {"speculative_config": {"method": "ngram", **options["speculative_config"]}}  # type: ignore[dict-item]
        options = {}
    assert EngineConfig().with_options(**options, **method).speculative.method == "ngram"


def test_groups_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig().kv.block_size = 8  # type: ignore[misc]
