"""Tokenizers built here for the tiny models: every one of their 384 ids decodes to readable text, so the
features that work on text (stop strings, bad words, detokenizing options) can be checked on a tiny random
model, whose outputs are then readable strings rather than stray bytes."""

import string
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RawTokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from tiny_models import VOCAB, save_tiny_model
from tokenmill.loading import LoadedModel, load_model

SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: the tiny configs' BOS 1 and EOS 2
_CHARACTERS = string.ascii_lowercase + string.ascii_uppercase + string.digits + " .,!?"
_SPACE = {" ": "Ġ"}  # how byte-level BPE writes the space byte in its vocabulary


def build_character_bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2's layout, "Ġ" for a space) of exactly ``VOCAB`` ids: the specials,
    single characters, then pairs of characters (merges) until the vocabulary is full."""
    vocab = {name: index for index, name in enumerate(SPECIALS)}
    for char in _CHARACTERS:
        vocab[_SPACE.get(char, char)] = len(vocab)
    merges: list[tuple[str, str]] = []
    pairs = ((a, b) for a in "etaoinsr hlcdu" for b in string.ascii_lowercase + " ")
    for first, second in (tuple(_SPACE.get(char, char) for char in pair) for pair in pairs):
        if len(vocab) == VOCAB:
            break
        vocab.setdefault(first + second, len(vocab))
        merges.append((first, second))
    raw = RawTokenizer(models.BPE(vocab, merges, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


# A plain chat template, so the chat route can be tried on the tiny model.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def save_tiny_text_model(folder: Path) -> Path:
    """The tiny Llama 3 model with the character tokenizer (and a chat template) beside it, as one model
    folder."""
    save_tiny_model("llama3", folder)
    tokenizer = build_character_bpe_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def text_model_fixtures(name: str) -> tuple[Any, Any, Any]:
    """For ``folder, model, hf_tokenizer = text_model_fixtures(...)`` in a test module: module-scoped
    fixtures of a tiny text model saved under ``name``, loaded by tokenmill (float32), and its tokenizer
    by transformers."""

    @pytest.fixture(scope="module")
    def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return save_tiny_text_model(tmp_path_factory.mktemp(name))

    @pytest.fixture(scope="module")
    def model(folder: Path) -> LoadedModel:
        return load_model(folder, dtype="float32")

    @pytest.fixture(scope="module")
    def hf_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
        return AutoTokenizer.from_pretrained(str(folder))

    return folder, model, hf_tokenizer
