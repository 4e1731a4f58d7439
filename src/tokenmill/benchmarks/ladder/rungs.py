"""The rungs of the ladder: each a name, the one toggle it changes, and how it derives its engine config
from the previous rung's (every rung keeps what the rungs below it turned on)."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenmill.config import FUSED_KERNEL_TOGGLES, EngineConfig

BASELINE_RUNG = "contiguous KV"  # sequential serving with a KV cache: the baseline the targets refer to


@dataclass(frozen=True)
class LadderSetup:
    """What a rung may size itself by."""

    batch_size: int
    num_requests: int
    max_model_len: int
    block_size: int


@dataclass(frozen=True)
class Rung:
    name: str
    change: str  # the one toggle this rung changes, for the report
    configure: Callable[[EngineConfig, LadderSetup], EngineConfig]  # previous rung's config -> this one's
    cuda_only: bool = False  # GPU fast-path rungs: Triton kernels and CUDA graphs need a CUDA device


def _recompute(config: EngineConfig, setup: LadderSetup) -> EngineConfig:
    return config.with_options(kv_cache="none", batching="sequential")


def _contiguous(config: EngineConfig, setup: LadderSetup) -> EngineConfig:
    return config.with_options(kv_cache="contiguous")


def _static(config: EngineConfig, setup: LadderSetup) -> EngineConfig:
    return config.with_options(batching="static", max_num_seqs=setup.batch_size)


def _continuous(config: EngineConfig, setup: LadderSetup) -> EngineConfig:
    return config.with_options(batching="continuous")


def _paged(config: EngineConfig, setup: LadderSetup) -> EngineConfig:
    # The same KV memory as the contiguous rung (batch_size whole contexts), cut into blocks; with it,
    # more sequences than batch_size fit at once, so the sequence cap is lifted to the whole workload.
    blocks = setup.batch_size * setup.max_model_len // setup.block_size
    return config.with_options(kv_cache="paged", num_kv_blocks=blocks, max_num_seqs=setup.num_requests)


def _triton_attention(config: EngineConfig, setup: LadderSetup) -> EngineConfig:
    return config.with_options(attention_backend="triton")


def _fused_kernels(config: EngineConfig, setup: LadderSetup) -> EngineConfig:
    return config.with_options(**dict.fromkeys(FUSED_KERNEL_TOGGLES, True))


def _cuda_graphs(config: EngineConfig, setup: LadderSetup) -> EngineConfig:
    return config.with_options(cuda_graphs=True)


def _programmatic_launch(config: EngineConfig, setup: LadderSetup) -> EngineConfig:
    return config.with_options(programmatic_launch=None)  # on where the GPU supports it (Hopper+)


def _graph_logits(config: EngineConfig, setup: LadderSetup) -> EngineConfig:
    return config.with_options(cuda_graph_logits=True)


def _overlap_decode(config: EngineConfig, setup: LadderSetup) -> EngineConfig:
    return config.with_options(overlap_decode=True)


def _ngram_speculation(config: EngineConfig, setup: LadderSetup) -> EngineConfig:
    # Verification steps run eagerly and without overlap: on a workload that does not copy from its
    # prompts, this rung shows what speculation costs where it cannot help.
    return config.with_options(speculative_method="ngram", num_speculative_tokens=4)


RUNGS: list[Rung] = [
    Rung("recompute", "kv_cache=none, batching=sequential", _recompute),
    Rung("contiguous KV", "kv_cache=contiguous", _contiguous),
    Rung("static batching", "batching=static, max_num_seqs=batch size", _static),
    Rung("continuous batching", "batching=continuous", _continuous),
    Rung("paged KV", "kv_cache=paged, same KV bytes as contiguous, max_num_seqs=N", _paged),
    Rung("Triton attention", "attention_backend=triton", _triton_attention, cuda_only=True),
    Rung(
        "fused kernels",
        "fused_rms_norm/rotary/activation/gemv/decode_rotary_kv/sampling=True",
        _fused_kernels,
        cuda_only=True,
    ),
    Rung("CUDA graphs", "cuda_graphs=True (decode steps replayed)", _cuda_graphs, cuda_only=True),
    Rung(
        "logits in graphs",
        "cuda_graph_logits=True (LM head + argmax replayed)",
        _graph_logits,
        cuda_only=True,
    ),
    Rung("overlapped decode", "overlap_decode=True", _overlap_decode, cuda_only=True),
    Rung(
        "programmatic launch",
        "programmatic_launch=auto (on for Hopper+)",
        _programmatic_launch,
        cuda_only=True,
    ),
    Rung("n-gram speculation", "speculative_method=ngram, num_speculative_tokens=4", _ngram_speculation),
]


def rung_configs(
    base: EngineConfig, setup: LadderSetup, rungs: Sequence[Rung]
) -> list[tuple[Rung, EngineConfig]]:
    configs = []
    config = base
    for rung in rungs:
        config = rung.configure(config, setup)
        configs.append((rung, config))
    return configs


def rung_names() -> str:
    return ", ".join(repr(rung.name) for rung in RUNGS)


def selected_rungs(names: Sequence[str] | None) -> list[Rung]:
    if names is None:
        return list(RUNGS)
    known = {rung.name: rung for rung in RUNGS}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown rung(s) {unknown}; known: {rung_names()}")
    # Configs still derive through every earlier rung, so a subset measures the same configs as the full run.
    return [rung for rung in RUNGS if rung.name in names]
