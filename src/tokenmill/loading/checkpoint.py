"""A checkpoint as the model loader sees it: a Hugging Face-style config, a stream of HF-named tensors,
and a tokenizer. Each on-disk format (safetensors folder, GGUF file) implements this."""

from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tokenmill.tokenizer import Tokenizer


class Checkpoint(ABC):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.current_file = path  # the file ``weights()`` is reading now, for error messages

    @property
    def config_file(self) -> Path:
        """Where the config comes from, for error messages."""
        return self.path

    @abstractmethod
    def hf_config(self) -> dict[str, Any]:
        """The model config as a Hugging Face ``config.json`` dict (with ``architectures``)."""

    @abstractmethod
    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors under their Hugging Face names, one at a time, so no second full copy is held."""

    @abstractmethod
    def tokenizer(self) -> "Tokenizer | None":
        """The tokenizer that ships with the checkpoint, if any."""

    def generation_config(self) -> dict[str, Any]:
        """The checkpoint's ``generation_config.json`` as a dict; {} where it has none."""
        return {}

    def eos_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids beyond the config's (e.g. from ``generation_config.json``)."""
        return ()
