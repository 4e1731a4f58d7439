"""Hugging Face transformers as the peer: the same weights, the same workload, in the same process.

The HF model is built from what tokenmill loaded: a GGUF file through transformers' GGUF reader (it
dequantizes the same blocks tokenmill does), a folder through ``from_pretrained``, and dummy weights by
copying tokenmill's tensors into a model made ``from_config`` (fused qkv / gate_up split back apart), so
both produce the same greedy tokens up to floating-point ties.

Three ways of serving the workload are measured: static batches through ``generate`` (left padding and an
attention mask, each batch running to its longest output), one prompt at a time for latency, and
transformers' own continuous batching where the installed version has it.
"""

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.benchmarks.measure import PeakMemory, RunResult, synchronize
from tokenmill.benchmarks.workload import BenchRequest, Workload
from tokenmill.loading import LoadedModel
from tokenmill.models import CausalLM

logger = logging.getLogger(__name__)


class PeerUnavailableError(RuntimeError):
    """The peer cannot run here (missing feature or unsupported model); the message says why."""


class _TokenTimes:
    """A stopping criterion that never stops, called once per generated token: it records the time."""

    def __init__(self, device: torch.device, start: float) -> None:
        self.device = device
        self.start = start
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        synchronize(self.device)
        self.times.append(time.perf_counter() - self.start)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@dataclass
class HFPeer:
    model: Any  # transformers.PreTrainedModel
    device: torch.device
    pad_token_id: int
    eos_token_ids: tuple[int, ...]
    origin: str  # how the weights got here, for the report

    def describe(self) -> str:
        import transformers

        attention = getattr(self.model.config, "_attn_implementation", "?")
        dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        model_class = type(self.model).__name__
        return f"transformers {transformers.__version__} {model_class} ({self.origin}, {dtype}, {attention})"

    # -- generate, static batches ----------------------------------------------------------------

    def generation_config(self, max_new_tokens: int, ignore_eos: bool) -> Any:
        from transformers import GenerationConfig

        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=False,
            num_beams=1,
            eos_token_id=None if ignore_eos else list(self.eos_token_ids),
            pad_token_id=self.pad_token_id,
        )

    def left_pad(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        return ids.to(self.device), mask.to(self.device)

    @torch.inference_mode()
    def generate_batch_once(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, ignore_eos: bool, start: float
    ) -> tuple[list[list[int]], list[float]]:
        """One ``generate`` call; returns each row's new tokens and the time of each generation step."""
        from transformers import StoppingCriteriaList

        input_ids, attention_mask = self.left_pad(prompts)
        recorder = _TokenTimes(self.device, start)
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=self.generation_config(max_new_tokens, ignore_eos),
            stopping_criteria=StoppingCriteriaList([recorder]),
        )
        new_tokens = out[:, input_ids.shape[1] :].tolist()
        return new_tokens, recorder.times

    def run_static(
        self, workload: Workload, batch_size: int, *, progress: Any = None, label: str | None = None
    ) -> RunResult:
        """Batches of ``batch_size`` requests in workload order; only each request's own tokens count."""
        ignore_eos = workload.spec.ignore_eos
        outputs: dict[str, list[int]] = {}
        times: dict[str, list[float]] = {}
        memory = PeakMemory(self.device)
        synchronize(self.device)
        memory.start()
        start = time.perf_counter()
        for batch in _batches(workload.requests, batch_size):
            longest = max(r.output_len for r in batch)
            rows, step_times = self.generate_batch_once(
                [r.prompt_token_ids for r in batch], longest, ignore_eos, start
            )
            for request, row in zip(batch, rows, strict=True):
                kept = self._own_tokens(request, row, ignore_eos)
                outputs[request.request_id] = kept
                times[request.request_id] = step_times[: len(kept)]
                if progress is not None:
                    progress.update(len(kept))
        elapsed = time.perf_counter() - start
        name = label or f"HF generate (static, batch {batch_size})"
        return RunResult(name, outputs, times, elapsed, peak_memory_bytes=memory.peak_bytes())

    def _own_tokens(self, request: BenchRequest, row: list[int], ignore_eos: bool) -> list[int]:
        kept = row[: request.output_len]
        if not ignore_eos:
            stop = next((i for i, t in enumerate(kept) if t in self.eos_token_ids), None)
            kept = kept if stop is None else kept[: stop + 1]
        elif len(kept) < request.output_len:
            got, wanted = len(kept), request.output_len
            raise RuntimeError(
                f"HF generate returned {got} tokens for {request.request_id}, expected {wanted}"
            )
        return kept

    def warm_up(self, workload: Workload, num_tokens: int = 4) -> None:
        """One short generate first, so one-time costs stay out of the timed run."""
        prompt = workload.requests[0].prompt_token_ids[:16]
        self.generate_batch_once([prompt], num_tokens, True, time.perf_counter())

    # -- batch-1 latency --------------------------------------------------------------------------

    def time_single(self, prompt: Sequence[int], output_len: int) -> tuple[list[int], list[float]]:
        """One prompt's ``output_len`` greedy tokens (EOS ignored) and the seconds from the call to each."""
        synchronize(self.device)
        start = time.perf_counter()
        rows, step_times = self.generate_batch_once([prompt], output_len, True, start)
        return rows[0], step_times

    # -- transformers' continuous batching ----------------------------------------------------------

    def has_continuous_batching(self) -> bool:
        return hasattr(self.model, "continuous_batching_context_manager")

    def run_continuous(self, workload: Workload, *, progress: Any = None) -> RunResult:
        """All requests through ``continuous_batching_context_manager`` (what ``generate_batch`` uses),
        with each request's own ``max_new_tokens``. Raises PeerUnavailableError where it is absent."""
        if not self.has_continuous_batching():
            raise PeerUnavailableError(
                "this transformers version has no continuous batching (generate_batch)"
            )
        longest = max(r.output_len for r in workload.requests)
        config = self.generation_config(longest, workload.spec.ignore_eos)
        eos: list[int] = [] if workload.spec.ignore_eos else list(self.eos_token_ids)
        # No inference_mode here: the manager's worker thread updates tensors created in this one.
        with self.model.continuous_batching_context_manager(
            generation_config=config, block=True, timeout=5
        ) as manager:
            synchronize(self.device)  # the clock starts once the manager is built and warmed up
            start = time.perf_counter()
            for request in workload.requests:
                manager.add_request(
                    request.prompt_token_ids,
                    request_id=request.request_id,
                    max_new_tokens=request.output_len,
                    record_timestamps=True,
                    eos_token_id=eos,
                )
            results = _collect_results(manager, workload.num_requests, progress)
            synchronize(self.device)
            elapsed = time.perf_counter() - start  # before the manager's shutdown
        return self._continuous_result(workload, results, start, elapsed)

    def _continuous_result(
        self, workload: Workload, results: dict[str, Any], start: float, elapsed: float
    ) -> RunResult:
        outputs, times = {}, {}
        for request in workload.requests:
            result = results[request.request_id]
            outputs[request.request_id] = list(result.generated_tokens)[: request.output_len]
            stamps = result.timestamps or []
            times[request.request_id] = [stamp - start for stamp in stamps][: request.output_len]
        return RunResult("HF generate_batch (continuous)", outputs, times, elapsed)


def _collect_results(manager: Any, count: int, progress: Any) -> dict[str, Any]:
    results: dict[str, Any] = {}
    while len(results) < count:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise PeerUnavailableError("transformers' continuous batching loop stopped unexpectedly")
            continue
        if result.is_finished():
            if result.error:
                raise PeerUnavailableError(f"continuous batching failed: {result.error}")
            results[result.request_id] = result
            if progress is not None:
                progress.update(len(result.generated_tokens))
    return results


def _batches(requests: Sequence[BenchRequest], size: int) -> Iterator[list[BenchRequest]]:
    for first in range(0, len(requests), size):
        yield list(requests[first : first + size])


# -- building the peer ----------------------------------------------------------------------------------


def build_hf_peer(loaded: LoadedModel) -> HFPeer:
    """An HF model with ``loaded``'s weights, on its device and in its dtype."""
    if loaded.source.startswith("dummy:"):
        model = _from_config_with_our_weights(loaded)
        origin = "from_config, weights copied from tokenmill"
    else:
        model, origin = _from_checkpoint(Path(loaded.source), loaded.dtype)
    model = model.to(loaded.device).eval()
    # generate() falls back to the model's own generation config for unset fields: keep it neutral.
    model.generation_config.eos_token_id = None
    pad = _pad_token_id(loaded)
    return HFPeer(model, loaded.device, pad, tuple(loaded.eos_token_ids), origin)


def _pad_token_id(loaded: LoadedModel) -> int:
    tokenizer = loaded.tokenizer
    for candidate in (tokenizer.pad_token_id if tokenizer else None, *loaded.eos_token_ids):
        if candidate is not None:
            return int(candidate)
    return 0


def _from_checkpoint(path: Path, dtype: torch.dtype) -> tuple[Any, str]:
    from transformers import AutoModelForCausalLM

    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        return model, f"from GGUF {path.name}, dequantized"
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype), f"from {path.name}"


def _from_config_with_our_weights(loaded: LoadedModel) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(loaded.config.raw)
    model_type = raw.pop("model_type", None)
    if model_type is None:
        raise PeerUnavailableError(f"{loaded.source}: the config has no model_type, so HF cannot build it")
    config = AutoConfig.for_model(model_type, **raw)
    model = AutoModelForCausalLM.from_config(config, dtype=loaded.dtype)
    copy_weights_to_hf(loaded.model, model)
    return model


@torch.no_grad()
def copy_weights_to_hf(ours: CausalLM, hf_model: torch.nn.Module) -> None:
    """Fill every HF parameter from tokenmill's model: the inverse of tokenmill's checkpoint loading."""
    our_params = dict(ours.named_parameters())
    for name, hf_param in hf_model.named_parameters():
        source, transposed = _our_tensor_for(ours, our_params, name, hf_param.detach())
        if transposed:
            source = source.t()  # e.g. GPT-2's Conv1D stores [in, out]
        if source.shape != hf_param.shape:
            shapes = f"{tuple(source.shape)} vs {tuple(hf_param.shape)}"
            raise PeerUnavailableError(f"cannot copy tokenmill's weights into HF '{name}': shapes {shapes}")
        hf_param.copy_(source.to(hf_param.device, hf_param.dtype))


def _our_tensor_for(
    ours: CausalLM, our_params: dict[str, torch.nn.Parameter], hf_name: str, hf_tensor: torch.Tensor
) -> tuple[torch.Tensor, bool]:
    """tokenmill's tensor (or fused slice) holding HF's ``hf_name``, and whether loading transposes it."""
    renamed, converted = ours.checkpoint_tensor(hf_name, hf_tensor)
    transposed = hf_tensor.dim() == 2 and converted.stride() == hf_tensor.t().stride() != hf_tensor.stride()
    target, shard_id = ours.checkpoint_target(renamed)
    if target not in our_params:
        raise PeerUnavailableError(f"HF parameter '{hf_name}' has no counterpart in {type(ours).__name__}")
    param = our_params[target].detach()
    if shard_id is None:
        return param, transposed
    fused = ours.get_submodule(target.rsplit(".", 1)[0])
    index = {"q": 0, "k": 1, "v": 2}[shard_id] if isinstance(shard_id, str) else int(shard_id)
    sizes: list[int] = list(fused.local_sizes)  # type: ignore[arg-type]
    return param.narrow(0, sum(sizes[:index]), sizes[index]), transposed
