"""Turning a sequence's sampled tokens into text: incremental detokenization and stop strings.

Stop strings are matched on the text, not on tokens, since one can span several tokens. The text ends
before the stop string, or after it with ``include_stop_str_in_output``; where several end in the same new
text, the one that ends first wins (as if the text had come one character at a time), ties going to the
first listed. A match must end in the text just added (a stop string completed while ``min_tokens`` held
the check off never stops the sequence later). Text that could still be the beginning of a stop string is
held back from the stream until it is decided (not needed when the stop string is kept), so streamed
pieces always add up to the final text.
"""

from collections.abc import Sequence

from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer


class StopStringDetokenizer:
    """One sequence's text so far, held back where a stop string may still begin."""

    def __init__(
        self, tokenizer: Tokenizer | None, prompt_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self.detokenizer = (
            IncrementalDetokenizer(
                tokenizer,
                prompt_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
            if tokenizer is not None
            else None
        )
        self.stop = tuple(params.stop)
        self.include_stop = params.include_stop_str_in_output
        longest = max((len(s) for s in self.stop), default=1)
        self.holdback = 0 if self.include_stop else longest - 1
        self.text = ""
        self.num_released = 0

    def append(self, token_ids: Sequence[int], check_stop: bool = True) -> str | None:
        """Add tokens' text; returns the stop string it now contains (text cut there), if any."""
        if self.detokenizer is None:
            return None
        new_from = len(self.text)
        self.text += self.detokenizer.push(token_ids)
        return self._cut_at_stop(new_from) if check_stop and len(self.text) > new_from else None

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

    def _cut_at_stop(self, new_from: int) -> str | None:
        """The stop string that ends first in ``text[new_from:]``; the text is cut at it."""
        found: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self.stop:
            start = self.text.find(stop, max(0, new_from - len(stop) + 1))
            if start != -1 and (found is None or start + len(stop) < found[0]):
                found = (start + len(stop), start, stop)
        if found is None:
            return None
        end, start, stop = found
        self.text = self.text[: end if self.include_stop else start]
        return stop
