"""Both grammar backends against references that know nothing of them: the allowed next tokens of a finite
language are exactly the vocabulary entries whose text extends a prefix of one of its strings (every
string enumerated in Python), EOS only once a string is complete; bad constraints raise naming their
field; a batch's rows are filled independently and ids past the tokenizer's vocabulary never allowed."""

import itertools
from collections.abc import Iterator

import pytest
import torch

from tokenmill.structured.backend import GrammarBackend, GrammarCompileError, GrammarMatcher, Vocabulary
from tokenmill.structured.bitmask import BitmaskStaging
from tokenmill.structured.manager import StructuredOutputs, create_backend
from tokenmill.structured.params import MAX_JSON_WHITESPACE, StructuredOutputsParams

BACKENDS = ["llguidance", "xgrammar"]
EXTRA_IDS = 40  # model vocabulary rows past the tokenizer's


@pytest.fixture(scope="module")
def token_texts(smollm2) -> list[str]:  # type: ignore[no-untyped-def]
    tokenizer = smollm2.tokenizer
    return [tokenizer.decode([token], skip_special_tokens=False) for token in range(tokenizer.vocab_size)]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest, smollm2) -> GrammarBackend:  # type: ignore[no-untyped-def]
    tokenizer = smollm2.tokenizer
    vocabulary = Vocabulary(tokenizer.hf_tokenizer, tokenizer.vocab_size + EXTRA_IDS, smollm2.eos_token_ids)
    return create_backend(request.param, vocabulary)


def allowed(backend: GrammarBackend, matcher: GrammarMatcher) -> set[int]:
    bitmask = torch.zeros((1, backend.width), dtype=torch.int32)
    backend.fill_bitmasks([(matcher, 0)], bitmask)
    return set(_set_bits(bitmask[0], backend.vocab_size))


def _set_bits(row: torch.Tensor, vocab_size: int) -> Iterator[int]:
    for word_index, word in enumerate(row.tolist()):
        word &= 0xFFFFFFFF
        while word:
            bit = (word & -word).bit_length() - 1
            if word_index * 32 + bit < vocab_size:
                yield word_index * 32 + bit
            word &= word - 1


def expected_next(language: set[str], done: str, texts: list[str], eos: set[int]) -> set[int]:
    """Tokens whose text continues ``done`` towards a string of ``language``; EOS if ``done`` is one."""
    prefixes = {
        s[len(done) : i] for s in language if s.startswith(done) for i in range(len(done) + 1, len(s) + 1)
    }
    tokens = {token for token, text in enumerate(texts) if text and text in prefixes}
    return tokens | (eos if done in language else set())


def walk(
    backend: GrammarBackend,
    matcher: GrammarMatcher,
    target: str,
    texts: list[str],
    language: set[str],
    eos: set[int],
) -> None:
    """Follow ``target`` one token at a time (the longest allowed token each time). Every mask allows only
    tokens that keep to the language, and EOS exactly where a string is complete; the first mask allows
    every such token (later ones may leave out tokenizations a backend deems non-canonical, as llguidance
    does once the rest of a word is forced). EOS ends it and terminates the matcher."""
    done = ""
    while True:
        mask = allowed(backend, matcher)
        reference = expected_next(language, done, texts, eos)
        assert mask and mask <= reference, f"after {done!r}: {sorted(mask - reference)[:5]} break the grammar"
        assert (mask & eos == eos) == (done in language), f"after {done!r}"
        if not done:
            assert mask == reference
        if done == target:
            break
        token = max(
            (t for t in mask - eos if target.startswith(done + texts[t])), key=lambda t: len(texts[t])
        )
        assert matcher.accept_token(token)
        done += texts[token]
    assert matcher.accept_token(next(iter(eos)))
    assert matcher.is_terminated()


def test_a_choice_allows_exactly_its_prefixes(
    backend: GrammarBackend, token_texts: list[str], smollm2
) -> None:  # type: ignore[no-untyped-def]
    choices = {"yes", "no", "maybe", "yesterday"}
    grammar = backend.compile(StructuredOutputsParams(choice=sorted(choices)).spec())
    eos = set(smollm2.eos_token_ids)
    walk(backend, grammar.matcher(), "yesterday", token_texts, choices, eos)
    walk(backend, grammar.matcher(), "no", token_texts, choices, eos)


def test_thousands_of_choices_keep_to_their_language(
    backend: GrammarBackend, token_texts: list[str], smollm2
) -> None:  # type: ignore[no-untyped-def]
    """5,000 choices (llguidance refused a parser rule of more than 2,000 alternatives at the first
    token; the choices are one lexer terminal now)."""
    choices = {f"{i} of many" for i in range(5000)}
    grammar = backend.compile(StructuredOutputsParams(choice=sorted(choices)).spec())
    walk(backend, grammar.matcher(), "4321 of many", token_texts, choices, set(smollm2.eos_token_ids))


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"type": "integer", "not": {"enum": [5]}}}, "required": ["a"]},
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "minItems": 3},
        {"type": "object", "required": ["a"], "additionalProperties": False},  # no instance at all
    ],
    ids=["not", "uniqueItems", "unsatisfiable"],
)
def test_both_backends_refuse_a_schema_they_would_not_enforce(
    backend: GrammarBackend, schema: dict[str, object]
) -> None:
    """Served, such a schema would end outputs with "stop" that fail validation (xgrammar compiled these
    and let ``{"a": 5}``, ``[1, 1, 1]`` and ``{}`` through); refused, the client is told why."""
    with pytest.raises(GrammarCompileError, match=r"structured_outputs\.json"):
        backend.compile(StructuredOutputsParams(json=schema).spec())


def test_a_string_length_beside_a_pattern_is_enforced_or_refused(
    backend: GrammarBackend, token_texts: list[str]
) -> None:
    """xgrammar drops minLength / maxLength beside a pattern (it let a 7-letter code through ``maxLength:
    6``): refused there. llguidance keeps to both: after 2 letters the string may not close, after 6 no
    token may add a letter."""
    schema = {"type": "string", "minLength": 3, "maxLength": 6, "pattern": "^[A-Z]+$"}
    spec = StructuredOutputsParams(json=schema).spec()
    if backend.name == "xgrammar":
        with pytest.raises(GrammarCompileError, match=r"\['maxLength', 'minLength'\] beside a 'pattern'"):
            backend.compile(spec)
        return
    matcher = backend.compile(spec).matcher()
    quote = token_texts.index('"')
    assert matcher.accept_token(quote)
    for count, letter in enumerate("ABCDEF", start=1):
        assert matcher.accept_token(token_texts.index(letter))
        mask = allowed(backend, matcher)
        assert (quote in mask) == (count >= 3), f"after {count} letters"
        adds_a_letter = {t for t in mask if token_texts[t][:1].isupper()}
        assert bool(adds_a_letter) == (count < 6), f"after {count} letters: {sorted(adds_a_letter)[:5]}"


def test_a_regex_allows_exactly_the_prefixes_of_its_strings(
    backend: GrammarBackend, token_texts: list[str], smollm2
) -> None:  # type: ignore[no-untyped-def]
    regex = "[0-9]{2}-[a-c](x|yz)?"
    language = {
        f"{a}{b}-{c}{d}"
        for a, b in itertools.product("0123456789", repeat=2)
        for c in "abc"
        for d in ("", "x", "yz")
    }
    grammar = backend.compile(StructuredOutputsParams(regex=regex).spec())
    eos = set(smollm2.eos_token_ids)
    walk(backend, grammar.matcher(), "42-byz", token_texts, language, eos)
    walk(backend, grammar.matcher(), "07-c", token_texts, language, eos)


def test_gbnf_and_lark_grammars_compile_alike(
    backend: GrammarBackend, token_texts: list[str], smollm2
) -> None:  # type: ignore[no-untyped-def]
    language = {f"{op}{digit}" for op in ("+", "-") for digit in "0123456789"}
    eos = set(smollm2.eos_token_ids)
    for grammar in ('root ::= ("+" | "-") [0-9]', 'start: ("+" | "-") /[0-9]/'):
        compiled = backend.compile(StructuredOutputsParams(grammar=grammar).spec())
        walk(backend, compiled.matcher(), "-7", token_texts, language, eos)


@pytest.mark.parametrize(
    ("constraint", "field"),
    [
        ({"regex": "a(b"}, "structured_outputs.regex is not a valid regular expression"),
        ({"json": {"type": "nope"}}, "structured_outputs.json is not a valid JSON schema"),
        ({"json": {"$ref": "#/$defs/missing"}}, "structured_outputs.json is not a valid JSON schema"),
        ({"grammar": "start: missing_rule"}, "structured_outputs.grammar is not a valid grammar"),
        ({"grammar": 'root ::= "a" (unclosed'}, "structured_outputs.grammar is not a valid grammar"),
    ],
)
def test_bad_constraints_fail_to_compile_naming_their_field(
    backend: GrammarBackend, constraint: dict[str, object], field: str
) -> None:
    with pytest.raises(GrammarCompileError, match=field) as caught:
        backend.compile(StructuredOutputsParams(**constraint).spec())  # type: ignore[arg-type]
    assert caught.value.field == field.split(" ")[0]
    assert isinstance(caught.value, ValueError)


def test_rows_are_filled_alone_and_ids_past_the_tokenizer_stay_clear(
    backend: GrammarBackend, smollm2
) -> None:  # type: ignore[no-untyped-def]
    tokenizer_vocab = smollm2.tokenizer.vocab_size
    anything = backend.compile(StructuredOutputsParams(regex="[\\s\\S]*").spec()).matcher()
    digit = backend.compile(StructuredOutputsParams(regex="[0-9]").spec()).matcher()
    bitmask = torch.full((4, backend.width), 7, dtype=torch.int32)
    backend.fill_bitmasks([(anything, 1), (digit, 3)], bitmask)
    assert torch.all(bitmask[0] == 7) and torch.all(bitmask[2] == 7)  # rows not named are left alone
    open_row = set(_set_bits(bitmask[1], backend.vocab_size))
    assert len(open_row) > tokenizer_vocab // 2 and max(open_row) < tokenizer_vocab
    digits = set(_set_bits(bitmask[3], backend.vocab_size))
    assert digits and all(smollm2.tokenizer.decode([t]) in "0123456789" for t in digits)


def test_the_manager_compiles_once_and_builds_its_backend_lazily(smollm2) -> None:  # type: ignore[no-untyped-def]
    manager = StructuredOutputs("llguidance", smollm2.tokenizer, 49152, [2], torch.device("cpu"))
    assert manager._backend is None
    params = StructuredOutputsParams(choice=["a", "b"])
    assert manager.compile(params) is manager.compile(StructuredOutputsParams(choice=["a", "b"]))
    no_tokenizer = StructuredOutputs("llguidance", None, 49152, [2], torch.device("cpu"))
    with pytest.raises(ValueError, match="need the model's tokenizer"):
        no_tokenizer.compile(params)
    foreign_eos = StructuredOutputs("llguidance", smollm2.tokenizer, 128256, [128001], torch.device("cpu"))
    with pytest.raises(ValueError, match="need an EOS id the tokenizer knows"):
        foreign_eos.compile(params)
    with pytest.raises(ValueError, match="unknown structured output backend 'outlines'"):
        StructuredOutputs("outlines", smollm2.tokenizer, 49152, [2], torch.device("cpu"))


@pytest.mark.parametrize("compact", [False, True])
def test_json_whitespace_is_bounded_or_off(
    backend: GrammarBackend, token_texts: list[str], smollm2, compact: bool
) -> None:  # type: ignore[no-untyped-def]
    """Up to MAX_JSON_WHITESPACE characters between two JSON tokens (none with disable_any_whitespace):
    a small model cannot pad its output with whitespace until max_tokens."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=compact)
    matcher = backend.compile(params.spec()).matcher()
    space = smollm2.tokenizer.encode(" ", add_special_tokens=False)
    assert (
        matcher.accept_token(smollm2.tokenizer.encode("{", add_special_tokens=False)[0]) and len(space) == 1
    )
    for _ in range(0 if compact else MAX_JSON_WHITESPACE):
        assert matcher.accept_token(space[0])
    mask = allowed(backend, matcher)
    assert mask and not any(token_texts[t][:1].isspace() for t in mask)
    assert all(token_texts[t].startswith('"') for t in mask)


def test_compact_json_has_no_whitespace_even_after_separators(
    backend: GrammarBackend, token_texts: list[str], smollm2
) -> None:  # type: ignore[no-untyped-def]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    matcher = backend.compile(params.spec()).matcher()
    for token in smollm2.tokenizer.encode('{"a":', add_special_tokens=False):
        assert matcher.accept_token(token)
    mask = allowed(backend, matcher)
    assert mask and not any(token_texts[t][:1].isspace() for t in mask)  # the value follows ':' at once


def test_masks_filled_ahead_equal_masks_filled_in_the_step(backend: GrammarBackend) -> None:
    """Masks filled in the background, then taken by a step whose rows come in another order, mixed with
    unconstrained rows, with a new matcher and with one moved after the fill: every row equals the
    backend's own fill of that matcher at its state when the step asks, and only rows that still hold are
    taken from the fill ahead."""
    staging = BitmaskStaging(backend, torch.device("cpu"))
    specs = [StructuredOutputsParams(regex=r"[0-9]{2}-[a-z]{3}"), StructuredOutputsParams(choice=["y", "n"])]
    grammars = [backend.compile(params.spec()) for params in specs]
    matchers = [grammars[i % 2].matcher() for i in range(5)]
    digits = [t for t in range(backend.vocab_size) if t in allowed(backend, matchers[0])][:3]
    for matcher in matchers[0::2]:  # three regex matchers, at different states
        for token in digits[: matchers.index(matcher) // 2]:
            assert matcher.accept_token(token)

    def reference(rows: list[GrammarMatcher | None]) -> torch.Tensor:
        expected = torch.full((len(rows), backend.width), -1, dtype=torch.int32)
        backend.fill_bitmasks([(m, i) for i, m in enumerate(rows) if m is not None], expected)
        return expected

    staging.fill_ahead(matchers)
    assert torch.equal(staging.fill(matchers), reference(list(matchers)))  # the fill ahead as it is
    assert staging.rows_from_ahead == len(matchers)

    staging.fill_ahead(matchers)
    moved, fresh = matchers[1], grammars[0].matcher()
    staging.before_advance([moved])
    assert moved.accept_token(next(iter(allowed(backend, moved))))
    step: list[GrammarMatcher | None] = [matchers[4], None, moved, fresh, matchers[0], None, matchers[2]]
    assert torch.equal(staging.fill(step), reference(step))
    assert staging.rows_from_ahead == len(matchers) + 3  # matchers 4, 0 and 2; not the moved or new one
