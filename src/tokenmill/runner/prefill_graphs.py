"""CUDA graphs for the prefill of one sequence: a short prompt's time to first token is launch-bound.

A 128-token prompt on a 1B model computes in about a millisecond but launches some two hundred kernels,
each costing the host tens of microseconds; replaying them from a graph costs one launch. A step that
is one sequence's chunk of ``L <= max(sizes)`` tokens runs the graph of the smallest captured size
``P > L``. The graph sees two sequences: the real one (its ``L`` tokens, at its positions, after its
cached context) and one padding sequence of the other ``P - L`` tokens (token 0 at positions from 0,
slot -1 so their K/V is written nowhere, a block table of zeros: they attend to block 0, whose contents
are finite, and their outputs are dropped). The paged prefill kernel's launch depends only on the token
and sequence counts, which a bucket fixes, so one capture serves every prompt length below it and any
cached prefix. The LM head runs after the replay, on the last real row only.

Under tensor parallelism rank 0 announces each such step's arrays (``mirror``) and every worker writes
them into its own runner's buffers and replays its graph of the same bucket
(:meth:`PrefillGraphRunner.run_arrays`).
"""

import logging
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import torch

from tokenmill.attention import AttentionBackend, ForwardContext, KVCacheLayer, forward_context
from tokenmill.cache.kv_cache_manager import KVCacheManager
from tokenmill.config import EngineConfig
from tokenmill.models import CausalLM
from tokenmill.runner.cuda_graphs import CaptureReport, capture_graphs, padded_batch_size
from tokenmill.runner.decode_inputs import HostStaging
from tokenmill.runner.step_inputs import PADDING_SLOT, PackedLayout, attention_metadata, build_step_arrays
from tokenmill.scheduler.output import ScheduledChunk

logger = logging.getLogger(__name__)
PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512)
_NUM_SEQS = 2  # the real sequence and the padding one
_FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc", "block_tables")


class PrefillMirror(Protocol):
    """Tensor-parallel workers, told of each prefill step rank 0 runs through its static buffers."""

    def prefill_step(self, arrays: Mapping[str, np.ndarray], num_tokens: int) -> None: ...


def prefill_graph_sizes(config: EngineConfig, device: torch.device, max_model_len: int) -> tuple[int, ...]:
    """The prefill buckets to capture for this engine (each holds ``P - 1`` tokens); empty when graphs or
    prefill graphs are off, or not on CUDA."""
    graphs = config.graphs
    if not (graphs.enabled and graphs.prefill) or device.type != "cuda":
        return ()
    longest = min(config.scheduler.token_budget, max_model_len)  # a chunk's most tokens
    needed = [size for size in PREFILL_GRAPH_TOKENS if size <= longest]
    above = [size for size in PREFILL_GRAPH_TOKENS if size > longest]
    return (*needed, *above[:1])  # up to the first bucket that holds every chunk


class PrefillGraphRunner:
    """Runs one-sequence prefill chunks through graphs captured at ``sizes`` tokens (eagerly over the same
    static buffers before :meth:`capture`, e.g. on CPU)."""

    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        kv_layers: Sequence[KVCacheLayer],
        kv: KVCacheManager,
        sizes: Sequence[int],
        max_model_len: int,
        mirror: PrefillMirror | None = None,
    ) -> None:
        if not sizes:
            raise ValueError("no prefill sizes to capture")
        self.model, self.backend, self.kv_layers, self.kv = model, backend, kv_layers, kv
        self.mirror = mirror
        self.sizes = tuple(sorted(sizes))
        self.max_model_len = max_model_len
        self.device = kv_layers[0].key.device
        self.table_width = -(-max_model_len // kv.block_size)
        capacity = self.sizes[-1]
        numel = {"query_start_loc": 3, "seq_lens": _NUM_SEQS, "block_tables": _NUM_SEQS * self.table_width}
        dtypes = {"seq_lens": torch.int32, "query_start_loc": torch.int32, "block_tables": torch.int32}
        self.layout = PackedLayout(
            [(name, dtypes.get(name, torch.int64), numel.get(name, capacity)) for name in _FIELDS]
        )
        self.buffer = torch.zeros(self.layout.nbytes, dtype=torch.uint8, device=self.device)
        self.views = self.layout.views(self.buffer)
        self.views["block_tables"] = self.views["block_tables"].view(_NUM_SEQS, self.table_width)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._staging = [HostStaging(self.layout, self.device) for _ in range(2)]  # filled in turns
        self._turn = 0

    def can_run(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """One sequence's chunk of more than one token that fits a bucket (and wants no prompt logprobs:
        those need every row's hidden state, which the graph keeps but the LM head would not see)."""
        if len(chunks) != 1:
            return False
        chunk = chunks[0]
        return 1 < chunk.num_tokens < self.sizes[-1] and chunk.seq.params.prompt_logprobs is None

    def run(self, chunk: ScheduledChunk) -> torch.Tensor:
        """The hidden states of the chunk's ``L`` tokens, ``[L, hidden]`` (valid until the next run)."""
        num_tokens = padded_batch_size(chunk.num_tokens + 1, self.sizes)
        assert num_tokens is not None
        arrays = build_step_arrays([chunk], self.kv, table_width=self.table_width)
        if self.mirror is not None:
            self.mirror.prefill_step(arrays, num_tokens)
        return self.run_arrays(arrays, num_tokens)[: chunk.num_tokens]

    def run_arrays(self, arrays: Mapping[str, np.ndarray], num_tokens: int) -> torch.Tensor:
        """The hidden states of the ``num_tokens`` bucket's rows over one chunk's arrays (rank 0's, or what a
        tensor-parallel worker receives)."""
        self._write(arrays, num_tokens)
        graph = self.graphs.get(num_tokens)
        if graph is None:
            return self.forward_static_buffers(num_tokens)
        graph.replay()
        return self.outputs[num_tokens]

    def _write(self, arrays: Mapping[str, np.ndarray], num_tokens: int) -> None:
        """The chunk's rows, then the padding sequence's, into a pinned staging copy sent in one transfer."""
        real = len(arrays["positions"])
        pad = num_tokens - real
        staging = self._staging[self._turn]
        self._turn ^= 1
        if staging.copied is not None:
            staging.copied.synchronize()  # its previous copy has long run: this returns at once
        views = staging.views
        views["block_tables"][:] = 0
        views["input_ids"][:real] = arrays["input_ids"]
        views["input_ids"][real:num_tokens] = 0
        views["positions"][:real] = arrays["positions"]
        views["positions"][real:num_tokens] = np.arange(pad)
        views["slot_mapping"][:real] = arrays["slot_mapping"]
        views["slot_mapping"][real:num_tokens] = PADDING_SLOT
        views["seq_lens"][:] = (arrays["seq_lens"][0], pad)
        views["query_start_loc"][:] = (0, real, num_tokens)
        views["block_tables"][: self.table_width] = arrays["block_tables"][0]
        self.buffer.copy_(staging.tensor, non_blocking=True)
        if staging.copied is not None:
            staging.copied.record()

    def forward_static_buffers(self, num_tokens: int) -> torch.Tensor:
        """The model over the first ``num_tokens`` rows of the static buffers: what a graph captures."""
        rows = {
            name: view[: num_tokens if name in ("input_ids", "positions", "slot_mapping") else None]
            for name, view in self.views.items()
        }
        metadata = attention_metadata(rows, max_query_len=num_tokens, max_seq_len=self.max_model_len)
        with forward_context(ForwardContext(metadata, self.backend, self.kv_layers)):
            hidden: torch.Tensor = self.model(rows["input_ids"], rows["positions"])
        return hidden

    def fill_for_capture(self, size: int) -> None:
        """Inputs of a ``size`` bucket split as a real step's can be (a bucket is picked for ``L >= P/2``,
        so both halves stay within the context and its block table): no K/V is written, every block is
        block 0, every position 0."""
        half = size // 2
        self.buffer.zero_()
        self.views["slot_mapping"].fill_(PADDING_SLOT)
        self.views["query_start_loc"].copy_(torch.tensor([0, size - half, size], dtype=torch.int32))
        self.views["seq_lens"].copy_(torch.tensor([size - half, half], dtype=torch.int32))

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        captured = capture_graphs(
            self.device,
            self.sizes,
            self.fill_for_capture,
            self.forward_static_buffers,
            "prefill token counts",
        )
        self.graphs, self.outputs, report = captured
        return report
