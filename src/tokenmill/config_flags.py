"""Command-line flags for every ``EngineConfig`` field, derived from the dataclass so a new toggle needs
no flag of its own: ``max_num_seqs`` is ``--max-num-seqs N``, a bool is ``--prefix-caching`` /
``--no-prefix-caching``, a ``Literal`` lists its choices. A flag left unset keeps EngineConfig's default."""

import argparse
import types
import typing
from collections.abc import Callable, Collection
from dataclasses import MISSING, fields
from typing import Any

from tokenmill.config import EngineConfig


def add_engine_config_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, exclude: Collection[str] = ()
) -> None:
    """One flag per field of EngineConfig not in ``exclude`` (fields the command sets its own way)."""
    hints = typing.get_type_hints(EngineConfig)
    for field in fields(EngineConfig):
        if field.name in exclude:
            continue
        flag = "--" + field.name.replace("_", "-")
        default = field.default if field.default is not MISSING else None
        kind = _without_none(hints[field.name])
        help_text = f"EngineConfig.{field.name} (default: {default})"
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif typing.get_origin(kind) is typing.Literal:
            parser.add_argument(flag, choices=typing.get_args(kind), default=None, help=help_text)
        else:
            parser.add_argument(flag, type=_parser_for(kind), default=None, help=help_text)


def engine_options_from(args: argparse.Namespace, exclude: Collection[str] = ()) -> dict[str, Any]:
    """The EngineConfig fields given on the command line, for ``EngineConfig.with_options``."""
    return {
        field.name: getattr(args, field.name)
        for field in fields(EngineConfig)
        if field.name not in exclude and getattr(args, field.name, None) is not None
    }


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
    raise TypeError(f"EngineConfig has a field of type {kind!r} that no command-line flag can express")
