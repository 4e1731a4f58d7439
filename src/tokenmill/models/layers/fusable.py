"""The base of every layer with more than one implementation: PyTorch, and Triton kernels or oneDNN.

A layer keeps its paths side by side as methods and binds one of them in :meth:`FusableLayer.configure`,
so ``forward`` calls what was bound and tests no flags. Layers bind the PyTorch path when built; a model
is configured as a whole by ``CausalLM.with_kernels``, which binds the layers of a copy that shares the
weights, so engines over one loaded model each keep their own choices.

Kernel modules import triton, so a layer imports them in ``configure``, only when options ask for them.
"""

from abc import ABC, abstractmethod

from torch import nn

from tokenmill.kernels.options import KernelOptions


class FusableLayer(nn.Module, ABC):
    """A layer whose implementation is chosen once, by :meth:`configure`, not tested on every call."""

    @abstractmethod
    def configure(self, options: KernelOptions) -> None:
        """Bind the paths ``options`` ask for (an all-off ``KernelOptions()`` binds plain PyTorch)."""
