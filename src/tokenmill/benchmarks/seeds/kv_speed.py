"""Table 1: decode speed with the KV cache and without it (``kv_cache="none"``: every step recomputes the
whole sequence), one request at a time, by generation length and by prompt length."""

from dataclasses import dataclass

from tokenmill.benchmarks.seeds.engines import SeedSetup, fastest_of, fixed_workload, run_on_engine
from tokenmill.benchmarks.seeds.published import KV_CACHE_SPEEDUP
from tokenmill.config import EngineConfig

CACHED, RECOMPUTE = "paged", "none"


@dataclass(frozen=True)
class SpeedRow:
    axis: str  # "generation length" or "prompt length": which one the row varies
    prompt_len: int
    gen_len: int
    cached_tok_s: float
    recompute_tok_s: float

    @property
    def speedup(self) -> float:
        return self.cached_tok_s / self.recompute_tok_s

    @property
    def seed_speedup(self) -> float | None:
        return KV_CACHE_SPEEDUP.get(self.gen_len) if self.axis == "generation length" else None


def row_shapes(setup: SeedSetup) -> list[tuple[str, int, int]]:
    sizes = setup.sizes
    by_gen = [("generation length", sizes.gen_prompt_len, n) for n in sizes.gen_lens]
    by_prompt = [("prompt length", n, sizes.prompt_gen_len) for n in sizes.prompt_lens]
    return by_gen + by_prompt


def speed_config(setup: SeedSetup, mode: str) -> EngineConfig:
    """One request at a time, with the KV cache (``paged``) or recomputing every step (``none``)."""
    return setup.config(kv_cache=mode, max_num_seqs=1)


def measure_kv_speed(setup: SeedSetup) -> list[SpeedRow]:
    """Each shape served alone by the cached engine and by the recomputing one (an engine each, reused
    over the rows); output tokens over the request's whole time, prefill included, as the seed timed it."""
    shapes = row_shapes(setup)
    speeds: dict[str, list[float]] = {}
    for mode in (CACHED, RECOMPUTE):
        speeds[mode] = run_on_engine(
            setup,
            speed_config(setup, mode),
            lambda engine: [
                fastest_of(engine, fixed_workload(setup, 1, prompt, gen), setup.sizes.repeats).tokens_per_s
                for _, prompt, gen in shapes
            ],
        )
        print(f"kv-cache table: {mode} done", flush=True)
    return [
        SpeedRow(axis, prompt, gen, cached, recompute)
        for (axis, prompt, gen), cached, recompute in zip(
            shapes, speeds[CACHED], speeds[RECOMPUTE], strict=True
        )
    ]
