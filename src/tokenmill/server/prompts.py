"""Prompts as the engine gets them: token ids, tokenized here (the HTTP process) so the engine's steps
never wait on a tokenizer, as the request says (``add_special_tokens``), and cut where it says
(``truncate_prompt_tokens``: keep the last k tokens, -1 meaning the context length). Without a
tokenizer a text prompt goes as it is, and the engine refuses it with its own message."""

from tokenmill.server.generation import ServerContext


def engine_prompt(
    ctx: ServerContext,
    prompt: str | list[int],
    add_special_tokens: bool | None,
    truncate_prompt_tokens: int | None,
) -> str | list[int]:
    """``prompt`` as the engine should take it. ``add_special_tokens`` None: the engine's own encoding (a
    BOS where the model wants one and the text brings none)."""
    if isinstance(prompt, str) and ctx.has_tokenizer:
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        prompt = ctx.tokenizer.encode(prompt, **special)
    if truncate_prompt_tokens is None:
        return prompt
    ids = ctx.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    keep = ctx.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    return ids[-keep:]


def is_rewritten(add_special_tokens: bool | None, truncate_prompt_tokens: int | None) -> bool:
    """Whether a text prompt reaches the engine as other text than it was sent as."""
    return add_special_tokens is False or truncate_prompt_tokens is not None
