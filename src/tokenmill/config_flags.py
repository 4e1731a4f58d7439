"""Command-line flags for every ``EngineConfig`` setting, derived from the dataclasses so a new toggle needs
no flag of its own: a setting's flat name (``tokenmill.config.FLAT_OPTIONS``) ``max_num_seqs`` is
``--max-num-seqs N``, a bool is ``--prefix-caching`` / ``--no-prefix-caching``, a ``Literal`` lists its
choices. A flag left unset keeps EngineConfig's default. Each flag's help is the setting's description
(``tokenmill.config_help``), then its choices and its default."""

import argparse
import json
import types
import typing
from collections.abc import Callable, Collection
from dataclasses import MISSING, Field, fields
from typing import Any

from tokenmill.config import FLAT_OPTIONS, GROUPS, EngineConfig
from tokenmill.config_help import CHOICES, OPTION_HELP
from tokenmill.config_speculative import speculative_options


def add_engine_config_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, exclude: Collection[str] = ()
) -> None:
    """One flag per setting of EngineConfig not in ``exclude`` (settings the command sets its own way)."""
    for name, (field, kind) in _settings().items():
        if name in exclude:
            continue
        flag = "--" + name.replace("_", "-")
        default = field.default if field.default is not MISSING else None
        choices = typing.get_args(kind) if typing.get_origin(kind) is typing.Literal else CHOICES.get(name)
        help_text = option_help(name, default, choices)
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif choices:
            parser.add_argument(flag, choices=choices, default=None, help=help_text)
        else:
            parser.add_argument(flag, type=_parser_for(kind), default=None, help=help_text)
    if "speculative_method" not in exclude:
        parser.add_argument(
            "--speculative-config",
            type=parse_speculative_config,
            default=None,
            help='speculative decoding as vLLM takes it, a JSON object, e.g. \'{"method": "ngram", '
            '"num_speculative_tokens": 4}\' (keys: method, num_speculative_tokens, prompt_lookup_min, '
            "prompt_lookup_max, model, load_format), checked as it is given; the --speculative-* flags "
            "override its keys",
        )


def parse_speculative_config(text: str) -> dict[str, Any]:
    """``--speculative-config``'s JSON object, its keys checked (no torch needed)."""
    value = parse_json_object(text)
    try:
        options = speculative_options(value)
        EngineConfig().with_options(**options)
    except (ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return value


def parse_json_object(text: str) -> dict[str, Any]:
    """A dict-valued setting's flag: a JSON object (its keys are checked by EngineConfig)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def option_help(name: str, default: Any, choices: Collection[str] | None = None) -> str:
    """``--max-num-seqs``'s help: what the setting does, its choices, and EngineConfig's default."""
    parts = [OPTION_HELP.get(name, f"EngineConfig.{_path(name)}")]
    if choices:
        parts.append(f"choices: {', '.join(choices)}")
    if isinstance(default, bool):
        parts.append(f"default: {'on' if default else 'off'}")
    elif default is not None:
        parts.append(f"default: {default}")
    return f"{parts[0]} ({'; '.join(parts[1:])})" if len(parts) > 1 else parts[0]


def engine_options_from(args: argparse.Namespace, exclude: Collection[str] = ()) -> dict[str, Any]:
    """The EngineConfig fields given on the command line, for ``EngineConfig.with_options``."""
    given = {
        name: getattr(args, name)
        for name in FLAT_OPTIONS
        if name not in exclude and getattr(args, name, None) is not None
    }
    return {**speculative_options(getattr(args, "speculative_config", None)), **given}


def _settings() -> dict[str, tuple["Field[Any]", Any]]:
    """Flat name -> (the dataclass field, its type without ``None``)."""
    found = {}
    for name, (group, attribute) in FLAT_OPTIONS.items():
        cls = EngineConfig if group is None else GROUPS[group]
        field = next(f for f in fields(cls) if f.name == attribute)
        found[name] = (field, _without_none(typing.get_type_hints(cls)[attribute]))
    return found


def _path(name: str) -> str:
    group, attribute = FLAT_OPTIONS[name]
    return attribute if group is None else f"{group}.{attribute}"


def _without_none(annotation: Any) -> Any:
    """``int | None`` → ``int``; other annotations unchanged."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def _parser_for(kind: Any) -> Callable[[str], Any]:
    if kind in (int, float, str):
        return typing.cast(Callable[[str], Any], kind)
    if typing.get_origin(kind) is dict:
        return parse_json_object
    raise TypeError(f"EngineConfig has a field of type {kind!r} that no command-line flag can express")
