"""The text of single tokens, special tokens included, cached: logprobs name every token they list."""

from functools import lru_cache

from tokenmill.tokenizer.tokenizer import Tokenizer

_CACHE_SIZE = 65536


class TokenTexts:
    """``token_texts(token_id)`` is that token decoded alone, without skipping special tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._decode = lru_cache(maxsize=_CACHE_SIZE)(self._decode_one)
        self.tokenizer = tokenizer

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id)
