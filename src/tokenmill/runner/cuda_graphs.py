"""CUDA graphs for decode steps: one forward pass per captured batch size, replayed with one launch.

A decode step (every scheduled chunk is one new token that gets sampled) of ``B`` sequences runs the
graph of the smallest captured size ``P >= B``. Its inputs live in static buffers (:class:`DecodeInputs`)
that are refilled before each replay in one non-blocking copy; rows ``B..P`` are padding: token 0 at
position 0, slot -1 (their K/V is written nowhere) and a context of one token in block 0 (whatever it
holds is finite: the pool starts zeroed; their outputs are dropped). Every graph shares one memory
pool; they are captured largest first, so the smaller ones reuse the largest one's activation memory.
Prefill and mixed steps, and decode batches above the largest size, run eagerly. With ``overlap`` the
next decode step's replay is enqueued before this step's tokens are read (:class:`DecodeGraphRunner`).

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
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from tokenmill.attention import (
    AttentionBackend,
    AttentionMetadata,
    ForwardContext,
    KVCacheLayer,
    forward_context,
)
from tokenmill.cache.block_manager import BlockManager
from tokenmill.config import EngineConfig
from tokenmill.models import CausalLM
from tokenmill.runner.step_inputs import PackedLayout, host_buffer

if TYPE_CHECKING:
    from tokenmill.scheduler.scheduler import ScheduledChunk
    from tokenmill.sequence import Request

logger = logging.getLogger(__name__)
SIZE_STEP = 8  # captured sizes: 1, 2, 4, then every multiple of this
PADDING_SLOT = -1
PADDING_SEQ_LEN = 1
GRAPH_LOGITS_MAX_ROWS = 16  # with logits_in_graph: 16 x a 128k vocabulary x 4 bytes = 8 MiB per graph


def cuda_graph_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 24, ... up to ``max_batch_size``, which is always included."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
    candidates = [1, 2, 4, *range(SIZE_STEP, max_batch_size + 1, SIZE_STEP), max_batch_size]
    return tuple(sorted({size for size in candidates if size <= max_batch_size}))


def cuda_graph_sizes(config: EngineConfig, device: torch.device) -> tuple[int, ...]:
    """The decode batch sizes to capture for this engine; empty when graphs are off or not on CUDA."""
    if not config.cuda_graphs:
        return ()
    if device.type != "cuda":
        logger.info("cuda_graphs applies only on CUDA devices; decoding eagerly on %s", device)
        return ()
    return cuda_graph_batch_sizes(min(config.cuda_graph_max_batch_size, config.max_running))


def padded_batch_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest of the sorted ``sizes`` that holds ``num_seqs`` rows; None if none does."""
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


def is_decode_step(chunks: Sequence["ScheduledChunk"]) -> bool:
    """Every chunk is one new token whose successor is sampled: the step a decode graph can run."""
    return bool(chunks) and all(chunk.num_tokens == 1 and chunk.completes_sequence for chunk in chunks)


@dataclass(frozen=True)
class CaptureReport:
    sizes: tuple[int, ...]
    seconds: float
    pool_bytes: int  # device memory the graphs keep (their pool, outputs included)

    def describe(self) -> str:
        return (
            f"CUDA graphs: captured {len(self.sizes)} decode batch sizes {list(self.sizes)} in "
            f"{self.seconds:.2f} s; they hold {self.pool_bytes / 2**20:.1f} MiB"
        )


class DecodeLogits(NamedTuple):
    """A decode step's logits ``[B, vocab]`` (float32) and, when the graph computed it, their argmax
    ``[B]``; both valid until the runner's next step."""

    logits: torch.Tensor
    argmax: torch.Tensor | None


@dataclass(frozen=True)
class DecodeRow:
    """One sequence of a decode step: ``request`` computes the token at ``position``."""

    request: "Request"
    position: int


class _HostStaging:
    """A pinned host copy of the static buffers' layout, written with numpy and copied in one transfer.
    The event marks when its last copy has run, so it is not overwritten before."""

    def __init__(self, layout: PackedLayout, capacity: int, table_width: int, device: torch.device) -> None:
        self.tensor = host_buffer(layout.nbytes, device).zero_()
        self.views = layout.numpy_views(self.tensor.numpy())
        self.tables = self.views["block_tables"].reshape(capacity, table_width)
        self.copied = torch.cuda.Event() if device.type == "cuda" else None


class DecodeInputs:
    """Static device buffers for decode steps of up to ``capacity`` sequences, in one allocation laid out
    so that a step of ``P`` rows is refreshed by copying one prefix of it (block tables last).

    Two pinned staging buffers take turns, so one can be filled while the other's copy is pending. Block
    table entries past a sequence's own blocks keep whatever an earlier step left there: any block id is
    valid, and attention never reads past a sequence's length."""

    def __init__(self, capacity: int, table_width: int, device: torch.device) -> None:
        self.capacity = capacity
        self.table_width = table_width
        self.device = device
        self.layout = PackedLayout(
            [
                ("input_ids", torch.int64, capacity),
                ("positions", torch.int64, capacity),
                ("slot_mapping", torch.int64, capacity),
                ("seq_lens", torch.int32, capacity),
                ("query_start_loc", torch.int32, capacity + 1),
                ("block_tables", torch.int32, capacity * table_width),
            ]
        )
        self.buffer = torch.zeros(self.layout.nbytes, dtype=torch.uint8, device=device)
        views = self.layout.views(self.buffer)
        self.input_ids = views["input_ids"]
        self.positions = views["positions"]
        self.slot_mapping = views["slot_mapping"]
        self.seq_lens = views["seq_lens"]
        self.query_start_loc = views["query_start_loc"]
        self.block_tables = views["block_tables"].view(capacity, table_width)
        self._staging = [_HostStaging(self.layout, capacity, table_width, device) for _ in range(2)]
        self._turn = 0

    def metadata(self, num_rows: int, max_seq_len: int) -> AttentionMetadata:
        """Metadata over the first ``num_rows`` rows; ``max_seq_len`` is a bound, not the step's value."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: num_rows + 1],
            seq_lens=self.seq_lens[:num_rows],
            max_query_len=1,
            max_seq_len=max_seq_len,
            slot_mapping=self.slot_mapping[:num_rows],
            block_tables=self.block_tables[:num_rows],
        )

    def write(
        self,
        rows: Sequence[DecodeRow],
        manager: BlockManager,
        num_rows: int,
        token_ids: torch.Tensor | None = None,
    ) -> None:
        """Fill rows ``0..len(rows)`` and pad the rest up to ``num_rows`` (a graph of ``num_rows`` reads no
        others). The input ids are the requests' tokens at their positions, or ``token_ids`` when given:
        device tensors, copied on the device (the tokens a step just sampled, not yet on the host)."""
        if not len(rows) <= num_rows <= self.capacity:
            raise ValueError(f"{len(rows)} sequences do not fit {num_rows} rows of {self.capacity}")
        staging = self._staging[self._turn]
        self._turn ^= 1
        if staging.copied is not None:
            staging.copied.synchronize()  # its previous copy has long run: this returns at once
        _fill_rows(staging.views, staging.tables[:num_rows], rows, manager, token_ids is None)
        nbytes = self.layout.prefix_bytes("block_tables", num_rows * self.table_width)
        self.buffer[:nbytes].copy_(staging.tensor[:nbytes], non_blocking=True)
        if staging.copied is not None:
            staging.copied.record()
        if token_ids is not None:
            self.input_ids[: len(rows)].copy_(token_ids, non_blocking=True)


def _fill_rows(
    views: dict[str, np.ndarray],
    tables: np.ndarray,
    rows: Sequence[DecodeRow],
    manager: BlockManager,
    with_token_ids: bool,
) -> None:
    count, block_size = len(rows), manager.block_size
    positions = [row.position for row in rows]
    block_rows = [manager.block_table(row.request.request_id) for row in rows]
    ids = [row.request.token_ids[row.position] for row in rows] if with_token_ids else 0
    views["input_ids"][:count] = ids
    views["input_ids"][count:] = 0
    views["positions"][:count] = positions
    views["positions"][count:] = 0
    views["slot_mapping"][:count] = [
        table[pos // block_size] * block_size + pos % block_size
        for table, pos in zip(block_rows, positions, strict=True)
    ]
    views["slot_mapping"][count:] = PADDING_SLOT
    views["seq_lens"][:count] = views["positions"][:count] + 1
    views["seq_lens"][count:] = PADDING_SEQ_LEN
    views["query_start_loc"][:] = np.arange(views["query_start_loc"].size)
    for index, table in enumerate(block_rows):
        tables[index, : len(table)] = table
    tables[count:, 0] = 0  # padding rows read position 0 of block 0


class DecodeGraphRunner:
    """Runs decode steps through CUDA graphs captured at ``sizes``; without a captured graph (on CPU, or
    before :meth:`capture`) it runs the same computation over the same static buffers eagerly.

    With ``overlap`` on, :meth:`start_next_step` enqueues the forward pass of the step after this one
    (the same sequences, one token further, fed the tokens just sampled, still on the device) before the
    host reads those tokens, so the GPU runs it while the host processes them and schedules the next
    step. If that next step turns out to be exactly this one (:meth:`run` checks), its forward is
    already done; otherwise the work is dropped and the step runs from scratch. The dropped work is
    harmless: it wrote K/V only to slots in blocks its sequences held, past what they have computed,
    so nothing reads them before a later step writes them again. A sequence whose blocks are full
    takes its next block when its next step starts, one step before the scheduler would.
    """

    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        kv_layers: Sequence[KVCacheLayer],
        manager: BlockManager,
        sizes: Sequence[int],
        max_model_len: int,
        device: torch.device,
        overlap: bool = False,
        requests_waiting: Callable[[], bool] = lambda: False,
        logits_in_graph: bool = False,
        argmax: Callable[[torch.Tensor], torch.Tensor] = lambda logits: logits.argmax(dim=-1),
    ) -> None:
        if not sizes:
            raise ValueError("no batch sizes to capture")
        self.model = model
        self.backend = backend
        self.kv_layers = kv_layers
        self.manager = manager
        self.sizes = tuple(sorted(sizes))
        self.max_model_len = max_model_len
        self.device = device
        self.overlap = overlap
        self.requests_waiting = requests_waiting  # True: the next step will likely admit some
        self.logits_in_graph = logits_in_graph
        self.argmax = argmax  # of the logits, over the vocabulary (captured with them)
        table_width = -(-max_model_len // manager.block_size)
        self.inputs = DecodeInputs(self.sizes[-1], table_width, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._started: tuple[list[DecodeRow], tuple[torch.Tensor, ...]] | None = None  # the next step, begun
        self.num_started = self.num_reused = 0

    def can_run(self, chunks: Sequence["ScheduledChunk"]) -> bool:
        return len(chunks) <= self.sizes[-1] and is_decode_step(chunks)

    def run(self, chunks: Sequence["ScheduledChunk"]) -> DecodeLogits:
        """The logits of a decode step's ``len(chunks)`` rows (valid until the next run)."""
        num_rows = padded_batch_size(len(chunks), self.sizes)
        if num_rows is None or not is_decode_step(chunks):
            raise ValueError(f"not a decode step of at most {self.sizes[-1]} sequences")
        started, self._started = self._started, None
        if started is not None and _same_rows(started[0], chunks):
            self.num_reused += 1
            return self._logits(started[1], len(chunks))
        rows = [DecodeRow(chunk.request, chunk.start) for chunk in chunks]
        self.inputs.write(rows, self.manager, num_rows)
        return self._logits(self._forward(num_rows), len(chunks))

    def computes_logits(self, num_rows: int) -> bool:
        """Whether the step of ``num_rows`` rows (a captured size) computes its logits itself."""
        return self.logits_in_graph and num_rows <= GRAPH_LOGITS_MAX_ROWS

    def _logits(self, outputs: tuple[torch.Tensor, ...], count: int) -> DecodeLogits:
        """The first ``count`` rows of a step's outputs as logits (computing them if the graph did not)."""
        if len(outputs) == 2:
            logits, argmax = outputs
            return DecodeLogits(logits[:count], argmax[:count])
        return DecodeLogits(self.model.compute_logits(outputs[0][:count]), None)

    def drop_started_step(self) -> None:
        """Forget a started next step: the engine runs something else first."""
        self._started = None

    def start_next_step(self, chunks: Sequence["ScheduledChunk"], sampled: torch.Tensor) -> None:
        """With ``overlap``: enqueue the forward of the step after the decode step ``chunks``, whose
        ``sampled`` token ids are its inputs. Skipped when that step is unlikely to be the next one."""
        if not self.overlap or self.requests_waiting():
            return
        if not all(self._continues(chunk) for chunk in chunks) or not self._reserve_next_slots(chunks):
            return
        rows = [DecodeRow(chunk.request, chunk.start + 1) for chunk in chunks]
        num_rows = padded_batch_size(len(rows), self.sizes)
        assert num_rows is not None
        self.inputs.write(rows, self.manager, num_rows, token_ids=sampled)
        self._started = (rows, self._forward(num_rows))
        self.num_started += 1

    def _continues(self, chunk: "ScheduledChunk") -> bool:
        """Whether the sequence certainly runs one more step, barring a stop token."""
        request = chunk.request
        return request.num_output_tokens + 1 < request.max_tokens and chunk.start + 2 < self.max_model_len

    def _reserve_next_slots(self, chunks: Sequence["ScheduledChunk"]) -> bool:
        """Give every sequence a KV slot for its next token: one whose blocks are full takes its next
        block now, as the scheduler would at the next step (if it ends instead, the block is freed with
        the others). False, taking nothing, when the pool has too few free blocks."""
        tokens = {chunk.request.request_id: chunk.start + 2 for chunk in chunks}
        needed = {seq_id: self.manager.blocks_needed(seq_id, count) for seq_id, count in tokens.items()}
        if sum(needed.values()) > self.manager.num_free_blocks:
            return False
        for seq_id, blocks in needed.items():
            if blocks:
                self.manager.allocate(seq_id, tokens[seq_id])
        return True

    def _forward(self, num_rows: int) -> tuple[torch.Tensor, ...]:
        graph = self.graphs.get(num_rows)
        if graph is None:
            return self.forward_static(num_rows)
        graph.replay()
        return self.outputs[num_rows]

    def forward_static(self, num_rows: int) -> tuple[torch.Tensor, ...]:
        """The model over the first ``num_rows`` rows of the static buffers: what a graph captures. Its
        outputs: the logits and their argmax where :meth:`computes_logits`, else the hidden states."""
        metadata = self.inputs.metadata(num_rows, self.max_model_len)
        with forward_context(ForwardContext(metadata, self.backend, self.kv_layers)):
            hidden: torch.Tensor = self.model(
                self.inputs.input_ids[:num_rows], self.inputs.positions[:num_rows]
            )
        if not self.computes_logits(num_rows):
            return (hidden,)
        logits = self.model.compute_logits(hidden)
        return logits, self.argmax(logits)

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(self.device)
        start = time.perf_counter()
        self.inputs.write([], self.manager, self.inputs.capacity)  # every row padding
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: the others reuse its pool memory
            self.forward_static(size)  # warm-up outside the capture: compiles this shape's kernels
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.forward_static(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        torch.cuda.empty_cache()
        pool_bytes = torch.cuda.memory_reserved(self.device) - reserved_before
        return CaptureReport(self.sizes, seconds, pool_bytes)


def _same_rows(rows: Sequence[DecodeRow], chunks: Sequence["ScheduledChunk"]) -> bool:
    return len(rows) == len(chunks) and all(
        chunk.request is row.request and chunk.start == row.position
        for row, chunk in zip(rows, chunks, strict=True)
    )
