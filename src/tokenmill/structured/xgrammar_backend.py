"""The second grammar backend: xgrammar (Apache-2.0; ``pip install 'tokenmill[xgrammar]'``).

It precompiles each grammar against the whole vocabulary (slower compiles that grow with the vocabulary,
a compile cache of its own) and then computes masks fastest, filling a batch's rows from its own thread
pool (``BatchGrammarMatcher``). Its matchers terminate on EOS; a sequence whose grammar is complete and
allows nothing but EOS ends there without sampling it, as with llguidance.

xgrammar 0.2.8 compiles ``allOf`` into a grammar that lets invalid JSON through (wrong types, or any
value at all), so schemas using it are refused here with a message that points to llguidance, rather
than served with outputs that do not validate; so are ``not``, ``uniqueItems`` and the other keywords of
``UNSUPPORTED_KEYWORDS``, which it compiles without enforcing, and a string length beside a pattern. Its
regex digit and word classes are ASCII-only, where
llguidance's (like Python's ``re``) also take other Unicode digits and letters.
"""

import json
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import xgrammar

from tokenmill.structured.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarCompileError,
    GrammarMatcher,
    Vocabulary,
)
from tokenmill.structured.params import MAX_JSON_WHITESPACE, GrammarSpec, choice_lark

_COMPILE_THREADS = 2
# Compiled, but not enforced (see above): refused, so no output that breaks its schema is served.
UNSUPPORTED_KEYWORDS = frozenset(
    {
        "allOf",
        "not",
        "uniqueItems",
        "if",
        "then",
        "else",
        "dependentRequired",
        "dependentSchemas",
        "contains",
        "minContains",
        "maxContains",
        "unevaluatedProperties",
        "unevaluatedItems",
    }
)
_NAMED_SUBSCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions"})
_VALUES = frozenset({"enum", "const", "default", "examples"})  # JSON values, not subschemas


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: xgrammar.GrammarMatcher, vocab_size: int) -> None:
        self.inner = matcher
        self.vocab_size = vocab_size

    def accept_token(self, token_id: int) -> bool:
        return bool(self.inner.accept_token(token_id))

    def is_terminated(self) -> bool:
        """Ended on EOS, or complete with nothing but EOS left to allow: the sequence ends there, as with
        llguidance (else ``min_tokens``, which bans EOS, would leave no token to sample)."""
        if self.inner.is_terminated():
            return True
        return bool(self.inner.is_completed()) and self._allows_only_stop_tokens()

    def _allows_only_stop_tokens(self) -> bool:
        mask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        self.inner.fill_next_token_bitmask(mask)
        bits = (mask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.flatten()[: self.vocab_size].nonzero().flatten().tolist()
        return set(allowed) <= set(self.inner.stop_token_ids)

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)


class XGrammarGrammar(CompiledGrammar):
    def __init__(self, compiled: xgrammar.CompiledGrammar, vocab_size: int) -> None:
        self._compiled = compiled
        self._vocab_size = vocab_size

    def matcher(self) -> GrammarMatcher:
        return XGrammarMatcher(xgrammar.GrammarMatcher(self._compiled), self._vocab_size)


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, vocabulary: Vocabulary) -> None:
        super().__init__(vocabulary)
        info = xgrammar.TokenizerInfo.from_huggingface(
            vocabulary.hf_tokenizer,  # type: ignore[arg-type]
            vocab_size=vocabulary.vocab_size,
            stop_token_ids=list(vocabulary.eos_token_ids) or None,
        )
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=_COMPILE_THREADS)
        self._batch = xgrammar.BatchGrammarMatcher()

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        try:
            return XGrammarGrammar(self._compile(spec), self.vocab_size)
        except (RuntimeError, ValueError) as exc:  # xgrammar's errors derive from these
            raise GrammarCompileError(spec, str(exc)) from None

    def _compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        compiler = self._compiler
        if spec.kind == "json":
            schema = json.loads(spec.source)
            unsupported = sorted(UNSUPPORTED_KEYWORDS.intersection(_keywords(schema)))
            if unsupported:
                raise ValueError(
                    f"the xgrammar backend does not enforce {unsupported}; serve this schema with "
                    "structured_output_backend='llguidance'"
                )
            _check_required_properties_allowed(schema)
            _check_no_length_beside_pattern(schema)
            return compiler.compile_json_schema(
                spec.source,
                any_whitespace=spec.any_whitespace,
                max_whitespace_cnt=MAX_JSON_WHITESPACE if spec.any_whitespace else None,
                separators=None if spec.any_whitespace else (",", ":"),  # its default puts spaces after them
            )
        if spec.kind == "regex":
            return compiler.compile_regex(spec.source)
        if spec.kind == "choice":
            return compiler.compile_lark(choice_lark(spec.choices))
        if "::=" in spec.source:  # GBNF, whose start rule is "root"
            return compiler.compile_grammar(spec.source)
        return compiler.compile_lark(spec.source)

    def fill_bitmasks(self, rows: Sequence[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        if len(rows) == 1:
            matcher, row = rows[0]
            _inner(matcher).fill_next_token_bitmask(bitmask, row)
            return
        matchers = [_inner(matcher) for matcher, _ in rows]
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, [row for _, row in rows])


def _inner(matcher: GrammarMatcher) -> xgrammar.GrammarMatcher:
    if not isinstance(matcher, XGrammarMatcher):
        raise TypeError(f"an xgrammar backend cannot fill the mask of a {type(matcher).__name__}")
    return matcher.inner


def _subschemas(schema: Any) -> Iterator[dict[str, Any]]:
    """A JSON schema and each of its subschemas (not the names of properties and definitions, nor the JSON
    values of ``enum`` / ``const`` / ``default`` / ``examples``)."""
    if isinstance(schema, list):
        for item in schema:
            yield from _subschemas(item)
    if not isinstance(schema, dict):
        return
    yield schema
    for key, value in schema.items():
        if key in _VALUES:
            continue
        if key in _NAMED_SUBSCHEMAS and isinstance(value, dict):
            for subschema in value.values():
                yield from _subschemas(subschema)
        else:
            yield from _subschemas(value)


def _keywords(schema: Any) -> Iterator[str]:
    """Every keyword of a JSON schema and its subschemas."""
    for subschema in _subschemas(schema):
        yield from subschema


def _check_no_length_beside_pattern(schema: Any) -> None:
    """xgrammar 0.2.9 drops ``minLength`` / ``maxLength`` where a string also has a ``pattern`` (it warns on
    its log and lets any length through), so such schemas are refused here; llguidance enforces both."""
    for subschema in _subschemas(schema):
        lengths = sorted({"minLength", "maxLength"}.intersection(subschema))
        if "pattern" in subschema and lengths:
            raise ValueError(
                f"the xgrammar backend does not enforce {lengths} beside a 'pattern'; serve this schema "
                "with structured_output_backend='llguidance'"
            )


def _check_required_properties_allowed(schema: Any) -> None:
    """An object that requires a property its ``additionalProperties: false`` forbids has no instance;
    xgrammar compiles it anyway (and lets ``{}`` through), so it is refused here, as llguidance does."""
    for subschema in _subschemas(schema):
        if subschema.get("additionalProperties") is not False or subschema.get("patternProperties"):
            continue
        properties = subschema.get("properties")
        allowed = properties if isinstance(properties, dict) else {}
        forbidden = [name for name in subschema.get("required") or [] if name not in allowed]
        if forbidden:
            raise ValueError(
                f"unsatisfiable schema: required property {forbidden[0]!r} is not allowed by "
                "additionalProperties: false"
            )
