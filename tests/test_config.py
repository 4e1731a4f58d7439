"""EngineConfig: settings grouped by concern, each with one flat name for flags and keyword options."""

import dataclasses

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


def test_groups_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig().kv.block_size = 8  # type: ignore[misc]
