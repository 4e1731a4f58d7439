"""``speculative_config``, the way vLLM takes speculative decoding's settings: one dict, its keys as
vLLM names them, read into the flat options of ``EngineConfig.speculative``."""

from typing import Any

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
