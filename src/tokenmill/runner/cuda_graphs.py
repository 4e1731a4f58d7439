"""CUDA graphs for decode steps: one forward pass per captured batch size, replayed with one launch.

A decode step (every scheduled chunk is one new token that gets sampled) of ``B`` sequences runs the
graph of the smallest captured size ``P >= B``. Its inputs live in static buffers
(:class:`~tokenmill.runner.decode_inputs.DecodeInputs`) that are refilled before each replay in one
non-blocking copy; rows ``B..P`` are padding: token 0 at position 0, slot -1 (their K/V is written nowhere)
and a context of one token in block 0 (whatever it holds is finite: the pool starts zeroed; their
outputs are dropped). Every graph shares one memory pool; they are captured largest first, so the
smaller ones reuse the largest one's activation memory. The static buffers are filled from the same step
arrays as eager steps (:func:`~tokenmill.runner.step_inputs.build_step_arrays`). Prefill and mixed
steps, and decode batches above the largest size, run eagerly. With ``overlap`` the next decode step's
replay is enqueued before this step's tokens are read (:class:`DecodeGraphRunner`), once the scheduler
has reserved its KV slots (``Scheduler.reserve_next_step``). Under tensor parallelism every rank
captures the same graphs in the same order, with the model's collectives inside them
(:mod:`tokenmill.runner.graph_runners`), and replays the same one each step (``mirror``).

A captured graph replays exactly the kernels and launch parameters it was captured with, so the
attention metadata must not steer them by per-step host values: graphs are captured with
``max_query_len = 1`` and ``max_seq_len = max_model_len``, which the Triton backend reads only as a
bound (it fixes the number of split-K partitions; partitions past a sequence's end return at once).
The torch backend reads a mask back to the host in its KV write, so it is not captured (EngineConfig
refuses the combination).

With ``logits_in_graph`` (``EngineConfig.cuda_graph_logits``) the graphs of up to
``GRAPH_LOGITS_MAX_ROWS`` rows also compute the logits and their argmax: at batch 1 the LM head is the
step's largest projection, and after the graph it and the kernels around it each wait for a launch from
the host; a batch of greedy rows then takes its tokens from the graph's argmax, with no sampling kernel.
Larger graphs leave the logits to after the replay: each graph keeps its own outputs, and ``[rows,
vocab]`` float32 logits at every captured size would hold gigabytes. Sampling always runs outside the
graphs (its inputs change from step to step).
"""

import bisect
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeVar

import numpy as np
import torch

from tokenmill.attention import (
    AttentionBackend,
    ForwardContext,
    KVCacheLayer,
    forward_context,
)
from tokenmill.cache.kv_cache_manager import KVCacheManager
from tokenmill.config import EngineConfig
from tokenmill.distributed import tp_world_size
from tokenmill.models import CausalLM
from tokenmill.runner.decode_inputs import DecodeInputs
from tokenmill.scheduler.output import ScheduledChunk
from tokenmill.sequence import Sequence as Seq

logger = logging.getLogger(__name__)
SIZE_STEP = 8  # captured sizes: 1, 2, 4, then every multiple of this
GRAPH_LOGITS_MAX_ROWS = 16  # with logits_in_graph: 16 x a 128k vocabulary x 4 bytes = 8 MiB per graph


def cuda_graph_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 24, ... up to ``max_batch_size``, which is always included."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
    candidates = [1, 2, 4, *range(SIZE_STEP, max_batch_size + 1, SIZE_STEP), max_batch_size]
    return tuple(sorted({size for size in candidates if size <= max_batch_size}))


def cuda_graph_sizes(config: EngineConfig, device: torch.device) -> tuple[int, ...]:
    """The decode batch sizes to capture for this engine; empty when graphs are off or not on CUDA."""
    if not config.graphs.enabled:
        return ()
    if device.type != "cuda":
        logger.info("cuda_graphs applies only on CUDA devices; decoding eagerly on %s", device)
        return ()
    return cuda_graph_batch_sizes(min(config.graphs.max_batch_size, config.scheduler.max_running))


def padded_batch_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest of the sorted ``sizes`` that holds ``num_seqs`` rows; None if none does."""
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


def is_decode_step(chunks: Sequence[ScheduledChunk]) -> bool:
    """Every chunk is one new token whose successor is sampled: the step a decode graph can run."""
    return bool(chunks) and all(chunk.num_tokens == 1 and chunk.samples_next_token for chunk in chunks)


@dataclass(frozen=True)
class CaptureReport:
    sizes: tuple[int, ...]
    seconds: float
    pool_bytes: int  # device memory the graphs keep (their pool, outputs included)
    what: str = "decode batch sizes"

    def describe(self) -> str:
        return (
            f"CUDA graphs: captured {len(self.sizes)} {self.what} {list(self.sizes)} in "
            f"{self.seconds:.2f} s; they hold {self.pool_bytes / 2**20:.1f} MiB"
        )


class DecodeLogits(NamedTuple):
    """A decode step's logits ``[B, vocab]`` (float32) and, when the graph computed it, their argmax
    ``[B]``; both valid until the runner's next step."""

    logits: torch.Tensor
    argmax: torch.Tensor | None


class DecodeOutputs(NamedTuple):
    """What a decode graph leaves in its outputs: the logits and their argmax where the graph computes
    them (``computes_logits``), else the final hidden states for the LM head to take after the replay."""

    hidden: torch.Tensor | None
    logits: DecodeLogits | None


class DecodeMirror(Protocol):
    """Tensor-parallel workers, told of each decode step rank 0 runs over its static buffers (their arrays,
    as :meth:`DecodeInputs.step_arrays` builds them) so that they run the same graph over theirs, and of
    each logits computation after a replay."""

    def decode_step(self, arrays: Mapping[str, np.ndarray], num_rows: int) -> None: ...

    def start_next_step(
        self, arrays: Mapping[str, np.ndarray], num_rows: int, token_ids: torch.Tensor
    ) -> None: ...

    def logits(self, hidden: torch.Tensor) -> None: ...


class DecodeGraphRunner:
    """Runs decode steps through CUDA graphs captured at ``sizes``; without a captured graph (on CPU, or
    before :meth:`capture`) it runs the same computation over the same static buffers eagerly.

    :meth:`start_next_step` enqueues the forward pass of the step after this one (the same sequences,
    one token further, fed the tokens just sampled, still on the device) before the host reads those
    tokens, so the GPU runs it while the host processes them and schedules the next step. If that next
    step turns out to be exactly this one (:meth:`run` checks), its forward is already done; otherwise the
    work is dropped and the step runs from scratch. The dropped work is harmless: it wrote K/V only to
    slots the scheduler had reserved for its sequences, past what they have computed, so nothing reads
    them before a later step writes them again.

    Under tensor parallelism (``mirror``: rank 0's workers) each step's arrays are announced before its
    replay, and a started step's are followed by the sampled token ids, so that every worker writes the
    same inputs into its own runner's buffers (:meth:`run_arrays`) and replays its graph of the same size:
    the graphs' collectives pair. A worker never decides: a started step that rank 0 drops was run by
    the workers too, and its K/V (their heads of the same reserved slots) is as harmless as rank 0's.
    """

    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        kv_layers: Sequence[KVCacheLayer],
        kv: KVCacheManager,
        sizes: Sequence[int],
        max_model_len: int,
        logits_in_graph: bool = False,
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
        mirror: DecodeMirror | None = None,
    ) -> None:
        if not sizes:
            raise ValueError("no batch sizes to capture")
        self.model = model
        self.backend = backend
        self.kv_layers = kv_layers
        self.kv = kv
        self.sizes = tuple(sorted(sizes))
        self.max_model_len = max_model_len
        self.device = kv_layers[0].key.device
        self.logits_in_graph = logits_in_graph
        self.argmax = argmax or _argmax  # of the logits, over the vocabulary (captured with them)
        self.mirror = mirror
        self.inputs = DecodeInputs(self.sizes[-1], -(-max_model_len // kv.block_size), self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, DecodeOutputs] = {}
        self._started: tuple[list[ScheduledChunk], DecodeOutputs] | None = None  # the next step, begun
        self.num_started = self.num_reused = 0

    def can_run(self, chunks: Sequence[ScheduledChunk]) -> bool:
        return len(chunks) <= self.sizes[-1] and is_decode_step(chunks)

    def run(self, chunks: Sequence[ScheduledChunk]) -> DecodeLogits:
        """The logits of a decode step's ``len(chunks)`` rows (valid until the next run)."""
        num_rows = padded_batch_size(len(chunks), self.sizes)
        if num_rows is None or not is_decode_step(chunks):
            raise ValueError(f"not a decode step of at most {self.sizes[-1]} sequences")
        started, self._started = self._started, None
        if started is not None and _same_rows(started[0], chunks):
            self.num_reused += 1
            return self._logits(started[1], len(chunks))
        arrays = self.inputs.step_arrays(chunks, self.kv, num_rows, full_width=self.mirror is None)
        if self.mirror is not None:
            self.mirror.decode_step(arrays, num_rows)
        return self._logits(self.run_arrays(arrays, num_rows), len(chunks))

    def run_arrays(
        self, arrays: Mapping[str, np.ndarray], num_rows: int, token_ids: torch.Tensor | None = None
    ) -> DecodeOutputs:
        """The forward pass of a step of ``num_rows`` rows given by its arrays (and ``token_ids``, see
        :meth:`DecodeInputs.write_arrays`): rank 0's steps, and those a tensor-parallel worker receives."""
        self.inputs.write_arrays(arrays, num_rows, token_ids)
        return self._forward(num_rows)

    def computes_logits(self, num_rows: int) -> bool:
        """Whether the step of ``num_rows`` rows (a captured size) computes its logits itself."""
        return self.logits_in_graph and num_rows <= GRAPH_LOGITS_MAX_ROWS

    def _logits(self, outputs: DecodeOutputs, count: int) -> DecodeLogits:
        """The first ``count`` rows of a step's outputs as logits (computing them if the graph did not)."""
        if outputs.logits is None:
            assert outputs.hidden is not None
            hidden = outputs.hidden[:count]
            if self.mirror is not None:
                self.mirror.logits(hidden)
            return DecodeLogits(self.model.compute_logits(hidden), None)
        logits, argmax = outputs.logits
        return DecodeLogits(logits[:count], None if argmax is None else argmax[:count])

    def started_sequences(self) -> list[Seq] | None:
        """The sequences of the started next step; None if there is none."""
        return None if self._started is None else [chunk.seq for chunk in self._started[0]]

    def drop_started_step(self) -> None:
        """Forget a started next step: the engine runs something else first."""
        self._started = None

    def start_next_step(
        self, chunks: Sequence[ScheduledChunk], sampled: torch.Tensor, rows: Sequence[int] | None = None
    ) -> None:
        """Enqueue the forward of the step after the decode step ``chunks`` for its ``rows`` (default: all),
        whose ``sampled`` token ids are its inputs; the scheduler has reserved the KV slots of its tokens."""
        kept = chunks if rows is None else [chunks[row] for row in rows]
        following = [ScheduledChunk(chunk.seq, chunk.start + 1, chunk.end + 1) for chunk in kept]
        num_rows = padded_batch_size(len(following), self.sizes)
        assert num_rows is not None
        full_width = self.mirror is None
        arrays = self.inputs.step_arrays(following, self.kv, num_rows, False, rows, full_width)
        if self.mirror is not None:
            self.mirror.start_next_step(arrays, num_rows, sampled)
        self._started = (following, self.run_arrays(arrays, num_rows, sampled))
        self.num_started += 1

    def _forward(self, num_rows: int) -> DecodeOutputs:
        graph = self.graphs.get(num_rows)
        if graph is None:
            return self.forward_static_buffers(num_rows)
        graph.replay()
        return self.outputs[num_rows]

    def forward_static_buffers(self, num_rows: int) -> DecodeOutputs:
        """The model over the first ``num_rows`` rows of the static buffers: what a graph captures."""
        input_ids, positions, metadata = self.inputs.view(num_rows, self.max_model_len)
        with forward_context(ForwardContext(metadata, self.backend, self.kv_layers)):
            hidden: torch.Tensor = self.model(input_ids, positions)
        if not self.computes_logits(num_rows):
            return DecodeOutputs(hidden, None)
        logits = self.model.compute_logits(hidden)
        return DecodeOutputs(None, DecodeLogits(logits, self.argmax(logits)))

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        self.inputs.write([], self.kv, self.inputs.capacity)  # every row padding
        captured = capture_graphs(
            self.device, self.sizes, lambda _: None, self.forward_static_buffers, "decode batch sizes"
        )
        self.graphs, self.outputs, report = captured
        return report


Output = TypeVar("Output")


def capture_graphs(
    device: torch.device,
    sizes: Sequence[int],
    prepare: Callable[[int], None],
    forward: Callable[[int], Output],
    what: str,
) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, Output], CaptureReport]:
    """One graph of ``forward(size)`` per size, each after ``prepare(size)`` and a run outside the capture
    that compiles the shape's kernels; largest first, so the others reuse its pool memory."""
    if device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    reserved_before = torch.cuda.memory_reserved(device)
    start = time.perf_counter()
    pool = torch.cuda.graph_pool_handle()
    # With collectives in the graphs, the NCCL watchdog thread polls the events of the eager warm-up's
    # collectives while this thread captures: only this thread's calls must be capture-safe.
    mode = "thread_local" if tp_world_size() > 1 else "global"
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, Output] = {}
    for size in sorted(sizes, reverse=True):
        prepare(size)
        forward(size)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
            outputs[size] = forward(size)
        graphs[size] = graph
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    torch.cuda.empty_cache()
    pool_bytes = torch.cuda.memory_reserved(device) - reserved_before
    return graphs, outputs, CaptureReport(tuple(sorted(sizes)), seconds, pool_bytes, what)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def _same_rows(started: Sequence[ScheduledChunk], chunks: Sequence[ScheduledChunk]) -> bool:
    return len(started) == len(chunks) and all(
        chunk.seq is row.seq and chunk.start == row.start for row, chunk in zip(started, chunks, strict=True)
    )
