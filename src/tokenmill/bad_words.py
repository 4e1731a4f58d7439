"""``bad_words``: the token sequences a request may not generate, and the tokens that would complete one.

vLLM's rule, which this follows: each word is encoded as it stands (leading spaces dropped) and, for a
word in the middle of text, again after a space; the spaced form is banned too when it is as many tokens
as the bare one and starts with another token. A word of one token is banned at every step; a longer one
bans its last token only where the output so far (the generated tokens, not the prompt) ends with the
others, so the word can never be completed.
"""

from collections.abc import Sequence
from typing import Protocol

BadWordIds = tuple[tuple[int, ...], ...]


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def bad_words_token_ids(bad_words: Sequence[str], tokenizer: Encoder) -> BadWordIds:
    """The token sequences to ban for ``bad_words``; a word the tokenizer turns into no token is refused."""
    found: list[tuple[int, ...]] = []
    for word in bad_words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            raise ValueError(f"bad_words entry {word!r} encodes to no token, so it cannot be banned")
        found.append(bare)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and len(spaced) == len(bare) and spaced[0] != bare[0]:
            found.append(spaced)
    return tuple(found)


def completing_tokens(words: BadWordIds, output_ids: Sequence[int]) -> list[int]:
    """The tokens that would complete one of ``words`` if generated after ``output_ids``."""
    banned = []
    for word in words:
        prefix_length = len(word) - 1
        if prefix_length > len(output_ids):
            continue
        if prefix_length == 0 or list(output_ids[-prefix_length:]) == list(word[:-1]):
            banned.append(word[-1])
    return banned
