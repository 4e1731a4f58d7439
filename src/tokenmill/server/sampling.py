"""From request bodies to ``SamplingParams``: OpenAI names and defaults in, validated engine params out."""

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from tokenmill.sampling_params import MAX_LOGPROBS, SamplingParams
from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    SamplingRequest,
)
from tokenmill.server.request_checks import check_request

# Sequences (prompts × n) one request may ask for: enough for batch clients, not a way to flood the engine.
MAX_SEQUENCES_PER_REQUEST = 256
_OPTIONAL_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)

NO_DEFAULTS: Mapping[str, Any] = MappingProxyType({})
_TOKEN_ID_KEY = re.compile(r"-?[0-9]+")  # as int() reads, less the spaces, "+" and "_" it also takes


def completion_params(
    body: CompletionRequest, num_prompts: int, defaults: Mapping[str, Any] = NO_DEFAULTS
) -> SamplingParams:
    """A completion request's ``SamplingParams``. ``defaults``: the generation config's (the engine's
    ``sampling_defaults``, by SamplingParams' names), for the fields the body leaves out (the same in
    :func:`chat_params` and :func:`make_params`)."""
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request(f"best_of must equal n ({body.n}) or be left out, got {body.best_of}", "best_of")
    check_sequence_count(body.n, num_prompts)
    echoed = body.logprobs if body.echo else None
    wanted = [count for count in (echoed, body.prompt_logprobs) if count is not None]
    prompt_logprobs = max(wanted) if wanted else None
    max_tokens = default_or_max_tokens(body, defaults)
    return make_params(
        body, defaults, max_tokens=max_tokens, logprobs=body.logprobs, prompt_logprobs=prompt_logprobs
    )


def default_or_max_tokens(
    body: CompletionRequest | GenerateRequest, defaults: Mapping[str, Any]
) -> int | None:
    """The ``max_tokens`` of a body whose field defaults to 16: None where the body leaves it out and the
    generation config has a default (``ServerContext.start`` fits that default to each prompt)."""
    if "max_tokens" not in body.model_fields_set and "max_tokens" in defaults:
        return None
    return body.max_tokens


def chat_params(body: ChatCompletionRequest, defaults: Mapping[str, Any] = NO_DEFAULTS) -> SamplingParams:
    check_sequence_count(body.n, 1)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise bad_request(
            f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {body.top_logprobs}", "top_logprobs"
        )
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return make_params(
        body, defaults, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=body.prompt_logprobs
    )


def check_sequence_count(n: int, num_prompts: int) -> None:
    if n * num_prompts > MAX_SEQUENCES_PER_REQUEST:
        raise bad_request(
            f"n ({n}) times the number of prompts ({num_prompts}) must be at most "
            f"{MAX_SEQUENCES_PER_REQUEST}",
            "n",
        )


def make_params(
    body: SamplingRequest, defaults: Mapping[str, Any] = NO_DEFAULTS, **fields: Any
) -> SamplingParams:
    """``SamplingParams`` from the body's shared fields (those it leaves out from ``defaults``, else
    SamplingParams' own) plus ``fields``; a bad value is a 400 naming it."""
    check_request(body)
    for name in _OPTIONAL_FIELDS:
        value = getattr(body, name)
        if value is None:
            value = defaults.get(name)
        if value is not None:
            fields[name] = value
    fields.update(
        n=body.n,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logit_bias=parse_logit_bias(body.logit_bias),
        allowed_token_ids=body.allowed_token_ids,
        bad_words=body.bad_words,
    )
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError, OverflowError) as exc:
        raise _param_error(str(exc)) from None


def parse_logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys, so as strings."""
    if raw is None:
        return None
    bad = next((key for key in raw if not _TOKEN_ID_KEY.fullmatch(key)), None)
    if bad is not None:
        message = f"logit_bias keys must be token ids (integers as strings), got {bad!r}"
        raise bad_request(message, "logit_bias")
    return {int(key): value for key, value in raw.items()}


def _param_error(message: str) -> APIError:
    # SamplingParams' messages start with the parameter's name: "top_p must be in (0, 1], got 2".
    first_word = message.split(" ", 1)[0]
    return bad_request(message, first_word if first_word.isidentifier() else None)
