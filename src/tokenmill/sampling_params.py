"""Per-request sampling parameters with vLLM / OpenAI semantics, validated on construction."""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmill.structured.params import StructuredOutputsParams

# Temperatures below this are treated as greedy (argmax), as in vLLM: dividing by them would overflow.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_ABS_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, int | float)) and not isinstance(value, bool)


def _require(ok: bool, name: str, requirement: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {requirement}, got {value!r}")


def _require_finite_in(name: str, value: object, low: float, high: float, requirement: str) -> None:
    ok = _is_number(value) and math.isfinite(value) and low <= value <= high  # type: ignore[arg-type,operator]
    _require(ok, name, requirement, value)


def _normalise_stop_token_ids(stop_token_ids: Sequence[int] | None) -> list[int]:
    """A list (None, as vLLM takes it, is none); the ids themselves are checked with the others."""
    if stop_token_ids is None:
        return []
    if isinstance(stop_token_ids, str | bytes) or not isinstance(stop_token_ids, Sequence):
        _require(False, "stop_token_ids", "a list of ids >= 0", stop_token_ids)
    return list(stop_token_ids)


def _normalise_allowed_token_ids(allowed: Sequence[int] | None) -> list[int] | None:
    """None (no restriction), or a non-empty list of ids >= 0 (checked against the vocabulary later)."""
    if allowed is None:
        return None
    requirement = "None or a non-empty list of token ids >= 0"
    ok = not isinstance(allowed, str | bytes) and isinstance(allowed, Sequence) and len(allowed) > 0
    _require(ok, "allowed_token_ids", requirement, allowed)
    for token_id in allowed:
        _require(_is_int(token_id) and token_id >= 0, "allowed_token_ids", requirement, allowed)
    return list(allowed)


def _normalise_bad_words(bad_words: Sequence[str] | None) -> list[str]:
    """A list of non-empty strings, each once (None is none); a lone string is refused, not split."""
    if bad_words is None:
        return []
    requirement = "a list of non-blank strings"
    ok = not isinstance(bad_words, str | bytes) and isinstance(bad_words, Sequence)
    _require(ok, "bad_words", requirement, bad_words)
    for word in bad_words:
        _require(isinstance(word, str) and word.strip() != "", "bad_words", requirement, bad_words)
    return list(dict.fromkeys(bad_words))


def _normalise_stop(stop: Sequence[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if not isinstance(stop, str | Sequence):
        _require(False, "stop", "a non-empty string or list of them", stop)
    strings = (stop,) if isinstance(stop, str) else tuple(stop)
    for text in strings:
        _require(isinstance(text, str) and text != "", "stop", "a non-empty string or list of them", stop)
    return strings


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request.

    ``temperature`` 0 means greedy; ``top_k`` 0 or -1 and ``top_p`` 1 disable those filters; ``min_p`` keeps
    tokens whose probability is at least ``min_p`` times the most likely token's. ``repetition_penalty``
    (HF semantics) applies over prompt and output tokens; ``presence_penalty`` / ``frequency_penalty``
    (OpenAI semantics) over output tokens only. ``max_tokens`` None means up to the context limit.
    ``min_tokens`` bans EOS and ``stop_token_ids`` until that many tokens were generated. The text stops
    before a ``stop`` string and leaves out the text of a stop token (EOS, ``stop_token_ids``) that ends it;
    ``include_stop_str_in_output`` keeps both. ``logprobs`` is the number of top alternatives returned
    besides the sampled token. ``structured_outputs`` constrains the output to a JSON schema, regex, choice
    or grammar; the logprobs of a constrained request are those of the constrained distribution (the model's
    logits with the tokens its grammar forbids masked out). ``allowed_token_ids`` restricts every step to
    those tokens (EOS too, unless listed); ``bad_words`` bans each word's token sequence (the last token,
    where the output so far ends with the others), as vLLM does; like logit bias and penalties, neither
    changes the logprobs reported (the model's, as vLLM v1 returns them). ``spaces_between_special_tokens``
    False joins consecutive special tokens without the separator a tokenizer's decoder may put between
    them (with ``skip_special_tokens`` False). ``speculative`` False opts the request out of the engine's
    speculative decoding (if it is on).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    # A single string is also a Sequence[str]; None is accepted too. Normalised to a tuple of strings.
    stop: Sequence[str] = ()
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    structured_outputs: StructuredOutputsParams | None = None
    speculative: bool = True

    def __post_init__(self) -> None:
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        self.allowed_token_ids = _normalise_allowed_token_ids(self.allowed_token_ids)
        self.bad_words = _normalise_bad_words(self.bad_words)
        self._validate_sampling()
        self._validate_penalties()
        self._validate_lengths()
        self._validate_outputs()
        self._validate_token_ids()
        _require(isinstance(self.speculative, bool), "speculative", "True or False", self.speculative)

    def _validate_sampling(self) -> None:
        _require(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1", self.n)
        _require_finite_in("temperature", self.temperature, 0.0, math.inf, "a finite number >= 0")
        _require_finite_in("top_p", self.top_p, 0.0, 1.0, "in (0, 1]")
        _require(self.top_p > 0.0, "top_p", "in (0, 1]", self.top_p)
        _require(_is_int(self.top_k) and self.top_k >= -1, "top_k", "-1, 0 (disabled) or >= 1", self.top_k)
        _require_finite_in("min_p", self.min_p, 0.0, 1.0, "in [0, 1]")
        _require(self.seed is None or _is_int(self.seed), "seed", "an integer or None", self.seed)

    def _validate_penalties(self) -> None:
        bound = MAX_ABS_PENALTY
        requirement = f"in [-{bound}, {bound}]"
        _require_finite_in("presence_penalty", self.presence_penalty, -bound, bound, requirement)
        _require_finite_in("frequency_penalty", self.frequency_penalty, -bound, bound, requirement)
        _require_finite_in(
            "repetition_penalty", self.repetition_penalty, 0.0, math.inf, "a finite number > 0"
        )
        _require(
            self.repetition_penalty > 0, "repetition_penalty", "a finite number > 0", self.repetition_penalty
        )

    def _validate_lengths(self) -> None:
        max_tokens = self.max_tokens
        ok_max = max_tokens is None or (_is_int(max_tokens) and max_tokens >= 1)
        _require(ok_max, "max_tokens", "an integer >= 1 or None", max_tokens)
        _require(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            "min_tokens",
            "an integer >= 0",
            self.min_tokens,
        )
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({max_tokens}), got {self.min_tokens}")

    def _validate_outputs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            ok = value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS)
            _require(ok, name, f"None or an integer in [0, {MAX_LOGPROBS}]", value)
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"):
            _require(isinstance(getattr(self, name), bool), name, "a bool", getattr(self, name))
        _require(
            isinstance(self.include_stop_str_in_output, bool),
            "include_stop_str_in_output",
            "a bool",
            self.include_stop_str_in_output,
        )
        structured = self.structured_outputs
        _require(
            structured is None or isinstance(structured, StructuredOutputsParams),
            "structured_outputs",
            "a StructuredOutputsParams or None",
            structured,
        )

    def _validate_token_ids(self) -> None:
        for token_id in self.stop_token_ids:
            _require(
                _is_int(token_id) and token_id >= 0,
                "stop_token_ids",
                "a list of ids >= 0",
                self.stop_token_ids,
            )
        if self.logit_bias is None:
            return
        _require(isinstance(self.logit_bias, dict), "logit_bias", "a dict {token id: bias}", self.logit_bias)
        bound = MAX_ABS_LOGIT_BIAS
        for token_id, bias in self.logit_bias.items():
            _require(_is_int(token_id) and token_id >= 0, "logit_bias", "keyed by token ids >= 0", token_id)
            _require_finite_in("logit_bias", bias, -bound, bound, f"values in [-{bound:g}, {bound:g}]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def banned_token_ids(self, num_output_tokens: int, eos_token_ids: Sequence[int]) -> list[int]:
        """Token ids to ban at the next step so that no stop/EOS token ends the output before min_tokens."""
        if num_output_tokens >= self.min_tokens:
            return []
        eos = [] if self.ignore_eos else list(eos_token_ids)
        return sorted(set(self.stop_token_ids) | set(eos))
