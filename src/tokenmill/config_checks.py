"""The checks ``EngineConfig`` and its groups run on their values: a bad one is a ``ValueError`` naming the
setting, what it must be, and what it got."""

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING

from tokenmill.generation_config import SAMPLING_FIELDS, field_problem, option_problem

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig


def require(ok: bool, name: str, requirement: str, value: object) -> None:
    if not ok:
        raise ValueError(f"EngineConfig.{name} must be {requirement}, got {value!r}")


def require_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    require(value in choices, name, f"one of {choices}", value)


def require_at_least_one(name: str, value: int | None) -> None:
    require(value is None or value >= 1, name, "at least 1", value)


def require_generation_config(option: str, override: object) -> None:
    """``generation_config`` names a source of defaults; ``override_generation_config`` holds sampling
    fields of the generation config with values of their type and range."""
    problem = option_problem(option)
    requirement = "'auto', 'vllm' or a folder holding generation_config.json"
    require(problem is None, "generation_config", f"{requirement} ({problem})", option)
    if not isinstance(override, dict):
        require(override is None, "override_generation_config", "a dict or None", override)
        return
    known = ", ".join(sorted(SAMPLING_FIELDS))
    for key, value in override.items():
        require(key in SAMPLING_FIELDS, "override_generation_config", f"keyed by {known}", key)
        problem = field_problem(key, value)
        require(problem is None, f"override_generation_config[{key!r}]", f"{problem} (or None)", value)


def require_consistent_groups(config: "EngineConfig") -> None:
    """The settings of different groups that only work together."""
    require(
        config.kernels.gguf_activations == "float32" or config.quantization in ("auto", "gguf"),
        "gguf_activations",
        "'float32' unless quantization is 'gguf' (or 'auto', which may pick it): it is packed GGUF "
        "projections' input format",
        config.kernels.gguf_activations,
    )
    require(
        not (config.scheduler.chunked_prefill and config.kv.mode == "none"),
        "chunked_prefill",
        "off when kv_cache is 'none' (a recomputed sequence has no cache to continue from)",
        config.scheduler.chunked_prefill,
    )
    require(
        not (config.graphs.enabled and config.kernels.attention_backend == "torch"),
        "cuda_graphs",
        "off when attention_backend is 'torch' (its KV write reads a mask back to the host, which a "
        "CUDA graph cannot capture)",
        config.graphs.enabled,
    )
    require(
        not (config.push_all_reduce and config.custom_all_reduce is False),
        "push_all_reduce",
        "off when custom_all_reduce is off (the push kernel is part of the symmetric-memory path)",
        config.push_all_reduce,
    )
    require(
        not (config.graphs.enabled and config.kv.mode == "none"),
        "cuda_graphs",
        "off when kv_cache is 'none' (without a cache no step is a one-token decode)",
        config.graphs.enabled,
    )


def require_types(config: object, flat_names: Mapping[str, str] | None = None) -> None:
    """Each field of a config dataclass holds a value of its annotated type (bool, int, float, str, one of
    a Literal's values, or None where allowed; other annotations are not checked), so that the value
    checks after this one compare like with like. ``flat_names``: field -> its option's flat name, where
    they differ (the name a ValueError gives)."""
    hints = typing.get_type_hints(type(config))
    for config_field in dataclasses.fields(config):  # type: ignore[arg-type]
        allowed = _simple_types(hints[config_field.name])
        value = getattr(config, config_field.name)
        if allowed is None or any(_is_instance(value, kind) for kind in allowed):
            continue
        name = (flat_names or {}).get(config_field.name, config_field.name)
        require(False, name, " or ".join(_describe(kind) for kind in allowed), value)


_Kind = type | tuple[object, ...]  # a type, or a Literal's values


def _simple_types(hint: object) -> list[_Kind] | None:
    """The kinds of value ``hint`` allows, or None where it is not made of simple ones."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    kinds: list[_Kind] = []
    for option in options:
        if typing.get_origin(option) is typing.Literal:
            kinds.append(typing.get_args(option))
        elif option in (bool, int, float, str, type(None)):
            kinds.append(option)
        else:
            return None
    return kinds


def _is_instance(value: object, kind: _Kind) -> bool:
    if isinstance(kind, tuple):
        return value in kind and not isinstance(value, bool)
    if kind is bool:
        return isinstance(value, bool)
    if kind in (int, float):  # an int is a float's value too; a bool is neither
        allowed = (int,) if kind is int else (int, float)
        return isinstance(value, allowed) and not isinstance(value, bool)
    return isinstance(value, kind)


def _describe(kind: _Kind) -> str:
    if isinstance(kind, tuple):
        return f"one of {kind}"
    return {bool: "a bool", int: "an integer", float: "a number", str: "a string"}.get(kind, "None")
