"""Turning a scheduled step into one forward pass: packed inputs, attention metadata, logits, samples.

A step's integer inputs reach the device in one non-blocking copy from pinned memory, and nothing on
the way reads a device value back, except the sampled token ids at the end: the step's one sync. Decode
steps run through CUDA graphs when they are captured (:mod:`tokenmill.runner.cuda_graphs`).
"""

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.attention import AttentionBackend, AttentionMetadata, ForwardContext, forward_context
from tokenmill.models import CausalLM
from tokenmill.outputs import RowLogprobs
from tokenmill.runner.cuda_graphs import DecodeGraphRunner
from tokenmill.runner.kv_cache import KVCache
from tokenmill.runner.sampler import Sampler, SamplingBatch, SamplingRow, compute_prompt_logprobs
from tokenmill.runner.step_inputs import pack_to_device
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.scheduler import ScheduledChunk
from tokenmill.sequence import Request

logger = logging.getLogger(__name__)
# What the memory profile samples with: top-k and top-p take the sampler's largest buffers (a sort).
PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    sample_rows: torch.Tensor  # rows of the packed batch whose logits are sampled
    sampled_chunks: list[ScheduledChunk]


@dataclass
class StepResult:
    sampled: dict[Request, tuple[int, RowLogprobs | None]] = field(default_factory=dict)
    prompt_logprobs: dict[Request, list[RowLogprobs]] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self, model: CausalLM, kv_cache: KVCache | None, backend: AttentionBackend, device: torch.device
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.sampler = Sampler()
        self.vocab_size = model.config.vocab_size
        self.decode_graphs: DecodeGraphRunner | None = None

    def capture_decode_graphs(
        self,
        sizes: Sequence[int],
        max_model_len: int,
        overlap: bool = False,
        requests_waiting: Callable[[], bool] = lambda: False,
        logits_in_graph: bool = False,
    ) -> None:
        """Capture CUDA graphs of decode steps at ``sizes`` (nothing when empty); logs what it took.
        ``overlap``: start each decode step's successor before reading its tokens; ``logits_in_graph``:
        capture the logits and their argmax too (DecodeGraphRunner)."""
        if not sizes:
            return
        if self.kv_cache is None:
            raise ValueError("decode graphs need a KV cache")
        self.decode_graphs = DecodeGraphRunner(
            self.model,
            self.backend,
            self.kv_cache.layers,
            self.kv_cache.manager,
            sizes,
            max_model_len,
            self.device,
            overlap,
            requests_waiting,
            logits_in_graph,
            self.sampler.argmax,
        )
        logger.info(self.decode_graphs.capture().describe())

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> StepResult:
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_run(chunks):
            result = StepResult()
            logits, argmax = graphs.run(chunks)
            self._sample(
                chunks, logits, result, lambda sampled: graphs.start_next_step(chunks, sampled), argmax
            )
            return result
        if graphs is not None:
            graphs.drop_started_step()
        inputs = self.prepare(chunks)
        layers = self.kv_cache.layers if self.kv_cache is not None else None
        with forward_context(ForwardContext(inputs.metadata, self.backend, layers)):
            hidden = self.model(inputs.input_ids, inputs.positions)
        result = StepResult(prompt_logprobs=self._prompt_logprobs(chunks, hidden))
        if inputs.sampled_chunks:
            logits = self.model.compute_logits(hidden[inputs.sample_rows])
            self._sample(inputs.sampled_chunks, logits, result)
        return result

    def prepare(self, chunks: list[ScheduledChunk]) -> StepInputs:
        dev = pack_to_device(self._host_inputs(chunks), self.device)
        sampled = [chunk for chunk in chunks if chunk.completes_sequence]
        metadata = AttentionMetadata(
            query_start_loc=dev["query_start_loc"],
            seq_lens=dev["seq_lens"],
            max_query_len=max(chunk.num_tokens for chunk in chunks),
            max_seq_len=max(chunk.end for chunk in chunks),
            slot_mapping=dev.get("slot_mapping"),
            block_tables=dev.get("block_tables"),
        )
        return StepInputs(dev["input_ids"], dev["positions"], metadata, dev["sample_rows"], sampled)

    def _host_inputs(self, chunks: list[ScheduledChunk]) -> dict[str, np.ndarray]:
        num_seqs = len(chunks)
        lengths = np.fromiter((chunk.num_tokens for chunk in chunks), np.int64, num_seqs)
        starts = np.fromiter((chunk.start for chunk in chunks), np.int64, num_seqs)
        query_start_loc = np.zeros(num_seqs + 1, np.int32)
        query_start_loc[1:] = np.cumsum(lengths)
        num_tokens = int(query_start_loc[-1])
        token_ids = itertools.chain.from_iterable(c.request.token_ids[c.start : c.end] for c in chunks)
        seq_of_token = np.repeat(np.arange(num_seqs), lengths)
        offset_in_seq = np.arange(num_tokens) - query_start_loc[:-1][seq_of_token]
        sampled = [i for i, chunk in enumerate(chunks) if chunk.completes_sequence]
        arrays = {
            "input_ids": np.fromiter(token_ids, np.int64, num_tokens),
            "positions": starts[seq_of_token] + offset_in_seq,
            "query_start_loc": query_start_loc,
            "seq_lens": (starts + lengths).astype(np.int32),
            "sample_rows": query_start_loc[1:][sampled].astype(np.int64) - 1,
        }
        if self.kv_cache is not None:
            manager = self.kv_cache.manager
            ranges = [(chunk.request.request_id, chunk.start, chunk.end) for chunk in chunks]
            arrays["slot_mapping"] = manager.build_slot_mapping(ranges).numpy()
            ids = [chunk.request.request_id for chunk in chunks]
            arrays["block_tables"] = manager.build_block_tables(ids).numpy()
        return arrays

    @torch.inference_mode()
    def profile_forward(self, num_tokens: int, max_seq_len: int, num_sampled: int) -> None:
        """Run ``num_tokens`` tokens as sequences of up to ``max_seq_len`` with no KV cache, then sample
        the last ``num_sampled`` rows with top-k and top-p: the activations of the largest step, for
        memory profiling."""
        lens = [min(max_seq_len, num_tokens - start) for start in range(0, num_tokens, max_seq_len)]
        metadata = AttentionMetadata.for_prefill(lens, self.device)
        input_ids = torch.arange(num_tokens, device=self.device) % self.vocab_size
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        with forward_context(ForwardContext(metadata, self.backend, None)):
            hidden = self.model(input_ids, positions)
        if num_sampled:
            logits = self.model.compute_logits(hidden[-num_sampled:])
            rows = [SamplingRow(PROFILE_SAMPLING)] * num_sampled
            self.sampler(logits, SamplingBatch.build(rows, self.vocab_size, self.device))

    def _sample(
        self,
        chunks: list[ScheduledChunk],
        logits: torch.Tensor,
        result: StepResult,
        before_reading: Callable[[torch.Tensor], None] | None = None,
        argmax: torch.Tensor | None = None,
    ) -> None:
        """Sample, then read the token ids back: the step's one sync. ``before_reading`` gets the ids
        on the device first, to enqueue work that should not delay the read (logprobs read everything).
        ``argmax``: the logits' argmax, when already computed (greedy rows may take it)."""
        rows = [
            SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, r.banned_token_ids())
            for r in (chunk.request for chunk in chunks)
        ]
        out = self.sampler(logits, SamplingBatch.build(rows, self.vocab_size, self.device), argmax)
        host_ids = _HostCopy(out.token_ids)
        if before_reading is not None and out.logprobs is None:
            before_reading(out.token_ids)
        token_ids = host_ids.tolist()
        logprobs: list[RowLogprobs | None] = [None] * len(chunks)
        if out.logprobs is not None:
            logprobs = list(out.logprobs.to_rows([row.params.logprobs for row in rows]))
        for chunk, token, entry in zip(chunks, token_ids, logprobs, strict=True):
            wanted = chunk.request.params.logprobs is not None
            result.sampled[chunk.request] = (token, entry if wanted else None)

    def _prompt_logprobs(
        self, chunks: list[ScheduledChunk], hidden: torch.Tensor
    ) -> dict[Request, list[RowLogprobs]]:
        """Logprobs of the prompt tokens this step's chunks predict, for requests that asked for them."""
        found: dict[Request, list[RowLogprobs]] = {}
        row = 0
        for chunk in chunks:
            request, num_top = chunk.request, chunk.request.params.prompt_logprobs
            last_predicting = min(
                chunk.end, request.num_prompt_tokens - 1
            )  # positions predicting a prompt token
            if num_top is not None and request.prompt_logprobs_done == chunk.start < last_predicting:
                count = last_predicting - chunk.start
                logits = self.model.compute_logits(hidden[row : row + count])
                targets = request.prompt_token_ids[chunk.start : last_predicting + 1]
                found[request] = compute_prompt_logprobs(logits, targets, num_top).to_rows(num_top)
            row += chunk.num_tokens
        return found


class _HostCopy:
    """A device tensor's values, copied to pinned host memory without blocking; :meth:`tolist` waits for
    that copy alone, not for work enqueued after it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.event: torch.cuda.Event | None = None
        if tensor.device.type != "cuda":
            self.host = tensor
            return
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.host.copy_(tensor, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def tolist(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        values: list[int] = self.host.tolist()
        return values
