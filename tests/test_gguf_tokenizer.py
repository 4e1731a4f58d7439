"""The GGUF tokenizer cache (``loading/gguf_tokenizer.py``) against transformers' own conversion of the
file: converted once, read back with the same encodings, decodings, special tokens and chat template, and
a damaged entry converted again."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tokenmill.loading import gguf_tokenizer
from tokenmill.loading.gguf_tokenizer import cache_root, gguf_hf_tokenizer

TEXTS = [
    "Hello world",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "  leading spaces\tand tabs\n\n",
    "émoji 🤖 ünïcode 日本語",
    "<|im_start|>system\nYou are helpful.<|im_end|>",
    "",
]


def test_a_gguf_tokenizer_is_converted_once_and_read_back_identically(
    smollm2_gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    reference = AutoTokenizer.from_pretrained(smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name)
    conversions: list[str] = []
    original = AutoTokenizer.from_pretrained

    def counting(*args: object, **kwargs: object) -> object:
        if "gguf_file" in kwargs:
            conversions.append(str(kwargs["gguf_file"]))
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", counting)
    gguf_hf_tokenizer(smollm2_gguf_path)
    entries = list(cache_root().iterdir())
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").is_file()  # no staging folder left
    cached = gguf_hf_tokenizer(smollm2_gguf_path)
    assert conversions == [smollm2_gguf_path.name]
    for text in TEXTS:
        ids = reference(text)["input_ids"]
        assert cached(text)["input_ids"] == ids
        assert cached.decode(ids) == reference.decode(ids)
    assert cached.all_special_tokens == reference.all_special_tokens
    assert cached.chat_template == reference.chat_template
    assert len(cached) == len(reference)

    expected = reference("Hello world")["input_ids"]
    (entries[0] / "tokenizer.json").write_text("{ not json")
    assert gguf_hf_tokenizer(smollm2_gguf_path)("Hello world")["input_ids"] == expected
    assert len(conversions) == 2
    assert gguf_hf_tokenizer(smollm2_gguf_path)("Hello world")["input_ids"] == expected
    assert len(conversions) == 2  # the damaged entry was replaced by a whole one


def test_an_unwritable_cache_still_gives_the_tokenizer(
    smollm2_gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"  # a file where the cache's parent folder would be
    blocker.write_text("")
    monkeypatch.setattr(gguf_tokenizer, "cache_root", lambda: blocker / "tokenizers")
    with caplog.at_level("WARNING", logger=gguf_tokenizer.__name__):
        tokenizer = gguf_hf_tokenizer(smollm2_gguf_path)
    assert tokenizer.decode(tokenizer("Hello world")["input_ids"]) == "Hello world"
    assert "not writable" in caplog.text
    assert blocker.read_text() == ""
