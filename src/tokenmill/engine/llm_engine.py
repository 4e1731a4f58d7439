"""``LLMEngine``: requests in, per-step token deltas out. The server and the offline ``LLM`` sit on it.

Each ``step()`` runs one forward pass for every scheduled request and returns what each sequence
gained; ``add_request`` and ``abort`` may be called between steps.
"""

import dataclasses
import logging
import time
from collections.abc import Sequence

import torch

from tokenmill.attention import AttentionBackend, TorchAttentionBackend
from tokenmill.config import EngineConfig
from tokenmill.engine.stop_strings import TextOutput
from tokenmill.errors import TokenmillError
from tokenmill.kernels.options import KernelOptions, resolve_kernel_toggle
from tokenmill.loading import LoadedModel, load_model
from tokenmill.models.layers.cpu_linear import prepack_linear_weights
from tokenmill.outputs import RequestDelta, RowLogprobs
from tokenmill.runner.cuda_graphs import cuda_graph_sizes
from tokenmill.runner.kv_cache import KVCache, create_kv_cache
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.scheduler import Scheduler, SchedulerStats
from tokenmill.sequence import FinishReason, Request
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN = 8192


class InvalidRequestError(TokenmillError, ValueError):
    """The request cannot be served as asked; the message names the parameter and the limit."""


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device '{device}' is not a valid torch device (try cpu, cuda, cuda:1)") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device '{device}' was asked for but CUDA is not available here")
    return resolved


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.loaded = loaded or load_model(
            config.model,
            device=self.device,
            dtype=config.dtype,
            load_format=config.load_format,
            max_model_len=config.max_model_len,
            seed=config.seed,
        )
        self.model_config = self.loaded.config
        self.tokenizer: Tokenizer | None = self.loaded.tokenizer
        self.max_model_len = self._max_model_len()
        self.eos_token_ids = self._eos_token_ids()
        dtype = next(self.loaded.model.parameters()).dtype
        kernel_options = self._kernel_options()
        self.loaded.model.use_kernels(kernel_options)  # before the runner (and any graph capture)
        prepack_linear_weights(self.loaded.model, config.prepacked_cpu_linear)
        attention = self._attention_backend(kernel_options.pdl)
        self.runner = ModelRunner(self.loaded.model, None, attention, self.device)
        self.runner.sampler.use_triton = resolve_kernel_toggle("sampling", config.fused_sampling, self.device)
        # On CUDA the pool is sized after profiling the largest step through the runner.
        self.kv_cache: KVCache | None = create_kv_cache(
            config, self.model_config, self.max_model_len, self.device, dtype, self.runner.profile_forward
        )
        self.runner.kv_cache = self.kv_cache
        self.scheduler = Scheduler(config, self.kv_cache)
        self.runner.capture_decode_graphs(
            cuda_graph_sizes(config, self.device),
            self.max_model_len,
            overlap=config.overlap_decode,
            requests_waiting=self._may_admit_next_step,
            logits_in_graph=config.cuda_graph_logits,
        )
        self.sequences: dict[str, list[Request]] = {}
        self.texts: dict[Request, TextOutput] = {}
        self._pending: list[RequestDelta] = []
        torch.manual_seed(config.seed)

    def _may_admit_next_step(self) -> bool:
        """Whether the next step may admit a waiting request (so it would differ from this one)."""
        return bool(self.scheduler.waiting) and len(self.scheduler.running) < self.config.max_running

    def _kernel_options(self) -> KernelOptions:
        """The model layers' fused kernels, from the ``fused_*`` toggles (None: on with CUDA + Triton)."""
        config = self.config
        return KernelOptions.resolve(
            self.device,
            config.fused_rms_norm,
            config.fused_rotary,
            config.fused_activation,
            config.fused_gemv,
            config.programmatic_launch,
        )

    def _attention_backend(self, pdl: bool) -> AttentionBackend:
        if self.config.attention_backend == "torch":
            return TorchAttentionBackend()
        from tokenmill.attention.triton_backend import TritonAttentionBackend
        from tokenmill.kernels import triton_available

        if not triton_available(self.device.type):
            raise ValueError(
                "attention_backend 'triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1 on CPU)"
            )
        fused = resolve_kernel_toggle("decode_rotary_kv", self.config.fused_decode_rotary_kv, self.device)
        return TritonAttentionBackend(pdl=pdl, fused_decode_rotary_kv=fused)

    def _max_model_len(self) -> int:
        model_limit = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len or min(model_limit, DEFAULT_MAX_MODEL_LEN)
        if wanted > model_limit:
            raise ValueError(f"max_model_len {wanted} exceeds the model's limit of {model_limit} positions")
        if self.config.max_num_batched_tokens < wanted and not self.config.chunked_prefill:
            raise ValueError(
                f"max_num_batched_tokens ({self.config.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({wanted}): a full-length prompt could never be scheduled "
                "(turn on chunked_prefill to split prompts across steps)"
            )
        return wanted

    def _eos_token_ids(self) -> frozenset[int]:
        ids = set(self.loaded.eos_token_ids)
        if not ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # -- requests ---------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        priority: int = 0,
    ) -> list[int]:
        """Queue a request (``params.n`` sequences); returns its prompt token ids. ``priority``: lower is
        served first, under the ``priority`` scheduling policy only."""
        params = params or SamplingParams()
        if request_id in self.sequences:
            raise InvalidRequestError(f"request id '{request_id}' is already in use")
        self._check_priority(priority)
        prompt_ids = self._prompt_ids(prompt)
        max_tokens = self._check_lengths(len(prompt_ids), params)
        self._check_token_ids(params)
        children = []
        for index in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = dataclasses.replace(params, seed=params.seed + index)
            child_id = request_id if params.n == 1 else f"{request_id}[{index}]"
            request = Request(
                child_id,
                prompt_ids,
                child_params,
                max_tokens,
                self.eos_token_ids,
                priority=priority,
                parent_id=request_id,
                index=index,
            )
            self.texts[request] = TextOutput(
                self.tokenizer, prompt_ids, params.stop, params.skip_special_tokens
            )
            children.append(request)
        self.sequences[request_id] = children
        for request in children:
            self.scheduler.add(request)
        return prompt_ids

    def _check_priority(self, priority: int) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise InvalidRequestError(
                f"Got priority {priority} but Priority scheduling is not enabled "
                "(set scheduling_policy='priority')"
            )

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer: pass prompt token ids instead of text"
                )
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return ids

    def _check_lengths(self, prompt_len: int, params: SamplingParams) -> int:
        limit = self.max_model_len
        if prompt_len >= limit:
            raise InvalidRequestError(
                f"the prompt has {prompt_len} tokens, which leaves no room to generate within the "
                f"context limit of {limit} tokens"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise InvalidRequestError(
                f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) is "
                f"{prompt_len + max_tokens} tokens, beyond the context limit of {limit} tokens"
            )
        if self.kv_cache is not None and prompt_len + max_tokens > self.kv_cache.capacity_tokens:
            raise InvalidRequestError(
                f"the request needs up to {prompt_len + max_tokens} tokens of KV cache, more than the whole "
                f"pool holds ({self.kv_cache.capacity_tokens} tokens)"
            )
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none")
        return max_tokens

    def _check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", list(params.logit_bias or {})),
        ):
            bad = [t for t in ids if not 0 <= int(t) < vocab]
            if bad:
                raise InvalidRequestError(
                    f"{name} holds token id {bad[0]}, outside the vocabulary [0, {vocab})"
                )

    def abort(self, request_id: str) -> None:
        """Stop ``request_id`` now: its KV blocks are freed at once, and the next ``step()`` reports it."""
        for request in self.sequences.get(request_id, []):
            if not request.is_finished:
                self.scheduler.finish(request, FinishReason.ABORT)
                self._pending.append(self._delta(request, [], None))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._pending)

    # -- stepping ---------------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            deltas, self._pending = self._pending, []
            return self._forget_finished(deltas)
        result = self.runner.execute(scheduled.chunks)  # if it raises, pending abort deltas are kept
        deltas, self._pending = self._pending, []
        recompute = self.kv_cache is None
        for chunk in scheduled.chunks:
            request = chunk.request
            request.num_computed_tokens = 0 if recompute else chunk.end
            self.scheduler.cache_computed_blocks(request)
            request.prompt_logprobs.extend(result.prompt_logprobs.get(request, []))
            if request in result.sampled:
                token, logprob = result.sampled[request]
                deltas.append(self._append_token(request, token, logprob))
        if self.config.debug_checks:
            self.scheduler.check_integrity()
        return self._forget_finished(deltas)

    def _append_token(self, request: Request, token: int, logprob: RowLogprobs | None) -> RequestDelta:
        first_delta = request.num_output_tokens == 0
        request.token_ids.append(token)
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        reason, stop_reason = self._finish_reason(request, token)
        text = self.texts[request]
        stop_string = text.append([token], check_stop=request.num_output_tokens >= request.params.min_tokens)
        if stop_string is not None and reason is None:
            reason, stop_reason = FinishReason.STOP, stop_string
        if reason is not None:
            if not isinstance(stop_reason, str):
                text.finish()
            self.scheduler.finish(request, reason)
            request.stop_reason = stop_reason
        delta = self._delta(request, [token], logprob)
        if first_delta and request.params.prompt_logprobs is not None:
            delta.prompt_logprobs = [None, *request.prompt_logprobs]
        return delta

    def _finish_reason(self, request: Request, token: int) -> tuple[FinishReason | None, int | str | None]:
        if token in request.params.stop_token_ids:
            return FinishReason.STOP, token
        if token in request.eos_token_ids and not request.params.ignore_eos:
            return FinishReason.STOP, None
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def _delta(self, request: Request, tokens: list[int], logprob: RowLogprobs | None) -> RequestDelta:
        finished = request.is_finished
        return RequestDelta(
            request_id=request.parent_id or request.request_id,
            index=request.index,
            new_token_ids=tokens,
            new_text=self.texts[request].release(finished),
            new_logprobs=[logprob] if logprob is not None else None,
            finish_reason=str(request.finish_reason) if finished and request.finish_reason else None,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
        )

    def _forget_finished(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        for delta in deltas:
            if delta.finished:
                children = self.sequences.get(delta.request_id, [])
                if all(child.is_finished for child in children):
                    for child in children:
                        self.texts.pop(child, None)
                    self.sequences.pop(delta.request_id, None)
        return deltas

    # -- introspection ----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def scheduler_stats(self) -> SchedulerStats:
        """A copy of the scheduler's counters: preemptions, prefix-cache queries and hits (in tokens)."""
        return dataclasses.replace(self.scheduler.stats)

    def kv_cache_usage(self) -> float:
        return self.kv_cache.manager.usage() if self.kv_cache is not None else 0.0
