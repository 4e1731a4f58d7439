"""The fast path for the hardware: every ``auto`` setting of an ``EngineConfig`` replaced by its value here.

A user who passes no flags gets, on a CUDA GPU with Triton, the Triton attention backend, the fused
kernels, CUDA graphs with overlapped decode, and a batch sized for the GPU; on a CPU, the PyTorch
reference path, each decode step's attention in one C call a layer where a C compiler is. Chunked
prefill and prefix caching are on wherever they apply. A setting given explicitly is kept as given (and
refused later where it cannot run).
"""

import os
import typing
from dataclasses import dataclass, replace

import torch

from tokenmill.config import (
    FUSED_KERNEL_TOGGLES,
    CudaGraphConfig,
    EngineConfig,
    GGUFActivations,
    KernelConfig,
    KVCacheConfig,
    QuantizationMethod,
    SchedulerConfig,
    SpeculativeConfig,
)
from tokenmill.kernels.options import KernelOptions, kernels_auto_on, pdl_supported
from tokenmill.native import compiler_available

GPU_MAX_NUM_SEQS = 256
CPU_MAX_NUM_SEQS = 64
GPU_TOKEN_BUDGET = 8192
# A 2-core CPU prefills ~2k tokens of a 135M model per second: a smaller step keeps decodes flowing
# beside a long prompt (chunked prefill) at no cost in throughput, the step being compute-bound already.
CPU_TOKEN_BUDGET = 2048


@dataclass(frozen=True)
class Platform:
    """What the defaults depend on: the device, and whether compiled Triton kernels run on it."""

    device: torch.device
    triton_kernels: bool  # compiled Triton on a CUDA device (the interpreter does not count: too slow)
    programmatic_launch: bool  # Hopper or later
    c_kernels: bool = False  # a CPU device and a C compiler for tokenmill.native's kernels

    @classmethod
    def detect(cls, device: torch.device) -> "Platform":
        c_kernels = device.type == "cpu" and compiler_available()
        return cls(device, kernels_auto_on(device), pdl_supported(device), c_kernels)


def resolve_config(
    config: EngineConfig, platform: Platform, max_model_len: int, loaded_quantization: str = "none"
) -> EngineConfig:
    """``config`` with no ``auto`` / None setting left that the hardware decides; ``quantization`` auto
    becomes ``loaded_quantization``, the method the loader chose (``loading.loader.packs_by_default``)."""
    if config.quantization == "auto":
        _require_packed_gguf_for_its_inputs(config, platform, loaded_quantization)
    kernels = _resolve_kernels(config, platform)
    if config.quantization == "auto":
        config = replace(config, quantization=typing.cast(QuantizationMethod, loaded_quantization))
    config = replace(config, kernels=kernels)
    warm_start = config.warm_start
    if warm_start is None:
        warm_start = platform.triton_kernels
    return replace(
        config,
        warm_start=warm_start,
        host_threads=_resolve_host_threads(config, platform),
        kv=_resolve_kv(config),
        scheduler=_resolve_scheduler(config, platform, max_model_len),
        graphs=_resolve_graphs(config, platform),
        speculative=_resolve_speculative(config, platform),
    )


def _resolve_host_threads(config: EngineConfig, platform: Platform) -> int | None:
    """One thread on a GPU: its engine's host work is Python, copies and grammar masks (llguidance's own
    pool), and torch's OpenMP threads, left spinning after each small CPU op, contend with them (on the
    H200's 16-core host, 64 rows of JSON-schema masks: 7.8 ms with torch's 16 threads, 1.6 ms with one)."""
    if config.host_threads is not None or platform.device.type != "cuda" or "OMP_NUM_THREADS" in os.environ:
        return config.host_threads
    return 1


CPU_SPECULATION_MAX_BATCH = 8  # bench speculative: at 64 sequences on 2 cores, n-gram speculation cost 29%
# On a GPU only a batch-1 verification step runs through a graph (the one-sequence prefill graphs); one of
# several sequences runs eagerly, ~10x a graphed decode step for a small model: bench speculative, SmolLM2
# bf16 on the H200, open-ended prompts at 8 / 16 sequences: 0.08x / 0.07x with guesses allowed.
GPU_SPECULATION_MAX_BATCH = 2
# A batch-1 verification step on a GPU runs through the one-sequence prefill graphs, whose replay costs the
# same for 13 or 31 tokens (SmolLM2 on the H200: 1,028 / 1,031 us, kernel latency), so a long guess is
# nearly free when it fails and pays when it holds. bench speculative there (SmolLM2 bf16, batch 1), code
# editing / copy mix: 1.30x / 1.32x at k = 8, 1.35-1.41x / 1.47-1.52x at 12, 1.49-1.53x / 1.55-1.60x at
# 20, 1.50-1.59x / 1.62-1.65x at 24, 1.50-1.63x / 1.63-1.64x at 30 (reports/gpu/speculative-ngram-smollm2).
# On the 2-core CPU a verification step's cost grows with its tokens. Float32 weights are read once a step
# whatever the rows: k = 4 and 8 were alike (2.21x / 1.71x, 2.15x / 1.81x), 3 a little behind (2.02x /
# 1.72x against 2.07x / 1.82x at 4). The packed GGUF kernel (a GGUF model's default there) is compute-bound
# and takes input rows four at a time: 1 + 3 rows are one pass over the weights, 1 + 4 two (a projection
# of 4 rows 2.0-2.3x one row's time, of 5 rows 2.8-3.2x): the default model's code editing / copy mix
# 1.47x / 1.39x at k = 3, 1.30x / 1.28x at 4, 1.44x / 1.38x at 2.
GPU_NGRAM_TOKENS = 24
PACKED_CPU_SPECULATIVE_TOKENS = 3
DEFAULT_SPECULATIVE_TOKENS = 4


def auto_speculative_tokens(method: str | None, device: torch.device, packed_gguf: bool = False) -> int:
    """``num_speculative_tokens`` left auto: 24 for ngram on a GPU, 3 with packed GGUF weights on the CPU,
    4 otherwise."""
    if device.type == "cuda" and method == "ngram":
        return GPU_NGRAM_TOKENS
    return PACKED_CPU_SPECULATIVE_TOKENS if packed_gguf else DEFAULT_SPECULATIVE_TOKENS


def _resolve_speculative(config: EngineConfig, platform: Platform) -> SpeculativeConfig:
    spec = config.speculative
    if spec.method is None:  # off: its settings stay unset (set, they would be refused)
        return spec
    gpu = platform.device.type == "cuda"
    if spec.num_speculative_tokens is None:
        packed_gguf = config.quantization == "gguf" and not gpu
        k = auto_speculative_tokens(spec.method, platform.device, packed_gguf)
        spec = replace(spec, num_speculative_tokens=k)
    if spec.disable_by_batch_size is None:
        cutoff = GPU_SPECULATION_MAX_BATCH if gpu else CPU_SPECULATION_MAX_BATCH
        spec = replace(spec, disable_by_batch_size=cutoff)
    return spec


def _resolve_kernels(config: EngineConfig, platform: Platform) -> KernelConfig:
    kernels = config.kernels
    fast = platform.triton_kernels
    backend = kernels.attention_backend
    fp8_kv = config.kv.kv_cache_dtype != "auto"  # the C decode kernel reads 16- and 32-bit K/V only
    if backend == "auto":
        backend = "triton" if fast else ("cpu" if platform.c_kernels and not fp8_kv else "torch")
    if backend == "cpu" and fp8_kv:
        raise ValueError(
            f"kv_cache_dtype '{config.kv.kv_cache_dtype}' needs attention_backend 'triton' or 'torch' "
            "(the 'cpu' backend reads K/V in the model's dtype only)"
        )
    toggles: dict[str, typing.Any] = {
        name: fast for name in FUSED_KERNEL_TOGGLES if getattr(kernels, name) is None
    }
    if backend in ("torch", "cpu"):
        toggles["fused_decode_rotary_kv"] = bool(kernels.fused_decode_rotary_kv)
        toggles["fused_prefill_rotary_kv"] = bool(kernels.fused_prefill_rotary_kv)
        toggles["split_prefill_attention"] = bool(kernels.split_prefill_attention)
    pdl = kernels.programmatic_launch
    return replace(
        kernels,
        attention_backend=backend,
        programmatic_launch=platform.programmatic_launch if pdl is None else pdl,
        **toggles,
    )


def _resolve_kv(config: EngineConfig) -> KVCacheConfig:
    kv = config.kv
    if kv.prefix_caching is not None:
        return kv
    return replace(kv, prefix_caching=kv.mode == "paged")


def _resolve_scheduler(config: EngineConfig, platform: Platform, max_model_len: int) -> SchedulerConfig:
    scheduler = config.scheduler
    on_gpu = platform.device.type == "cuda"
    chunked = scheduler.chunked_prefill
    if chunked is None:
        chunked = config.kv.mode != "none"
    budget = scheduler.max_num_batched_tokens
    if budget is None:
        budget = GPU_TOKEN_BUDGET if on_gpu else CPU_TOKEN_BUDGET
        if not chunked:  # a whole prompt must fit in one step
            budget = max(budget, max_model_len)
    max_num_seqs = scheduler.max_num_seqs
    if max_num_seqs is None:
        max_num_seqs = GPU_MAX_NUM_SEQS if on_gpu else CPU_MAX_NUM_SEQS
    return replace(
        scheduler, chunked_prefill=chunked, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs
    )


def _resolve_graphs(config: EngineConfig, platform: Platform) -> CudaGraphConfig:
    graphs = config.graphs
    enabled = graphs.enabled
    if enabled is None:
        enabled = (
            platform.device.type == "cuda"
            and config.kernels.attention_backend == "triton"
            and config.kv.mode != "none"
        )
    overlap = graphs.overlap_decode
    if overlap is None:
        overlap = enabled and platform.device.type == "cuda"
    return replace(graphs, enabled=enabled, overlap_decode=overlap)


def _require_packed_gguf_for_its_inputs(config: EngineConfig, platform: Platform, picked: str) -> None:
    """Integer ``gguf_activations`` feed packed GGUF projections: refused, saying why, where ``auto`` did
    not pack the model (on a GPU, say: the config check alone would say 'auto' may pick it)."""
    inputs = config.kernels.gguf_activations
    if inputs != "float32" and picked != "gguf":
        raise ValueError(
            f"EngineConfig.gguf_activations {inputs!r} needs packed GGUF projections, and quantization "
            f"'auto' loaded this model as {picked!r} on {platform.device.type} (it packs a .gguf file "
            "loaded in float32 on the CPU only): load it with device='cpu', or keep gguf_activations "
            "'float32'"
        )


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device '{device}' is not a valid torch device (try cpu, cuda, cuda:1)") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device '{device}' was asked for but CUDA is not available here")
    return resolved


def gguf_activations(setting: GGUFActivations) -> GGUFActivations:
    """``setting``, where this CPU runs it: integer inputs need the integer kernel (an AVX2 CPU and a C
    compiler), and are refused where it cannot be built."""
    from tokenmill.quantization.gguf_packed import activations_available  # imports gguf: only when asked

    if not activations_available(setting):
        raise ValueError(
            f"gguf_activations {setting!r} needs the integer kernel, which needs an AVX2 CPU and a C "
            "compiler (this machine cannot build it); use 'float32'"
        )
    return setting


def kernel_options_for(config: EngineConfig, device: torch.device) -> KernelOptions:
    """The kernels a resolved ``config`` binds into the model on ``device`` (every rank binds the same)."""
    kernels = config.kernels
    packed_gguf = config.quantization == "gguf" and device.type == "cpu"  # the only weights they apply to
    return KernelOptions.resolve(
        device,
        kernels.fused_rms_norm,
        kernels.fused_rotary,
        kernels.fused_activation,
        kernels.fused_gemv,
        kernels.programmatic_launch,
        prepacked_cpu_linear=kernels.prepacked_cpu_linear,
        gguf_packed=packed_gguf,
        gguf_activations=gguf_activations(kernels.gguf_activations) if packed_gguf else "float32",
        gguf_decode_blocks=packed_gguf and kernels.gguf_decode_blocks,
        w8a8=kernels.fused_w8a8,
        gemv_rows=kernels.fused_gemv_rows,
    )
