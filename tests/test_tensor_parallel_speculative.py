"""Speculative decoding under tensor parallelism on CPU (gloo): with either proposer, TP=2 and TP=3 engines
give the greedy tokens of a plain TP=1 engine under continuous batching and preemption, while guesses are
really made and accepted. The draft model runs whole on rank 0: its steps are never sent to the workers,
and it need not split over the ranks at all."""

import multiprocessing
import random
from pathlib import Path
from typing import Any

import pytest

from spec_workloads import repetitive_workload, run_workload
from tiny_models import save_tiny_model
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.loading import load_model
from tokenmill.speculative.draft_model import DraftModelProposer

WORKLOAD = repetitive_workload(random.Random(3), 6)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
BASE = {"device": "cpu", "max_num_seqs": 4, "num_kv_blocks": 64, "debug_checks": True}
TIGHT_POOL = {"block_size": 4, "num_kv_blocks": 14, "max_model_len": 64}  # preempts; the draft's pool too


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    saved = {}
    for name in ("gpt2", "llama-6h-1kv", "llama-6h-3kv"):
        saved[name] = tmp_path_factory.mktemp(name)
        save_tiny_model(name, saved[name])
    return saved


@pytest.fixture(scope="module")
def plain_tokens(folders: dict[str, Path]) -> dict[str, dict[str, list[int]]]:
    """Each model's greedy tokens for the workload from a TP=1 engine without speculation."""
    tokens = {}
    for name in ("gpt2", "llama-6h-1kv"):
        engine = LLMEngine(EngineConfig(model=str(folders[name])).with_options(**BASE))
        tokens[name] = run_workload(engine, WORKLOAD)
    return tokens


def _speculative_config(folders: dict[str, Path], draft: str | None) -> dict[str, Any]:
    if draft is None:
        return NGRAM
    return {"method": "draft_model", "model": str(folders[draft]), "num_speculative_tokens": 3}


def _count_calls(obj: Any, name: str, counts: dict[str, int], key: str) -> None:
    method = getattr(obj, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[key] += 1
        return method(*args, **kwargs)

    setattr(obj, name, counted)


@pytest.mark.parametrize(
    ("target", "tp", "draft", "options"),
    [
        pytest.param("gpt2", 2, None, TIGHT_POOL, id="gpt2-tp2-ngram-preempted"),
        # the draft's 3 KV heads do not split over 2 ranks: it runs whole on rank 0
        pytest.param("gpt2", 2, "llama-6h-3kv", {}, id="gpt2-tp2-llama-draft"),
        pytest.param("llama-6h-1kv", 3, None, {}, id="gqa-1kv-tp3-ngram"),
        pytest.param("llama-6h-1kv", 3, "llama-6h-1kv", TIGHT_POOL, id="gqa-1kv-tp3-self-draft-preempted"),
    ],
)
def test_speculative_tokens_match_one_plain_rank(
    folders: dict[str, Path],
    plain_tokens: dict[str, dict[str, list[int]]],
    target: str,
    tp: int,
    draft: str | None,
    options: dict[str, Any],
) -> None:
    config = EngineConfig(model=str(folders[target])).with_options(
        **{**BASE, **options},
        tensor_parallel_size=tp,
        speculative_config=_speculative_config(folders, draft),
    )
    engine = LLMEngine(config)
    calls = {"steps": 0, "sent": 0, "draft_steps": 0}
    try:
        assert engine.workers is not None
        _count_calls(engine.runner, "execute", calls, "steps")
        _count_calls(engine.workers.sender, "forward", calls, "sent")
        if draft is not None:
            assert isinstance(engine.proposer, DraftModelProposer)
            _count_calls(engine.proposer.runner, "logits", calls, "draft_steps")
        outputs = run_workload(engine, WORKLOAD)
        stats = engine.scheduler_stats()
        assert engine.kv_cache.manager.num_used_blocks == 0
    finally:
        engine.shutdown()
    assert outputs == plain_tokens[target]
    spec = stats.spec_decode
    assert spec.num_proposed > 0
    if draft is None:
        assert spec.num_accepted > 0
    elif draft == target:  # the whole draft computes what the sharded model does: every guess is kept
        assert spec.num_accepted == spec.num_proposed
    assert (stats.num_preemptions > 0) == (options == TIGHT_POOL)
    assert calls["sent"] == calls["steps"]  # one forward announced per target step, none per draft step
    assert (calls["draft_steps"] > 0) == (draft is not None)


def test_speculation_with_tensor_parallelism_is_configurable(folders: dict[str, Path]) -> None:
    """The old refusal is gone for both methods; a draft already loaded is refused (it is loaded on rank 0
    by name), before any worker starts."""
    for method in (NGRAM, _speculative_config(folders, "llama-6h-3kv")):
        config = EngineConfig().with_options(tensor_parallel_size=3, speculative_config=method)
        assert config.tensor_parallel_size == 3 and config.speculative.method == method["method"]
    draft = load_model(folders["llama-6h-3kv"], dtype="float32")
    config = EngineConfig(model=str(folders["gpt2"])).with_options(
        device="cpu",
        tensor_parallel_size=2,
        speculative_config={"method": "draft_model", "model": "given"},
    )
    with pytest.raises(ValueError, match=r"draft model.*pass them by name"):
        LLMEngine(config, draft=draft)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("tokenmill-tp")]
