"""Picking the attention backend an engine runs (``KernelConfig.attention_backend``)."""

import torch

from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.torch_backend import TorchAttentionBackend
from tokenmill.config import KernelConfig
from tokenmill.kernels import triton_available
from tokenmill.kernels.options import resolve_kernel_toggle


def create_attention_backend(kernels: KernelConfig, device: torch.device, pdl: bool) -> AttentionBackend:
    """The PyTorch reference backend, or the paged Triton kernels (``pdl``: launched programmatically
    dependent; the fused decode step as ``fused_decode_rotary_kv`` resolves)."""
    if kernels.attention_backend == "torch":
        return TorchAttentionBackend()
    if not triton_available(device.type):
        raise ValueError(
            "attention_backend 'triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1 on CPU)"
        )
    from tokenmill.attention.triton_backend import TritonAttentionBackend  # imports triton

    fused = resolve_kernel_toggle("decode_rotary_kv", kernels.fused_decode_rotary_kv, device)
    return TritonAttentionBackend(pdl=pdl, fused_decode_rotary_kv=fused)
