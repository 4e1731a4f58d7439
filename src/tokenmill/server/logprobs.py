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

__all__ = ["TokenTexts", "chat_logprobs", "completion_logprobs", "echo_logprobs", "prompt_logprobs_out"]


def completion_logprobs(
    entries: Sequence[RowLogprobs], token_texts: TokenTexts, text_offset: int = 0
) -> CompletionLogprobs:
    """Generated tokens' logprobs; ``text_offset`` is where the first token's text starts."""
    out = CompletionLogprobs()
    for entry in entries:
        text = token_texts(entry.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(entry.logprob)
        out.top_logprobs.append(_top_dict(entry, token_texts))
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out


def echo_logprobs(
    prompt_ids: Sequence[int],
    prompt_entries: Sequence[RowLogprobs | None],
    token_texts: TokenTexts,
    num_top: int,
) -> CompletionLogprobs:
    """The prompt's part of an echoed completion's logprobs (``num_top`` alternatives each): the first
    token has none."""
    out = CompletionLogprobs()
    offset = 0
    for token_id, entry in zip(prompt_ids, prompt_entries, strict=False):
        text = token_texts(token_id)
        out.tokens.append(text)
        out.token_logprobs.append(None if entry is None else entry.logprob)
        top = None if entry is None else _top_dict(entry._replace(top=entry.top[:num_top]), token_texts)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def join_completion_logprobs(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    shift = (first.text_offset[-1] + len(first.tokens[-1])) if first.tokens else 0
    return CompletionLogprobs(
        text_offset=first.text_offset + [offset + shift for offset in second.text_offset],
        token_logprobs=first.token_logprobs + second.token_logprobs,
        tokens=first.tokens + second.tokens,
        top_logprobs=first.top_logprobs + second.top_logprobs,
    )


def _top_dict(entry: RowLogprobs, token_texts: TokenTexts) -> dict[str, float]:
    # The sampled token is always listed, as vLLM does, even when it is not among the top ones.
    top = {token_texts(token_id): logprob for token_id, logprob in entry.top}
    top.setdefault(token_texts(entry.token_id), entry.logprob)
    return top


def chat_logprobs(entries: Sequence[RowLogprobs], token_texts: TokenTexts, num_top: int) -> ChatLogprobs:
    return ChatLogprobs(content=[_token_logprob(entry, token_texts, num_top) for entry in entries])


def _token_logprob(entry: RowLogprobs, token_texts: TokenTexts, num_top: int) -> TokenLogprob:
    text = token_texts(entry.token_id)
    top = [
        TopLogprob(token=token_texts(token_id), logprob=logprob, bytes=_utf8(token_texts(token_id)))
        for token_id, logprob in entry.top[:num_top]
    ]
    return TokenLogprob(token=text, logprob=entry.logprob, bytes=_utf8(text), top_logprobs=top)


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
