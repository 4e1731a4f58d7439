"""Which fused Triton kernels run in place of their PyTorch code. Importing this module imports no triton.

Each kernel option is resolved from a request: ``None`` (auto) turns the kernel on where it compiles (a CUDA
device with Triton installed) and off elsewhere; ``False`` forces the PyTorch code; ``True`` forces the
kernel and is refused where it cannot run (on CPU it needs ``TRITON_INTERPRET=1``, for tests).
"""

from dataclasses import dataclass, fields

import torch

from tokenmill.config import GGUFActivations
from tokenmill.kernels import interpreter_enabled, triton_available

# Rows (tokens) a projection may have to go through tokenmill.kernels.gemv (with ``gemv_rows``; one row
# without); more go to cuBLAS.
GEMV_MAX_ROWS = 32
# With gemv_rows, only weights of fewer elements take more than one row. Measured on the H200 (bf16,
# reports/gpu/speculative-ngram-smollm2/gemv-rows/): SmolLM2-135M's projections (at most 1.8M elements)
# replay decode graphs of 2-32 rows in 636-693 µs instead of 875-893 and its 16-token prefill graph in 710
# instead of 933; Llama-3.2-1B's (4.2M and more) are 5-15% slower than on cuBLAS. Sizes in between were
# not measured, so the cut sits just above SmolLM2's (it also keeps tensor-parallel shards of 1B and 8B
# models, 2.1M and more, on cuBLAS).
GEMV_ROWS_MAX_WEIGHTS = 1 << 21
_NOT_KERNELS = ("pdl", "prepacked_cpu_linear", "gguf_packed", "gguf_activations", "gguf_decode_blocks")


@dataclass(frozen=True)
class KernelOptions:
    """The model layers' fast paths; all off is plain PyTorch. A model runs them through
    ``CausalLM.with_kernels(options)``, a copy with each layer bound to its path."""

    rms_norm: bool = False  # RMSNorm, and the residual add fused into it (tokenmill.kernels.rmsnorm)
    rotary: bool = False  # rotary embedding of q and k in place, one launch (tokenmill.kernels.rotary)
    activation: bool = False  # SwiGLU / GeGLU activation-and-multiply (tokenmill.kernels.activation)
    gemv: bool = False  # one-row projections, norm / activation fused in (tokenmill.kernels.gemv)
    # With gemv: up to GEMV_MAX_ROWS rows too for small weights, on the tensor cores, with no prologue.
    gemv_rows: bool = False
    # 8-bit weights' projections of more rows on the 8-bit tensor cores, the activations quantized per
    # token (tokenmill.kernels.scaled_matmul); off, they run dequantized (a reference, not a fast path).
    w8a8: bool = False
    # Launch the kernels above (and the attention backend's) programmatically dependent: each starts while
    # the one before it finishes and waits only where it reads its results (tokenmill.kernels.launch).
    pdl: bool = False
    # Float32 CPU projections through a oneDNN-reordered copy of their weight (models/layers/cpu_linear.py).
    prepacked_cpu_linear: bool = False
    # The projections are packed GGUF blocks on the CPU (quantization "gguf"): the norm or gated activation
    # before one runs inside its C call (quantization/gguf_prologue.py).
    gguf_packed: bool = False
    # With gguf_packed: "float32" inputs, or "int16" / "int8" ones, rounded per block of 32 and multiplied
    # as integers (quantization/gguf_integer_kernel.py; AVX2 CPUs).
    gguf_activations: GGUFActivations = "float32"
    # With gguf_packed: decode steps through every plain Llama block in one C call
    # (quantization/gguf_decode_blocks.py).
    gguf_decode_blocks: bool = False

    @classmethod
    def resolve(
        cls,
        device: torch.device | str,
        rms_norm: bool | None = None,
        rotary: bool | None = None,
        activation: bool | None = None,
        gemv: bool | None = None,
        pdl: bool | None = None,
        prepacked_cpu_linear: bool = False,
        w8a8: bool | None = None,
        gguf_packed: bool = False,
        gguf_activations: GGUFActivations = "float32",
        gguf_decode_blocks: bool = False,
        gemv_rows: bool | None = None,
    ) -> "KernelOptions":
        """Options for a model on ``device``; see the module docstring for None / True / False.
        ``prepacked_cpu_linear`` and the ``gguf_*`` options need no resolving: layers whose weights or CPU
        cannot take them ignore them."""
        return cls(
            rms_norm=resolve_kernel_toggle("rms_norm", rms_norm, device),
            rotary=resolve_kernel_toggle("rotary", rotary, device),
            activation=resolve_kernel_toggle("activation", activation, device),
            gemv=resolve_kernel_toggle("gemv", gemv, device),
            gemv_rows=resolve_kernel_toggle("gemv_rows", gemv_rows, device),
            w8a8=resolve_kernel_toggle("w8a8", w8a8, device),
            pdl=resolve_pdl(pdl, device),
            prepacked_cpu_linear=prepacked_cpu_linear,
            gguf_packed=gguf_packed,
            gguf_activations=gguf_activations,
            gguf_decode_blocks=gguf_decode_blocks,
        )

    def gemv_max_rows(self, weight_elements: int) -> int:
        """The most rows a projection of ``weight_elements`` weights takes through the GEMV (0: none)."""
        if not self.gemv:
            return 0
        return GEMV_MAX_ROWS if self.gemv_rows and weight_elements < GEMV_ROWS_MAX_WEIGHTS else 1

    @property
    def enabled(self) -> tuple[str, ...]:
        """The fused Triton kernels switched on (``pdl`` is how they launch, prepacking is not Triton)."""
        return tuple(f.name for f in fields(self) if f.name not in _NOT_KERNELS and getattr(self, f.name))


def kernels_auto_on(device: torch.device | str) -> bool:
    """The auto setting: on for CUDA devices where Triton compiles kernels, off on CPU (even where the
    interpreter could run them: it is orders of magnitude slower than PyTorch)."""
    return torch.device(device).type == "cuda" and triton_available(device)


def pdl_supported(device: torch.device | str) -> bool:
    """Whether kernels on ``device`` can be launched programmatically dependent: compiled (not
    interpreted) Triton on a CUDA device of compute capability 9.0 or later."""
    device = torch.device(device)
    if not kernels_auto_on(device) or interpreter_enabled():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def resolve_pdl(requested: bool | None, device: torch.device | str) -> bool:
    if requested is None:
        return pdl_supported(device)
    if requested and not pdl_supported(device):
        raise ValueError(
            "programmatic dependent launch needs compiled Triton kernels on a CUDA device of compute "
            f"capability 9.0 or later (Hopper); it cannot run on {torch.device(device)} here"
        )
    return requested


def resolve_kernel_toggle(name: str, requested: bool | None, device: torch.device | str) -> bool:
    if requested is None:
        return kernels_auto_on(device)
    if requested and not triton_available(device):
        raise ValueError(
            f"the fused {name} kernel needs Triton and a CUDA device (or TRITON_INTERPRET=1 on CPU); "
            f"it cannot run on {torch.device(device)} here"
        )
    return requested
