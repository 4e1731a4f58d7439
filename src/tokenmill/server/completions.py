"""``POST /v1/completions`` (OpenAI's legacy completions, streamed or not) and ``POST /generate``."""

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tokenmill.outputs import RowLogprobs
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.errors import bad_request
from tokenmill.server.generation import ChoiceResult, Generation, ServerContext
from tokenmill.server.logprobs import (
    LogprobTokens,
    TokenTexts,
    completion_logprobs,
    echo_logprobs,
    join_completion_logprobs,
    prompt_logprobs_out,
    text_length,
)
from tokenmill.server.prompts import engine_prompt
from tokenmill.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    GenerateRequest,
    PromptInput,
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
from tokenmill.server.sampling import (
    check_sequence_count,
    completion_params,
    default_or_max_tokens,
    make_params,
)
from tokenmill.server.structured import constrained, structured_outputs_of

router = APIRouter()


def normalise_prompts(prompt: PromptInput) -> list[str | list[int]]:
    """One text or token id list per prompt."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(item, int) for item in prompt):
        return [[int(item) for item in prompt]]  # type: ignore[arg-type]
    return [item if isinstance(item, str) else _token_ids(item) for item in prompt]


def _token_ids(item: object) -> list[int]:
    assert isinstance(item, list)
    return [int(token) for token in item]


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    ctx = context(request)
    ctx.check_model(body.model)
    prompts = normalise_prompts(body.prompt)
    params = completion_params(body, len(prompts), ctx.facts.sampling_defaults)
    params = await constrained(ctx.grammars, params, structured_outputs_of(body))
    special = None if body.add_special_tokens else False
    engine_prompts = await ctx.run_text_work(
        lambda: [engine_prompt(ctx, prompt, special, body.truncate_prompt_tokens) for prompt in prompts]
    )
    generation = await ctx.start(engine_prompts, params, request, body.priority, body.cache_salt)
    view = _CompletionView(ctx, body, params, prompts, generation)
    if body.stream:
        return await streaming_response(generation, view.chunks())
    return await json_response_when_done(generation, view.response)


class _CompletionView:
    """Turns one completion request's outputs into OpenAI's response or stream chunks."""

    def __init__(
        self,
        ctx: ServerContext,
        body: CompletionRequest,
        params: SamplingParams,
        prompts: list[str | list[int]],
        generation: Generation,
    ) -> None:
        self.ctx = ctx
        self.body = body
        self.params = params
        self.prompts = prompts
        self.generation = generation
        self.id = ctx.new_id("cmpl", body.request_id)
        self.token_texts = TokenTexts(ctx.tokenizer) if ctx.has_tokenizer else None

    def echo_text(self, prompt_index: int) -> str:
        """The prompt as sent, or for token ids (or a cut prompt) their text with special tokens shown, as
        the echoed logprobs name them, so that ``text_offset`` points into this text."""
        prompt = self.prompts[prompt_index]
        if isinstance(prompt, str) and self.body.truncate_prompt_tokens is None:
            return prompt
        ids = self.generation.prompt_token_ids[prompt_index]
        return self.ctx.tokenizer.decode(ids, skip_special_tokens=False)

    def response(self, results: list[ChoiceResult]) -> CompletionResponse:
        choices = [self._choice(index, result) for index, result in enumerate(results)]
        return CompletionResponse(
            id=self.id,
            created=self.generation.created,
            model=self.ctx.settings.served_model_name,
            choices=choices,
            usage=usage_info(self.generation, sum(len(result.token_ids) for result in results)),
        )

    def _choice(self, index: int, result: ChoiceResult) -> CompletionChoice:
        prompt_index = index // self.generation.n
        text = self.echo_text(prompt_index) + result.text if self.body.echo else result.text
        logprobs = None
        if self.body.logprobs is not None:
            echoed = result.prompt_logprobs if self.body.echo else None
            logprobs = self._logprobs(prompt_index, echoed, result, 0)
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=result.finish_reason,
            stop_reason=result.stop_reason,
            prompt_logprobs=self._prompt_logprobs(result),
            prompt_token_ids=self._prompt_ids(prompt_index),
            token_ids=result.token_ids if self.body.return_token_ids else None,
        )

    def _prompt_logprobs(self, result: ChoiceResult) -> PromptLogprobsOut | None:
        if self.body.prompt_logprobs is None or result.prompt_logprobs is None:
            return None
        assert self.token_texts is not None
        return prompt_logprobs_out(result.prompt_logprobs, self.token_texts, self.body.prompt_logprobs)

    def _prompt_ids(self, prompt_index: int) -> list[int] | None:
        return self.generation.prompt_token_ids[prompt_index] if self.body.return_token_ids else None

    def _logprobs(
        self,
        prompt_index: int,
        prompt_entries: list[RowLogprobs | None] | None,
        result: ChoiceResult,
        text_offset: int,
    ) -> CompletionLogprobs:
        assert self.token_texts is not None
        tokens = LogprobTokens(self.token_texts, self.body.return_tokens_as_token_ids)
        if prompt_entries is None:
            return completion_logprobs(result.logprobs, tokens, text_offset)
        prompt_ids = self.generation.prompt_token_ids[prompt_index]
        echoed = echo_logprobs(prompt_ids, prompt_entries, tokens, self.body.logprobs or 0)
        text_offset += text_length(prompt_ids, self.token_texts)
        return join_completion_logprobs(echoed, completion_logprobs(result.logprobs, tokens, text_offset))

    def _text_length(
        self, prompt_index: int, prompt_entries: list[RowLogprobs | None] | None, step: ChoiceResult
    ) -> int:
        """How far a chunk's logprobs move the text offset: its echoed prompt's and tokens' texts."""
        assert self.token_texts is not None
        echoed = self.generation.prompt_token_ids[prompt_index] if prompt_entries is not None else []
        return text_length([*echoed, *(entry.token_id for entry in step.logprobs)], self.token_texts)

    async def chunks(self) -> AsyncIterator[str]:
        num_tokens = [0] * self.generation.num_choices
        text_offsets = [0] * self.generation.num_choices
        started: set[int] = set()  # choices whose first chunk went out
        async for index, delta in self.generation.deltas():
            step = ChoiceResult()
            step.apply(delta)
            num_tokens[index] += len(delta.new_token_ids)
            text, prompt_entries = step.text, None
            prompt_index = index // self.generation.n
            first = index not in started
            started.add(index)
            if first and self.body.echo:
                text = self.echo_text(prompt_index) + text
                prompt_entries = step.prompt_logprobs
            logprobs = None
            if self.body.logprobs is not None:
                logprobs = self._logprobs(prompt_index, prompt_entries, step, text_offsets[index])
                text_offsets[index] += self._text_length(prompt_index, prompt_entries, step)
            if text or delta.finished or (logprobs is not None and logprobs.tokens) or self._ids_due(step):
                choice = self._stream_choice(index, text, logprobs, step)
                if first:
                    choice.prompt_token_ids = self._prompt_ids(prompt_index)
                usage = self._choice_usage(prompt_index, num_tokens[index])
                yield sse(self._chunk([choice], usage))
        if self.body.include_usage:
            yield sse(self._chunk([], usage_info(self.generation, sum(num_tokens))))
        yield SSE_DONE

    def _stream_choice(
        self, index: int, text: str, logprobs: CompletionLogprobs | None, step: ChoiceResult
    ) -> CompletionChoice:
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=step.finish_reason,
            stop_reason=step.stop_reason,
            token_ids=step.token_ids if self.body.return_token_ids else None,
        )

    def _ids_due(self, step: ChoiceResult) -> bool:
        """New token ids go out with ``return_token_ids`` even where they bring no text yet."""
        return self.body.return_token_ids and bool(step.token_ids)

    def _choice_usage(self, prompt_index: int, completion_tokens: int) -> UsageInfo | None:
        """With ``continuous_usage_stats``: the choice's prompt and its tokens so far, in every chunk."""
        if not (self.body.include_usage and self.body.continuous_usage):
            return None
        prompt_tokens = len(self.generation.prompt_token_ids[prompt_index])
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )

    def _chunk(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionResponse:
        return CompletionResponse(
            id=self.id,
            created=self.generation.created,
            model=self.ctx.settings.served_model_name,
            choices=choices,
            usage=usage,
        )


# vLLM's extras that /v1/completions answers and /generate's plain answer has no place for.
_NOT_ON_GENERATE = ("prompt_logprobs", "return_token_ids", "truncate_prompt_tokens", "request_id")
# /v1/completions' own fields, which /generate would otherwise take as unknown extras and ignore.
_COMPLETIONS_ONLY = ("logprobs", "echo", "best_of", "suffix")


@router.post("/generate", response_model=None)
async def generate(body: GenerateRequest, request: Request) -> Response:
    """For curl users: ``{"prompt": ..., "max_tokens": ...}`` in, ``{"text": ...}`` out."""
    ctx = context(request)
    ctx.check_model(body.model)
    check_sequence_count(body.n, 1)
    extra = body.model_extra or {}
    asked = [name for name in _NOT_ON_GENERATE if name in body.model_fields_set]
    asked += [name for name in _COMPLETIONS_ONLY if extra.get(name) not in (None, False)]
    asked += ["stream"] if body.stream else []  # its answer is one JSON object
    if asked:
        raise bad_request(f"'{asked[0]}' is not supported on /generate; use /v1/completions", asked[0])
    defaults = ctx.facts.sampling_defaults
    params = make_params(body, defaults, max_tokens=default_or_max_tokens(body, defaults))
    params = await constrained(ctx.grammars, params, structured_outputs_of(body))
    prompt = await ctx.run_text_work(lambda: engine_prompt(ctx, body.prompt, None, None))
    generation = await ctx.start([prompt], params, request, body.priority, body.cache_salt)

    def build(results: list[ChoiceResult]) -> dict[str, Any]:
        completion_tokens = sum(len(result.token_ids) for result in results)
        return {
            "text": results[0].text,
            "choices": [{"text": r.text, "finish_reason": r.finish_reason} for r in results],
            "usage": usage_info(generation, completion_tokens).model_dump(),
        }

    return await json_response_when_done(generation, build)
