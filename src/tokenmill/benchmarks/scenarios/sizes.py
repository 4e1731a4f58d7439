"""How big each scenario is: every size knob in one record, with a CPU preset (the defaults) and a GPU one.

The CPU preset is sized for all five scenarios, feature off and on, to take about ten minutes on two cores
with the default model (SmolLM2-135M, one torch thread; estimated from scaled-down runs). The GPU preset
is the size of the measurements this project reproduces (48 requests over a 1024-token shared prefix,
4096-token prompts among decode streams); its arrival rates are starting points, not tuned on a GPU yet.
Each field is also a command-line flag (``batching_requests`` is ``--batching-requests``) that overrides
the preset.
"""

import argparse
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def _knob(default: Any, help_text: str) -> Any:
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class Sizes:
    """Length ranges are inclusive (MIN, MAX); rates are Poisson arrivals per second."""

    max_num_seqs: int = _knob(8, "sequences in flight at once (the static batch size), every scenario")
    # continuous_batching and burst
    batching_requests: int = _knob(16, "requests of continuous_batching and burst")
    batching_input_len: tuple[int, int] = _knob((32, 96), "their prompt lengths, MIN-MAX")
    batching_output_len: tuple[int, int] = _knob((8, 64), "their output lengths, MIN-MAX")
    batching_rate: float = _knob(1.0, "continuous_batching arrivals, requests/s (burst: all at t=0)")
    # chunked_prefill
    chunked_requests: int = _knob(16, "requests of chunked_prefill, long prompts and streams together")
    long_fraction: float = _knob(0.75, "share of chunked_prefill requests that have a long prompt")
    long_input_len: int = _knob(512, "long prompt length")
    long_output_len: int = _knob(16, "output length after a long prompt")
    long_rate: float = _knob(0.5, "long-prompt arrivals, requests/s, after the streams start at t=0")
    stream_input_len: int = _knob(32, "prompt length of the short-prompt streams")
    stream_output_len: int = _knob(96, "output length of the short-prompt streams")
    chunk_budget: int = _knob(64, "max_num_batched_tokens per step with chunked prefill on")
    # prefix_caching
    prefix_requests: int = _knob(16, "requests of prefix_caching")
    prefix_len: int = _knob(512, "length of the prefix they all share")
    suffix_len: tuple[int, int] = _knob((16, 32), "length of each request's own suffix, MIN-MAX")
    prefix_output_len: int = _knob(16, "prefix_caching output length")
    prefix_rate: float = _knob(1.0, "prefix_caching arrivals, requests/s")
    # multi_turn
    conversations: int = _knob(4, "conversations of multi_turn")
    turns: int = _knob(4, "turns per conversation")
    first_turn_len: int = _knob(256, "tokens of a conversation's first user message")
    turn_len: int = _knob(32, "tokens of each later user message")
    answer_len: int = _knob(32, "output length of every turn")
    conversation_rate: float = _knob(0.5, "conversation starts, per second")
    think_time: float = _knob(0.0, "seconds between an answer and the next turn")

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            values = value if isinstance(value, tuple) else (value,)
            if name != "think_time" and any(v <= 0 for v in values):
                raise ValueError(f"--{flag_name(name)} must be positive, got {value}")
        if not 0 < self.long_fraction < 1:
            raise ValueError(f"--long-fraction must be in (0, 1), got {self.long_fraction}")
        if self.think_time < 0:
            raise ValueError(f"--think-time must be >= 0, got {self.think_time}")


def flag_name(field_name: str) -> str:
    return field_name.replace("_", "-")


CPU = Sizes()
GPU = replace(
    CPU,
    max_num_seqs=64,
    batching_requests=512,
    batching_input_len=(64, 512),
    batching_output_len=(16, 512),
    batching_rate=32.0,
    chunked_requests=64,
    long_input_len=4096,
    long_output_len=64,
    long_rate=8.0,
    stream_input_len=64,
    stream_output_len=512,
    chunk_budget=512,
    prefix_requests=48,
    prefix_len=1024,
    suffix_len=(32, 64),
    prefix_output_len=64,
    prefix_rate=16.0,
    conversations=32,
    turns=6,
    first_turn_len=1024,
    turn_len=128,
    answer_len=128,
    conversation_rate=4.0,
)
PRESETS: dict[str, Sizes] = {"cpu": CPU, "gpu": GPU}


def preset_name(args: argparse.Namespace, device: "torch.device | None") -> str:
    if args.preset != "auto":
        return str(args.preset)
    return "gpu" if device is not None and device.type == "cuda" else "cpu"


def sizes_for(args: argparse.Namespace, device: "torch.device | None") -> Sizes:
    overrides = {f.name: getattr(args, f.name) for f in fields(Sizes) if getattr(args, f.name) is not None}
    return replace(PRESETS[preset_name(args, device)], **overrides)
