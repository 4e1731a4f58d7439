"""The feature each scenario toggles: its ``EngineConfig`` with the feature off and on, all else equal."""

from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.benchmarks.scenarios.sizes import Sizes
from tokenmill.config import EngineConfig


@dataclass(frozen=True)
class FeatureToggle:
    name: str  # what the report calls the feature
    off_label: str
    on_label: str
    configure: Callable[[EngineConfig, bool, Sizes], EngineConfig]  # (base, on, sizes) -> config

    def configs(self, base: EngineConfig, sizes: Sizes) -> tuple[EngineConfig, EngineConfig]:
        base = base.with_options(max_num_seqs=sizes.max_num_seqs)
        return self.configure(base, False, sizes), self.configure(base, True, sizes)


def _batching(base: EngineConfig, on: bool, sizes: Sizes) -> EngineConfig:
    return base.with_options(batching="continuous" if on else "static")


def _chunked_prefill(base: EngineConfig, on: bool, sizes: Sizes) -> EngineConfig:
    # Off, a whole prompt must fit one step, so the budget stays at least max_model_len (the base's).
    if not on:
        return base.with_options(chunked_prefill=False)
    return base.with_options(chunked_prefill=True, max_num_batched_tokens=sizes.chunk_budget)


def _prefix_caching(base: EngineConfig, on: bool, sizes: Sizes) -> EngineConfig:
    return base.with_options(kv_cache="paged", prefix_caching=on)


BATCHING = FeatureToggle("continuous batching", "static", "continuous", _batching)
CHUNKED_PREFILL = FeatureToggle(
    "chunked prefill", "chunked prefill off", "chunked prefill on", _chunked_prefill
)
PREFIX_CACHING = FeatureToggle("prefix caching", "prefix caching off", "prefix caching on", _prefix_caching)

TOGGLES: dict[str, FeatureToggle] = {
    "continuous_batching": BATCHING,
    "burst": BATCHING,
    "chunked_prefill": CHUNKED_PREFILL,
    "prefix_caching": PREFIX_CACHING,
    "multi_turn": PREFIX_CACHING,
}


def config_difference(off: EngineConfig, on: EngineConfig) -> str:
    """The options that differ, as ``name off -> on`` (what the report says was toggled)."""
    before, after = off.options(), on.options()
    changes = [f"{name} {before[name]} -> {after[name]}" for name in before if before[name] != after[name]]
    return ", ".join(changes) or "nothing"
