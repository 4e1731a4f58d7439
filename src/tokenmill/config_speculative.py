"""``EngineConfig.speculative`` (:class:`SpeculativeConfig`), and ``speculative_config``, the way vLLM
takes speculative decoding's settings: one dict, its keys as vLLM names them, read into its flat options."""

from dataclasses import dataclass
from typing import Any, Literal

from tokenmill.config_checks import require, require_at_least_one, require_choice, require_types

SpeculativeMethod = Literal["ngram", "draft_model"]

SPECULATIVE_CONFIG_KEYS: dict[str, str] = {
    "method": "speculative_method",
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_min": "prompt_lookup_min",
    "prompt_lookup_max": "prompt_lookup_max",
    "model": "speculative_model",
    "load_format": "speculative_load_format",
    "disable_by_batch_size": "speculative_disable_by_batch_size",
}


def speculative_options(speculative_config: dict[str, Any] | None) -> dict[str, Any]:
    """A vLLM-style ``speculative_config`` dict (keys as vLLM names them) as flat options; an unknown key
    is a ValueError."""
    if speculative_config is None:
        return {}
    if not isinstance(speculative_config, dict):
        raise ValueError(f"speculative_config must be a dict, got {speculative_config!r}")
    unknown = sorted(set(speculative_config) - set(SPECULATIVE_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"speculative_config has unknown key(s) {unknown}; known: {sorted(SPECULATIVE_CONFIG_KEYS)}"
        )
    options = {SPECULATIVE_CONFIG_KEYS[key]: value for key, value in speculative_config.items()}
    if options.get("speculative_model") is not None and "speculative_method" not in options:
        options["speculative_method"] = "draft_model"
    return options


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses up to ``num_speculative_tokens`` next tokens, the model
    checks them in one step, a rejection sampler keeps exactly its output distribution. ``ngram``: prompt
    lookup (what followed the last earlier occurrence of the output's last ``prompt_lookup_min`` to
    ``_max`` tokens); ``draft_model``: a smaller ``model`` with the same vocabulary. None: off."""

    method: SpeculativeMethod | None = None
    # None (auto): 24 for ngram on a GPU (a batch-1 verification step costs about the same for 5 or 31
    # tokens there: launch-bound); on the CPU 3 with packed GGUF weights (their kernel takes input rows
    # four at a time), else 4 (8 measured no better; a draft model's round grows with k).
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None  # draft_model: the draft (a short name, folder, .gguf or preset)
    load_format: str = "auto"  # draft_model: "dummy" for random weights of a preset
    # No guesses while this many sequences run (a large batch is compute-bound: verifying 1 + k tokens
    # each costs more than it saves). None (auto): 8 on CPU; 2 on a GPU, where only a batch-1
    # verification step runs in a CUDA graph.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        require_types(self, SPECULATIVE_CONFIG_KEYS)
        require(
            self.method in (None, "ngram", "draft_model"),
            "speculative_method",
            "None (off), 'ngram' or 'draft_model'",
            self.method,
        )
        require(
            self.num_speculative_tokens is None or 1 <= self.num_speculative_tokens <= 32,
            "num_speculative_tokens",
            "in [1, 32] (or None: auto)",
            self.num_speculative_tokens,
        )
        require(self.prompt_lookup_min >= 1, "prompt_lookup_min", "at least 1", self.prompt_lookup_min)
        require(
            self.prompt_lookup_max >= self.prompt_lookup_min,
            "prompt_lookup_max",
            f"at least prompt_lookup_min ({self.prompt_lookup_min})",
            self.prompt_lookup_max,
        )
        require(
            (self.method == "draft_model") == (self.model is not None),
            "speculative_model",
            "set exactly when speculative_method is 'draft_model'",
            self.model,
        )
        require_choice("speculative_load_format", self.load_format, ("auto", "dummy"))
        require_at_least_one("speculative_disable_by_batch_size", self.disable_by_batch_size)
        if self.method is None:
            for name, value in self._changed_method_settings():
                require(False, name, "left unset without a speculative method (ngram, draft_model)", value)

    def _changed_method_settings(self) -> list[tuple[str, object]]:
        """(flat name, value) of the settings only a method reads that differ from their defaults (vLLM
        refuses them without a method too)."""
        fields = SpeculativeConfig.__dataclass_fields__
        names = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "load_format")
        values = {name: getattr(self, name) for name in names}
        changed = [(name, value) for name, value in values.items() if value != fields[name].default]
        if self.disable_by_batch_size is not None:
            changed.append(("disable_by_batch_size", self.disable_by_batch_size))
        return [(SPECULATIVE_CONFIG_KEYS[name], value) for name, value in changed]

    @property
    def num_tokens(self) -> int:
        """``num_speculative_tokens`` as the engine resolved it for its hardware (auto: see above)."""
        if self.num_speculative_tokens is None:
            raise ValueError("num_speculative_tokens is auto until an engine resolves it for its device")
        return self.num_speculative_tokens
