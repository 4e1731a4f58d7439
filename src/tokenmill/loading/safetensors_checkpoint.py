"""A Hugging Face model folder: ``config.json``, one or more ``*.safetensors`` files, tokenizer files and
optionally ``generation_config.json``."""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open

from tokenmill.errors import ModelLoadError
from tokenmill.generation_config import read_generation_config
from tokenmill.loading.checkpoint import Checkpoint

if TYPE_CHECKING:
    from tokenmill.tokenizer import Tokenizer

_INDEX_FILE = "model.safetensors.index.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


class SafetensorsCheckpoint(Checkpoint):
    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"{folder} has no config.json: not a Hugging Face model folder")
        self.files = self._weight_files()

    def _weight_files(self) -> list[Path]:
        index = self.path / _INDEX_FILE
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelLoadError(f"{index} has no 'weight_map' object")
            files = [self.path / name for name in sorted(set(weight_map.values()))]
        else:
            files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(
                f"{self.path} holds no *.safetensors weights (PyTorch .bin files are not read)"
            )
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists weight files that do not exist: {', '.join(missing)}")
        return files

    @property
    def config_file(self) -> Path:
        return self.path / "config.json"

    def hf_config(self) -> dict[str, Any]:
        return read_json(self.config_file)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self.files:
            self.current_file = file
            try:
                with safe_open(str(file), framework="pt", device="cpu") as reader:
                    for name in reader.keys():  # noqa: SIM118 (safe_open is not a mapping)
                        yield name, reader.get_tensor(name)
            except SafetensorError as exc:
                raise ModelLoadError(f"{file} is not a valid safetensors file: {exc}") from None

    def tokenizer(self) -> "Tokenizer | None":
        if not any((self.path / name).is_file() for name in _TOKENIZER_FILES):
            return None
        from tokenmill.tokenizer import Tokenizer

        return Tokenizer.from_pretrained(self.path)

    def generation_config(self) -> dict[str, Any]:
        return read_generation_config(self.path)

    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.generation_config().get("eos_token_id")
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, list) else (int(eos),)
