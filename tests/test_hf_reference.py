"""The disk cache of transformers' reference outputs (``hf_reference``): an entry is used only for the same
file, prompts, token count, stop ids and library versions; anything else changed recomputes it."""

from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

import hf_reference as module
from hf_reference import CACHE_ENV, HFOutput, HFReference, hf_reference

PROMPTS = {"a": [1, 2, 3], "b": [4]}


@pytest.fixture
def computed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[dict[str, list[int]]]:
    """The prompts of each call that reached transformers (stood in for here), the cache in ``tmp_path``."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    calls: list[dict[str, list[int]]] = []

    def compute(path: Path, prompts: dict[str, list[int]], new_tokens: int, eos: Any) -> HFReference:
        calls.append(prompts)
        config = LlamaConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=len(calls))
        outputs = {name: HFOutput(torch.randn(32), [*prompt, len(calls)]) for name, prompt in prompts.items()}
        return HFReference(config, outputs)

    monkeypatch.setattr(module, "_compute", compute)
    return calls


def test_a_stored_reference_is_returned_as_computed(computed: list[Any], tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF weights")
    first = hf_reference(path, PROMPTS, 8, (2,))
    again = hf_reference(path, PROMPTS, 8, (2,))
    assert len(computed) == 1
    assert again.config.to_dict() == first.config.to_dict()
    for name in PROMPTS:
        assert torch.equal(again.outputs[name].logits, first.outputs[name].logits)
        assert again.outputs[name].tokens == first.outputs[name].tokens


def test_any_changed_input_recomputes(
    computed: list[Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF weights")
    variants = [
        (PROMPTS, 8, (2,)),
        ({**PROMPTS, "b": [5]}, 8, (2,)),
        (PROMPTS, 16, (2,)),
        (PROMPTS, 8, (2, 3)),
    ]
    for variant in variants:
        hf_reference(path, *variant)
    assert len(computed) == 4
    for variant in variants:  # each one stored beside the others
        hf_reference(path, *variant)
    assert len(computed) == 4
    path.write_bytes(b"GGUF weight5")  # the same size, one byte changed
    hf_reference(path, *variants[0])
    assert len(computed) == 5
    monkeypatch.setattr(module, "version", lambda name: "99" if name == "transformers" else version(name))
    hf_reference(path, *variants[0])
    assert len(computed) == 6


def test_an_unreadable_entry_is_recomputed_and_off_stores_nothing(
    computed: list[Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF weights")
    hf_reference(path, PROMPTS, 8, (2,))
    [entry] = (tmp_path / "cache").iterdir()
    entry.write_bytes(entry.read_bytes()[:100])
    hf_reference(path, PROMPTS, 8, (2,))
    hf_reference(path, PROMPTS, 8, (2,))
    assert len(computed) == 2
    monkeypatch.setenv(CACHE_ENV, "off")
    hf_reference(path, PROMPTS, 8, (2,))
    hf_reference(path, PROMPTS, 8, (2,))
    assert len(computed) == 4 and [entry] == list((tmp_path / "cache").iterdir())
