"""The one line an engine logs when it is ready: what was resolved for this hardware, and how long it took."""

from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig
from tokenmill.distributed import uses_custom_all_reduce, uses_push_all_reduce
from tokenmill.engine.warm_start import WarmStartReport
from tokenmill.kernels.options import KernelOptions
from tokenmill.runner.cuda_graphs import CaptureReport
from tokenmill.runner.kv_cache import KVCache
from tokenmill.symmetric_all_reduce import DEFAULT_MAX_BYTES, PUSH_MAX_BYTES


@dataclass(frozen=True)
class StartupTimes:
    total: float  # the engine's constructor, end to end
    load: float  # reading (or initializing) the weights; 0 when the engine was handed a loaded model
    warm_start: WarmStartReport | None


def describe_startup(
    config: EngineConfig,
    device: torch.device,
    kernels: KernelOptions,
    graphs: CaptureReport | None,
    kv: KVCache,
    times: StartupTimes,
    prefill_graphs: CaptureReport | None = None,
) -> str:
    scheduler = config.scheduler
    parts = [
        f"tokenmill ready on {_device_name(device)}" + _tensor_parallel(config.tensor_parallel_size),
        f"attention {config.kernels.attention_backend}",
        "fused kernels "
        + ("+".join(kernels.enabled) if kernels.enabled else "none")
        + (" (programmatic launch)" if kernels.pdl else ""),
        _graphs(graphs, config.graphs.overlap_decode) + _prefill_graphs(prefill_graphs),
        f"KV {config.kv.mode}: {kv.pool_tokens} tokens ({kv.pool_bytes() / 2**30:.2f} GiB)"
        + (", prefix caching" if config.kv.prefix_caching else "")
        + (", float8 e4m3" if config.kv.kv_cache_dtype != "auto" else ""),
        f"max_num_seqs {scheduler.max_running}, {scheduler.token_budget} tokens per step"
        + (", chunked prefill" if scheduler.chunked_prefill else ""),
        *_weights(config, kernels),
        _host_threads(torch.get_num_threads()),
        _times(times, graphs, prefill_graphs),
    ]
    return "; ".join(parts)


def _weights(config: EngineConfig, kernels: KernelOptions) -> list[str]:
    """The quantization the model runs in, where it is one (``auto`` resolved)."""
    if config.quantization == "gguf":
        return [f"weights gguf packed, {kernels.gguf_activations} inputs"]
    return [] if config.quantization == "none" else [f"weights {config.quantization}"]


def _tensor_parallel(size: int) -> str:
    if size == 1:
        return ""
    small = f"symmetric memory up to {DEFAULT_MAX_BYTES // 1024} KiB, NCCL above"
    if uses_push_all_reduce():
        small = f"the push kernel up to {PUSH_MAX_BYTES // 1024} KiB, " + small
    path = small if uses_custom_all_reduce() else "the process group"
    return f" and {size - 1} worker rank(s), all-reduces through {path}"


def _host_threads(count: int) -> str:
    return f"{count} host thread" + ("s" if count != 1 else "")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def _graphs(graphs: CaptureReport | None, overlap: bool | None) -> str:
    if graphs is None:
        return "eager decode"
    sizes = graphs.sizes
    return f"CUDA graphs for {len(sizes)} decode sizes {sizes[0]}..{sizes[-1]}" + (
        " with overlapped decode" if overlap else ""
    )


def _prefill_graphs(graphs: CaptureReport | None) -> str:
    if graphs is None:
        return ""
    return f", prefill graphs of {graphs.sizes[0]}..{graphs.sizes[-1]} tokens"


def _times(times: StartupTimes, graphs: CaptureReport | None, prefill: CaptureReport | None) -> str:
    detail = [f"load {times.load:.1f} s"]
    if graphs is not None:
        seconds = graphs.seconds + (prefill.seconds if prefill is not None else 0.0)
        detail.append(f"graphs {seconds:.1f} s")
    if times.warm_start is not None:
        detail.append(times.warm_start.describe())
    return f"started in {times.total:.1f} s ({', '.join(detail)})"
