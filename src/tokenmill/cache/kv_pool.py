"""Sizing and allocating the per-layer KV pool that the block tables index into."""

from dataclasses import dataclass

import torch

from tokenmill.attention.metadata import KVCacheLayer

_GIB = 1024**3


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take across all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


def kv_bytes_per_block(
    block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    return block_size * kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)


def num_blocks_for_budget(
    budget_bytes: int, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """How many whole blocks fit in ``budget_bytes``; ValueError if not even one does."""
    block_bytes = kv_bytes_per_block(block_size, num_layers, num_kv_heads, head_dim, dtype)
    num_blocks = max(0, budget_bytes) // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"a KV cache budget of {budget_bytes} bytes ({budget_bytes / _GIB:.3f} GiB) does not fit one "
            f"block of {block_bytes} bytes ({block_size} tokens x {num_layers} layers x {num_kv_heads} "
            f"KV heads x {head_dim} dims x 2 (K and V) x {dtype.itemsize} bytes of {dtype})"
        )
    return num_blocks


CPU_KV_CACHE_CAP_BYTES = 2 * _GIB  # the most a sized CPU pool takes unless one sequence needs more


def sized_cpu_kv_budget(bytes_per_token: int, block_size: int, max_model_len: int, max_running: int) -> int:
    """The CPU pool's bytes when ``cpu_kv_cache_gib`` is unset: room for ``max_running`` sequences of
    ``max_model_len`` tokens, at most 2 GiB, but never less than one full-length sequence (so a prompt up
    to the context limit can always run), in whole blocks."""
    block_bytes = block_size * bytes_per_token
    one_sequence = -(-max_model_len // block_size) * block_bytes
    wanted = min(max_running * one_sequence, CPU_KV_CACHE_CAP_BYTES // block_bytes * block_bytes)
    return max(wanted, one_sequence)


@dataclass(frozen=True)
class DeviceMemory:
    """What KV sizing needs to know about a GPU's memory, read once (see :func:`read_device_memory`)."""

    total_bytes: int
    free_bytes: int  # free on the device right now, whoever holds the rest
    peak_used_bytes: int  # this process's peak PyTorch reservation: weights plus profiled activations
    reserved_bytes: int  # this process's PyTorch reservation when read: the tensors it still holds
    process_fraction: float = 1.0  # the cap torch.cuda.set_per_process_memory_fraction puts on it

    @property
    def usable_bytes(self) -> int:
        """The device's memory, or this process's share of it under a per-process memory fraction."""
        return int(self.total_bytes * self.process_fraction)

    def describe(self) -> str:
        if self.process_fraction >= 1:
            return f"{self.total_bytes / _GIB:.2f} GiB total"
        return (
            f"{self.usable_bytes / _GIB:.2f} GiB ({self.process_fraction:g} of {self.total_bytes / _GIB:.2f})"
        )


def read_device_memory(device: torch.device | str | int | None = None) -> DeviceMemory:
    """Read after the profiling forward passes and ``torch.cuda.empty_cache()``: the peak then covers the
    activations, and the free memory no longer counts them as taken."""
    if not torch.cuda.is_available():
        raise ValueError("no CUDA device: size the KV cache with num_blocks_for_budget and a byte budget")
    # get_per_process_memory_fraction refuses a device without an index ("cuda"): name it by its index.
    named = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
    index = named.index if named.index is not None else torch.cuda.current_device()
    free_bytes, total_bytes = torch.cuda.mem_get_info(index)
    return DeviceMemory(
        total_bytes,
        free_bytes,
        torch.cuda.max_memory_reserved(index),
        torch.cuda.memory_reserved(index),
        torch.cuda.get_per_process_memory_fraction(index),
    )


def kv_budget_bytes(memory: DeviceMemory, gpu_memory_utilization: float, reserve_bytes: int = 0) -> int:
    """``min(utilization x usable, free + reserved) - peak used - reserve``: the KV pool may take this much.

    ``free + reserved`` is the most this process can hold while others hold the rest of the device; the
    peak (weights and the largest step's activations) comes out of it as out of the utilization's share,
    so a pool sized by what is free still leaves the activations it was profiled with their room."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    share = int(memory.usable_bytes * gpu_memory_utilization)
    reachable = memory.free_bytes + memory.reserved_bytes
    return min(share, reachable) - memory.peak_used_bytes - reserve_bytes


def num_blocks_for_device_memory(
    memory: DeviceMemory,
    gpu_memory_utilization: float,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    reserve_bytes: int = 0,
) -> int:
    """Blocks that fit in :func:`kv_budget_bytes`; the error spells the budget's terms out."""
    budget = kv_budget_bytes(memory, gpu_memory_utilization, reserve_bytes)
    try:
        return num_blocks_for_budget(budget, block_size, num_layers, num_kv_heads, head_dim, dtype)
    except ValueError as error:
        raise ValueError(
            f"{error}; the budget is min({gpu_memory_utilization} x {memory.describe()}, "
            f"{memory.free_bytes / _GIB:.2f} GiB free + {memory.reserved_bytes / _GIB:.2f} GiB held) - "
            f"{memory.peak_used_bytes / _GIB:.2f} GiB used by this process at its peak - "
            f"{reserve_bytes / _GIB:.2f} GiB reserved"
        ) from None


def allocate_kv_pool(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[KVCacheLayer]:
    """Zeroed ``[num_blocks, block_size, num_kv_heads, head_dim]`` key and value pools, one pair per layer.

    Zeroed, not empty: reference attention multiplies masked-out slots by zero weights, and 0 * NaN
    garbage would poison the output. The pools are views of one allocation, which keeps the allocator
    from fragmenting memory around them.
    """
    for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    storage = torch.zeros(
        (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
    )
    return [KVCacheLayer(key=storage[layer, 0], value=storage[layer, 1]) for layer in range(num_layers)]
