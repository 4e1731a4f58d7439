"""Linear layers that know how to load (their shard of) a checkpoint weight.

Column-parallel layers split the output features across tensor-parallel ranks, row-parallel layers the
input features (and sum the partial results). Fused layers (QKV, gate+up) take the separate checkpoint
tensors one shard at a time. With one rank these are plain linear layers; model code is the same either way.

Each projection runs on the path bound when configured (:class:`LinearProjection`): with
``KernelOptions.gemv``, one-row inputs (batch-1 decode), and with ``gemv_rows`` up to ``GEMV_MAX_ROWS``
(small batches, speculative verification) for weights below ``GEMV_ROWS_MAX_WEIGHTS`` elements, go through
the Triton GEMV; with ``KernelOptions.prepacked_cpu_linear``, float32 CPU weights through oneDNN. A
quantized layer (``quantization`` int8 / fp8) binds the path its method provides
(:mod:`tokenmill.quantization`).

Loaders say which rows (and, row-parallel, which columns) of a checkpoint tensor this rank keeps and where
they go, as a :class:`RowShard`; the layer's quantization method stores them in its parameters' units
(float rows, quantized rows and their scales, 128 x 128 blocks).
"""

from collections.abc import Callable, Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import all_reduce_sum, divide, kv_head_shard, tp_rank, tp_world_size
from tokenmill.kernels.options import KernelOptions
from tokenmill.models.layers.cpu_linear import packed_linear, shared_packed_weight, supports_prepacking
from tokenmill.models.layers.fusable import FusableLayer
from tokenmill.quantization import UNQUANTIZED, LinearMethod, RowShard, linear_method

ShardId = str | int | None


def gemv_fits(x: torch.Tensor, layer: "LinearProjection", prologue: bool = False) -> bool:
    """Whether the Triton GEMV takes ``x @ layer.weight.T``: at most ``layer.gemv_max_rows`` rows (one with
    a fused ``prologue``: over more rows every program would recompute it for all of them), and a weight
    of x's dtype or an 8-bit one with a scale per row that the GEMV applies (per-channel int8 / fp8)."""
    if x.dim() != 2 or x.shape[0] > (min(layer.gemv_max_rows, 1) if prologue else layer.gemv_max_rows):
        return False
    if layer.quant_method.quantized:
        return layer.quant_method.gemv_scale is not None
    return x.dtype == layer.weight.dtype


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
    the rows it takes, oneDNN's packed copy of a float32 CPU weight, ``F.linear``, or for a quantized
    weight its method's path.

    Linear layers and the LM head share these paths; a subclass provides ``weight`` (created by its
    ``quant_method``) and the bias it adds.
    """

    weight: nn.Parameter
    quant_method: LinearMethod = UNQUANTIZED
    gemv_max_rows = 0  # rows the Triton GEMV takes (KernelOptions.gemv_max_rows), set by configure
    gemv_out_dtype: ClassVar[torch.dtype | None] = None  # the GEMV's output dtype (None: the input's)

    def configure(self, options: KernelOptions) -> None:
        self.pdl = options.pdl  # launch the GEMV programmatically dependent (tokenmill.kernels.launch)
        self.gemv_max_rows = options.gemv_max_rows(self.weight.numel())
        self.packed_weight: torch.Tensor | None = None  # oneDNN copy of weight (cpu_linear), when prepacked
        self._matmul: Callable[[torch.Tensor], torch.Tensor] = self._bind_matmul(options)
        self._project = self._matmul
        if options.gemv:
            from tokenmill.kernels.gemv import gemv

            self._gemv_kernel = gemv
            self._project = self.project_gemv

    def _bind_matmul(self, options: KernelOptions) -> Callable[[torch.Tensor], torch.Tensor]:
        """The matmul for any rows: a quantized method's path, else oneDNN's packed copy or ``F.linear``."""
        if self.quant_method.quantized:
            return self.quant_method.matmul_path(self, options)
        if options.prepacked_cpu_linear and supports_prepacking(self.weight):
            self.packed_weight = shared_packed_weight(self.weight)
            return self.project_packed
        return self.project_torch

    def store(self, param: nn.Parameter, loaded: torch.Tensor, shard: RowShard) -> None:
        """Store the rows ``shard`` names of ``loaded`` into ``param``, in the quantization's format."""
        self.quant_method.load(self, param, loaded, shard)

    def local_bias(self) -> torch.Tensor | None:
        """The bias this rank adds (row-parallel layers add it on one rank only)."""
        return None

    def gemv_weight_scale(self) -> torch.Tensor | None:
        """The scale per output row the GEMV applies to an 8-bit weight (None: a float weight)."""
        name = self.quant_method.gemv_scale
        return None if name is None else getattr(self, name)

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
        if not gemv_fits(x, self):
            return self._matmul(x)
        return self._gemv_kernel(
            x,
            self.weight,
            self.local_bias(),
            pdl=self.pdl,
            out_dtype=self.gemv_out_dtype,
            weight_scale=self.gemv_weight_scale(),
        )


class LinearBase(LinearProjection):
    """``y = x W^T + b`` with ``W`` of shape ``[out_local, in_local]``; weights are filled by the loader."""

    def __init__(self, in_local: int, out_local: int, bias: bool) -> None:
        super().__init__()
        self.in_local, self.out_local = in_local, out_local
        self.quant_method = linear_method()  # chosen by the model's build (tokenmill.quantization.context)
        self.quant_method.create_weights(self, out_local, in_local, self.weight_loader)
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
        rows = self.out_local
        self.store(param, loaded, RowShard(rows * self.tp_size, self.tp_rank * rows, rows, 0))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (e.g. gate and up)."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(in_features, sum(output_sizes), bias)
        self.local_sizes = [size // self.tp_size for size in self.output_sizes]  # the rows this rank holds

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if shard_id is None:  # the checkpoint already stores the fused tensor: each part in turn
            full = sum(self.output_sizes)
            for index in range(len(self.output_sizes)):
                self.store(param, loaded, self._shard(index, full, sum(self.output_sizes[:index])))
            return
        assert isinstance(shard_id, int)
        self.store(param, loaded, self._shard(shard_id, self.output_sizes[shard_id], 0))

    def _shard(self, index: int, full_rows: int, part_start: int) -> RowShard:
        """Part ``index`` (starting at row ``part_start`` of a tensor of ``full_rows``): this rank's rows."""
        local = self.local_sizes[index]
        return RowShard(full_rows, part_start + self.tp_rank * local, local, sum(self.local_sizes[:index]))


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
        if shard_id is None:  # the checkpoint already stores the fused tensor: each part in turn
            full = sum(self.full_sizes)
            for index in range(3):
                self.store(param, loaded, self._shard(index, full, sum(self.full_sizes[:index])))
            return
        index = {"q": 0, "k": 1, "v": 2}[shard_id] if isinstance(shard_id, str) else shard_id
        self.store(param, loaded, self._shard(index, self.full_sizes[index], 0))

    def _shard(self, index: int, full_rows: int, part_start: int) -> RowShard:
        """Part ``index`` (starting at row ``part_start`` of a tensor of ``full_rows``): this rank's rows."""
        start = part_start + self.source_starts[index]
        return RowShard(full_rows, start, self.local_sizes[index], sum(self.local_sizes[:index]))


class RowParallelLinear(LinearBase):
    """Splits input features; each rank computes a partial sum, reduced across ranks (bias added once)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp_size = tp_world_size()
        self.tp_rank = tp_rank()
        super().__init__(divide(in_features, self.tp_size, "input features"), out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        """Every row, this rank's columns (a bias or per-row scale has no columns: all of it)."""
        cols = self.in_local
        columns = (cols * self.tp_size, self.tp_rank * cols, cols)
        self.store(param, loaded, RowShard(self.out_local, 0, self.out_local, 0, columns))

    def local_bias(self) -> torch.Tensor | None:
        return self.bias if self.tp_rank == 0 else None

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(partial, self.tp_size)
