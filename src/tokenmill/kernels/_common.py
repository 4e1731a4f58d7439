"""Small helpers shared by the kernel wrappers."""

import functools

import torch

# Programs per SM that split-K decode aims for; the CPU interpreter pretends to have a few SMs.
INTERPRETER_SM_COUNT = 4


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def require_unit_last_stride(name: str, tensor: torch.Tensor) -> None:
    if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {tensor.stride()})")


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SM_COUNT
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


_ARRIVALS: dict[tuple[str, torch.device], torch.Tensor] = {}
MIN_ARRIVAL_COUNTERS = 4096  # more than any split launch needs, so CUDA graphs find them made


def arrival_counters(owner: str, device: torch.device, count: int = 1) -> torch.Tensor:
    """Zeroed int32 counters that ``owner``'s split launches count their arrivals on (the last to arrive
    merges, and leaves its counter at zero again), kept from launch to launch: one buffer per owner and
    device, made before any CUDA graph capture (the warm-up runs first). Owners do not share a buffer."""
    counters = _ARRIVALS.get((owner, device))
    if counters is None or counters.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{owner} needs more arrival counters during CUDA graph capture")
        counters = torch.zeros(max(count, MIN_ARRIVAL_COUNTERS), dtype=torch.int32, device=device)
        _ARRIVALS[(owner, device)] = counters
    return counters
