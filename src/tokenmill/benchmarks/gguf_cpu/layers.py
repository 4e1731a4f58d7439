"""Per-projection timings: packed GGUF codes against the float32 oneDNN-prepacked weight.

The projections are those the engine runs: q/k/v fused into one weight and gate/up into another (rows
stacked, as ``QKVParallelLinear`` and ``MergedColumnParallelLinear`` hold them), the attention output, the
down projection and the LM head (the tied token embedding). A decode step reads each layer's weights once,
from memory rather than cache (SmolLM2's float32 weights are 540 MB), so a sample calls the projection of
every layer in turn, as a step does, and reports the time per call. The two paths are sampled in
alternation, so that load from other processes on the machine falls on both; medians are reported.
"""

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from tokenmill.config import GGUFActivations
from tokenmill.loading.gguf_file import GGUFFile
from tokenmill.models.layers.cpu_linear import pack_weight, packed_linear
from tokenmill.quantization.gguf_blocks import GGUFBlocks, concat_rows
from tokenmill.quantization.gguf_packed import PackedWeight, pack_blocks

# The engine's projection -> the GGUF tensors stacked into it ({} is the layer index).
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("blk.{}.attn_q.weight", "blk.{}.attn_k.weight", "blk.{}.attn_v.weight"),
    "o": ("blk.{}.attn_output.weight",),
    "gate_up": ("blk.{}.ffn_gate.weight", "blk.{}.ffn_up.weight"),
    "down": ("blk.{}.ffn_down.weight",),
    "lm_head": ("output.weight",),  # tied models have none: the token embedding is the LM head
}


@dataclass(frozen=True)
class LayerTiming:
    name: str
    qtype: str
    out_features: int
    in_features: int
    rows: int
    packed_s: float  # float32 inputs
    float32_s: float
    packed_bytes: int
    packed_int16_s: float  # inputs rounded to int16 (gguf_activations)
    packed_int8_s: float  # inputs rounded to int8

    @property
    def speedup(self) -> float:
        return self.float32_s / self.packed_s

    @property
    def int16_speedup(self) -> float:
        return self.float32_s / self.packed_int16_s

    @property
    def int8_speedup(self) -> float:
        return self.float32_s / self.packed_int8_s


def _blocks(file: GGUFFile, name: str) -> GGUFBlocks:
    info = file.tensors[name]
    return GGUFBlocks(file.read_blocks(info), info.qtype, *info.shape)


def load_projection(file: GGUFFile, names: tuple[str, ...]) -> tuple[PackedWeight, torch.Tensor]:
    """The packed weight and its float32 twin (gguf-py's dequantization, stacked the same way)."""
    if names == ("output.weight",) and names[0] not in file.tensors:
        names = ("token_embd.weight",)
    packed = pack_blocks(concat_rows([_blocks(file, name) for name in names]))
    weight = torch.cat([torch.from_numpy(file.read_float32(file.tensors[name])) for name in names])
    return packed, weight


def _burst_seconds(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def time_pair(
    first: Callable[[], object], second: Callable[[], object], samples: int, calls: int
) -> tuple[float, float]:
    """Median seconds per call of each, sampled in alternation after a warm-up."""
    first(), second()
    a, b = [], []
    for _ in range(samples):
        a.append(_burst_seconds(first, calls))
        b.append(_burst_seconds(second, calls))
    return statistics.median(a), statistics.median(b)


def _sweep_packed(
    weights: list[PackedWeight], x: torch.Tensor, activations: GGUFActivations = "float32"
) -> None:
    for weight in weights:
        weight.linear(x, None, activations)


def _sweep_float32(weights: list[torch.Tensor], x: torch.Tensor) -> None:
    for weight in weights:
        packed_linear(x, weight, None)


def time_projections(
    file: GGUFFile, layers: int, rows: tuple[int, ...] = (1, 8), samples: int = 7
) -> list[LayerTiming]:
    results = []
    for name, patterns in PROJECTIONS.items():
        count = 1 if name == "lm_head" else layers
        weights = [load_projection(file, tuple(p.format(i) for p in patterns)) for i in range(count)]
        packed = [weight for weight, _ in weights]
        onednn = [pack_weight(dense) for _, dense in weights]
        del weights
        first = packed[0]
        for batch in rows:
            x = torch.randn(batch, first.in_features)
            calls = max(1, 3 * layers // count)
            packed_s, float32_s = time_pair(
                partial(_sweep_packed, packed, x), partial(_sweep_float32, onednn, x), samples, calls
            )
            int16_s, int8_s = time_pair(
                partial(_sweep_packed, packed, x, "int16"),
                partial(_sweep_packed, packed, x, "int8"),
                samples,
                calls,
            )
            results.append(
                LayerTiming(
                    name, first.qtype.name, first.out_features, first.in_features, batch,
                    packed_s / count, float32_s / count, first.nbytes, int16_s / count, int8_s / count,
                )
            )  # fmt: skip
    return results
