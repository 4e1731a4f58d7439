"""What a request asks its output to match, in the shape of vLLM's ``StructuredOutputsParams``.

Exactly one constraint is set: ``json`` (a JSON schema as a dict or its text, or ``True`` for any JSON
object), ``json_object=True`` (any JSON object), ``regex``, ``choice`` (one of these strings) or ``grammar``
(Lark, or GBNF, which is recognised by its ``::=``). :meth:`StructuredOutputsParams.spec` turns it into the
one hashable :class:`GrammarSpec` that the grammar backends compile (and cache by).
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

GrammarKind = Literal["json", "regex", "choice", "grammar"]
ANY_JSON_OBJECT = '{"type": "object"}'
# JSON whitespace between two tokens: any mix of space, tab and newlines, up to this many characters (deep
# pretty-printing included). Unbounded, a small model can emit whitespace until max_tokens.
MAX_JSON_WHITESPACE = 20
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint as the backends see it: its kind and its text (a JSON schema serialised, a regex, the
    choices as a JSON list, a Lark or GBNF grammar). ``field`` names where it came from, for errors."""

    kind: GrammarKind
    source: str
    any_whitespace: bool = True  # JSON: whitespace between tokens as the model likes (bounded), or none
    field: str = field(default="structured_outputs", compare=False)

    @property
    def choices(self) -> list[str]:
        if self.kind != "choice":
            raise ValueError(f"a {self.kind} grammar has no choices")
        choices: list[str] = json.loads(self.source)
        return choices


def choice_lark(choices: Sequence[str]) -> str:
    """A Lark grammar whose only sentences are ``choices`` (JSON string literals are Lark literals): one
    terminal, so the lexer holds the alternatives (a parser rule of more than 2,000 alternatives fails in
    llguidance at the first token)."""
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(choice) for choice in choices)


def _fail(name: str, requirement: str, value: object) -> None:
    raise ValueError(f"structured_outputs.{name} must be {requirement}, got {value!r}")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output; set exactly one of the constraints. ``disable_any_whitespace``: JSON
    with no whitespace between its tokens (else any, up to ``MAX_JSON_WHITESPACE`` characters a gap)."""

    json: dict[str, Any] | str | bool | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(_CONSTRAINTS)}; got "
                f"{', '.join(given) or 'none'}"
            )
        if self.choice is not None:
            object.__setattr__(self, "choice", _checked_choices(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                _fail(name, "a non-empty string", value)
        if not isinstance(self.json_object, bool):
            _fail("json_object", "a bool", self.json_object)
        if not isinstance(self.disable_any_whitespace, bool):
            _fail("disable_any_whitespace", "a bool", self.disable_any_whitespace)
        if self.json is not None:
            _schema_text(self.json)

    @property
    def kind(self) -> GrammarKind:
        if self.json is not None or self.json_object:
            return "json"
        if self.regex is not None:
            return "regex"
        return "choice" if self.choice is not None else "grammar"

    def spec(self, field: str | None = None) -> GrammarSpec:
        """The constraint as the backends compile it; ``field`` names it in errors (default:
        ``structured_outputs.json``, ``structured_outputs.regex``, ...)."""
        kind = self.kind
        any_whitespace = not self.disable_any_whitespace
        name = "json_object" if self.json_object else kind
        if kind == "json":
            source = ANY_JSON_OBJECT if self.json_object else _schema_text(self.json)
        elif kind == "choice":
            source = json.dumps(list(self.choice or ()))
        else:
            source = str(self.regex if kind == "regex" else self.grammar)
        return GrammarSpec(kind, source, any_whitespace, field or f"structured_outputs.{name}")


def _checked_choices(choice: object) -> tuple[str, ...]:
    if isinstance(choice, str) or not isinstance(choice, Sequence):
        _fail("choice", "a list of strings", choice)
    assert isinstance(choice, Sequence)
    if not choice or not all(isinstance(item, str) and item for item in choice):
        _fail("choice", "a non-empty list of non-empty strings", choice)
    return tuple(choice)


def _schema_text(schema: object) -> str:
    """A JSON schema's canonical text: ``True`` is any object; a dict or a string holding a JSON object."""
    if schema is True:
        return ANY_JSON_OBJECT
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        _fail("json", "a JSON schema object (a dict, its JSON text, or True)", schema)
    try:
        return json.dumps(schema)  # key order kept: it is the order properties are generated in
    except (TypeError, ValueError) as exc:
        raise ValueError(f"structured_outputs.json cannot be serialised as JSON: {exc}") from None
