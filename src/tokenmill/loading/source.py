"""Turns what the user named (nothing, a path, an installed model's short name, a hub id, a preset) into a
checkpoint to load."""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.errors import ModelLoadError
from tokenmill.loading.checkpoint import Checkpoint
from tokenmill.loading.default_model import default_model_path
from tokenmill.loading.packaged_models import packaged_model_names, packaged_model_path
from tokenmill.loading.presets import load_preset, preset_names
from tokenmill.loading.safetensors_checkpoint import SafetensorsCheckpoint, read_json

LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True)
class DummySource:
    """A config (from a preset or a config.json) whose weights are drawn at random."""

    name: str
    config: dict[str, Any]


def resolve_source(
    model: str | os.PathLike[str] | None, load_format: str = "auto"
) -> Checkpoint | DummySource:
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"load_format '{load_format}' is not one of {LOAD_FORMATS}")
    if load_format == "dummy":
        return _dummy_source(model)
    if model is None:
        return _gguf(default_model_path())
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix == ".gguf":
            return _gguf(path)
        raise ModelLoadError(f"{path} is a file but not a .gguf file; pass a model folder or a .gguf file")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            return _gguf(ggufs[0])
        return SafetensorsCheckpoint(path)
    packaged = packaged_model_path(str(model))
    if packaged is not None:
        return _gguf(packaged)
    if _looks_like_hub_id(str(model)):
        from tokenmill.loading.hub import download_from_hub

        return SafetensorsCheckpoint(download_from_hub(str(model)))
    raise ModelLoadError(_not_found_message(str(model)))


def _not_found_message(model: str) -> str:
    if load_preset(model) is not None:
        return (
            f"model '{model}' is a dummy-weight preset (real shapes, random weights): add --load-format "
            f"dummy, and --tokenizer smollm2 to give it text; installed models: {packaged_model_names()}"
        )
    return (
        f"model '{model}' not found: no such file or directory, not an installed model "
        f"({packaged_model_names()}) and not a hub id (org/name)"
    )


def _gguf(path: Path) -> Checkpoint:
    from tokenmill.loading.gguf_checkpoint import GGUFCheckpoint

    return GGUFCheckpoint(path)


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def _dummy_source(model: str | os.PathLike[str] | None) -> DummySource:
    if model is None:
        raise ModelLoadError(
            f"dummy weights need a preset ({', '.join(preset_names())}) or a config.json path"
        )
    preset = load_preset(str(model))
    if preset is not None:
        return DummySource(str(model), preset)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return DummySource(str(path), read_json(path))
    raise ModelLoadError(
        f"'{model}' is neither a preset ({', '.join(preset_names())}) nor a config.json file or folder"
    )
