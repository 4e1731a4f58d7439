"""``Tokenizer``: text to token ids and back, and chat templates, on top of a Hugging Face tokenizer.

Transformers is used for tokenization and chat templates only. This wrapper owns the BOS policy (the
checkpoint's own ``add_bos`` statement wins; a BOS is never doubled when the text already starts with one)
and turns OpenAI-style messages into what chat templates expect.
"""

from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, overload

import jinja2
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from tokenmill.errors import TokenizerError

# Encoded with and without special tokens to learn which ids the HF tokenizer puts around a text.
_PROBE_TEXT = "Hello"


class Tokenizer:
    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, *, add_bos: bool | None = None) -> None:
        """``add_bos``: whether the checkpoint says a BOS token starts every prompt (GGUF's
        ``tokenizer.ggml.add_bos_token``); None trusts what ``hf_tokenizer`` does by itself."""
        self.hf_tokenizer = hf_tokenizer
        self._prefix_ids, self._suffix_ids = self._special_affixes(add_bos)

    @classmethod
    def from_pretrained(cls, folder: Path, *, add_bos: bool | None = None) -> "Tokenizer":
        """Load the tokenizer files (tokenizer.json, tokenizer_config.json, ...) of a local model folder."""
        try:
            hf_tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as exc:  # transformers raises OSError, ValueError, JSON and Rust errors alike
            raise TokenizerError(f"{folder}: the tokenizer files could not be loaded: {exc}") from None
        return cls(hf_tokenizer, add_bos=add_bos)

    def _special_affixes(self, add_bos: bool | None) -> tuple[list[int], list[int]]:
        """The ids the HF tokenizer adds before and after a text, with the BOS set as ``add_bos`` says."""
        with_specials = self.hf_tokenizer.encode(_PROBE_TEXT, add_special_tokens=True)
        plain = self.hf_tokenizer.encode(_PROBE_TEXT, add_special_tokens=False)
        start = _find_sublist(with_specials, plain)
        if start is None:  # a post-processor that rewrites the text's ids: keep only its BOS, if any
            prefix = with_specials[:1] if with_specials[:1] == [self.bos_token_id] else []
            suffix: list[int] = []
        else:
            prefix, suffix = with_specials[:start], with_specials[start + len(plain) :]
        bos = self.bos_token_id
        if add_bos is not None and bos is not None:
            prefix = [token for token in prefix if token != bos]
            if add_bos:
                prefix = [bos, *prefix]
        return prefix, suffix

    @property
    def bos_token_id(self) -> int | None:
        return self.hf_tokenizer.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.hf_tokenizer.eos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.hf_tokenizer.pad_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the HF ``vocab_size`` leaves those out)."""
        return len(self.hf_tokenizer)

    @cached_property
    def all_special_ids(self) -> list[int]:
        return list(self.hf_tokenizer.all_special_ids)

    @cached_property
    def skipped_special_ids(self) -> frozenset[int]:
        """Ids that ``decode(..., skip_special_tokens=True)`` leaves out: the added tokens marked special."""
        added = self.hf_tokenizer.added_tokens_decoder
        return frozenset(token_id for token_id, token in added.items() if token.special)

    @cached_property
    def added_token_texts(self) -> dict[int, str]:
        """The added tokens (special or not, e.g. ``<|im_end|>``), each id with its own text."""
        return {
            token_id: str(token.content) for token_id, token in self.hf_tokenizer.added_tokens_decoder.items()
        }

    @cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of SentencePiece byte tokens ``<0x00>``..``<0xFF>`` (none in byte-level BPE vocabularies)."""
        found = set()
        for byte in range(256):
            name = f"<0x{byte:02X}>"
            token_id = self.hf_tokenizer.convert_tokens_to_ids(name)
            # An unknown name maps to the unk id, whose own name differs.
            if isinstance(token_id, int) and self.hf_tokenizer.convert_ids_to_tokens(token_id) == name:
                found.add(token_id)
        return frozenset(found)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf_tokenizer.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            ids: list[int] = self.hf_tokenizer.encode(text, add_special_tokens=False)
        except TypeError:  # what the Rust tokenizer says of text it cannot take, e.g. a lone surrogate
            raise TokenizerError(_untokenizable(text)) from None
        if not add_special_tokens:
            return ids
        prefix = self._prefix_ids
        if prefix and prefix[-1] == self.bos_token_id and ids[:1] == prefix[-1:]:
            prefix = prefix[:-1]  # the text brings its own BOS, as chat templates often do
        return [*prefix, *ids, *self._suffix_ids]

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token's text can hold (its vocabulary entry's length bounds it: a
        byte-level or SentencePiece entry has a character per byte or more): text longer than this many
        times a limit cannot fit in that many tokens."""
        return max(map(len, self.hf_tokenizer.get_vocab()), default=1)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # No clean-up of "tokenization spaces": the text is exactly what the model produced, and the
        # incremental detokenizer can reproduce it piece by piece.
        if self._rust_decoder is not None:
            return str(self._rust_decoder.decode(list(ids), skip_special_tokens=skip_special_tokens))
        text = self.hf_tokenizer.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )
        return str(text)

    @cached_property
    def _rust_decoder(self) -> Any:
        """The ``tokenizers`` object a fast tokenizer's ``decode`` ends in, when that is all it does (no
        clean-up asked, no subclass decoding its own way): the streaming detokenizer decodes twice per
        token, and the Python layers around it cost more than the decoding (H200 host, 64 rows: 1.2 of
        ~9 ms per step under the profiler)."""
        hf = self.hf_tokenizer
        backend = getattr(hf, "backend_tokenizer", None)
        plain = type(hf).decode is PreTrainedTokenizerBase.decode
        return backend if plain and type(hf)._decode is PreTrainedTokenizerFast._decode else None

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return list(self.hf_tokenizer.convert_ids_to_tokens(list(ids)))

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: Literal[False] = False,
        **kwargs: Any,
    ) -> str: ...

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tokenize: Literal[True],
        **kwargs: Any,
    ) -> list[int]: ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render OpenAI-style ``{"role", "content"}`` messages with the model's chat template; ``kwargs``
        go to the template (e.g. ``tools``, or ``chat_template`` to use another template). ``tokenize=True``
        returns ids, with a single BOS at most."""
        if not (self.has_chat_template or kwargs.get("chat_template")):
            raise TokenizerError(
                "this model has no chat template (its tokenizer files define none), so chat messages "
                "cannot be rendered; send a plain text prompt instead"
            )
        if not messages:
            raise TokenizerError("a chat needs at least one message; got none")
        conversation = [_flatten_message(message) for message in messages]
        try:
            rendered = self.hf_tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
            )
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"the model's chat template rejected the messages: {exc}") from None
        text = str(rendered)
        return self.encode(text) if tokenize else text


def _untokenizable(text: str) -> str:
    surrogate = next((i for i, char in enumerate(text) if "\ud800" <= char <= "\udfff"), None)
    if surrogate is None:
        return f"the text could not be tokenized: {text[:40]!r}"
    return (
        f"the text holds a lone surrogate, U+{ord(text[surrogate]):04X} at character {surrogate}: it is not "
        "valid Unicode, and no tokenizer takes it"
    )


def _find_sublist(haystack: list[int], needle: list[int]) -> int | None:
    for start in range(len(haystack) - len(needle) + 1):
        if haystack[start : start + len(needle)] == needle:
            return start
    return None


def _flatten_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``message`` whose content, if a list of OpenAI content parts, is joined into one string."""
    if not isinstance(message, Mapping) or "role" not in message:
        raise TokenizerError(f"chat message {message!r} is not an object with a 'role'")
    flattened = dict(message)
    if isinstance(message.get("content"), list):
        flattened["content"] = _join_text_parts(message["content"])
    return flattened


def _join_text_parts(parts: list[Any]) -> str:
    texts = []
    for part in parts:
        if not _is_text_part(part):
            raise TokenizerError(
                f"message content part {part!r} is not supported: only text parts "
                "({'type': 'text', 'text': ...}) can be sent to this model"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _is_text_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
