"""Tensor-parallel process state.

Linear layers and embeddings ask this module for their rank and world size once, when they are built,
so that they load only their shard of each weight, and pass that world size to the collectives they
call: a layer built as rank 0 of 1 calls none, whatever group its process has joined. Without an
initialized tensor-parallel group everything is built as rank 0 of 1, and :func:`unsharded` builds so
inside one (the draft model rank 0 runs alone). :func:`init_tensor_parallel` (called by
:mod:`tokenmill.parallel`) starts the group: the model's collectives run on the default process group
(NCCL on CUDA, gloo on CPU); the step inputs rank 0 sends each step travel on a second, gloo group
(:func:`control_group`). On GPUs, :func:`set_up_all_reduce` may route the small all-reduces through
symmetric memory instead of NCCL (:mod:`tokenmill.symmetric_all_reduce`).
"""

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from tokenmill.symmetric_all_reduce import SymmetricAllReduce, create_symmetric_all_reduce

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _TensorParallelState:
    world_size: int = 1
    rank: int = 0
    control: dist.ProcessGroup | None = None  # gloo, CPU tensors: headers and step inputs
    small_all_reduce: SymmetricAllReduce | None = None  # custom_all_reduce: messages it fits skip NCCL


_STATE = _TensorParallelState()
TEARDOWN_TIMEOUT_S = 30.0
# torch numbers its symmetric-memory exchanges per process, not per group: a process that set some up
# for an earlier group is ahead of a new worker's count, and their next exchange would wait forever.
_symmetric_memory_used = False


def init_tensor_parallel(
    backend: str, store: dist.Store, rank: int, world_size: int, timeout: timedelta, idle_timeout: timedelta
) -> None:
    """Join the group of ``world_size`` ranks through ``store``. ``timeout`` bounds the model's
    collectives; ``idle_timeout`` those of the control group, where a worker waits for rank 0's next
    step (an engine may idle for long; each rank's gloo timeout is its own)."""
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=idle_timeout)
    _STATE.world_size, _STATE.rank, _STATE.control = world_size, rank, control


def destroy_tensor_parallel(graceful: bool = True) -> None:
    """Leave the group (every rank at shutdown), so that a later engine in this process starts its own.
    Graceful: every rank leaves together, each having freed its captured graphs first (NCCL's teardown
    waits for every rank, and for good on a communicator a live graph captured). Not graceful (a rank has
    died): NCCL communicators are aborted instead. Either NCCL teardown is given ``TEARDOWN_TIMEOUT_S``
    before it is left to the process's exit, so that a shutdown never hangs on it."""
    _STATE.small_all_reduce = None  # its buffer goes before the group it was exchanged over
    if _STATE.world_size > 1 and dist.is_initialized():
        if dist.get_backend() != "nccl":
            dist.destroy_process_group()
        else:
            dist.destroy_process_group(_STATE.control)  # gloo: local
            leave = dist.destroy_process_group if graceful else dist.distributed_c10d._abort_process_group
            leaving = threading.Thread(target=leave, daemon=True)
            leaving.start()
            leaving.join(TEARDOWN_TIMEOUT_S)
            if leaving.is_alive():
                logger.warning(
                    "the NCCL communicator did not tear down in %.0f s; left to exit", TEARDOWN_TIMEOUT_S
                )
    _STATE.world_size, _STATE.rank, _STATE.control = 1, 0, None


def set_up_all_reduce(
    custom: bool | None, push: bool | None, device: torch.device, dtype: torch.dtype, pdl: bool
) -> None:
    """Every rank, in step, before the model's first collective: route the all-reduces that fit through
    symmetric memory when ``custom`` (None: on GPUs where it can be set up), the smallest of them through
    the push kernel unless ``push`` is False, else all through NCCL / gloo."""
    _STATE.small_all_reduce = None
    if _STATE.world_size == 1 or custom is False or (custom is None and device.type != "cuda"):
        return
    assert dist.group.WORLD is not None
    if not _first_symmetric_memory(custom is True, device):
        return
    _STATE.small_all_reduce = create_symmetric_all_reduce(
        dist.group.WORLD, device, custom is True, dtype, push, pdl
    )


def _first_symmetric_memory(required: bool, device: torch.device) -> bool:
    """Whether no rank's process has set up symmetric memory before (for an earlier engine): only then
    can the ranks set it up together. Otherwise NCCL does every all-reduce (``required``: an error)."""
    global _symmetric_memory_used
    if min_over_ranks(int(not _symmetric_memory_used), device) == 0:
        if required:
            raise RuntimeError(
                "custom_all_reduce: symmetric memory is set up once per process (torch numbers its "
                "exchanges per process), and this process did for an earlier tensor-parallel engine; "
                "build this one in a new process, or leave custom_all_reduce unset (NCCL is then used)"
            )
        logger.warning(
            "an earlier engine of this process set up symmetric memory: NCCL does every all-reduce"
        )
        return False
    _symmetric_memory_used = True
    return True


def uses_custom_all_reduce() -> bool:
    return _STATE.small_all_reduce is not None


def uses_push_all_reduce() -> bool:
    return _STATE.small_all_reduce is not None and _STATE.small_all_reduce.push_capacity > 0


def tp_world_size() -> int:
    return _STATE.world_size


def tp_rank() -> int:
    return _STATE.rank


@contextlib.contextmanager
def unsharded() -> Iterator[None]:
    """Build as rank 0 of 1 inside a tensor-parallel process: the layers of a model built here take whole
    weights and never call a collective, so this process can run it alone (the group stays joined)."""
    saved = _STATE.world_size, _STATE.rank
    _STATE.world_size, _STATE.rank = 1, 0
    try:
        yield
    finally:
        _STATE.world_size, _STATE.rank = saved


def control_group() -> dist.ProcessGroup:
    if _STATE.control is None:
        raise RuntimeError("no tensor-parallel group has been started")
    return _STATE.control


def all_reduce_sum(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """The sum of ``x`` over the ``world_size`` ranks a layer was built for (1: ``x``, no collective): in
    place through NCCL / gloo, or a new tensor from the symmetric-memory path where ``x`` fits it."""
    if world_size == 1:
        return x
    small = _STATE.small_all_reduce
    if small is not None and small.fits(x):
        return small(x)
    dist.all_reduce(x)
    return x


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest of the ranks' ``value`` (each rank calls this in step; ``device``: where the model's
    collectives run)."""
    if _STATE.world_size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def all_gather_last_dim(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """The ranks' ``x`` side by side along the last dimension (1: ``x``, no collective)."""
    if world_size == 1:
        return x
    gathered = x.new_empty((world_size * x.shape[0], *x.shape[1:]))  # one buffer, no per-rank parts
    dist.all_gather_into_tensor(gathered, x.contiguous())
    gathered = gathered.view(world_size, *x.shape)
    # [ranks, ..., part] -> [..., ranks * part]: a view for one row (batch-1 decode), a copy otherwise
    return gathered.movedim(0, -2).reshape(*x.shape[:-1], world_size * x.shape[-1])


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator


def kv_head_shard(num_kv_heads: int, world_size: int, rank: int) -> tuple[int, int]:
    """(KV heads this rank holds, index of its first): ``num_kv_heads / world_size`` each, or, with
    fewer KV heads than ranks, one each, replicated on the ``world_size / num_kv_heads`` ranks whose
    query heads read it."""
    if num_kv_heads >= world_size:
        local = divide(num_kv_heads, world_size, "KV heads")
        return local, rank * local
    if world_size % num_kv_heads:
        raise ValueError(
            f"the tensor-parallel size ({world_size}) is neither a divisor nor a multiple of the number "
            f"of KV heads ({num_kv_heads})"
        )
    return 1, rank * num_kv_heads // world_size
