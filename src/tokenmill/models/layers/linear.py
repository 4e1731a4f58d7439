"""Linear layers that know how to load (their shard of) a checkpoint weight.

Column-parallel layers split the output features across tensor-parallel ranks, row-parallel layers the
input features (and sum the partial results). Fused layers (QKV, gate+up) take the separate checkpoint
tensors one shard at a time. With one rank these are plain linear layers; model code is the same either way.

Each projection runs on the path bound when configured (:class:`LinearProjection`): with
``KernelOptions.gemv``, inputs of at most ``GEMV_MAX_ROWS`` rows (small-batch decode) go through the
Triton GEMV; with ``KernelOptions.prepacked_cpu_linear``, float32 CPU weights through oneDNN.
"""

from collections.abc import Callable, Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import all_reduce_sum, divide, kv_head_shard, tp_rank, tp_world_size
from tokenmill.kernels.options import GEMV_MAX_ROWS, KernelOptions
from tokenmill.models.layers.cpu_linear import packed_linear, shared_packed_weight, supports_prepacking
from tokenmill.models.layers.fusable import FusableLayer

ShardId = str | int | None


def gemv_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the Triton GEMV takes ``x @ weight.T``: at most ``GEMV_MAX_ROWS`` rows, the weight's dtype."""
    return x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS and x.dtype == weight.dtype


def check_shape(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"has shape {tuple(loaded.shape)} but the model expects {tuple(param.shape)}")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
    check_shape(param, loaded)
    param.data.copy_(loaded)


WeightLoader = Callable[[nn.Parameter, torch.Tensor, ShardId], None]


def weight_loader_of(param: nn.Parameter) -> WeightLoader:
    """The loader the owning layer attached to ``param`` (it knows the shard this rank holds)."""
    loader: WeightLoader = getattr(param, "weight_loader", default_weight_loader)
    return loader


def _parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class LinearProjection(FusableLayer):
    """``x W^T (+ b)`` with this rank's weight, on the path bound by :meth:`configure`: the Triton GEMV for
    the rows it takes, oneDNN's packed copy of a float32 CPU weight, or ``F.linear``.

    Linear layers and the LM head share these paths; a subclass provides ``weight`` and the bias it adds.
    """

    weight: nn.Parameter
    gemv_out_dtype: ClassVar[torch.dtype | None] = None  # the GEMV's output dtype (None: the input's)

    def configure(self, options: KernelOptions) -> None:
        self.pdl = options.pdl  # launch the GEMV programmatically dependent (tokenmill.kernels.launch)
        self.packed_weight: torch.Tensor | None = None  # oneDNN copy of weight (cpu_linear), when prepacked
        if options.prepacked_cpu_linear and supports_prepacking(self.weight):
            self.packed_weight = shared_packed_weight(self.weight)
        self._matmul: Callable[[torch.Tensor], torch.Tensor] = (
            self.project_torch if self.packed_weight is None else self.project_packed
        )
        self._project = self._matmul
        if options.gemv:
            from tokenmill.kernels.gemv import gemv

            self._gemv_kernel = gemv
            self._project = self.project_gemv

    def local_bias(self) -> torch.Tensor | None:
        """The bias this rank adds (row-parallel layers add it on one rank only)."""
        return None

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's ``x W^T + b``, before the ranks' outputs are combined."""
        return self._project(x)

    def project_torch(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.local_bias())

    def project_packed(self, x: torch.Tensor) -> torch.Tensor:
        assert self.packed_weight is not None  # bound only with a packed copy
        return packed_linear(x, self.packed_weight, self.local_bias())

    def project_gemv(self, x: torch.Tensor) -> torch.Tensor:
        """The GEMV for inputs it takes (:func:`gemv_fits`); more rows read the weight once through the
        matmul bound beside it."""
        if not gemv_fits(x, self.weight):
            return self._matmul(x)
        return self._gemv_kernel(
            x, self.weight, self.local_bias(), pdl=self.pdl, out_dtype=self.gemv_out_dtype
        )


class LinearBase(LinearProjection):
    """``y = x W^T + b`` with ``W`` of shape ``[out_local, in_local]``; weights are filled by the loader."""

    def __init__(self, in_local: int, out_local: int, bias: bool) -> None:
        super().__init__()
        self.weight = _parameter(out_local, in_local)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = _parameter(out_local)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.configure(KernelOptions())

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.project(x))

    def local_bias(self) -> torch.Tensor | None:
        return self.bias

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Combine the ranks' outputs (row-parallel layers sum their partial products)."""
        return partial


class ColumnParallelLinear(LinearBase):
    """Splits output features: rank ``r`` holds rows ``[r * out/tp, (r+1) * out/tp)``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp_size = tp_world_size()
        self.tp_rank = tp_rank()
        super().__init__(in_features, divide(out_features, self.tp_size, "output features"), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        rows = param.shape[0]
        if loaded.shape[0] != rows * self.tp_size:
            raise ValueError(f"has shape {tuple(loaded.shape)}; expected {rows * self.tp_size} rows")
        default_weight_loader(param, loaded.narrow(0, self.tp_rank * rows, rows))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (e.g. gate and up)."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(in_features, sum(output_sizes), bias)
        self.local_sizes = [size // self.tp_size for size in self.output_sizes]  # the rows this rank holds

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if shard_id is None:  # the checkpoint already stores the fused tensor
            if loaded.shape[0] != sum(self.output_sizes):
                raise ValueError(f"has shape {tuple(loaded.shape)}; expected {sum(self.output_sizes)} rows")
            for index, part in enumerate(loaded.split(self.output_sizes, dim=0)):
                self.weight_loader(param, part, index)
            return
        assert isinstance(shard_id, int)
        local = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        target = param.data.narrow(0, offset, local)
        expected = (self.output_sizes[shard_id], *param.shape[1:])
        if tuple(loaded.shape) != expected:
            raise ValueError(f"has shape {tuple(loaded.shape)} but the model expects {expected}")
        target.copy_(loaded.narrow(0, self.tp_rank * local, local))


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections fused; split by heads across ranks. With fewer KV heads than
    ranks each rank holds the one KV head its query heads read (:func:`kv_head_shard`)."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ):
        self.tp_size, self.tp_rank = tp_world_size(), tp_rank()
        self.head_dim = head_dim
        local_q = divide(num_heads, self.tp_size, "attention heads")
        local_kv, first_kv = kv_head_shard(num_kv_heads, self.tp_size, self.tp_rank)
        self.full_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self.local_sizes = [local_q * head_dim, local_kv * head_dim, local_kv * head_dim]
        q_start, kv_start = self.tp_rank * local_q * head_dim, first_kv * head_dim
        self.source_starts = [q_start, kv_start, kv_start]  # this rank's first row of each checkpoint part
        LinearBase.__init__(self, hidden_size, sum(self.local_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if shard_id is None:  # the checkpoint already stores the fused tensor
            if loaded.shape[0] != sum(self.full_sizes):
                raise ValueError(f"has shape {tuple(loaded.shape)}; expected {sum(self.full_sizes)} rows")
            for index, part in enumerate(loaded.split(self.full_sizes, dim=0)):
                self.weight_loader(param, part, index)
            return
        index = {"q": 0, "k": 1, "v": 2}[shard_id] if isinstance(shard_id, str) else shard_id
        expected = (self.full_sizes[index], *param.shape[1:])
        if tuple(loaded.shape) != expected:
            raise ValueError(f"has shape {tuple(loaded.shape)} but the model expects {expected}")
        size = self.local_sizes[index]
        target = param.data.narrow(0, sum(self.local_sizes[:index]), size)
        target.copy_(loaded.narrow(0, self.source_starts[index], size))


class RowParallelLinear(LinearBase):
    """Splits input features; each rank computes a partial sum, reduced across ranks (bias added once)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp_size = tp_world_size()
        self.tp_rank = tp_rank()
        super().__init__(divide(in_features, self.tp_size, "input features"), out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if param.dim() == 2 and self.tp_size > 1:
            cols = param.shape[1]
            if loaded.shape[1] != cols * self.tp_size:
                raise ValueError(f"has shape {tuple(loaded.shape)}; expected {cols * self.tp_size} columns")
            loaded = loaded.narrow(1, self.tp_rank * cols, cols)
        default_weight_loader(param, loaded)

    def local_bias(self) -> torch.Tensor | None:
        return self.bias if self.tp_rank == 0 else None

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(partial)
