"""Fast by default: what auto settings resolve to on a GPU and a CPU; the warm start; the start-up line."""

import dataclasses
from typing import Any

import pytest
import torch

from engine_helpers import engine_for, run_to_completion
from tokenmill import SamplingParams
from tokenmill.cli import build_parser
from tokenmill.config import FUSED_KERNEL_TOGGLES, EngineConfig
from tokenmill.config_flags import engine_options_from
from tokenmill.engine.hardware_defaults import Platform, resolve_config
from tokenmill.engine.warm_start import WARM_TOKENS, warm_up_waves
from tokenmill.loading import load_model
from tokenmill.runner.cuda_graphs import GRAPH_LOGITS_MAX_ROWS
from tokenmill.scheduler.output import ScheduledChunk

HOPPER = Platform(torch.device("cuda"), triton_kernels=True, programmatic_launch=True)
CPU = Platform(torch.device("cpu"), triton_kernels=False, programmatic_launch=False)


def resolved(platform: Platform, max_model_len: int = 4096, **options: Any) -> EngineConfig:
    return resolve_config(EngineConfig().with_options(**options), platform, max_model_len)


def test_a_gpu_with_triton_gets_the_fast_path_without_flags() -> None:
    config = resolved(HOPPER)
    assert config.kernels.attention_backend == "triton"
    assert all(config.option(name) is True for name in FUSED_KERNEL_TOGGLES)
    assert config.kernels.programmatic_launch is True
    assert config.graphs.enabled is True and config.graphs.overlap_decode is True
    assert config.scheduler.chunked_prefill is True and config.kv.prefix_caching is True
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (256, 8192)
    assert config.warm_start is True


def test_integer_gguf_inputs_where_auto_did_not_pack_the_model_are_refused_saying_so() -> None:
    """On a GPU ``quantization`` auto loads a .gguf file's weights as floats: integer inputs for packed
    projections cannot apply, and the error says that auto picked 'none' there (the config check said
    "unless quantization is 'gguf' (or 'auto', which may pick it)" of a config whose quantization was
    auto)."""
    config = EngineConfig().with_options(gguf_activations="int16")
    with pytest.raises(
        ValueError, match=r"'int16' needs packed GGUF .* 'auto' loaded this model as 'none' on cuda"
    ):
        resolve_config(config, HOPPER, 4096, loaded_quantization="none")
    with pytest.raises(ValueError, match=r"as 'none' on cpu .* device='cpu', or keep gguf_activations"):
        resolve_config(config, CPU, 4096, loaded_quantization="none")  # a float checkpoint, say
    assert resolved(HOPPER, gguf_activations="float32").quantization == "none"


def test_a_cpu_gets_the_reference_path_with_the_scheduling_features_on() -> None:
    config = resolved(CPU)
    assert config.kernels.attention_backend == "torch"  # no C compiler: the PyTorch reference
    assert resolved(dataclasses.replace(CPU, c_kernels=True)).kernels.attention_backend == "cpu"
    assert not any(config.option(name) for name in FUSED_KERNEL_TOGGLES)
    assert config.kernels.programmatic_launch is False
    assert config.graphs.enabled is False and config.graphs.overlap_decode is False
    assert config.scheduler.chunked_prefill is True and config.kv.prefix_caching is True
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (64, 2048)
    assert config.warm_start is False


def test_host_threads_are_one_on_a_gpu_unless_the_environment_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert resolved(HOPPER).host_threads == 1
    assert resolved(CPU).host_threads is None  # torch's own default
    assert resolved(HOPPER, host_threads=4).host_threads == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    assert resolved(HOPPER).host_threads is None
    with pytest.raises(ValueError, match="host_threads"):
        EngineConfig().with_options(host_threads=0)


def test_an_engine_sets_the_host_threads_it_resolves(tiny) -> None:  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    try:
        engine = engine_for(tiny, host_threads=1)
        assert torch.get_num_threads() == 1 and "; 1 host thread;" in engine.describe_startup()
    finally:
        torch.set_num_threads(before)


def test_explicit_settings_win_and_auto_follows_what_applies() -> None:
    torch_on_gpu = resolved(HOPPER, attention_backend="torch")
    assert not torch_on_gpu.graphs.enabled and not torch_on_gpu.graphs.overlap_decode
    assert not torch_on_gpu.kernels.fused_decode_rotary_kv  # part of the Triton decode kernel
    no_overlap = resolved(HOPPER, overlap_decode=False, fused_gemv=False, max_num_seqs=8)
    assert no_overlap.graphs.enabled and not no_overlap.graphs.overlap_decode
    assert not no_overlap.kernels.fused_gemv and no_overlap.kernels.fused_rms_norm
    assert no_overlap.scheduler.max_num_seqs == 8
    recompute = resolved(HOPPER, kv_cache="none")
    assert not recompute.scheduler.chunked_prefill and not recompute.kv.prefix_caching
    assert not recompute.graphs.enabled
    contiguous = resolved(CPU, kv_cache="contiguous")
    assert contiguous.scheduler.chunked_prefill and not contiguous.kv.prefix_caching
    # Without chunked prefill a whole prompt must fit one step: the budget grows to the model length.
    whole = resolved(CPU, max_model_len=8192, chunked_prefill=False)
    assert whole.scheduler.max_num_batched_tokens == 8192
    assert resolved(CPU, max_num_batched_tokens=512).scheduler.max_num_batched_tokens == 512


def test_speculation_guesses_more_tokens_per_step_with_ngram_on_a_gpu() -> None:
    """k auto: 24 n-gram guesses on a GPU (a batch-1 verification step is launch-bound there); on a CPU 3
    with packed GGUF weights (1 + 3 rows are one pass of their kernel), else 4, as for a draft model on a
    GPU; an explicit k and an explicit cutoff win."""

    def spec(platform: Platform, loaded: str = "none", **options: Any) -> tuple[int | None, int | None]:
        config = EngineConfig().with_options(**options)
        resolved_spec = resolve_config(config, platform, 4096, loaded_quantization=loaded).speculative
        return resolved_spec.num_speculative_tokens, resolved_spec.disable_by_batch_size

    assert spec(HOPPER, speculative_method="ngram") == (24, 2)
    assert spec(CPU, speculative_method="ngram") == (4, 8)
    assert spec(CPU, "gguf", speculative_method="ngram") == (3, 8)
    assert spec(CPU, "gguf", speculative_method="ngram", quantization="none") == (4, 8)
    assert spec(HOPPER, "gguf", speculative_method="ngram") == (24, 2)
    draft = {"speculative_method": "draft_model", "speculative_model": "llama-3.2-1b"}
    assert spec(HOPPER, **draft) == (4, 2)
    assert spec(CPU, "gguf", **draft) == (3, 8)
    assert spec(HOPPER, speculative_method="ngram", num_speculative_tokens=3) == (3, 2)
    assert spec(CPU, speculative_method="ngram", speculative_disable_by_batch_size=2) == (4, 2)
    with pytest.raises(ValueError, match="num_speculative_tokens is auto"):
        _ = EngineConfig().with_options(speculative_method="ngram").speculative.num_tokens


def test_the_cli_has_a_no_flag_for_each_default_on_feature() -> None:
    args = build_parser().parse_args(
        ["generate", "hi", "--no-prefix-caching", "--no-chunked-prefill", "--attention-backend", "auto"]
    )
    options = engine_options_from(args)
    assert options["prefix_caching"] is False and options["chunked_prefill"] is False
    assert options["attention_backend"] == "auto"
    assert "cuda_graphs" not in options  # unset flags keep the auto default


@pytest.fixture(scope="module")
def tiny(tiny_llama_folder):  # type: ignore[no-untyped-def]
    return load_model(tiny_llama_folder, dtype="float32")


def test_warm_up_waves_reach_chunk_continuations_mixed_steps_and_wide_decodes() -> None:
    waves = warm_up_waves(max_tokens_per_seq=256, token_budget=300, max_running=64, vocab_size=1000)
    prompts = [prompt for wave in waves for _, prompt, _ in wave]
    assert all(1 <= len(prompt) <= 256 - WARM_TOKENS for prompt in prompts)
    assert sum(len(prompt) for _, prompt, _ in waves[2]) > 300  # overflows one step: the last is chunked
    assert any(waves[3][0][1] == prompt for _, prompt, _ in waves[2])  # a repeat: a prefix-cache hit
    assert len(waves[-1]) > GRAPH_LOGITS_MAX_ROWS
    assert len({repr(params) for wave in waves for _, _, params in wave}) >= 5  # each sampling path
    assert warm_up_waves(max_tokens_per_seq=WARM_TOKENS, token_budget=64, max_running=4, vocab_size=10) == []


def test_a_warm_start_changes_no_output_and_leaves_no_trace(tiny) -> None:  # type: ignore[no-untyped-def]
    options = {"max_num_batched_tokens": 96, "max_model_len": 256, "max_num_seqs": 40}
    cold = engine_for(tiny, warm_start=False, **options)
    warm = engine_for(tiny, warm_start=True, **options)
    assert cold.warm_start is None and warm.warm_start is not None
    assert warm.scheduler_stats().prefix_cache_queries == 0 and warm.kv_cache_usage() == 0
    assert warm.kv_cache.manager.num_free_blocks == cold.kv_cache.manager.num_free_blocks  # nothing cached
    requests = {
        f"r{i}": (list(range(3 + i, 40 + 7 * i)), SamplingParams(temperature=0.8, seed=i, max_tokens=8))
        for i in range(4)
    }
    requests["greedy"] = (list(range(50, 90)), SamplingParams(temperature=0, max_tokens=8))
    expected = {rid: out.outputs[0].token_ids for rid, out in run_to_completion(cold, requests).items()}
    got = {rid: out.outputs[0].token_ids for rid, out in run_to_completion(warm, requests).items()}
    assert got == expected


def test_the_warm_start_runs_mixed_steps_and_chunk_continuations(tiny) -> None:  # type: ignore[no-untyped-def]
    engine = engine_for(tiny, warm_start=False, max_num_batched_tokens=96, max_model_len=256, max_num_seqs=40)
    steps: list[list[ScheduledChunk]] = []
    execute = engine.runner.execute
    engine.runner.execute = lambda chunks: (steps.append(list(chunks)), execute(chunks))[1]  # type: ignore[method-assign]
    report = engine.warm_up()
    assert report.num_steps == len(steps) and report.num_requests > GRAPH_LOGITS_MAX_ROWS
    continued = [c for step in steps for c in step if 0 < c.start < c.seq.num_prompt_tokens]
    mixed = [s for s in steps if {c.start >= c.seq.num_prompt_tokens for c in s} == {True, False}]
    widest_decode = max(sum(c.start >= c.seq.num_prompt_tokens for c in step) for step in steps)
    assert continued and mixed and widest_decode > GRAPH_LOGITS_MAX_ROWS


def test_the_startup_line_says_what_was_resolved(tiny) -> None:  # type: ignore[no-untyped-def]
    line = engine_for(tiny, attention_backend="auto").describe_startup()
    backend = "cpu" if Platform.detect(torch.device("cpu")).c_kernels else "torch"
    assert line.startswith(f"tokenmill ready on cpu; attention {backend}; fused kernels none; eager decode;")
    assert "prefix caching" in line and "chunked prefill" in line and "max_num_seqs 64" in line
    assert "tokens per step" in line and "started in" in line
