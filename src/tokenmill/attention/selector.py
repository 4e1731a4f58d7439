"""Picking the attention backend an engine runs (``KernelConfig.attention_backend``)."""

import torch

from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.torch_backend import TorchAttentionBackend
from tokenmill.config import KernelConfig
from tokenmill.kernels import triton_available
from tokenmill.kernels.options import resolve_kernel_toggle


def create_attention_backend(kernels: KernelConfig, device: torch.device, pdl: bool) -> AttentionBackend:
    """The PyTorch reference backend, the CPU one (its decode steps in C), or the paged Triton kernels
    (``pdl``: launched programmatically dependent; the fused decode and prefill rotary / K/V writes and
    split short prefills as ``fused_decode_rotary_kv``, ``fused_prefill_rotary_kv`` and
    ``split_prefill_attention`` resolve)."""
    if kernels.attention_backend == "torch":
        return TorchAttentionBackend()
    if kernels.attention_backend == "cpu":
        return _cpu_backend(device)
    if not triton_available(device.type):
        raise ValueError(
            "attention_backend 'triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1 on CPU)"
        )
    from tokenmill.attention.triton_backend import TritonAttentionBackend  # imports triton

    fused = resolve_kernel_toggle("decode_rotary_kv", kernels.fused_decode_rotary_kv, device)
    split = resolve_kernel_toggle("split_prefill_attention", kernels.split_prefill_attention, device)
    prefill = resolve_kernel_toggle("prefill_rotary_kv", kernels.fused_prefill_rotary_kv, device)
    return TritonAttentionBackend(
        pdl=pdl, fused_decode_rotary_kv=fused, split_prefill=split, fused_prefill_rotary_kv=prefill
    )


def _cpu_backend(device: torch.device) -> AttentionBackend:
    from tokenmill.attention.cpu_backend import CpuAttentionBackend
    from tokenmill.attention.cpu_kernel import load_decode_attention

    if device.type != "cpu":
        raise ValueError(f"attention_backend 'cpu' runs on the cpu device, not {device}")
    library = load_decode_attention()
    if library is None:
        raise ValueError("attention_backend 'cpu' needs a C compiler (cc or gcc, or $CC) to build its kernel")
    return CpuAttentionBackend(library)
