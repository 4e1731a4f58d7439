"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests take the parameters vLLM honours (OpenAI's plus ``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``, ``min_tokens``, ``skip_special_tokens``,
``spaces_between_special_tokens``, ``include_stop_str_in_output``, ``allowed_token_ids``, ``bad_words``,
``priority``, and structured outputs: ``response_format``, ``structured_outputs``, the older ``guided_*``
fields, and on chat ``tools`` with ``tool_choice``) and vLLM's extras (``prompt_logprobs``,
``return_token_ids``, ``return_tokens_as_token_ids``, ``cache_salt``, ``truncate_prompt_tokens``,
``add_special_tokens``, chat's ``echo`` and ``continue_final_message``, ...).
A top-level body keeps the fields it does not declare in ``model_extra``: ``request_checks`` refuses
those OpenAI or vLLM define but tokenmill does not implement, and ignores the rest. Types are checked
here; ranges are checked by ``SamplingParams``, whose errors name the parameter.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

# Text, texts, token ids, or lists of token ids.
PromptInput = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, Field(strict=True, ge=INT64_MIN, le=INT64_MAX)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Body(BaseModel):
    """A whole request body: undeclared fields are kept (``model_extra``) to be refused or ignored."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # usage in every chunk, counting the tokens so far


class JsonSchemaFormat(_Request):
    name: StrictStr | None = None
    description: StrictStr | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's ``structured_outputs`` body field: set one of the constraints."""

    model_config = ConfigDict(extra="allow")  # vLLM's other keys, checked in server/structured.py

    json_: dict[str, Any] | StrictStr | StrictBool | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool = False


class SamplingRequest(_Body):
    """Fields shared by completions and chat completions. None means the default."""

    model: StrictStr | None = None
    n: StrictInt = 1
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    seed: Int64 | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    logit_bias: dict[str, StrictFloat] | None = None
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[StrictStr] | None = None
    return_tokens_as_token_ids: StrictBool = False  # logprobs name tokens "token_id:<id>"
    cache_salt: StrictStr | None = None  # prefix-cache blocks are shared only within one salt
    user: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    priority: StrictInt = 0  # lower is served first; non-zero needs the engine's "priority" policy
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    prompt_logprobs: StrictInt | None = None
    return_token_ids: StrictBool = False  # vLLM's: prompt_token_ids and token_ids in the response
    truncate_prompt_tokens: StrictInt | None = None  # keep the prompt's last k tokens; -1: max_model_len
    request_id: StrictStr | None = None  # the response's id is built from it

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    prompt: PromptInput
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None
    add_special_tokens: StrictBool = True


class ContentPart(_Request):
    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(_Request):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ... go to the chat template as they are
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None


class FunctionDefinition(_Request):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: StrictStr


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    echo: StrictBool = False  # start the answer with the last message when it is the assistant's
    add_special_tokens: StrictBool | None = None  # None: a BOS only where the template brings none
    chat_template_kwargs: dict[str, Any] | None = None


class GenerateRequest(SamplingRequest):
    """``POST /generate``: a prompt and sampling parameters in, the text out."""

    prompt: StrictStr | list[StrictInt]
    max_tokens: StrictInt | None = 16


class TokenizeRequest(_Request):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Request):
    model: StrictStr | None = None
    tokens: list[StrictInt]


# -- responses ----------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class LogprobOut(BaseModel):
    """vLLM's per-token entry of ``prompt_logprobs``, keyed by the token id."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobsOut = list[dict[str, LogprobOut] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsOut | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsOut | None = None
    prompt_token_ids: list[int] | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tokenmill"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def as_dict(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
