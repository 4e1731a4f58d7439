"""Small all-reduces through symmetric memory, in place of NCCL's (``custom_all_reduce``).

Each rank owns a buffer that every other rank of the node can read directly (CUDA peer access over
NVLink, set up once by ``torch.distributed._symmetric_memory``). One kernel per rank copies its input
into its own buffer, meets the other ranks at a barrier, reads every rank's buffer and writes the sum
(``torch.ops.symm_mem.one_shot_all_reduce_copy``; a second barrier at its end keeps a fast rank from
overwriting its buffer while a slow one still reads it). That is one launch on the caller's stream with
no protocol handshakes, where NCCL's small-message path costs several microseconds more per call: at
batch-1 decode a tensor-parallel step makes two all-reduces of one hidden vector per layer, so their
latency, not their bytes, is what they cost. Each rank reads ``world_size`` times the message, so large
messages (prefill steps, big decode batches) stay with NCCL, which moves each byte fewer times.

The smallest messages (``push``: up to 64 KiB, a decode step of up to 8 rows of a 4096-wide model) skip
even the barriers: every rank writes its input into every rank's buffer and sums what has arrived in its
own, each value announcing its own arrival (:mod:`tokenmill.kernels.push_all_reduce`); that Triton kernel
also takes part in programmatic launch, so the projection after it starts loading its weights while the
sum is under way.
"""

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)
# Messages up to this size take the one-shot kernel: a decode step of up to 64 rows of a 4096-wide model.
DEFAULT_MAX_BYTES = 512 * 1024
PUSH_MAX_BYTES = 64 * 1024  # messages up to this size take the push kernel (when it is on)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)  # the dtypes the symmetric-memory kernel sums


class SymmetricAllReduce:
    """Sums of small tensors across the ranks of ``group`` through symmetric memory; built by every rank
    of the group in step (the buffers are exchanged through the group's store). ``dtype``: the model's,
    the only one the push kernel takes (its buffer holds that dtype's sentinel); ``push``: use that kernel
    for the messages it fits; ``pdl``: launch it with programmatic launch."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        device: torch.device,
        dtype: torch.dtype,
        push: bool = True,
        pdl: bool = False,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.max_bytes = max_bytes
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # needed before torch 2.8
        if enable is not None and not symm_mem.is_symm_mem_enabled_for_group(self.group_name):
            enable(self.group_name)
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        self.dtype, self.pdl = dtype, pdl
        self.push_capacity = PUSH_MAX_BYTES // dtype.itemsize if push else 0
        if push:
            self._set_up_push(group, device, dtype)

    def _set_up_push(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype) -> None:
        """The push kernel's buffer (every slot empty: the sentinel), its pointers and phase counters; no
        rank pushes before every rank has emptied its buffer (the barrier)."""
        import torch.distributed._symmetric_memory as symm_mem

        from tokenmill.kernels.push_all_reduce import BLOCK, push_all_reduce, sentinel_bits  # Triton: GPUs

        self._push_kernel = push_all_reduce
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        bits, sentinel = sentinel_bits(dtype)
        self.push_buffer = symm_mem.empty((2, world, self.push_capacity), dtype=bits, device=device)
        handle = symm_mem.rendezvous(self.push_buffer, self.group_name)
        self.push_buffer.fill_(sentinel)
        self.push_pointers = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.push_phases = torch.zeros(-(-self.push_capacity // BLOCK), dtype=torch.int32, device=device)
        self.push_timed_out = torch.zeros(1, dtype=torch.int32, device=device)
        self.rank = rank
        torch.cuda.synchronize(device)
        dist.barrier(group)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through this path (else NCCL): small, contiguous, a dtype the kernel sums,
        and a whole number of 4-byte words (the kernel's narrowest vector)."""
        nbytes = x.numel() * x.element_size()
        return (
            x.dtype in SUPPORTED_DTYPES
            and x.is_contiguous()
            and 0 < nbytes <= self.max_bytes
            and nbytes % 4 == 0
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks, as a new tensor (``x`` itself is left as it was)."""
        if x.dtype == self.dtype and x.numel() <= self.push_capacity:
            return self.push(x)
        return self.one_shot(x)

    def push(self, x: torch.Tensor) -> torch.Tensor:
        """The sum through the push kernel (``x``: the model's dtype, within its capacity)."""
        return self._push_kernel(
            x,
            self.push_pointers,
            self.push_phases,
            self.push_timed_out,
            self.push_capacity,
            self.rank,
            self.pdl,
        )

    def one_shot(self, x: torch.Tensor) -> torch.Tensor:
        """The sum through torch's one-shot kernel (barriers around reading every rank's buffer)."""
        nbytes = x.numel() * x.element_size()
        staging = self.buffer[:nbytes].view(x.dtype).view(x.shape)
        summed: torch.Tensor = torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x, "sum", self.group_name)
        return summed


def create_symmetric_all_reduce(
    group: dist.ProcessGroup,
    device: torch.device,
    required: bool,
    dtype: torch.dtype,
    push: bool | None = None,
    pdl: bool = False,
) -> SymmetricAllReduce | None:
    """The symmetric-memory path for ``group`` on CUDA ``device`` (``start_workers`` refuses the setting on
    any other), or None where it cannot be set up (then NCCL does every all-reduce). ``required``
    (``custom_all_reduce=True``): a failure is an error, not a fallback; ``push`` (``push_all_reduce``): the
    push kernel for the smallest messages, None where the ranks are a power of 2, True required. Every
    rank calls this in step."""
    world = dist.get_world_size(group)
    if push is True and not _power_of_2(world):
        raise ValueError(f"push_all_reduce needs a power-of-2 number of ranks, not {world}")
    try:
        return SymmetricAllReduce(group, device, dtype, push is not False and _power_of_2(world), pdl)
    except Exception as error:  # no peer access, no symmetric-memory support in this torch build, ...
        if required:
            raise RuntimeError(f"custom_all_reduce: symmetric memory could not be set up: {error}") from error
        logger.warning("symmetric-memory all-reduce unavailable (%s); NCCL does every all-reduce", error)
        return None


def _power_of_2(n: int) -> bool:
    return n & (n - 1) == 0
