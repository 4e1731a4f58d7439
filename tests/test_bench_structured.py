"""``tokenmill bench structured`` at a tiny size on the real SmolLM2 (CPU): mask timings for both
backends, the correctness checks, the three end-to-end runs, and the report; a tokenizer-less model gets
the embedded one's tokenizer."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from engine_helpers import in_thread
from tokenmill.benchmarks.structured import command
from tokenmill.benchmarks.structured.schemas import NESTED, NESTED_INSTANCE, endless


def test_the_nested_schema_holds_its_instance_and_endless_never_completes() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(NESTED_INSTANCE, NESTED)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([NESTED_INSTANCE] * 3, endless(NESTED, min_items=4))


def test_bench_structured_reports_masks_checks_and_runs(tmp_path: Path) -> None:
    argv = [
        "--num-requests", "3", "--input-len", "8", "--output-len", "6", "--check-prompts", "1",
        "--check-tokens", "160", "--mask-batch-sizes", "1,3", "--no-progress", "--threads", "1",
        "--cpu-kv-cache-gib", "0.05", "--report-dir", str(tmp_path),
    ]  # fmt: skip
    assert in_thread(lambda: command.main(argv)) == 0
    report = (tmp_path / "structured.md").read_text()
    for backend in ("llguidance", "xgrammar"):
        assert f"structured correctness ({backend}) passed" in report
        assert f"all constrained ({backend})" in report
    assert "correctness passed" in report and "unconstrained again" in report
    payload = json.loads((tmp_path / "structured.json").read_text())
    assert [m["backend"] for m in payload["masks"]] == ["llguidance", "xgrammar"]
    assert all(set(m["steps"]) == {"1", "3"} for m in payload["masks"])
    # Every constrained request generated exactly its max_tokens: the same work as the unconstrained ones.
    assert {run["output_tokens"] for run in payload["runs"]} == {18}


def test_a_model_without_a_tokenizer_borrows_the_embedded_one(smollm2) -> None:  # type: ignore[no-untyped-def]
    bare = dataclasses.replace(smollm2, tokenizer=None, eos_token_ids=(128001, 128009))  # as a dummy Llama's
    loaded = command.with_tokenizer(bare, None)
    assert loaded.tokenizer is not None and loaded.tokenizer.vocab_size == 49152
    assert loaded.eos_token_ids == (loaded.tokenizer.eos_token_id,)
    assert command.with_tokenizer(smollm2, None) is smollm2
    tiny = dataclasses.replace(bare, config=dataclasses.replace(smollm2.config, vocab_size=384))
    with pytest.raises(ValueError, match="exceed the model's 384"):
        command.with_tokenizer(tiny, None)


def test_the_float32_reference_keeps_a_borrowed_tokenizer_and_eos(tiny_llama_folder) -> None:  # type: ignore[no-untyped-def]
    """A dummy model measured with another model's tokenizer: the float32 copy the checks run must end
    sequences on the same EOS ids (the reloaded copy would have its own vocabulary's)."""
    import dataclasses

    from tokenmill.benchmarks.correctness import float32_copy
    from tokenmill.config import EngineConfig
    from tokenmill.loading import load_model

    loaded = load_model(tiny_llama_folder, dtype="bfloat16")
    borrowed = dataclasses.replace(loaded, eos_token_ids=(7,), tokenizer=None)
    copy = float32_copy(EngineConfig(model=str(tiny_llama_folder)), borrowed)
    assert copy.dtype == torch.float32 and copy.eos_token_ids == (7,) and copy.tokenizer is None
    assert loaded.eos_token_ids != (7,)


def test_a_model_loaded_for_fewer_positions_serves_only_those(tiny_llama_folder) -> None:  # type: ignore[no-untyped-def]
    """An engine asked for more positions than its model was loaded for is refused by name (it started,
    and its first long sequence indexed past the rotary table: a device-side assert on CUDA); the checks'
    float32 copy is loaded for the positions the check needs, even from a float32 model loaded for fewer."""
    from tokenmill.benchmarks.correctness import float32_copy
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.loading import load_model

    short = load_model(tiny_llama_folder, dtype="float32", max_model_len=32)
    config = EngineConfig(model=str(tiny_llama_folder), max_model_len=64)
    assert short.position_limit() == 32 < short.config.max_position_embeddings
    with pytest.raises(ValueError, match="max_model_len 64 exceeds the model's limit of 32 positions"):
        LLMEngine(config, loaded=short)
    for loaded in (short, load_model(tiny_llama_folder, dtype="bfloat16", max_model_len=32)):
        copy = float32_copy(config, loaded)
        assert copy.dtype == torch.float32 and copy.position_limit() >= 64
    assert float32_copy(EngineConfig(model=str(tiny_llama_folder), max_model_len=32), short) is short
