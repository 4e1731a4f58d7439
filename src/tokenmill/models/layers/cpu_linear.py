"""Float32 projections on CPU through oneDNN, each weight reordered ("prepacked") once.

``F.linear`` on CPU calls MKL's sgemm on the row-major weight every time; at decode sizes (one to a few
dozen rows) that runs far below the memory bandwidth. oneDNN reorders the weight once into its blocked
layout, after which SmolLM2-135M's layer projections at 12 rows take about a third of the time and the
49152-row LM head a quarter. Results differ from ``F.linear`` by float32 rounding only (another summation
order), and a row's result does not depend on how many rows share the call.

The packed copy is made from the weight as it is then (after loading) and is opaque; it costs the weight's
size again in memory, once however many configured copies of a model use it (:func:`shared_packed_weight`).
Layers take one when configured with ``KernelOptions.prepacked_cpu_linear``.
"""

import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

_BATCH_HINT = 16  # rows oneDNN tunes the packed layout for; any row count runs on it


def supports_prepacking(weight: torch.Tensor) -> bool:
    """A 2-D float32 CPU weight, and a torch built with oneDNN's packed linear."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[out, in]``) reordered for :func:`packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with ``packed = pack_weight(weight)``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# weight -> a weak reference to its packed copy: the configured layers hold the copy, and it goes with them.
_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def shared_packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """``pack_weight(weight)``, made once while any layer holds it: engines configured over one loaded model
    share its packed copies as they share its weights. The weight must not change after it is packed."""
    ref = _PACKED.get(weight)
    packed = ref() if ref is not None else None
    if packed is None:
        packed = pack_weight(weight)
        _PACKED[weight] = weakref.ref(packed)
    return packed
