"""Checks of the ``tokenmill`` command line that need neither torch nor the model, run before either is
loaded: a flag that cannot work on this machine fails in a fraction of a second, not after the import of
torch and the load of the weights.

Without torch, "is there a CUDA device" is answered from the NVIDIA driver's files; where the driver is
present, the engine still asks torch when it starts (a GPU the driver sees but torch cannot use fails there).
"""

import argparse
import importlib.util
import os
from pathlib import Path

from tokenmill.config import FUSED_KERNEL_TOGGLES, EngineConfig

_NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")


def parse_token_ids(text: str) -> list[int]:
    """``--prompt-token-ids 1,2,3`` (commas and/or spaces) -> ``[1, 2, 3]``."""
    parts = text.replace(",", " ").split()
    try:
        ids = [int(part) for part in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids like 1,2,3, got '{text}'") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected one or more non-negative token ids, got '{text}'")
    return ids


def nvidia_driver_present() -> bool:
    return _NVIDIA_DRIVER.is_file() or any(Path("/dev").glob("nvidia[0-9]*"))


def check_before_loading(config: EngineConfig, command: str, has_text_prompt: bool) -> None:
    """ValueError naming the flag, for settings that cannot work here or for this command."""
    _check_device(config)
    _check_triton(config)
    _check_tokenizer(config, command, has_text_prompt)


def _cuda_possible(device: str) -> bool:
    return device != "cpu" and nvidia_driver_present()


def _check_device(config: EngineConfig) -> None:
    if config.device.startswith("cuda") and not nvidia_driver_present():
        raise ValueError(f"--device {config.device}: no NVIDIA driver on this machine, so no CUDA device")


def _check_triton(config: EngineConfig) -> None:
    """Triton attention and forced-on fused kernels need Triton and a CUDA device, or Triton's
    interpreter (TRITON_INTERPRET=1, slow: for tests)."""
    wanted = [f"--{name.replace('_', '-')}" for name in FUSED_KERNEL_TOGGLES if config.option(name)]
    if config.kernels.attention_backend == "triton":
        wanted.insert(0, "--attention-backend triton")
    if not wanted:
        return
    if importlib.util.find_spec("triton") is None:
        raise ValueError(f"{wanted[0]} needs Triton, which is not installed (pip install triton)")
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if not (interpreted or _cuda_possible(config.device)):
        where = "--device cpu" if config.device == "cpu" else "this machine, which has no CUDA device"
        raise ValueError(
            f"{wanted[0]} needs a CUDA device, and {where} (or TRITON_INTERPRET=1 to run the kernels "
            "in Triton's slow interpreter); leave it out for the PyTorch path"
        )


def _check_tokenizer(config: EngineConfig, command: str, has_text_prompt: bool) -> None:
    needs_text = command == "chat" or has_text_prompt  # the server takes token ids without one
    if config.load_format == "dummy" and config.tokenizer is None and needs_text:
        what = "a text prompt" if command == "generate" else f"'tokenmill {command}'"
        raise ValueError(
            f"dummy weights come without a tokenizer, and {what} needs one: add --tokenizer (e.g. "
            "--tokenizer smollm2, an installed model)"
            + (", or give --prompt-token-ids instead of text" if command == "generate" else "")
        )
