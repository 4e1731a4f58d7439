"""Logprobs in OpenAI's two shapes (completions' parallel lists, chat's list of token objects) and vLLM's
``prompt_logprobs`` (one ``{token id: {logprob, rank, decoded_token}}`` per prompt position)."""

from collections.abc import Sequence

from tokenmill.outputs import RowLogprobs, position_logprobs
from tokenmill.server.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    LogprobOut,
    PromptLogprobsOut,
    TokenLogprob,
    TopLogprob,
)
from tokenmill.tokenizer.token_texts import TokenTexts

__all__ = [
    "LogprobTokens",
    "TokenTexts",
    "chat_logprobs",
    "completion_logprobs",
    "echo_logprobs",
    "prompt_logprobs_out",
    "text_length",
]


class LogprobTokens:
    """How logprobs name tokens: by their text, or (``as_ids``, vLLM's ``return_tokens_as_token_ids``) as
    ``"token_id:<id>"``. Text offsets and ``bytes`` always come from the text."""

    def __init__(self, token_texts: TokenTexts, as_ids: bool = False) -> None:
        self.text = token_texts
        self.as_ids = as_ids

    def name(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.text(token_id)


def text_length(token_ids: Sequence[int], token_texts: TokenTexts) -> int:
    """How many characters the tokens' texts (each decoded alone) add up to."""
    return sum(len(token_texts(token_id)) for token_id in token_ids)


def completion_logprobs(
    entries: Sequence[RowLogprobs], tokens: LogprobTokens, text_offset: int = 0
) -> CompletionLogprobs:
    """Generated tokens' logprobs; ``text_offset`` is where the first token's text starts."""
    out = CompletionLogprobs()
    for entry in entries:
        out.tokens.append(tokens.name(entry.token_id))
        out.token_logprobs.append(entry.logprob)
        out.top_logprobs.append(_top_dict(entry, tokens))
        out.text_offset.append(text_offset)
        text_offset += len(tokens.text(entry.token_id))
    return out


def echo_logprobs(
    prompt_ids: Sequence[int],
    prompt_entries: Sequence[RowLogprobs | None],
    tokens: LogprobTokens,
    num_top: int,
) -> CompletionLogprobs:
    """The prompt's part of an echoed completion's logprobs (``num_top`` alternatives each): the first
    token has none."""
    out = CompletionLogprobs()
    offset = 0
    for token_id, entry in zip(prompt_ids, prompt_entries, strict=False):
        out.tokens.append(tokens.name(token_id))
        out.token_logprobs.append(None if entry is None else entry.logprob)
        top = None if entry is None else _top_dict(entry._replace(top=entry.top[:num_top]), tokens)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(tokens.text(token_id))
    return out


def join_completion_logprobs(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    """``first``'s tokens then ``second``'s (whose offsets already count ``first``'s text)."""
    return CompletionLogprobs(
        text_offset=first.text_offset + second.text_offset,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        tokens=first.tokens + second.tokens,
        top_logprobs=first.top_logprobs + second.top_logprobs,
    )


def _top_dict(entry: RowLogprobs, tokens: LogprobTokens) -> dict[str, float]:
    # The sampled token is always listed, as vLLM does, even when it is not among the top ones.
    top = {tokens.name(token_id): logprob for token_id, logprob in entry.top}
    top.setdefault(tokens.name(entry.token_id), entry.logprob)
    return top


def chat_logprobs(entries: Sequence[RowLogprobs], tokens: LogprobTokens, num_top: int) -> ChatLogprobs:
    return ChatLogprobs(content=[_token_logprob(entry, tokens, num_top) for entry in entries])


def _token_logprob(entry: RowLogprobs, tokens: LogprobTokens, num_top: int) -> TokenLogprob:
    top = [
        TopLogprob(token=tokens.name(token_id), logprob=logprob, bytes=_utf8(tokens.text(token_id)))
        for token_id, logprob in entry.top[:num_top]
    ]
    token_id = entry.token_id
    return TokenLogprob(
        token=tokens.name(token_id),
        logprob=entry.logprob,
        bytes=_utf8(tokens.text(token_id)),
        top_logprobs=top,
    )


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def prompt_logprobs_out(
    entries: Sequence[RowLogprobs | None], token_texts: TokenTexts, num_top: int
) -> PromptLogprobsOut:
    """vLLM's ``prompt_logprobs``: per prompt position the prompt token and its ``num_top`` best rivals."""
    out: PromptLogprobsOut = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        found = position_logprobs(entry._replace(top=entry.top[:num_top]), token_texts)
        out.append({str(token_id): LogprobOut(**vars(logprob)) for token_id, logprob in found.items()})
    return out
