"""The per-layer quantization method: what a linear layer delegates to its format.

A method (vLLM's ``LinearMethodBase``) is chosen when the model is built (:mod:`.context`), and a linear
layer or LM head keeps it as ``layer.quant_method``. It creates the layer's parameters, stores the rows
the layer's sharding rule hands it (quantizing float rows as they arrive, or copying published ones), and
provides the PyTorch path that :meth:`LinearProjection.configure` binds. Layers keep their float paths
(``F.linear``, oneDNN prepacking) themselves, so ``none`` runs exactly the code it ran before quantization
existed; only quantized methods supply a path of their own.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.options import KernelOptions
from tokenmill.quantization.shards import RowShard, layout_of

MatmulPath = Callable[[torch.Tensor], torch.Tensor]
WeightLoader = Callable[..., None]
# Rows quantized (or drawn at random) at once: bounds the float32 temporaries of quantizing a large tensor
# (an 8B model's LM head is 128256 rows) to 64 MiB at 4096 columns. A multiple of the 128-row blocks.
CHUNK_ROWS = 4096


class ProjectionLayer(Protocol):
    """What a method needs of its layer (``LinearProjection`` provides it)."""

    @property
    def weight(self) -> torch.Tensor: ...

    def local_bias(self) -> torch.Tensor | None: ...


def add_parameter(
    layer: nn.Module, name: str, tensor: torch.Tensor, loader: WeightLoader, layout: Any = None
) -> nn.Parameter:
    """Register ``tensor`` as the checkpoint-loaded parameter ``layer.<name>``, filled by ``loader``."""
    param = nn.Parameter(tensor, requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    if layout is not None:
        param.shard_layout = layout  # type: ignore[attr-defined]
    layer.register_parameter(name, param)
    return param


class LinearMethod(ABC):
    """How one linear layer stores and multiplies its weight; stateless, shared by the layers it serves
    (each layer holds its own parameters)."""

    name: ClassVar[str]
    quantized: ClassVar[bool] = True
    # The layer's float32 scale per output row that the Triton GEMV applies to an 8-bit weight it reads
    # as stored (tokenmill.kernels.gemv); None: the GEMV cannot read this format.
    gemv_scale: ClassVar[str | None] = None

    @abstractmethod
    def create_weights(self, layer: nn.Module, out_local: int, in_local: int, loader: WeightLoader) -> None:
        """Register ``layer.weight`` ``[out_local, in_local]`` and whatever scales the format keeps."""

    def load(self, layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor, shard: RowShard) -> None:
        """Store the rows ``shard`` names of the checkpoint tensor ``loaded`` into ``param``."""
        layout_of(param).store(param, loaded, shard)

    @abstractmethod
    def matmul_path(self, layer: ProjectionLayer, options: KernelOptions) -> MatmulPath:
        """The function ``x -> x W^T + b`` that ``configure(options)`` binds for a quantized layer."""

    @abstractmethod
    def dequantized_weight(self, layer: ProjectionLayer, dtype: torch.dtype) -> torch.Tensor:
        """The weight the quantized one stands for, ``[out_local, in_local]`` in ``dtype``."""

    @abstractmethod
    def init_dummy(self, layer: ProjectionLayer, generator: torch.Generator, std: float) -> None:
        """Random weights ~ N(0, std), stored in the format (for ``load_format="dummy"``)."""


class UnquantizedLinearMethod(LinearMethod):
    """Float weights in the model's dtype; the layer binds its own float paths."""

    name = "none"
    quantized = False

    def create_weights(self, layer: nn.Module, out_local: int, in_local: int, loader: WeightLoader) -> None:
        add_parameter(layer, "weight", torch.empty(out_local, in_local), loader)

    def matmul_path(self, layer: ProjectionLayer, options: KernelOptions) -> MatmulPath:
        return lambda x: F.linear(x, layer.weight, layer.local_bias())

    def dequantized_weight(self, layer: ProjectionLayer, dtype: torch.dtype) -> torch.Tensor:
        return layer.weight.to(dtype)

    def init_dummy(self, layer: ProjectionLayer, generator: torch.Generator, std: float) -> None:
        layer.weight.normal_(0.0, std, generator=generator)


UNQUANTIZED = UnquantizedLinearMethod()


def random_row_chunks(
    weight: torch.Tensor, generator: torch.Generator, std: float
) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, float32 rows ~ N(0, std)) covering ``weight``'s rows a chunk at a time, on its device,
    so random quantized weights never need the whole float matrix."""
    rows, cols = weight.shape
    for start in range(0, rows, CHUNK_ROWS):
        count = min(CHUNK_ROWS, rows - start)
        chunk = torch.empty(count, cols, dtype=torch.float32, device=weight.device)
        yield start, chunk.normal_(0.0, std, generator=generator)
