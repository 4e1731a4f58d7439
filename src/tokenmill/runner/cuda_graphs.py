"""CUDA graphs for decode steps: one forward pass per captured batch size, replayed with one launch.

A decode step (every scheduled chunk is one new token that gets sampled) of ``B`` sequences runs the
graph of the smallest captured size ``P >= B``. Its inputs live in static buffers (:class:`DecodeInputs`)
that are refilled before each replay in one non-blocking copy; rows ``B..P`` are padding: token 0 at
position 0, slot -1 (their K/V is written nowhere) and a context of one token in block 0 (whatever it
holds is finite: the pool starts zeroed; their outputs are dropped). Every graph shares one memory
pool; they are captured largest first, so the smaller ones reuse the largest one's activation memory.
The static buffers are filled from the same step arrays as eager steps
(:func:`~tokenmill.runner.step_inputs.build_step_arrays`).
Prefill and mixed steps, and decode batches above the largest size, run eagerly. With ``overlap`` the
next decode step's replay is enqueued before this step's tokens are read (:class:`DecodeGraphRunner`),
once the scheduler has reserved its KV slots (``Scheduler.reserve_next_step``).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import torch

from tokenmill.attention import (
    AttentionBackend,
    AttentionMetadata,
    ForwardContext,
    KVCacheLayer,
    forward_context,
)
from tokenmill.cache.kv_cache_manager import KVCacheManager
from tokenmill.config import EngineConfig
from tokenmill.models import CausalLM
from tokenmill.runner.step_inputs import PackedLayout, attention_metadata, build_step_arrays, host_buffer
from tokenmill.scheduler.output import ScheduledChunk

logger = logging.getLogger(__name__)
SIZE_STEP = 8  # captured sizes: 1, 2, 4, then every multiple of this
GRAPH_LOGITS_MAX_ROWS = 16  # with logits_in_graph: 16 x a 128k vocabulary x 4 bytes = 8 MiB per graph
_STATIC_FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc", "block_tables")
# The static buffers: the step's inputs, and the rows of the sampled tokens an overlapped step takes
# (block tables last: a step of P rows copies a prefix).
_LAYOUT_FIELDS = (*_STATIC_FIELDS[:-1], "token_rows", "block_tables")


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


class HostStaging:
    """A pinned host copy of the static buffers' layout, written with numpy and copied in one transfer.
    The event marks when its last copy has run, so it is not overwritten before."""

    def __init__(self, layout: PackedLayout, device: torch.device) -> None:
        self.tensor = host_buffer(layout.nbytes, device).zero_()
        self.views = layout.numpy_views(self.tensor.numpy())
        self.copied = torch.cuda.Event() if device.type == "cuda" else None


class DecodeInputs:
    """Static device buffers for decode steps of up to ``capacity`` sequences, in one allocation laid out
    so that a step of ``P`` rows is refreshed by copying one prefix of it (block tables last). Two pinned
    staging buffers take turns, so one can be filled while the other's copy is pending."""

    def __init__(self, capacity: int, table_width: int, device: torch.device) -> None:
        self.capacity = capacity
        self.table_width = table_width
        sizes = {"query_start_loc": capacity + 1, "block_tables": capacity * table_width}
        dtypes = {"seq_lens": torch.int32, "query_start_loc": torch.int32, "block_tables": torch.int32}
        self.layout = PackedLayout(
            [(name, dtypes.get(name, torch.int64), sizes.get(name, capacity)) for name in _LAYOUT_FIELDS]
        )
        self.buffer = torch.zeros(self.layout.nbytes, dtype=torch.uint8, device=device)
        self.views = self.layout.views(self.buffer)
        self.views["block_tables"] = self.views["block_tables"].view(capacity, table_width)
        self._staging = [HostStaging(self.layout, device) for _ in range(2)]
        self._turn = 0

    def view(self, num_rows: int, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and attention metadata of the first ``num_rows`` rows; ``max_seq_len`` is
        a bound, not the step's value."""
        rows = {name: view[: num_rows + (name == "query_start_loc")] for name, view in self.views.items()}
        metadata = attention_metadata(rows, max_query_len=1, max_seq_len=max_seq_len)
        return rows["input_ids"], rows["positions"], metadata

    def write(
        self,
        chunks: Sequence[ScheduledChunk],
        kv: KVCacheManager,
        num_rows: int,
        token_ids: torch.Tensor | None = None,
        token_rows: Sequence[int] | None = None,
    ) -> None:
        """Fill the rows of ``chunks`` and pad the rest up to ``num_rows`` (a graph of ``num_rows`` reads no
        others). The input ids are the sequences' tokens, or ``token_ids`` when given: device tensors,
        copied on the device (the tokens a step just sampled, not yet on the host), those at
        ``token_rows`` when given (the indexes travel with the other inputs, so nothing waits)."""
        if not len(chunks) <= num_rows <= self.capacity:
            raise ValueError(f"{len(chunks)} sequences do not fit {num_rows} rows of {self.capacity}")
        arrays = build_step_arrays(chunks, kv, num_rows, self.table_width, with_token_ids=token_ids is None)
        staging = self._staging[self._turn]
        self._turn ^= 1
        if staging.copied is not None:
            staging.copied.synchronize()  # its previous copy has long run: this returns at once
        for name in _STATIC_FIELDS:
            if name in arrays:
                values = arrays[name].reshape(-1)
                staging.views[name][: values.size] = values
        if token_rows is not None:
            staging.views["token_rows"][: len(token_rows)] = token_rows
        nbytes = self.layout.prefix_bytes("block_tables", num_rows * self.table_width)
        self.buffer[:nbytes].copy_(staging.tensor[:nbytes], non_blocking=True)
        if staging.copied is not None:
            staging.copied.record()
        if token_ids is not None:
            if token_rows is not None:
                token_ids = token_ids.index_select(0, self.views["token_rows"][: len(token_rows)])
            self.views["input_ids"][: len(chunks)].copy_(token_ids, non_blocking=True)


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
        argmax: Callable[[torch.Tensor], torch.Tensor] = lambda logits: logits.argmax(dim=-1),
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
        self.argmax = argmax  # of the logits, over the vocabulary (captured with them)
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
        self.inputs.write(chunks, self.kv, num_rows)
        return self._logits(self._forward(num_rows), len(chunks))

    def computes_logits(self, num_rows: int) -> bool:
        """Whether the step of ``num_rows`` rows (a captured size) computes its logits itself."""
        return self.logits_in_graph and num_rows <= GRAPH_LOGITS_MAX_ROWS

    def _logits(self, outputs: DecodeOutputs, count: int) -> DecodeLogits:
        """The first ``count`` rows of a step's outputs as logits (computing them if the graph did not)."""
        if outputs.logits is None:
            assert outputs.hidden is not None
            return DecodeLogits(self.model.compute_logits(outputs.hidden[:count]), None)
        logits, argmax = outputs.logits
        return DecodeLogits(logits[:count], None if argmax is None else argmax[:count])

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
        self.inputs.write(following, self.kv, num_rows, token_ids=sampled, token_rows=rows)
        self._started = (following, self._forward(num_rows))
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
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, Output] = {}
    for size in sorted(sizes, reverse=True):
        prepare(size)
        forward(size)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs[size] = forward(size)
        graphs[size] = graph
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    torch.cuda.empty_cache()
    pool_bytes = torch.cuda.memory_reserved(device) - reserved_before
    return graphs, outputs, CaptureReport(tuple(sorted(sizes)), seconds, pool_bytes, what)


def _same_rows(started: Sequence[ScheduledChunk], chunks: Sequence[ScheduledChunk]) -> bool:
    return len(started) == len(chunks) and all(
        chunk.seq is row.seq and chunk.start == row.start for row, chunk in zip(started, chunks, strict=True)
    )
