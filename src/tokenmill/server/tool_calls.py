"""Chat ``tools`` with a forcing ``tool_choice``: the arguments are generated under the tool's schema.

``tool_choice`` naming a function constrains the output to that function's ``parameters`` schema and
returns it as the ``arguments`` of one tool call (streamed as argument pieces). ``"required"`` constrains
it to a JSON list of ``{"name", "parameters"}`` objects, each naming one of the tools with its arguments,
and returns one tool call per item (streamed whole once the list is complete). ``"auto"`` and ``"none"``
constrain nothing: the reply is text. In every case ``tools`` reach the chat template.
"""

import json
import uuid
from typing import Any

from tokenmill.server.errors import bad_request
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    ChatMessageOut,
    ChatTool,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
)
from tokenmill.server.structured import StructuredRequest, build

ANY_ARGUMENTS: dict[str, Any] = {"type": "object"}


def tools_for_template(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as the chat template receives them (OpenAI's shape)."""
    if not body.tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in body.tools]


def tool_choice_constraint(body: ChatCompletionRequest) -> StructuredRequest | None:
    """The grammar a forcing ``tool_choice`` puts on the output; None for ``auto`` / ``none`` / unset."""
    choice = body.tool_choice
    if choice is None or choice in ("none", "auto"):
        return None
    tools = body.tools or []
    if not tools:
        raise bad_request(f"tool_choice {_describe(choice)} needs a non-empty tools list", "tool_choice")
    if choice == "required":
        return build("tools", json=required_schema(tools))
    assert isinstance(choice, NamedToolChoice)
    for index, tool in enumerate(tools):
        if tool.function.name == choice.function.name:
            return build(f"tools.{index}.function.parameters", json=tool.function.parameters or ANY_ARGUMENTS)
    names = [tool.function.name for tool in tools]
    raise bad_request(
        f"tool_choice names the function '{choice.function.name}', which is not among the tools {names}",
        "tool_choice",
    )


def required_schema(tools: list[ChatTool]) -> dict[str, Any]:
    """A non-empty JSON list of calls, each ``{"name": <a tool>, "parameters": <its arguments>}``."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": tool.function.parameters or ANY_ARGUMENTS,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


def _describe(choice: str | NamedToolChoice) -> str:
    return repr(choice) if isinstance(choice, str) else f"naming the function {choice.function.name!r}"


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallView:
    """A forced tool choice's outputs as tool calls, whole or streamed, for each choice of a request."""

    def __init__(self, body: ChatCompletionRequest) -> None:
        choice = body.tool_choice
        self.name = choice.function.name if isinstance(choice, NamedToolChoice) else None
        self._buffers: dict[int, str] = {}
        self._started: set[int] = set()

    def message(self, text: str) -> ChatMessageOut:
        """The reply of a whole output: its tool calls, or the text itself where it is not a complete
        list of calls (an output cut short by ``max_tokens``)."""
        calls = self._calls(text)
        if calls is None:
            return ChatMessageOut(content=text)
        return ChatMessageOut(content=None, tool_calls=calls)

    def finish_reason(self, text: str, reason: str | None) -> str | None:
        """OpenAI's reason: ``tool_calls`` when ``required`` produced its calls, else the output's own."""
        if self.name is None and reason == "stop" and self._calls(text) is not None:
            return "tool_calls"
        return reason

    def delta(self, index: int, text: str, finished: bool) -> DeltaMessage | None:
        """What choice ``index``'s new ``text`` adds to the stream, if anything yet."""
        if self.name is not None:
            return self._argument_delta(index, text)
        self._buffers[index] = self._buffers.get(index, "") + text
        if not finished:
            return None
        whole = self._buffers.pop(index)
        calls = self._calls(whole)
        if calls is None:
            return DeltaMessage(content=whole) if whole else None
        deltas = [
            DeltaToolCall(
                index=i,
                id=call.id,
                type="function",
                function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments),
            )
            for i, call in enumerate(calls)
        ]
        return DeltaMessage(tool_calls=deltas)

    def _argument_delta(self, index: int, text: str) -> DeltaMessage | None:
        if index in self._started:
            if not text:
                return None
            return DeltaMessage(
                tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))]
            )
        self._started.add(index)
        first = DeltaToolCall(
            index=0,
            id=_call_id(),
            type="function",
            function=DeltaFunctionCall(name=self.name, arguments=text),
        )
        return DeltaMessage(tool_calls=[first])

    def _calls(self, text: str) -> list[ToolCall] | None:
        if self.name is not None:
            return [ToolCall(id=_call_id(), function=FunctionCall(name=self.name, arguments=text))]
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(items, list):
            return None
        return [
            ToolCall(
                id=_call_id(),
                function=FunctionCall(name=item["name"], arguments=json.dumps(item["parameters"])),
            )
            for item in items
            if isinstance(item, dict) and "name" in item and "parameters" in item
        ]
