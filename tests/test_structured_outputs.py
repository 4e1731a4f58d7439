"""Structured outputs on the real SmolLM2-135M and Gemma 3 270M (CPU, float32), under each grammar backend.

Every sampled output of 36 constraints x 3 seeds on SmolLM2, x 2 on Gemma 3 (whose 262k-token head
makes each step 5x as slow on the CPU) (24 JSON schemas, 8 regexes, 2 choices, a Lark and a GBNF
grammar), all in one batch, ends by its grammar and passes a reference that knows nothing of the
backends: the ``jsonschema`` library (formats checked), ``re.fullmatch``, the choice list. A greedy output
that already conforms is unchanged by its constraint. A bad constraint is refused at ``add_request``,
naming its field.
"""

import json
import re
from collections.abc import Iterator
from functools import partial
from typing import Any

import jsonschema
import pytest

from engine_helpers import in_thread, llm_for
from structured_cases import CHOICES, GRAMMARS, REGEXES, SCHEMAS
from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.outputs import CompletionOutput

MODELS = ("smollm2", "gemma3")
BACKENDS = ("llguidance", "xgrammar")
SEEDS = (0, 1, 2)
LARGE_VOCAB_SEEDS = SEEDS[:2]
TEMPERATURE = 0.7
# Refused by that backend: it would not enforce allOf, nor a string's length beside its pattern.
UNSUPPORTED = {"xgrammar": {"allof", "code"}}


@pytest.fixture(scope="module", params=[(m, b) for m in MODELS for b in BACKENDS], ids="-".join)
def llm(request: pytest.FixtureRequest) -> Iterator[LLM]:
    model, backend = request.param
    loaded = request.getfixturevalue(model)
    yield llm_for(
        loaded, max_model_len=512, max_num_seqs=128, cpu_kv_cache_gib=0.5, structured_output_backend=backend
    )


def chats(llm: LLM) -> bool:
    """SmolLM2 (instruction-tuned, 49,152 tokens) is prompted through its chat template; the pretrained
    Gemma 3 270M with plain text, though tokenmill gives it Gemma's template."""
    return llm.get_tokenizer().has_chat_template and llm.engine.model_config.vocab_size < 100_000


def prompt(llm: LLM, what: str, example: str) -> dict[str, Any]:
    """Ask for ``what`` like ``example``: through the chat template where the model has one."""
    tokenizer = llm.get_tokenizer()
    if chats(llm):
        message = {"role": "user", "content": f"Reply with {what} like this one: {example}"}
        return {"prompt_token_ids": tokenizer.apply_chat_template([message], tokenize=True)}
    return {"prompt": f"Here is {what}: {example}\nHere is another one: "}


def check_json(schema: dict[str, Any]) -> Any:
    def check(text: str) -> None:
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())

    return check


def check_regex(regex: str) -> Any:
    def check(text: str) -> None:
        assert re.fullmatch(regex, text), f"does not match {regex}"

    return check


def check_choice(choices: list[str]) -> Any:
    def check(text: str) -> None:
        assert text in choices

    return check


def cases(llm: LLM, backend: str) -> list[tuple[str, dict[str, Any], StructuredOutputsParams, Any]]:
    """(name, prompt, constraint, check) for every constraint the backend serves."""
    found = []
    for name, (schema, example) in SCHEMAS.items():
        if name not in UNSUPPORTED.get(backend, set()):
            constraint = StructuredOutputsParams(json=schema)
            found.append(
                (name, prompt(llm, "a JSON value", json.dumps(example)), constraint, check_json(schema))
            )
    for name, (regex, example) in REGEXES.items():
        constraint = StructuredOutputsParams(regex=regex)
        found.append((name, prompt(llm, "a string", example), constraint, check_regex(regex)))
    for name, (choices, example) in CHOICES.items():
        constraint = StructuredOutputsParams(choice=choices)
        found.append((name, prompt(llm, "one word", example), constraint, check_choice(choices)))
    for name, (grammar, regex, example) in GRAMMARS.items():
        constraint = StructuredOutputsParams(grammar=grammar)
        found.append((name, prompt(llm, "a sum", example), constraint, check_regex(regex)))
    return found


def failure(output: CompletionOutput, check: Any) -> str | None:
    if output.finish_reason != "stop":
        return f"finished by {output.finish_reason}: {output.text!r}"
    try:
        check(output.text)
    except Exception as exc:
        return f"{output.text!r}: {exc}"
    return None


def backend_of(llm: LLM) -> str:
    return llm.engine.config.structured_output_backend


def test_every_sampled_output_parses_and_validates(llm: LLM) -> None:
    found = cases(llm, backend_of(llm))
    assert len(found) >= 34  # 36 constraints, less those a backend refuses
    seeds = SEEDS if llm.engine.model_config.vocab_size < 100_000 else LARGE_VOCAB_SEEDS
    params = [
        SamplingParams(temperature=TEMPERATURE, seed=seed, max_tokens=96, structured_outputs=constraint)
        for seed in seeds
        for _, _, constraint, _ in found
    ]
    outputs = in_thread(lambda: llm.generate([case[1] for _ in seeds for case in found], params))
    failures = []
    for index, output in enumerate(outputs):
        name, _, _, check = found[index % len(found)]
        problem = failure(output.outputs[0], check)
        if problem is not None:
            failures.append(f"{name} (seed {seeds[index // len(found)]}): {problem}")
    assert not failures, "\n".join(failures)


def test_a_backend_refuses_what_it_would_not_enforce(llm: LLM) -> None:
    schema = SCHEMAS["allof"][0]
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json=schema))
    if "allof" not in UNSUPPORTED.get(backend_of(llm), set()):
        return  # served (and validated) by the test above
    with pytest.raises(ValueError, match=r"structured_outputs.json is not a valid JSON schema: .*allOf"):
        llm.generate("x", params)
    assert not llm.engine.has_unfinished_requests()


# The prompts' greedy outputs already conform: the SmolLM2 ones end with EOS right there, the Gemma ones
# go on (a newline, more text), which the constraint ends.
CONFORMING = {
    "smollm2": [
        (
            'Reply with only this JSON and nothing else: {"name": "Ada", "age": 36}',
            {"json": SCHEMAS["person"][0]},
        ),
        (
            "What is the capital of France? Answer in one word.",
            {"regex": r"The capital of France is [A-Z][a-z]+\."},
        ),
    ],
    "gemma3": [
        ("Q: What is the capital of France?\nA:", {"regex": r" The capital of France is [A-Z][a-z]+\."}),
        (
            'Here is a JSON object: {"name": "Ada", "age": 36}\nHere is the same JSON object again: ',
            {"regex": r'\n\{"name": "[A-Z][a-z]+", "age": [0-9]+\}'},
        ),
    ],
}


def test_a_conforming_greedy_output_is_unchanged_by_its_constraint(llm: LLM) -> None:
    model = "smollm2" if chats(llm) else "gemma3"
    eos = llm.engine.eos_token_ids
    for text, constraint in CONFORMING[model]:
        request = _as_prompt(llm, text)
        free = in_thread(partial(llm.generate, request, SamplingParams(temperature=0, max_tokens=32)))
        params = SamplingParams(
            temperature=0, max_tokens=32, structured_outputs=StructuredOutputsParams(**constraint)
        )
        bound = in_thread(partial(llm.generate, request, params))
        free, bound = free[0].outputs[0], bound[0].outputs[0]
        content = [token for token in bound.token_ids if token not in eos]  # the EOS a backend waits for
        assert bound.finish_reason == "stop" and content, bound
        assert content == free.token_ids[: len(content)], (bound.text, free.text)
        assert free.text.startswith(bound.text)


def _as_prompt(llm: LLM, text: str) -> dict[str, Any]:
    tokenizer = llm.get_tokenizer()
    if chats(llm):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
        return {"prompt_token_ids": ids}
    return {"prompt": text}


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        ({"regex": "[0-9"}, "structured_outputs.regex is not a valid regular expression"),
        (
            {"json": {"type": "object", "properties": {"a": {"type": "nope"}}}},
            "structured_outputs.json is not",
        ),
        ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar is not a valid grammar"),
    ],
)
def test_a_bad_constraint_is_refused_at_add_request(
    llm: LLM, constraint: dict[str, Any], message: str
) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad", "Hello", params)
    assert "bad" not in llm.engine.requests and not llm.engine.has_unfinished_requests()
