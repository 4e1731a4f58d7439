"""Linear layers that know how to load (their shard of) a checkpoint weight.

Column-parallel layers split the output features across tensor-parallel ranks, row-parallel layers the
input features (and sum the partial results). Fused layers (QKV, gate+up) take the separate checkpoint
tensors one shard at a time. With one rank these are plain linear layers; model code is the same either way.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import all_reduce_sum, divide, tp_rank, tp_world_size

ShardId = str | int | None


def check_shape(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"has shape {tuple(loaded.shape)} but the model expects {tuple(param.shape)}")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
    check_shape(param, loaded)
    param.data.copy_(loaded)


def weight_loader_of(param: nn.Parameter):  # type: ignore[no-untyped-def]
    return getattr(param, "weight_loader", default_weight_loader)


def _parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class LinearBase(nn.Module):
    """``y = x W^T + b`` with ``W`` of shape ``[out_local, in_local]``; weights are filled by the loader."""

    def __init__(self, in_local: int, out_local: int, bias: bool) -> None:
        super().__init__()
        self.weight = _parameter(out_local, in_local)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = _parameter(out_local)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        default_weight_loader(param, loaded)


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


class QKVParallelLinear(MergedColumnParallelLinear):
    """Query, key and value projections fused; split by heads across ranks."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ):
        self.head_dim = head_dim
        super().__init__(
            hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias
        )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        index = {"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id) if isinstance(shard_id, str) else shard_id
        super().weight_loader(param, loaded, index)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        return all_reduce_sum(F.linear(x, self.weight, bias))
