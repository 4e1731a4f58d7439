"""The model's generation config (``generation_config.json``) as default sampling parameters, as vLLM takes
it. ``EngineConfig.generation_config``: "auto" reads the model's own file (a Hugging Face folder's; GGUF
files and dummy weights have none), "vllm" reads none (SamplingParams' own defaults), a folder reads that
folder's file. ``override_generation_config`` sets fields on top (None removes one). Only the sampling
fields below are taken; an explicit ``SamplingParams``, or a field a server request sends, wins.

No torch here: the command line checks these settings before anything heavy is imported."""

import json
import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.errors import ModelLoadError

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
OWN_DEFAULTS = "vllm"  # the option's value that turns the model's defaults off (vLLM's name for it)
# generation_config.json's name -> SamplingParams' name, for the fields vLLM takes as defaults.
SAMPLING_FIELDS: dict[str, str] = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# Each field's check and what it asks for (SamplingParams' ranges).
_REQUIREMENTS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "repetition_penalty": (lambda v: _is_finite(v) and v > 0, "a finite number > 0"),
    "temperature": (lambda v: _is_finite(v) and v >= 0, "a finite number >= 0"),
    "top_k": (lambda v: _is_int(v) and v >= -1, "an integer: -1 or 0 (off) or >= 1"),
    "top_p": (lambda v: _is_finite(v) and 0 < v <= 1, "a number in (0, 1]"),
    "min_p": (lambda v: _is_finite(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "max_new_tokens": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
}


def field_problem(name: str, value: object) -> str | None:
    """What ``value`` of the generation-config field ``name`` must be, where it is not; None where it is
    good (None itself is good: it means no default)."""
    check, requirement = _REQUIREMENTS[name]
    return None if value is None or check(value) else requirement


def option_problem(value: str) -> str | None:
    """What is wrong with ``generation_config``'s value ("auto", "vllm" or a folder holding the file), or
    None."""
    if value in ("auto", OWN_DEFAULTS):
        return None
    folder = Path(value).expanduser()
    if not folder.is_dir():
        return "no such folder"
    if not (folder / GENERATION_CONFIG_FILE).is_file():
        return f"the folder has no {GENERATION_CONFIG_FILE}"
    return None


def read_generation_config(folder: Path) -> dict[str, Any]:
    """``folder``'s generation_config.json as a dict; {} where the folder has none."""
    path = folder / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def sampling_defaults(
    config: "EngineConfig", model_file: Mapping[str, Any], model_source: str
) -> dict[str, Any]:
    """The default sampling parameters, by SamplingParams' names: the sampling fields of the generation
    config ``config.generation_config`` names (for "auto" ``model_file``, the file of the model loaded
    from ``model_source``), ``config.override_generation_config`` on top. A bad value in the file that the
    override does not replace is a ModelLoadError naming the file and the field."""
    override = config.override_generation_config or {}
    source, where = _chosen_file(config.generation_config, model_file, model_source)
    fields = {name: source[name] for name in SAMPLING_FIELDS if name in source}
    for name, value in fields.items():
        problem = None if name in override else field_problem(name, value)
        if problem is not None:
            raise ModelLoadError(
                f"{where}: {name} must be {problem}, got {value!r}; set it with "
                "--override-generation-config, or ignore the file with --generation-config vllm"
            )
    fields.update(override)
    defaults = {SAMPLING_FIELDS[name]: value for name, value in fields.items() if value is not None}
    if defaults:
        origin = " and ".join(filter(None, [where, "--override-generation-config" if override else ""]))
        logger.info(
            "default sampling parameters from %s: %s (--generation-config vllm: none)", origin, defaults
        )
    return defaults


def _chosen_file(
    option: str, model_file: Mapping[str, Any], model_source: str
) -> tuple[Mapping[str, Any], str]:
    """The generation config ``option`` names, and its path for messages; ({}, "") for none."""
    if option == OWN_DEFAULTS or (option == "auto" and not model_file):
        return {}, ""
    if option == "auto":
        return model_file, str(Path(model_source) / GENERATION_CONFIG_FILE)
    folder = Path(option).expanduser()
    return read_generation_config(folder), str(folder / GENERATION_CONFIG_FILE)
