"""Checks a request passes before the engine queues it; each error names the parameter and the limit."""

import operator
from collections.abc import Sequence

from tokenmill.errors import TokenmillError
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import Tokenizer


class InvalidRequestError(TokenmillError, ValueError):
    """The request cannot be served as asked; the message names the parameter and the limit."""


def check_request_types(request_id: object, params: object) -> None:
    """A string id (an int 5 and a float 5.0 would be one key) and ``SamplingParams`` (or None)."""
    if not isinstance(request_id, str):
        raise InvalidRequestError(f"request_id must be a string, got {request_id!r}")
    if params is not None and not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"params must be a SamplingParams (or None), got {params!r}")


def check_priority(priority: int, priority_scheduling: bool) -> None:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
    if priority != 0 and not priority_scheduling:
        raise InvalidRequestError(
            f"Got priority {priority} but Priority scheduling is not enabled "
            "(set scheduling_policy='priority')"
        )


def prompt_token_ids(prompt: str | Sequence[int], tokenizer: Tokenizer | None, vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: pass prompt token ids instead of text")
        ids = tokenizer.encode(prompt)
    else:
        ids = [_token_id(t) for t in prompt]
    if not ids:
        raise InvalidRequestError("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids


def _token_id(token: object) -> int:
    """An integer token id as it is (numpy's integers too); a float, string or bool is refused, not read."""
    if isinstance(token, bool) or not hasattr(token, "__index__"):
        raise InvalidRequestError(f"prompt token ids must be integers, got {token!r}")
    return operator.index(token)


def resolve_max_tokens(
    prompt_len: int, params: SamplingParams, max_model_len: int, kv_capacity_tokens: int, has_tokenizer: bool
) -> int:
    """``params.max_tokens``, or what the context leaves when None; raises when the request cannot fit."""
    if prompt_len >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {prompt_len} tokens, which leaves no room to generate within the "
            f"context limit of {max_model_len} tokens"
        )
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) is "
            f"{prompt_len + max_tokens} tokens, beyond the context limit of {max_model_len} tokens"
        )
    if prompt_len + max_tokens > kv_capacity_tokens:
        raise InvalidRequestError(
            f"the request needs up to {prompt_len + max_tokens} tokens of KV cache, more than the whole "
            f"pool holds ({kv_capacity_tokens} tokens)"
        )
    if params.stop and not has_tokenizer:
        raise InvalidRequestError("stop strings need a tokenizer; this model has none")
    return max_tokens


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    for name, ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", list(params.logit_bias or {})),
        ("allowed_token_ids", params.allowed_token_ids or []),
    ):
        bad = [t for t in ids if not 0 <= int(t) < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"{name} holds token id {bad[0]}, outside the vocabulary [0, {vocab_size})"
            )
