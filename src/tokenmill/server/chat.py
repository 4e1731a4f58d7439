"""``POST /v1/chat/completions``: messages through the model's chat template, streamed or not."""

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tokenmill.errors import TokenmillError
from tokenmill.server.errors import bad_request
from tokenmill.server.generation import ChoiceResult, Generation, ServerContext
from tokenmill.server.logprobs import LogprobTokens, TokenTexts, chat_logprobs, prompt_logprobs_out
from tokenmill.server.prompts import engine_prompt
from tokenmill.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatMessageOut,
    DeltaMessage,
    PromptLogprobsOut,
    UsageInfo,
)
from tokenmill.server.responses import (
    SSE_DONE,
    context,
    json_response_when_done,
    sse,
    streaming_response,
    usage_info,
)
from tokenmill.server.sampling import chat_params
from tokenmill.server.structured import constrained, structured_outputs_of
from tokenmill.server.tool_calls import ToolCallView, tool_choice_constraint, tools_for_template

router = APIRouter()


# Template arguments the request sets through its own fields, so chat_template_kwargs may not.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "tokenize", "add_generation_prompt", "continue_final_message"}
)
# A request's own template is refused as a field (request_checks.py), and so inside chat_template_kwargs.
_REFUSED_TEMPLATE_KWARGS = frozenset({"chat_template"})


def render_chat(
    ctx: ServerContext,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    **template_options: Any,
) -> str:
    """The chat template's text for ``messages`` (and ``tools``, where the template shows them);
    ``template_options`` go to the template (``continue_final_message``, ``chat_template_kwargs``' items).
    A template or content problem is a 400."""
    conversation = [_message_dict(message) for message in messages]
    if not conversation:
        raise bad_request("messages must hold at least one message", "messages")
    extra: dict[str, Any] = {"tools": tools} if tools else {}
    extra.update(template_options)
    try:
        return ctx.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )
    except TokenmillError as exc:
        raise bad_request(str(exc), "messages") from None
    except Exception as exc:  # the template runs on the client's messages, so whatever it raises is theirs
        raise bad_request(f"the chat template could not render the messages: {exc}", "messages") from None


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    as_dict = message.model_dump(exclude_none=True)
    if as_dict.get("content") is None:
        as_dict["content"] = ""
    return as_dict


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    ctx = context(request)
    ctx.check_model(body.model)
    params = chat_params(body, ctx.facts.sampling_defaults)
    constraint = structured_outputs_of(body, tool_choice_constraint(body))
    params = await constrained(ctx.grammars, params, constraint)
    options = _options(body)

    def prompt_ids() -> str | list[int]:
        tools = tools_for_template(body)
        text = render_chat(ctx, body.messages, _adds_generation_prompt(body), tools, **options)
        return engine_prompt(ctx, text, body.add_special_tokens, body.truncate_prompt_tokens, "messages")

    prompt = await ctx.run_text_work(prompt_ids)
    generation = await ctx.start([prompt], params, request, body.priority, body.cache_salt)
    view = _ChatView(ctx, body, generation)
    if body.stream:
        return await streaming_response(generation, view.chunks())
    return await json_response_when_done(generation, view.response)


def _adds_generation_prompt(body: ChatCompletionRequest) -> bool:
    # Continuing the last message adds no generation prompt (asking for both is refused earlier).
    return body.add_generation_prompt and not body.continue_final_message


def _options(body: ChatCompletionRequest) -> dict[str, Any]:
    options = dict(body.chat_template_kwargs or {})
    refused = sorted(_REFUSED_TEMPLATE_KWARGS & set(options))
    if refused:
        raise bad_request(
            f"chat_template_kwargs may not set {refused[0]}: the server renders the model's own template",
            "chat_template_kwargs",
        )
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(options))
    if reserved:
        raise bad_request(
            f"chat_template_kwargs may not set {reserved[0]}: it has a field of its own",
            "chat_template_kwargs",
        )
    if body.continue_final_message:
        options["continue_final_message"] = True
    return options


def _echo_text(body: ChatCompletionRequest) -> str:
    """With ``echo``: the last message's text, where it is the assistant's (the answer continues it)."""
    last = body.messages[-1]
    if not body.echo or last.role != "assistant":
        return ""
    content = _message_dict(last)["content"]
    if isinstance(content, list):
        return "\n".join(str(part.get("text") or "") for part in content)
    return str(content)


class _ChatView:
    def __init__(self, ctx: ServerContext, body: ChatCompletionRequest, generation: Generation) -> None:
        self.ctx = ctx
        self.body = body
        self.generation = generation
        self.id = ctx.new_id("chatcmpl", body.request_id)
        self.token_texts = TokenTexts(ctx.tokenizer)
        self.num_top = body.top_logprobs or 0
        forced = body.tool_choice not in (None, "none", "auto")
        self.tool_calls = ToolCallView(body) if forced else None
        self.echo = _echo_text(body) if self.tool_calls is None else ""
        self.return_ids = body.return_token_ids

    def response(self, results: list[ChoiceResult]) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=index,
                message=self._message(result.text),
                logprobs=self._logprobs(result),
                finish_reason=self._finish_reason(result.text, result.finish_reason),
                stop_reason=result.stop_reason,
                token_ids=result.token_ids if self.return_ids else None,
            )
            for index, result in enumerate(results)
        ]
        return ChatCompletionResponse(
            id=self.id,
            created=self.generation.created,
            model=self.ctx.settings.served_model_name,
            choices=choices,
            usage=usage_info(self.generation, sum(len(result.token_ids) for result in results)),
            prompt_logprobs=self._prompt_logprobs(results[0]),
            prompt_token_ids=self._prompt_ids(),
        )

    def _prompt_logprobs(self, result: ChoiceResult) -> PromptLogprobsOut | None:
        if self.body.prompt_logprobs is None or result.prompt_logprobs is None:
            return None
        return prompt_logprobs_out(result.prompt_logprobs, self.token_texts, self.body.prompt_logprobs)

    def _prompt_ids(self) -> list[int] | None:
        return self.generation.prompt_token_ids[0] if self.return_ids else None

    def _message(self, text: str) -> ChatMessageOut:
        if self.tool_calls is None:
            return ChatMessageOut(content=self.echo + text)
        return self.tool_calls.message(text)

    def _finish_reason(self, text: str, reason: str | None) -> str | None:
        return reason if self.tool_calls is None else self.tool_calls.finish_reason(text, reason)

    def _logprobs(self, result: ChoiceResult) -> ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        tokens = LogprobTokens(self.token_texts, self.body.return_tokens_as_token_ids)
        return chat_logprobs(result.logprobs, tokens, self.num_top)

    async def chunks(self) -> AsyncIterator[str]:
        for index in range(self.generation.num_choices):
            role = DeltaMessage(role="assistant", content="")
            chunk = self._chunk([ChatChunkChoice(index=index, delta=role)], self._usage(0))
            chunk.prompt_token_ids = self._prompt_ids()
            yield sse(chunk)
            if self.echo:
                echoed = ChatChunkChoice(index=index, delta=DeltaMessage(content=self.echo))
                yield sse(self._chunk([echoed], self._usage(0)))
        num_tokens = 0
        choice_tokens = [0] * self.generation.num_choices
        texts = [""] * self.generation.num_choices
        async for index, delta in self.generation.deltas():
            step = ChoiceResult()
            step.apply(delta)
            num_tokens += len(delta.new_token_ids)
            choice_tokens[index] += len(delta.new_token_ids)
            texts[index] += step.text
            message = self._delta_message(index, step.text, delta.finished)
            logprobs = self._logprobs(step)
            ids_due = self.return_ids and bool(step.token_ids)
            if (
                message is not None
                or delta.finished
                or (logprobs is not None and logprobs.content)
                or ids_due
            ):
                empty = DeltaMessage(content="" if self.tool_calls is None else None)
                choice = self._stream_choice(index, step, message or empty, logprobs)
                choice.finish_reason = self._finish_reason(texts[index], step.finish_reason)
                yield sse(self._chunk([choice], self._usage(choice_tokens[index])))
        if self.body.include_usage:
            yield sse(self._chunk([], usage_info(self.generation, num_tokens)))
        yield SSE_DONE

    def _delta_message(self, index: int, text: str, finished: bool) -> DeltaMessage | None:
        if self.tool_calls is not None:
            return self.tool_calls.delta(index, text, finished)
        return DeltaMessage(content=text) if text else None

    def _stream_choice(
        self, index: int, step: ChoiceResult, message: DeltaMessage, logprobs: ChatLogprobs | None
    ) -> ChatChunkChoice:
        return ChatChunkChoice(
            index=index,
            delta=message,
            logprobs=logprobs,
            finish_reason=step.finish_reason,
            stop_reason=step.stop_reason,
            token_ids=step.token_ids if self.return_ids else None,
        )

    def _usage(self, completion_tokens: int) -> UsageInfo | None:
        """With ``continuous_usage_stats``: the prompt and the choice's tokens so far, in every chunk."""
        if not (self.body.include_usage and self.body.continuous_usage):
            return None
        prompt_tokens = self.generation.num_prompt_tokens
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id,
            created=self.generation.created,
            model=self.ctx.settings.served_model_name,
            choices=choices,
            usage=usage,
        )
