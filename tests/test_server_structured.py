"""Structured outputs over HTTP, driven by the official ``openai`` client against a real server on the
SmolLM2 model, under each grammar backend: ``response_format`` (json_schema, json_object) on chat and
completions, vLLM's ``structured_outputs`` and ``guided_*`` fields, ``tools`` with a forcing
``tool_choice``; every output validated by ``jsonschema`` / ``re.fullmatch``, streamed text equal to
non-streamed; bad constraints answered 400 naming their field."""

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from engine_helpers import engine_for
from tokenmill.server import ServerSettings, ServerThread, create_app

MODEL = "smollm2-structured"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME},
    },
]
ASK_PERSON = [{"role": "user", "content": "Give me a person as JSON, with a name and an age."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
JSON_PROMPT = 'Here is a JSON object: {"name": "Ada", "age": 36}\nHere is another one:'


@pytest.fixture(scope="module", params=["llguidance", "xgrammar"])
def client(request: pytest.FixtureRequest, smollm2) -> Iterator[openai.OpenAI]:  # type: ignore[no-untyped-def]
    engine = engine_for(smollm2, max_model_len=512, max_num_seqs=8, structured_output_backend=request.param)
    with ServerThread(create_app(engine, ServerSettings(served_model_name=MODEL))) as server:
        yield openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def person_format() -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


def test_chat_response_format_json_schema_streamed_and_not(client: openai.OpenAI) -> None:
    common: dict[str, Any] = {"model": MODEL, "messages": ASK_PERSON, "temperature": 0.8, "seed": 5, "n": 3}
    whole = client.chat.completions.create(response_format=person_format(), max_tokens=48, **common)  # type: ignore[arg-type]
    for choice in whole.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
    stream = client.chat.completions.create(
        response_format=person_format(),  # type: ignore[arg-type]
        max_tokens=48,
        stream=True,
        **common,
    )
    pieces: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            pieces[choice.index] = pieces.get(choice.index, "") + (choice.delta.content or "")
    assert pieces == {choice.index: choice.message.content for choice in whole.choices}


@pytest.mark.parametrize("stream", [False, True])
def test_completions_response_format(client: openai.OpenAI, stream: bool) -> None:
    for response_format, schema in ((person_format(), PERSON), ({"type": "json_object"}, {"type": "object"})):
        response = client.completions.create(
            model=MODEL,
            prompt=JSON_PROMPT,
            max_tokens=48,
            temperature=0,
            stream=stream,
            extra_body={"response_format": response_format},
        )
        if stream:
            text = "".join(chunk.choices[0].text for chunk in response if chunk.choices)  # type: ignore[union-attr]
        else:
            text = response.choices[0].text  # type: ignore[union-attr]
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    ("body", "check"),
    [
        ({"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}}, r"[0-9]{3}-[0-9]{4}"),
        ({"structured_outputs": {"choice": ["red", "green"]}}, r"red|green"),
        ({"guided_regex": "[A-Z][a-z]{2,8}"}, r"[A-Z][a-z]{2,8}"),
        ({"guided_choice": ["yes", "no"]}, r"yes|no"),
        ({"guided_grammar": 'start: /[0-9]{1,2}/ "+" /[0-9]{1,2}/'}, r"[0-9]{1,2}\+[0-9]{1,2}"),
        ({"guided_json": PERSON}, PERSON),
        ({"guided_json": json.dumps(PERSON)}, PERSON),
    ],
)
def test_vllm_fields_constrain_the_output(client: openai.OpenAI, body: dict[str, Any], check: Any) -> None:
    response = client.completions.create(
        model=MODEL, prompt=JSON_PROMPT, max_tokens=48, temperature=0.7, seed=1, n=2, extra_body=body
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.text
        if isinstance(check, str):
            assert re.fullmatch(check, choice.text), choice.text
        else:
            jsonschema.validate(json.loads(choice.text), check)


def _stream_tool_calls(stream: Any) -> tuple[dict[int, dict[str, str]], str | None]:
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    return calls, finish


def test_tool_choice_naming_a_function_constrains_its_arguments(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    common: dict[str, Any] = {"model": MODEL, "messages": ASK_WEATHER, "tools": TOOLS, "tool_choice": choice}
    whole = client.chat.completions.create(temperature=0, max_tokens=48, **common)
    message = whole.choices[0].message
    assert message.content is None and message.tool_calls and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)  # type: ignore[union-attr]
    calls, finish = _stream_tool_calls(
        client.chat.completions.create(temperature=0, max_tokens=48, stream=True, **common)
    )
    assert calls == {0: {"name": "get_weather", "arguments": call.function.arguments}}  # type: ignore[union-attr]
    assert finish == whole.choices[0].finish_reason == "stop"


def test_tool_choice_required_calls_tools_with_valid_arguments(client: openai.OpenAI) -> None:
    common: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK_WEATHER,
        "tools": TOOLS,
        "tool_choice": "required",
    }
    whole = client.chat.completions.create(temperature=0, max_tokens=96, **common)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])  # type: ignore[union-attr]
    calls, finish = _stream_tool_calls(
        client.chat.completions.create(temperature=0, max_tokens=96, stream=True, **common)
    )
    expected = {
        i: {"name": call.function.name, "arguments": call.function.arguments}  # type: ignore[union-attr]
        for i, call in enumerate(choice.message.tool_calls)
    }
    assert calls == expected and finish == "tool_calls"


def test_logprobs_of_a_constrained_chat_serialise(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is water wet?"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=10,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    content = response.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and response.choices[0].message.content in ("yes", "no")
    first = content[0].top_logprobs
    assert 0 < len(first) < 10 and all(
        "yes".startswith(top.token) or "no".startswith(top.token) for top in first
    )


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        (
            "chat",
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
            "response_format.json_schema.schema",
        ),
        (
            "chat",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
        ),
        ("completions", {"guided_regex": "a(b"}, "guided_regex"),
        ("completions", {"guided_grammar": "start: nowhere"}, "guided_grammar"),
        ("completions", {"structured_outputs": {"regex": "[0-9", "choice": ["a"]}}, "structured_outputs"),
        ("completions", {"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs.json"),
        (
            "completions",
            {"guided_regex": "[0-9]", "response_format": {"type": "json_object"}},
            "guided_regex",
        ),
        (
            "chat",
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
            "tool_choice",
        ),
        ("chat", {"tool_choice": "required"}, "tool_choice"),
        (
            "chat",
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        ("chat", {"tools": TOOLS, "tool_choice": "required", "guided_choice": ["a"]}, "guided_choice"),
    ],
)
def test_bad_constraints_are_400s_naming_their_field(
    client: openai.OpenAI, route: str, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        if route == "chat":
            client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=4, extra_body=body)
        else:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body=body)
    error = caught.value.body
    assert isinstance(error, dict) and error.get("param") == param, error
