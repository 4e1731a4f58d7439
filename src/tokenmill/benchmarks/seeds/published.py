"""The seed engines' published numbers: GPT-2 124M in float32 on an A100, as their README gives them (quoted
in issue 23). They come from another machine and another engine, so they sit beside tokenmill's tables for
the shape of the curves, never as a peer measured in the same run."""

from dataclasses import dataclass

SEED_SOURCE = "from another machine (A100, seed's README)"
SEED_WORKLOAD = "GPT-2 124M, float32"


@dataclass(frozen=True)
class SeedNumber:
    """One published figure: what it measures (the row it sits beside) and its value as printed."""

    row: str
    value: str


# KV cache vs recompute: the cache's speed-up by generation length (prompt-length rows are not quoted).
KV_CACHE_SPEEDUP = {200: 1.02, 500: 1.32, 1000: 2.22}

# Batch-size scaling: output tok/s and peak memory at the two ends of the ladder.
BATCH_SCALING = {1: (155.0, "643 MB"), 512: (18_346.0, "55.8 GB")}
BATCH_SCALING_SPEEDUP = 118.0

# Standard (contiguous) vs paged KV memory.
KV_MEMORY = (
    SeedNumber("crossover (paged uses less from here)", "batch ~24-32"),
    SeedNumber("standard runs out of memory", "batch 1024"),
    SeedNumber("paged runs out of blocks", "batch 2048 (survives 1024)"),
    SeedNumber("paged's memory vs standard at batch 256", "8.7x less"),
)

# Serving: paged continuous batching over sequential, by concurrent users.
SERVING_SPEEDUP = {64: 11.1}


def seed_speed_line() -> str:
    speedups = ", ".join(f"{n} tokens {r:.2f}x" for n, r in KV_CACHE_SPEEDUP.items())
    return f"KV cache over recompute by generation length: {speedups}"


def seed_batch_line() -> str:
    low, high = BATCH_SCALING[1], BATCH_SCALING[512]
    return (
        f"batch 1 -> 512: {low[0]:,.0f} -> {high[0]:,.0f} tok/s ({BATCH_SCALING_SPEEDUP:.0f}x), "
        f"peak memory {low[1]} -> {high[1]}"
    )


def seed_memory_line() -> str:
    return "; ".join(f"{number.row}: {number.value}" for number in KV_MEMORY)


def seed_serving_line() -> str:
    return "; ".join(f"{users} users: batched {r}x sequential" for users, r in SERVING_SPEEDUP.items())


def seed_note(line: str) -> str:
    """A table's seed figures, as printed under it."""
    return f"Seed ({SEED_WORKLOAD}, {SEED_SOURCE}): {line}."
