"""The CPU attention backend: a decode step's attention in one C call per layer
(:mod:`tokenmill.attention.cpu_kernel`), everything else as the PyTorch reference does it.

The C call takes steps of up to ``C_MAX_QUERY_LEN`` new tokens per sequence over a paged float32 pool:
every decode step of a running batch, and the verification steps of speculative decoding (1 + k tokens).
The kernel reads one row per new token; a sequence's several rows each get the sequence's block table
and a context that ends at the row's own position (the kernel stores every new key and value before any
row attends, so that is causal attention). Longer prefill chunks, other dtypes and steps without a KV
cache go to the PyTorch backend it extends.
"""

import ctypes
from dataclasses import dataclass

import torch

from tokenmill.attention.backend import AttentionLayer, PendingRotary
from tokenmill.attention.metadata import AttentionMetadata, KVCacheLayer
from tokenmill.attention.torch_backend import TorchAttentionBackend

# New tokens per sequence the C call takes: speculative verification steps (1 + k, k <= 12 by default) and
# short chunks. Longer prefills attend through PyTorch's batched matmuls, faster there than one row at a time.
C_MAX_QUERY_LEN = 16


@dataclass(frozen=True)
class DecodeArrays:
    """The step's integer inputs as the kernel reads them, converted once per step (shared by the layers)."""

    slots: torch.Tensor  # int64 [T]
    tables: torch.Tensor  # int32 [T, W]
    seq_lens: torch.Tensor  # int32 [T]

    @classmethod
    def of(cls, metadata: AttentionMetadata) -> "DecodeArrays":
        found = metadata.derived.get(cls)
        if found is None:
            assert metadata.slot_mapping is not None and metadata.block_tables is not None
            tables, lens = metadata.block_tables, metadata.seq_lens
            if len(metadata.slot_mapping) != metadata.num_seqs:  # a row per token: its table, its own length
                ends = metadata.query_start_loc[1:].long()
                counts = ends.diff(prepend=ends.new_zeros(1))
                sequence = torch.repeat_interleave(torch.arange(len(ends)), counts)
                rows = torch.arange(len(sequence))
                tables, lens = tables[sequence], lens[sequence] - (ends[sequence] - rows) + 1
            found = metadata.derived[cls] = cls(
                metadata.slot_mapping.to(torch.int64).contiguous(),
                tables.to(torch.int32).contiguous(),
                lens.to(torch.int32).contiguous(),
            )
        return found


class CpuAttentionBackend(TorchAttentionBackend):
    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: AttentionMetadata,
        kv_cache: KVCacheLayer | None,
        rotary: PendingRotary | None = None,
    ) -> torch.Tensor:
        if not runs_in_c(query, key, value, metadata, kv_cache):
            return super().forward(layer, query, key, value, metadata, kv_cache, rotary)
        assert kv_cache is not None
        table = rotary.cos_sin_cache if rotary is not None else None
        if rotary is not None and (table is None or table.dtype != torch.float32):
            query, key = rotary.apply(query, key)  # a partial rotation: PyTorch rotates, the kernel does not
            table = None
        arrays = decode_arrays(metadata)
        # without a table the kernel reads no position: the slots stand in as a valid int64 array
        positions = arrays.slots if rotary is None or table is None else rotary.positions.to(torch.int64)
        positions = positions.contiguous()  # held in locals: the kernel reads them after data_ptr() returns
        table = None if table is None else table.contiguous()
        num_tokens, num_heads, head_dim = query.shape
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
        status = self.library.decode_attention(
            query.data_ptr(), query.stride(0), key.data_ptr(), key.stride(0),
            value.data_ptr(), value.stride(0), num_tokens, num_heads, layer.num_kv_heads, head_dim,
            None if table is None else table.data_ptr(), positions.data_ptr(),
            kv_cache.key.data_ptr(), kv_cache.value.data_ptr(), kv_cache.block_size,
            arrays.slots.data_ptr(), arrays.tables.data_ptr(), arrays.tables.shape[1],
            arrays.seq_lens.data_ptr(), layer.scale, layer.sliding_window or 0, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if status == 1:
            raise ValueError(f"the C decode attention cannot run {num_heads} heads over {layer.num_kv_heads}")
        if status != 0:
            raise MemoryError("the C decode attention could not allocate its scratch buffers")
        return out


def runs_in_c(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    metadata: AttentionMetadata,
    kv_cache: KVCacheLayer | None,
) -> bool:
    """A step of up to ``C_MAX_QUERY_LEN`` new tokens per sequence, float32 on the CPU over a contiguous
    paged pool, each row's heads laid out contiguously (the q / k / v views of a fused projection are)."""
    if kv_cache is None or metadata.block_tables is None or metadata.slot_mapping is None:
        return False
    if metadata.max_query_len > C_MAX_QUERY_LEN or query.shape[0] != metadata.slot_mapping.shape[0]:
        return False
    tensors = (query, key, value, kv_cache.key, kv_cache.value)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return False
    pools = kv_cache.key.is_contiguous() and kv_cache.value.is_contiguous()
    return pools and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (query, key, value))


def decode_arrays(metadata: AttentionMetadata) -> DecodeArrays:
    """The step's integer inputs as the C kernel reads them (converted once per step)."""
    return DecodeArrays.of(metadata)
