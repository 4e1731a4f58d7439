"""The CPU KV pool's default size: room for ``max_num_seqs`` sequences of ``max_model_len`` tokens, at most
2 GiB but never less than one full-length sequence; an explicit ``cpu_kv_cache_gib`` still wins; the
one-sequence commands (``tokenmill generate`` / ``chat``) size it for one sequence."""

from pathlib import Path

import pytest

from tokenmill.cache.kv_pool import sized_cpu_kv_budget
from tokenmill.cli import build_parser, engine_config_from
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.loading import LoadedModel, load_model

GIB = 2**30
# SmolLM2-135M in float32: 30 layers x 3 KV heads x 64 dims x 2 (K and V) x 4 bytes per token.
SMOLLM2_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 4


def test_the_default_budget_holds_max_num_seqs_full_sequences_up_to_2_gib() -> None:
    per_token, block = SMOLLM2_BYTES_PER_TOKEN, 16
    assert sized_cpu_kv_budget(per_token, block, 8192, 1) == 8192 * per_token  # 360 MiB: one sequence
    assert sized_cpu_kv_budget(per_token, block, 1024, 4) == 4 * 1024 * per_token
    capped = sized_cpu_kv_budget(per_token, block, 8192, 64)  # 22.5 GiB wanted
    assert capped <= 2 * GIB and capped > 2 * GIB - block * per_token and capped % (block * per_token) == 0
    assert sized_cpu_kv_budget(per_token, block, 100, 1) == 112 * per_token  # whole blocks: 7 x 16 tokens


def test_one_full_length_sequence_always_fits_even_above_the_cap() -> None:
    per_token = 2**20  # 1 MiB a token: 4096 tokens are 4 GiB
    assert sized_cpu_kv_budget(per_token, 16, 4096, 8) == 4 * GIB


@pytest.fixture(scope="module")
def tiny(tiny_llama_folder: Path) -> LoadedModel:
    return load_model(tiny_llama_folder, dtype="float32")


def _pool_tokens(loaded: LoadedModel, **options: object) -> int:
    engine = LLMEngine(EngineConfig().with_options(device="cpu", **options), loaded=loaded)
    return engine.kv_cache.pool_tokens


def test_the_engine_sizes_its_pool_from_the_model_and_the_limits(tiny: LoadedModel) -> None:
    assert _pool_tokens(tiny, max_model_len=256, max_num_seqs=3) == 3 * 256
    assert _pool_tokens(tiny, max_model_len=200, max_num_seqs=2) == 2 * 208  # 13 blocks of 16 each
    assert _pool_tokens(tiny, max_model_len=256, max_num_seqs=3, batching="sequential") == 256
    config = tiny.config  # an explicit budget wins: 1 MiB of this model's blocks
    per_block = 16 * config.num_layers * config.num_kv_heads * config.head_dim * 2 * 4
    assert _pool_tokens(tiny, max_num_seqs=3, cpu_kv_cache_gib=1 / 1024) == 2**20 // per_block * 16


def test_generate_and_chat_run_one_sequence_unless_told_otherwise() -> None:
    parser = build_parser()
    for argv in (["generate", "Hi"], ["chat"]):
        assert engine_config_from(parser.parse_args(argv)).scheduler.max_num_seqs == 1
    assert engine_config_from(parser.parse_args(["chat", "--max-num-seqs", "4"])).scheduler.max_num_seqs == 4
    default = EngineConfig().scheduler.max_num_seqs
    assert engine_config_from(parser.parse_args(["serve"])).scheduler.max_num_seqs == default
    assert EngineConfig().kv.cpu_kv_cache_gib is None  # sized, unless given
