"""The offline API: ``LLM(model).generate(prompts, sampling_params)`` in the shape users know from vLLM."""

import contextlib
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeAlias, cast

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.errors import TokenmillError
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.parallel.launcher import TensorParallelError
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.scheduler import SchedulerStats
from tokenmill.tokenizer import Tokenizer
from tokenmill.tokenizer.token_texts import TokenTexts

Prompt: TypeAlias = str | Mapping[str, Any]  # text, or {"prompt_token_ids": [...]} (with "cache_salt")
Message: TypeAlias = Mapping[str, Any]


class LLM:
    """Loads a model (``None``: the embedded default) and runs batches of prompts to completion.

    ``engine_options`` are :class:`EngineConfig` fields, e.g.
    ``LLM(kv_cache="contiguous", batching="static")``; or pass a ready ``engine``.
    """

    def __init__(
        self, model: str | None = None, *, engine: LLMEngine | None = None, **engine_options: Any
    ) -> None:
        self.engine = engine or LLMEngine(EngineConfig(model=model).with_options(**engine_options))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel worker processes, if it has any."""
        self.engine.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        if self.engine.tokenizer is None:
            raise TokenmillError("this model was loaded without a tokenizer")
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters ``generate`` and ``chat`` use when given none: SamplingParams' defaults
        with the model's generation config over them (``generation_config``, ``override_generation_config``;
        "vllm" leaves SamplingParams' own)."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: int | Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in the order given; ``sampling_params`` None takes
        :meth:`get_default_sampling_params`. ``priority`` (one for all prompts, or one per prompt; lower is
        served first) needs ``scheduling_policy="priority"``. A prompt dict may carry a ``cache_salt``
        (vLLM's): it shares prefix-cache blocks only with prompts of the same salt."""
        if not isinstance(prompts, str | Mapping | Iterable):
            raise TokenmillError(f"prompts must be a prompt or a list of prompts, got {prompts!r}")
        prompt_list = [prompts] if isinstance(prompts, str | Mapping) else list(prompts)
        given = self.get_default_sampling_params() if sampling_params is None else sampling_params
        params_list = _params_per_prompt(given, len(prompt_list))
        priorities = _priority_per_prompt(priority, len(prompt_list))
        outputs: dict[str, RequestOutput] = {}
        try:
            for prompt, params, request_priority in zip(prompt_list, params_list, priorities, strict=True):
                request_id = str(next(self._ids))
                text, prompt_input = _split_prompt(prompt)
                salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None
                prompt_ids = self.engine.add_request(request_id, prompt_input, params, request_priority, salt)
                completions = [CompletionOutput(index=i) for i in range(params.n)]
                outputs[request_id] = RequestOutput(request_id, text, prompt_ids, completions)
            self._run(outputs, use_tqdm)
        except BaseException:
            for request_id in outputs:
                self.engine.abort(request_id)
            with contextlib.suppress(TensorParallelError):  # workers stopped by the failure: nothing to drain
                while self.engine.has_unfinished_requests():
                    self.engine.step()
            raise
        return list(outputs.values())

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
        priority: int | Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate
        (``priority`` as for :meth:`generate`, one per conversation)."""
        is_single = bool(messages) and isinstance(messages[0], Mapping)
        conversations = (
            [cast(Sequence[Message], messages)] if is_single else cast(Sequence[Sequence[Message]], messages)
        )
        tokenizer = self.get_tokenizer()
        prompts = [
            {"prompt_token_ids": tokenizer.apply_chat_template(list(c), add_generation_prompt, tokenize=True)}
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, priority=priority)

    def scheduler_stats(self) -> SchedulerStats:
        """Preemptions and prefix-cache queries / hits (in prompt tokens) since the engine started."""
        return self.engine.scheduler_stats()

    def _run(self, outputs: dict[str, RequestOutput], use_tqdm: bool) -> None:
        progress = _progress_bar(len(outputs)) if use_tqdm else None
        tokenizer = self.engine.tokenizer
        token_texts = TokenTexts(tokenizer) if tokenizer is not None else None
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                output = outputs[delta.request_id]
                output.apply(delta, token_texts)
                if progress is not None and output.finished:
                    progress.update(1)
        if progress is not None:
            progress.close()


def _split_prompt(prompt: Prompt) -> tuple[str | None, str | list[int]]:
    """(the prompt's text if known, what to tokenize or the token ids)."""
    if isinstance(prompt, str):
        return prompt, prompt
    if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
            raise TokenmillError(f"prompt_token_ids must be a list of token ids, got {ids!r}")
        return prompt.get("prompt"), list(ids)
    if isinstance(prompt, Mapping) and "prompt" in prompt:
        return str(prompt["prompt"]), str(prompt["prompt"])
    raise TokenmillError(
        f"a prompt must be a string or a dict with 'prompt' or 'prompt_token_ids', got {prompt!r}"
    )


def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams], count: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * count
    if not isinstance(params, Sequence) or not all(isinstance(p, SamplingParams) for p in params):
        raise TokenmillError(
            f"sampling_params must be a SamplingParams or a list of them (one per prompt), got {params!r}"
        )
    if len(params) != count:
        raise TokenmillError(f"got {len(params)} sampling params for {count} prompts")
    return list(params)


def _priority_per_prompt(priority: int | Sequence[int] | None, count: int) -> list[int]:
    if priority is None:
        return [0] * count
    if isinstance(priority, int):
        return [priority] * count
    if isinstance(priority, str | bytes) or not isinstance(priority, Sequence):
        raise TokenmillError(f"priority must be an integer, or a list of one per prompt, got {priority!r}")
    if len(priority) != count:
        raise TokenmillError(f"got {len(priority)} priorities for {count} prompts; give one per prompt")
    return list(priority)


def _progress_bar(total: int):  # type: ignore[no-untyped-def]
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req")
