"""``IncrementalDetokenizer``: turns generated token ids into text pieces as soon as the text is final.

A token's text can depend on its neighbours: byte-level BPE splits one character's UTF-8 bytes over several
tokens, and some SentencePiece decoders (Llama 2's) drop the leading space of the first token they see, so
a token decoded alone can lose its space. So each push decodes
a short window: the tokens of the previously emitted piece (context) plus the tokens not yet emitted, and
returns what the window's text has beyond the context's text. Text is held back while it ends in U+FFFD (an
incomplete character) and while it ends inside a run of SentencePiece byte tokens (the decoder turns a
whole run into U+FFFD if any byte of it is invalid). The window stays a few tokens long, so a push costs
O(1) in the length of the sequence.

``spaces_between_special_tokens=False`` (with ``skip_special_tokens=False``) is vLLM's: an added token
right after another generated one adds exactly its own text, without the separator a tokenizer's decoder
may put between tokens (a WordPiece decoder's space, say); the window restarts at it.
"""

from collections.abc import Sequence
from functools import cached_property

from tokenmill.tokenizer.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded in front of the first output tokens, e.g. so a leading space is kept.
_PROMPT_CONTEXT_TOKENS = 5
# A run of byte tokens longer than this (text spelled out byte by byte, e.g. CJK in a 32k SentencePiece
# vocabulary) is streamed at character boundaries instead of held to its end. The price: should a bad byte
# come later in such a run, the one-shot decode turns the whole run into U+FFFD, while the characters
# already streamed stay as they were.
_MAX_HELD_BYTE_RUN = 16


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        """``prompt_ids`` are context only: the output text reads as their continuation. Without them the
        pieces add up to ``tokenizer.decode(output_ids)``; with them, to the output's text as it reads after
        the prompt (which differs only where the decoder treats the first token specially, e.g. a
        SentencePiece tokenizer that strips the leading space of the first token)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._joins_added_tokens = not (skip_special_tokens or spaces_between_special_tokens)
        # Whether the last output token was an added one (a prompt's last token does not count, as in vLLM).
        self._last_was_added = False
        self._window = self._prompt_context(self._kept(prompt_ids))
        self._read_offset = len(self._window)  # _window[:_read_offset] is context, the rest is pending
        self._context_text = self._decode(self._window)

    def push(self, new_ids: Sequence[int]) -> str:
        """Add generated ids; returns the text that became final (often "", while text is held back)."""
        if not self._joins_added_tokens:
            return self._push(new_ids)
        added = self.tokenizer.added_token_texts
        pieces: list[str] = []
        run: list[int] = []
        for token in new_ids:
            if token in added and self._last_was_added:
                pieces.append(self._push(run))
                pieces.append(self._restart_at(token, added[token]))
                run = []
            else:
                run.append(token)
            self._last_was_added = token in added
        pieces.append(self._push(run))
        return "".join(pieces)

    def _restart_at(self, token: int, text: str) -> str:
        """``text`` (an added token's own), after whatever the window still held; the window restarts at
        ``token``, the context of what follows."""
        held = self.flush()
        self._window = [token]
        self._read_offset = 1
        self._context_text = self._decode(self._window)
        return held + text

    def _push(self, new_ids: Sequence[int]) -> str:
        self._window.extend(self._kept(new_ids))
        if len(self._window) == self._read_offset:
            return ""
        text = self._decode(self._window)
        if (
            len(text) <= len(self._context_text)  # nothing new yet, e.g. a lone "▁" the decoder stripped
            or text.endswith(_REPLACEMENT_CHAR)
            or self._ends_in_held_byte_run()
        ):
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """Return all held-back text (at the end of generation), U+FFFD for incomplete characters included."""
        if len(self._window) == self._read_offset:
            return ""
        return self._emit(self._decode(self._window))

    def _emit(self, text: str) -> str:
        piece = text[len(self._context_text) :]
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        self._context_text = self._decode(self._window)
        return piece

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _kept(self, ids: Sequence[int]) -> list[int]:
        """``ids`` without the special tokens that decoding skips anyway, so they never widen the window."""
        if not self.skip_special_tokens:
            return list(ids)
        skipped = self.tokenizer.skipped_special_ids
        return [token for token in ids if token not in skipped]

    def _prompt_context(self, prompt_ids: list[int]) -> list[int]:
        """The last few prompt ids, reaching back to the start of a byte-token run the prompt ends in (the
        output may continue that run, and the decoder only reads a run correctly from its start)."""
        start = max(len(prompt_ids) - _PROMPT_CONTEXT_TOKENS, 0)
        while start > 0 and prompt_ids[start] in self._byte_ids and prompt_ids[start - 1] in self._byte_ids:
            start -= 1
        return prompt_ids[start:]

    @cached_property
    def _byte_ids(self) -> frozenset[int]:
        return self.tokenizer.byte_fallback_ids

    def _ends_in_held_byte_run(self) -> bool:
        if not self._byte_ids:
            return False
        run = 0
        for token in reversed(self._window):
            if token not in self._byte_ids:
                break
            run += 1
        return 0 < run <= _MAX_HELD_BYTE_RUN
