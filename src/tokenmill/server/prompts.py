"""Prompts as the engine gets them: token ids, tokenized here (the HTTP process) so the engine's steps
never wait on a tokenizer, as the request says (``add_special_tokens``), and cut where it says
(``truncate_prompt_tokens``: keep the last k tokens, -1 meaning the context length). Without a
tokenizer a text prompt goes as it is, and the engine refuses it with its own message.

Tokenizing runs in the server's text thread (:meth:`ServerContext.run_text_work`), not on the event loop,
so a long prompt does not hold up the other requests' streams; text that cannot fit the context whatever
its tokens is refused before it is tokenized."""

from tokenmill.errors import TokenizerError
from tokenmill.server.errors import bad_request
from tokenmill.server.generation import ServerContext


def engine_prompt(
    ctx: ServerContext,
    prompt: str | list[int],
    add_special_tokens: bool | None,
    truncate_prompt_tokens: int | None,
    field: str = "prompt",
) -> str | list[int]:
    """``prompt`` as the engine should take it. ``add_special_tokens`` None: the engine's own encoding (a
    BOS where the model wants one and the text brings none). Text that cannot be tokenized, or is too long
    for the context whatever its tokens, is a 400 naming ``field``."""
    if isinstance(prompt, str) and ctx.has_tokenizer:
        if truncate_prompt_tokens is None:
            check_fits(ctx, prompt, field)
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        prompt = encode(ctx, prompt, field, **special)
    if truncate_prompt_tokens is None:
        return prompt
    ids = encode(ctx, prompt, field) if isinstance(prompt, str) else prompt
    keep = ctx.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    return ids[-keep:]


def encode(ctx: ServerContext, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
    try:
        return ctx.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except TokenizerError as exc:
        raise bad_request(f"'{field}': {exc}", field) from None


def check_fits(ctx: ServerContext, text: str, field: str) -> None:
    """Refuse text longer than the context could hold even if every token were the vocabulary's longest."""
    longest = ctx.max_model_len * ctx.tokenizer.max_token_chars
    if len(text) > longest:
        raise bad_request(
            f"'{field}' is {len(text):,} characters long: more than the {ctx.max_model_len:,}-token context "
            f"can hold (a token of this model holds at most {ctx.tokenizer.max_token_chars} characters)",
            field,
        )


def is_rewritten(add_special_tokens: bool | None, truncate_prompt_tokens: int | None) -> bool:
    """Whether a text prompt reaches the engine as other text than it was sent as."""
    return add_special_tokens is False or truncate_prompt_tokens is not None
