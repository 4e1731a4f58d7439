"""The GGUF tokenizer cache (``loading/gguf_tokenizer.py``) against transformers' own conversion of the
file: converted once, read back with the same encodings, decodings, special tokens and chat template, and
a damaged entry converted again; and the properties of a conversion that transformers' versions broke, each
against an independent reference (GPT-2's byte map, the file's own BOS key, a naive SentencePiece BPE)."""

from itertools import pairwise
from pathlib import Path
from typing import Any

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


def _gpt2_byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable bytes stand for themselves, the other 68 take the
    characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    mapping = {chr(byte): byte for byte in printable}
    mapping.update({chr(256 + index): byte for index, byte in enumerate(others)})
    return mapping


def test_a_byte_level_decoder_wrapped_in_sentencepiece_steps_is_made_plain(smollm2) -> None:  # type: ignore[no-untyped-def]
    """transformers 5.17's GGUF conversion of SmolLM2 wraps ByteLevel in ByteFallback / Fuse / Replace:
    llguidance then reads 'Ġ' as two bytes instead of a space and masks refuse every space-led token.
    After ``plain_byte_level_decoder`` the grammar engine's bytes of every token are GPT-2's byte map of
    the vocabulary strings, and decoded text is unchanged."""
    from copy import deepcopy

    from llguidance.hf import from_tokenizer
    from tokenizers import decoders

    from tokenmill.loading.gguf_tokenizer import plain_byte_level_decoder

    tokenizer = deepcopy(smollm2.tokenizer.hf_tokenizer)
    tokenizer.backend_tokenizer.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("\u2581", " "), decoders.ByteLevel()]
    )
    ids = list(range(0, len(tokenizer), 97))
    decoded_before = [tokenizer.decode([token]) for token in ids]
    byte_of = _gpt2_byte_of_char()
    vocabulary = tokenizer.convert_ids_to_tokens(ids)
    expected = [bytes(byte_of[char] for char in piece) for piece, token in zip(vocabulary, ids, strict=True)]
    special = set(tokenizer.all_special_ids)
    regular = [index for index, token in enumerate(ids) if token not in special]
    misread = from_tokenizer(tokenizer)
    assert any(misread.decode_bytes([ids[i]]) != expected[i] for i in regular)  # the failure is real

    plain_byte_level_decoder(tokenizer)
    read = from_tokenizer(tokenizer)
    assert [read.decode_bytes([ids[i]]) for i in regular] == [expected[i] for i in regular]
    assert [tokenizer.decode([token]) for token in ids] == decoded_before


def test_other_decoders_are_left_alone() -> None:
    """A sentencepiece tokenizer (Metaspace, a Sequence decoder ending in Strip) keeps its decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tokenmill.loading.gguf_tokenizer import plain_byte_level_decoder

    backend = Tokenizer(models.BPE({"\u2581a": 0, "b": 1, "<unk>": 2}, [], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    before = tokenizer.backend_tokenizer.decoder.__getstate__()
    plain_byte_level_decoder(tokenizer)
    assert tokenizer.backend_tokenizer.decoder.__getstate__() == before


GEMMA3_TEXTS = [
    "user",
    "Hello world",
    "The capital of France is Paris.",
    "Tokenization of unbelievable words, naturally!",
    "机器学习 émoji 🤖",
]


@pytest.fixture(scope="module")
def gemma3_hf(gemma3_gguf_path: Path) -> Any:
    return gguf_hf_tokenizer(gemma3_gguf_path)


def test_a_bos_is_added_as_the_file_states(
    smollm2_gguf_path: Path, gemma3_gguf_path: Path, gemma3_hf: Any
) -> None:
    """transformers' conversions disagree with the files on the BOS from version to version (4.x added one
    to SmolLM2's, whose file refuses it; 5.18-5.20 none to Gemma 3's, whose file asks for it). The file's
    ``tokenizer.ggml.add_bos_token`` is the reference."""
    from copy import deepcopy

    from tokenmill.loading.gguf_file import GGUFFile
    from tokenmill.loading.gguf_tokenizer import bos_as_stated

    smollm2_hf = gguf_hf_tokenizer(smollm2_gguf_path)
    for path, tokenizer in [(smollm2_gguf_path, smollm2_hf), (gemma3_gguf_path, gemma3_hf)]:
        stated = GGUFFile(path).metadata["tokenizer.ggml.add_bos_token"]
        plain = tokenizer.encode("Hi", add_special_tokens=False)
        assert tokenizer.encode("Hi") == [tokenizer.bos_token_id] * stated + plain, path.name
    flipped = deepcopy(smollm2_hf)
    flipped.add_bos_token = True  # as transformers 4.x converted it
    bos = flipped.bos_token_id
    assert flipped.encode("Hi")[:1] == [bos]
    assert bos_as_stated(flipped, True).encode("Hi")[:1] == [bos]
    assert bos_as_stated(flipped, False).encode("Hi") == smollm2_hf.encode("Hi", add_special_tokens=False)


def test_gemma3_text_is_split_as_sentencepiece_bpe_merges_it(gemma3_gguf_path: Path, gemma3_hf: Any) -> None:
    """Gemma 3's GGUF vocabulary is SentencePiece BPE: the pieces the model was trained on are the merges
    its scores rank. transformers up to 5.17 converted it as Unigram ('user' -> 'us' 'er') and read
    tokenmill's cached copy back as single characters; pyproject requires the first version that works."""
    from tokenmill.loading.gguf_file import GGUFFile

    metadata = GGUFFile(gemma3_gguf_path).metadata
    tokens, scores = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.scores"]
    normal_or_byte = {1, 6}  # llama.cpp token types that text is made of (no control or user-defined)
    pieces = {
        token: (token_id, scores[token_id])
        for token_id, token in enumerate(tokens)
        if metadata["tokenizer.ggml.token_type"][token_id] in normal_or_byte
    }
    for text in GEMMA3_TEXTS:
        assert gemma3_hf.encode(text, add_special_tokens=False) == _sentencepiece_bpe(text, pieces), text
    turn = "<start_of_turn>"
    assert gemma3_hf.encode(turn, add_special_tokens=False) == [tokens.index(turn)]


def _sentencepiece_bpe(text: str, pieces: dict[str, tuple[int, float]]) -> list[int]:
    """llama.cpp's SentencePiece BPE, naively: spaces become '▁', the text starts as characters, and the
    adjacent pair whose joined piece scores highest (the leftmost of equals) merges until none is a piece;
    a character outside the vocabulary is its UTF-8 byte tokens."""
    symbols = list(text.replace(" ", "\u2581"))
    while True:
        joinable = [
            (pieces[left + right][1], -index)
            for index, (left, right) in enumerate(pairwise(symbols))
            if left + right in pieces
        ]
        if not joinable:
            break
        index = -max(joinable)[1]
        symbols[index : index + 2] = [symbols[index] + symbols[index + 1]]
    ids: list[int] = []
    for symbol in symbols:
        if symbol in pieces:
            ids.append(pieces[symbol][0])
        else:
            ids.extend(pieces[f"<0x{byte:02X}>"][0] for byte in symbol.encode())
    return ids
