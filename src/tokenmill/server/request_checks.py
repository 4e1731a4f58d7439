"""Request fields that cannot be honoured: refused with a 400 naming them, never silently ignored.

A field that OpenAI or vLLM defines but tokenmill does not implement is refused unless it holds its no-op
value (``use_beam_search: false`` is fine, ``true`` is not). Fields neither defines are ignored, with a
debug log, so clients written for other servers keep working. Combinations OpenAI and vLLM refuse are
refused here too.
"""

import logging
from typing import Any

from tokenmill.server.errors import bad_request
from tokenmill.server.protocol import ChatCompletionRequest, SamplingRequest, TokenizeRequest

logger = logging.getLogger(__name__)

_ABSENT = (None,)

# Defined by OpenAI or vLLM, not implemented: field -> the values that ask for nothing.
_UNIMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "logits_processors": (None, []),
    "kv_transfer_params": _ABSENT,
    "vllm_xargs": _ABSENT,
    "prompt_embeds": _ABSENT,
    "mm_processor_kwargs": _ABSENT,
    "guided_decoding_backend": _ABSENT,
    "guided_whitespace_pattern": _ABSENT,
    "structural_tag": _ABSENT,
    "chat_template": _ABSENT,
    "documents": _ABSENT,
    "reasoning_effort": _ABSENT,
    "include_reasoning": (None, True),
    "parallel_tool_calls": (None, True),
    "audio": _ABSENT,
    "modalities": (None, ["text"]),
    "prediction": _ABSENT,
    "functions": _ABSENT,
    "function_call": _ABSENT,
    "web_search_options": _ABSENT,
    "store": (None, False),
    "metadata": _ABSENT,
    "service_tier": (None, "auto", "default"),
    "verbosity": _ABSENT,
}

# Defined by OpenAI as hints with no effect on the output: accepted and ignored on purpose.
_IGNORED_HINTS = frozenset({"prompt_cache_key", "safety_identifier"})


def check_request(body: SamplingRequest) -> None:
    """Refuse what the body asks for and tokenmill cannot do; a 400 naming the field."""
    _refuse_unimplemented(body.model_extra or {})
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if body.cache_salt is not None and not body.cache_salt:
        raise bad_request("cache_salt must be a non-empty string", "cache_salt")
    if body.prompt_logprobs is not None and body.stream:
        raise bad_request("prompt_logprobs is not available when stream is true", "prompt_logprobs")
    truncate = body.truncate_prompt_tokens
    if truncate is not None and truncate != -1 and truncate < 1:
        raise bad_request(
            f"truncate_prompt_tokens must be -1 or an integer >= 1, got {truncate}", "truncate_prompt_tokens"
        )
    if isinstance(body, ChatCompletionRequest) and body.continue_final_message:
        check_continue_final_message(body)


def check_continue_final_message(body: ChatCompletionRequest | TokenizeRequest) -> None:
    """Continuing the last message adds no generation prompt; asking for both explicitly is refused."""
    if body.add_generation_prompt and "add_generation_prompt" in body.model_fields_set:
        raise bad_request(
            "continue_final_message and add_generation_prompt cannot both be true", "continue_final_message"
        )
    if not body.messages or body.messages[-1].role != "assistant":
        raise bad_request(
            "continue_final_message needs the last message to be the assistant's", "continue_final_message"
        )


def _refuse_unimplemented(extra: dict[str, Any]) -> None:
    for name, value in extra.items():
        no_op_values = _UNIMPLEMENTED.get(name)
        if no_op_values is None:
            if name not in _IGNORED_HINTS:
                logger.debug("ignoring the request field '%s', which neither OpenAI nor vLLM defines", name)
            continue
        if not any(value == no_op and type(value) is type(no_op) for no_op in no_op_values):
            raise bad_request(f"'{name}' is not supported by this server (got {value!r})", name)
