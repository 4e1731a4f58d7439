"""What a request's sequences are built from, worked out once at ``add_request``, and the per-request
checks and rules of the newer sampling fields (``cache_salt``, ``bad_words``, ``allowed_token_ids``, the
text of a stop token)."""

from collections.abc import Set
from dataclasses import dataclass

from tokenmill.bad_words import BadWordIds, bad_words_token_ids
from tokenmill.engine.input_checks import InvalidRequestError
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import FinishReason, Sequence
from tokenmill.structured.backend import CompiledGrammar
from tokenmill.tokenizer import Tokenizer


@dataclass(frozen=True)
class RequestSetup:
    """What each of a request's ``n`` sequences starts from."""

    prompt_ids: list[int]
    max_tokens: int  # resolved against the context limit
    priority: int
    cache_salt: str | None
    bad_words: BadWordIds
    grammar: CompiledGrammar | None


def check_cache_salt(cache_salt: object) -> None:
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise InvalidRequestError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}")


def encode_bad_words(
    params: SamplingParams, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Set[int]
) -> BadWordIds:
    """The token sequences ``params.bad_words`` bans (none without bad words), once they are checked to
    leave ``allowed_token_ids`` some token to sample."""
    words = _encode(params, tokenizer, vocab_size)
    _check_allowed_ids_leave_a_choice(params, words, eos_token_ids)
    return words


def _encode(params: SamplingParams, tokenizer: Tokenizer | None, vocab_size: int) -> BadWordIds:
    if not params.bad_words:
        return ()
    if tokenizer is None:
        raise InvalidRequestError("bad_words need a tokenizer; this model has none")
    try:
        words = bad_words_token_ids(params.bad_words, tokenizer)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
    outside = [token for word in words for token in word if not 0 <= token < vocab_size]
    if outside:
        raise InvalidRequestError(
            f"bad_words encode to token id {outside[0]}, outside the vocabulary [0, {vocab_size})"
        )
    return words


def _check_allowed_ids_leave_a_choice(
    params: SamplingParams, bad_words: BadWordIds, eos_token_ids: Set[int]
) -> None:
    """Refuse ``allowed_token_ids`` that leave no token to sample: all banned as one-token bad words, or,
    while ``min_tokens`` holds them back, all EOS or stop tokens."""
    if params.allowed_token_ids is None:
        return
    usable = set(params.allowed_token_ids) - {word[0] for word in bad_words if len(word) == 1}
    if not usable:
        raise InvalidRequestError("allowed_token_ids leaves no token to sample: bad_words bans them all")
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    if params.min_tokens > 0 and usable <= stops:
        raise InvalidRequestError(
            "allowed_token_ids leaves no token to sample before min_tokens: all are EOS or stop tokens"
        )


def ends_at_stop_token(seq: Sequence, token: int, num_later: int) -> bool:
    """Whether ``token`` is the stop token (EOS, one of ``stop_token_ids``) that ended ``seq`` and its text
    is left out, as vLLM leaves it out unless ``include_stop_str_in_output``."""
    params = seq.params
    if params.include_stop_str_in_output or num_later or seq.finish_reason is not FinishReason.STOP:
        return False
    return token in params.stop_token_ids or (token in seq.eos_token_ids and not params.ignore_eos)
