"""Attention in Triton kernels: the new K/V are written into the paged pool by one kernel, then attention
reads them in place through the block tables (no gather, no padding, no mask tensor).

* decode steps (every sequence has one new token) use split-K paged decoding, its launch fixed by the
  batch size and ``metadata.max_seq_len`` alone (read as a bound: a CUDA graph captured with
  ``max_seq_len = max_model_len`` replays correctly for every shorter context; see
  ``tokenmill.kernels.attention.plan_decode_split``);
* prefill, chunked prefill and mixed batches use the variable-length causal kernel; with
  ``split_prefill`` a launch of few query tokens (a speculative verification step) splits each query
  tile's keys over several programs, planned from ``metadata.max_seq_len`` as decode's split is;
* without a KV cache, whole packed sequences attend to themselves.

Same semantics as :class:`~tokenmill.attention.torch_backend.TorchAttentionBackend`; needs
``tokenmill.kernels.triton_available()`` (a CUDA device, or ``TRITON_INTERPRET=1``).
"""

import torch

from tokenmill.attention.backend import AttentionBackend, AttentionLayer, PendingRotary
from tokenmill.attention.metadata import AttentionMetadata, KVCacheLayer
from tokenmill.kernels.attention import (
    DecodeConfig,
    NewTokens,
    PrefillConfig,
    Rotation,
    check_head_dim,
    paged_decode_attention,
    paged_prefill_attention,
    varlen_attention,
)
from tokenmill.kernels.kv_write import write_kv
from tokenmill.kernels.rotary import rotate_and_write_kv


class TritonAttentionBackend(AttentionBackend):
    def __init__(
        self,
        decode_partition_size: int | None = None,
        decode_config: DecodeConfig | None = None,
        prefill_config: PrefillConfig | None = None,
        pdl: bool = False,
        fused_decode_rotary_kv: bool = False,
        split_prefill: bool = False,
        fused_prefill_rotary_kv: bool = False,
    ) -> None:
        """The first three override the kernels' tile choices (for tuning and tests; None picks defaults);
        ``pdl`` launches the KV write and decode kernels programmatically dependent
        (``tokenmill.kernels.launch``); ``fused_decode_rotary_kv`` lets the decode kernel rotate q and the
        new key and store the new K/V itself (no rotary and KV-write launches on decode steps);
        ``split_prefill``: paged prefill launches of few query tokens split their keys
        (``split_prefill_attention``); ``fused_prefill_rotary_kv``: prefill steps rotate q and k and
        store the new K/V in one launch."""
        self.decode_partition_size = decode_partition_size
        self.decode_config = decode_config
        self.prefill_config = prefill_config
        self.pdl = pdl
        self.fused_decode_rotary_kv = fused_decode_rotary_kv
        self.split_prefill = split_prefill
        self.fused_prefill_rotary_kv = fused_prefill_rotary_kv
        self._decode = self._decode_fused if fused_decode_rotary_kv else self._decode_separate

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
        check_head_dim(layer.head_dim)
        if kv_cache is not None and metadata.max_query_len == 1 and query.shape[0] == metadata.num_seqs:
            return self._decode(layer, query, key, value, metadata, kv_cache, rotary)
        window = layer.sliding_window
        if kv_cache is not None:
            query = self._rotate_and_write(query, key, value, metadata, kv_cache, rotary)
        elif rotary is not None:
            query, key = rotary.apply(query, key)
        if kv_cache is None:
            return varlen_attention(
                query,
                key,
                value,
                metadata.query_start_loc,
                layer.scale,
                window,
                self.prefill_config,
                metadata.derived,
            )
        _, block_tables = _require_paging(metadata)
        return paged_prefill_attention(
            query,
            kv_cache.key,
            kv_cache.value,
            block_tables,
            metadata.query_start_loc,
            metadata.seq_lens,
            layer.scale,
            window,
            self.prefill_config,
            metadata.derived,
            pdl=self.pdl,
            max_seq_len=metadata.max_seq_len if self.split_prefill else None,
        )

    def _rotate_and_write(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: AttentionMetadata,
        kv_cache: KVCacheLayer,
        rotary: PendingRotary | None,
    ) -> torch.Tensor:
        """A prefill step's rotary embedding and K/V write; the rotated query. One launch where the rotation
        covers the whole head (``fused_prefill_rotary_kv``: q and k rotated in place), else the rotation
        then the KV-write kernel."""
        slot_mapping, _ = _require_paging(metadata)
        pools = (kv_cache.key, kv_cache.value)
        if self.fused_prefill_rotary_kv and rotary is not None and rotary.cos_sin_cache is not None:
            positions, table = rotary.positions, rotary.cos_sin_cache
            rotate_and_write_kv(positions, query, key, value, table, pools, slot_mapping, self.pdl)
            return query
        if rotary is not None:
            query, key = rotary.apply(query, key)
        write_kv(key, value, *pools, slot_mapping, self.pdl)
        return query

    def _decode_fused(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: AttentionMetadata,
        kv_cache: KVCacheLayer,
        rotary: PendingRotary | None,
    ) -> torch.Tensor:
        """One new token per sequence, one launch per layer: the decode kernel stores the new K/V, and
        rotates q and k on the way when the rotation covers the whole head (otherwise it is applied first)."""
        slot_mapping, block_tables = _require_paging(metadata)
        rotation = None
        if rotary is not None and rotary.cos_sin_cache is not None:
            rotation = Rotation(rotary.positions, rotary.cos_sin_cache)
        elif rotary is not None:
            query, key = rotary.apply(query, key)
        new_tokens = NewTokens(key, value, slot_mapping)
        return self._decode_attention(layer, query, kv_cache, block_tables, metadata, new_tokens, rotation)

    def _decode_separate(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: AttentionMetadata,
        kv_cache: KVCacheLayer,
        rotary: PendingRotary | None,
    ) -> torch.Tensor:
        """One new token per sequence: the rotary and KV-write kernels run before the decode kernel."""
        slot_mapping, block_tables = _require_paging(metadata)
        if rotary is not None:
            query, key = rotary.apply(query, key)
        write_kv(key, value, kv_cache.key, kv_cache.value, slot_mapping, self.pdl)
        return self._decode_attention(layer, query, kv_cache, block_tables, metadata, None, None)

    def _decode_attention(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        kv_cache: KVCacheLayer,
        block_tables: torch.Tensor,
        metadata: AttentionMetadata,
        new_tokens: NewTokens | None,
        rotation: Rotation | None,
    ) -> torch.Tensor:
        return paged_decode_attention(
            query,
            kv_cache.key,
            kv_cache.value,
            block_tables,
            metadata.seq_lens,
            metadata.max_seq_len,
            layer.scale,
            layer.sliding_window,
            self.decode_partition_size,
            self.decode_config,
            pdl=self.pdl,
            new_tokens=new_tokens,
            rotation=rotation,
            order=metadata.seq_order,
        )


def _require_paging(metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    if metadata.slot_mapping is None or metadata.block_tables is None:
        raise ValueError("attention with a KV cache needs metadata.slot_mapping and metadata.block_tables")
    return metadata.slot_mapping, metadata.block_tables
