"""Causal attention over packed variable-length queries, reading K/V in place from the paged pool.

The pool is ``[num_blocks, block_size, Hkv, D]``; position ``p`` of sequence ``b`` lives in block
``block_tables[b, p // block_size]`` at offset ``p % block_size``. A query's absolute position is
``seq_len - query_len + i``; it sees keys ``p <= pos`` with ``p > pos - sliding_window`` when windowed.

Both kernels put the query heads that share a KV head into one program (GQA), so each K/V tile is loaded
once for the whole group, and keep a running (max, sum) softmax in base 2 (the scale folds in log2 e).

* Decode (one query per sequence, ``decode``): flash-decoding. Each sequence's context is cut into
  ``num_splits`` equal partitions, one program per (sequence, KV head, partition), so a single long
  sequence still fills the GPU; the last program of a (sequence, KV head) to finish merges the
  partitions' partial outputs by their softmax maxima and sums (an arrival counter decides which: no
  second launch), and a context that fits one partition is written directly (``partitions``). The
  number of splits is fixed on the host from the batch size and a bound on the context
  (:func:`plan_decode_split`, ``plan``), the partition length on the device from each sequence's own
  length, so the launch is the same for every step of a CUDA graph while short contexts still spread
  over the splits. Keys of earlier steps are in the pool before the step starts, so each program loads
  its first tile of them before waiting for the kernels ahead (``kernels/launch.py``); the new token's
  key comes last. With ``new_tokens`` the kernel also stores the new K/V (no KV-write launch), and with
  ``rotation`` applies the rotary embedding to q and the new key on the way (no rotary launch;
  ``new_token``).
* Prefill / mixed batches (``prefill``): each program takes a tile of consecutive query tokens of one
  sequence (times the group's heads as rows); key tiles that every row sees skip the mask. A launch of
  few query tokens (a speculative verification step) splits each tile's keys into partitions as decode
  does (:func:`plan_prefill_split`), where its few tiles would leave most of the GPU idle.

Both walk their keys with the tile loop of ``tiles``; ``checks`` holds the layout checks of the launchers.
"""

from tokenmill.kernels.attention.checks import check_head_dim
from tokenmill.kernels.attention.decode import paged_decode_attention
from tokenmill.kernels.attention.new_token import NewTokens, Rotation
from tokenmill.kernels.attention.plan import (
    DECODE_MAX_UNSPLIT,
    DecodeConfig,
    DecodeSplit,
    PrefillConfig,
    default_decode_config,
    default_prefill_config,
    launch_waves,
    plan_decode_split,
    plan_prefill_split,
)
from tokenmill.kernels.attention.prefill import paged_prefill_attention, varlen_attention
from tokenmill.kernels.attention.query_tiles import PrefillTiles, prefill_tiles

__all__ = [
    "DECODE_MAX_UNSPLIT",
    "DecodeConfig",
    "DecodeSplit",
    "NewTokens",
    "PrefillConfig",
    "PrefillTiles",
    "Rotation",
    "check_head_dim",
    "default_decode_config",
    "default_prefill_config",
    "launch_waves",
    "paged_decode_attention",
    "paged_prefill_attention",
    "plan_decode_split",
    "plan_prefill_split",
    "prefill_tiles",
    "varlen_attention",
]
