"""Turning a sequence's sampled tokens into text: incremental detokenization and stop strings.

Stop strings are matched on the text, not on tokens, since one can span several tokens. Text that
could still be the beginning of a stop string is held back from the stream until it is decided, so
streamed pieces always add up to the final text.
"""

from collections.abc import Sequence

from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer


class StopStringDetokenizer:
    """One sequence's text so far, held back where a stop string may still begin."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        prompt_ids: Sequence[int],
        stop: Sequence[str],
        skip_special_tokens: bool = True,
    ) -> None:
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
            if tokenizer is not None
            else None
        )
        self.stop = tuple(stop)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.num_released = 0

    def append(self, token_ids: Sequence[int], check_stop: bool = True) -> str | None:
        """Add tokens' text; returns the stop string it now contains (text cut before it), if any."""
        if self.detokenizer is None:
            return None
        searched_from = max(0, len(self.text) - self.holdback)
        self.text += self.detokenizer.push(token_ids)
        return self._cut_at_stop(searched_from) if check_stop else None

    def finish(self) -> None:
        if self.detokenizer is not None:
            self.text += self.detokenizer.flush()

    def release(self, finished: bool) -> str:
        """The text not yet handed out that is final: all of it once finished, else all but what might
        begin a stop string."""
        end = len(self.text) if finished else max(self.num_released, len(self.text) - self.holdback)
        piece = self.text[self.num_released : end]
        self.num_released = end
        return piece

    def _cut_at_stop(self, searched_from: int) -> str | None:
        found: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.text.find(stop, searched_from)
            if index != -1 and (found is None or index < found[0]):
                found = (index, stop)
        if found is None:
            return None
        self.text = self.text[: found[0]]
        return found[1]
