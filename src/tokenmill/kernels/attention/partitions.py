"""Flash-decoding partitions: the keys each decode program (or split prefill program) takes, and the
split merge (the partials' buffers, the arrival counters that pick the merging program, and the merge
itself)."""

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import arrival_counters

COUNTERS_OWNER = "split attention"
MERGE_CHUNK = tl.constexpr(8)  # partitions a decode program's merge reads per round (a group's few rows)


@triton.jit
def context_range(seq_len: tl.tensor, window: int, has_window: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """First visible key position and the number of visible keys of a decode query at ``seq_len - 1``."""
    start = tl.maximum(seq_len - window, 0) if has_window else seq_len * 0
    return start, seq_len - start


@triton.jit
def partition_length(
    context_len: tl.tensor, num_splits: int, min_partition: int, max_unsplit: int, block_n: tl.constexpr
) -> tl.tensor:
    """Keys per partition for this sequence: its context over the splits, in whole key tiles; the whole
    context when it is at most ``max_unsplit`` keys."""
    per_split = tl.maximum(tl.cdiv(tl.cdiv(context_len, num_splits), block_n) * block_n, min_partition)
    return tl.where(context_len <= max_unsplit, tl.cdiv(context_len, block_n) * block_n, per_split)


@triton.jit
def merge_partitions(
    part_out_ptr: tl.tensor,
    part_max_ptr: tl.tensor,
    part_sum_ptr: tl.tensor,
    parts: tl.tensor,
    row_ok: tl.tensor,
    used: tl.tensor,
    dims: tl.tensor,
    merge_chunk: tl.constexpr,
) -> tl.tensor:
    """Partition ``j``'s output was normalized by its own sum: reweight by ``sum_j * 2^(max_j - max)``
    (a partition that saw no key of a row has sum 0 and output 0 there: weight 0). Partitions are read
    ``merge_chunk`` at a time, so a short merge is one round of loads; rows x chunk x head_dim floats
    must fit the program's registers."""
    row_max = tl.full(parts.shape, float("-inf"), tl.float32)
    row_sum = tl.zeros(parts.shape, tl.float32)
    acc = tl.zeros([parts.shape[0], dims.shape[0]], tl.float32)
    for first in range(0, used, merge_chunk):
        chunk = first + tl.arange(0, merge_chunk)
        index = parts[:, None] + chunk[None, :]  # [rows, chunk]
        valid = row_ok[:, None] & (chunk < used)[None, :]
        # .cg: read from L2, where the other programs' stores are, not a stale L1 line.
        part_max = tl.load(part_max_ptr + index, mask=valid, other=float("-inf"), cache_modifier=".cg")
        part_sum = tl.load(part_sum_ptr + index, mask=valid, other=0.0, cache_modifier=".cg")
        part_out = tl.load(
            part_out_ptr + (index * dims.shape[0])[:, :, None] + dims[None, None, :],
            mask=valid[:, :, None],
            other=0.0,
            cache_modifier=".cg",
        )
        new_max = tl.maximum(row_max, tl.max(part_max, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # masked-off rows (past the group)
        alpha = tl.exp2(row_max - safe_max)
        weight = tl.exp2(part_max - safe_max[:, None]) * part_sum
        row_sum = row_sum * alpha + tl.sum(weight, 1)
        acc = acc * alpha[:, None] + tl.sum(part_out * weight[:, :, None], 1)
        row_max = new_max
    return acc / row_sum[:, None]


@triton.jit
def store_partition(
    out: tl.tensor,
    row_max: tl.tensor,
    row_sum: tl.tensor,
    out_ptrs: tl.tensor,
    part_out_ptr: tl.tensor,
    part_max_ptr: tl.tensor,
    part_sum_ptr: tl.tensor,
    parts: tl.tensor,
    partition: tl.tensor,
    counter: tl.tensor,
    used: tl.tensor,
    row_ok: tl.tensor,
    dims: tl.tensor,
    merge_chunk: tl.constexpr,
) -> None:
    """A split program's rows: its partition's output (normalized by its own sum), maximum and sum stored
    at ``parts + partition``; the last of the ``used`` partitions to arrive merges them all into
    ``out_ptrs``. Its acq_rel increment of ``counter`` comes after every other partition's release of its
    stores, so it sees them all; it resets the counter for the next launch (the next layer, or the next
    replay of a graph)."""
    tl.store(
        part_out_ptr + (parts + partition)[:, None] * dims.shape[0] + dims[None, :], out, mask=row_ok[:, None]
    )
    tl.store(part_max_ptr + parts + partition, row_max, mask=row_ok)
    tl.store(part_sum_ptr + parts + partition, row_sum, mask=row_ok)
    tl.debug_barrier()
    if tl.atomic_add(counter, 1, sem="acq_rel") == used - 1:
        tl.atomic_xchg(counter, 0)
        merged = merge_partitions(
            part_out_ptr, part_max_ptr, part_sum_ptr, parts, row_ok, used, dims, merge_chunk
        )
        tl.store(out_ptrs, merged.to(out_ptrs.dtype.element_ty), mask=row_ok[:, None])


def decode_partials(
    num_rows: int, num_merges: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-partition outputs (normalized), maxima and sums of ``num_rows`` query tokens, and the arrival
    counters of ``num_merges`` merging groups (decode: a sequence's KV head; split prefill: a query
    tile's). With one split the kernel touches none of them: one placeholder kept per device stands for
    the three buffers, so an unsplit launch (every prefill layer but short ones) allocates nothing."""
    if num_splits == 1:
        unused = _PLACEHOLDERS.get(device)
        if unused is None:
            unused = _PLACEHOLDERS[device] = torch.empty(1, dtype=torch.float32, device=device)
        return unused, unused, unused, arrival_counters(COUNTERS_OWNER, device)
    shape = (num_rows, num_heads, num_splits)
    part_out = torch.empty(*shape, head_dim, dtype=torch.float32, device=device)
    part_max = torch.empty(shape, dtype=torch.float32, device=device)
    part_sum = torch.empty(shape, dtype=torch.float32, device=device)
    return part_out, part_max, part_sum, arrival_counters(COUNTERS_OWNER, device, num_merges)


_PLACEHOLDERS: dict[torch.device, torch.Tensor] = {}
