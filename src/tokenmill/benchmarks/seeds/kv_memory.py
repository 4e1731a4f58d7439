"""Table 3: contiguous KV (``kv_cache="contiguous"``: one slab of ``context_len`` slots per sequence,
allocated when the engine starts) against paged KV (one pool of ``paged_pool_gib``, blocks of 16 tokens
taken as sequences grow), by batch size: the memory each allocates and uses, the batch from which paged
allocates less (the crossover), and where each runs out.

Contiguous runs out when its slabs cannot be allocated: on a GPU the allocation itself fails (caught:
``torch.OutOfMemoryError``); on a CPU, or under ``kv_limit_gib``, the slabs are refused beyond that limit
before anything is allocated (a CPU would swap or kill the process instead of failing). Paged runs out of
blocks when the batch needs more than its pool holds: the engine then cannot run the whole batch at once
and preempts (the table counts both), rather than failing."""

from dataclasses import dataclass

import torch

from tokenmill.benchmarks.report import fmt_bytes
from tokenmill.benchmarks.seeds.engines import (
    BatchRun,
    SeedSetup,
    fixed_workload,
    release_memory,
    run_on_engine,
    serve_at_once,
)

GIB = 2**30


@dataclass(frozen=True)
class MemoryRow:
    batch_size: int
    contiguous_bytes: int  # batch x context_len slots: what the contiguous engine allocates
    contiguous: BatchRun | None  # None: it ran out of memory
    contiguous_failure: str  # why it did not run ("" when it ran)
    paged: BatchRun
    paged_blocks_needed: int  # naive: batch x ceil(tokens per sequence / block size)
    paged_pool_blocks: int

    @property
    def paged_exhausted(self) -> bool:
        """Measured: the engine could not hold the whole batch at once."""
        return self.paged.peak_running < self.batch_size or self.paged.preemptions > 0


@dataclass(frozen=True)
class MemoryTable:
    rows: list[MemoryRow]
    slab_bytes: int  # one sequence's contiguous reservation
    block_bytes: int
    limit_text: str  # what bounds contiguous's allocation

    def crossover(self) -> int | None:
        """The smallest batch at which contiguous allocates more than paged's whole pool."""
        return next((r.batch_size for r in self.rows if r.contiguous_bytes > r.paged.kv_pool_bytes), None)

    def contiguous_oom(self) -> int | None:
        return next((r.batch_size for r in self.rows if r.contiguous is None), None)

    def paged_exhausted(self) -> int | None:
        return next((r.batch_size for r in self.rows if r.paged_exhausted), None)


def contiguous_limit_bytes(setup: SeedSetup) -> int | None:
    """The bytes contiguous slabs may take: ``kv_limit_gib`` if set, else none (the GPU's own limit)."""
    if setup.sizes.kv_limit_gib > 0:
        return int(setup.sizes.kv_limit_gib * GIB)
    if setup.device.type != "cuda":
        raise ValueError("--kv-limit-gib 0 (allocate until it fails) is for a GPU; give a limit on CPU")
    return None


def measure_kv_memory(setup: SeedSetup) -> MemoryTable:
    sizes = setup.sizes
    per_token = setup.kv_bytes_per_token()
    block_size = setup.base.kv.block_size
    pool_blocks = int(sizes.paged_pool_gib * GIB) // (block_size * per_token)
    limit = contiguous_limit_bytes(setup)
    tokens = sizes.memory_input_len + sizes.memory_output_len
    paged_runs = _paged_runs(setup, pool_blocks)
    rows, failed_at = [], None
    for batch_size, paged in zip(sizes.memory_batch_sizes, paged_runs, strict=True):
        needed = batch_size * sizes.context_len * per_token
        run, failure = None, ""
        if failed_at is not None:
            failure = f"more than batch {failed_at}, which ran out"
        elif limit is not None and needed > limit:
            failure = f"needs {fmt_bytes(needed)} > the {fmt_bytes(limit)} limit (refused)"
        else:
            run, failure = _contiguous_run(setup, batch_size)
        if run is None and failed_at is None:
            failed_at = batch_size
        blocks_needed = batch_size * -(-tokens // block_size)
        rows.append(MemoryRow(batch_size, needed, run, failure, paged, blocks_needed, pool_blocks))
        print(f"memory table: batch {batch_size}: contiguous {failure or 'ran'}", flush=True)
    limit_text = f"{fmt_bytes(limit)} (kv_limit_gib)" if limit else "the GPU's free memory"
    return MemoryTable(rows, sizes.context_len * per_token, block_size * per_token, limit_text)


def _paged_runs(setup: SeedSetup, pool_blocks: int) -> list[BatchRun]:
    """Every batch size through one paged engine: its pool is the same for all of them."""
    sizes = setup.sizes
    config = setup.config(
        kv_cache="paged", num_kv_blocks=pool_blocks, max_num_seqs=max(sizes.memory_batch_sizes)
    )
    return run_on_engine(
        setup,
        config,
        lambda engine: [
            serve_at_once(engine, fixed_workload(setup, n, sizes.memory_input_len, sizes.memory_output_len))
            for n in sizes.memory_batch_sizes
        ],
    )


def _contiguous_run(setup: SeedSetup, batch_size: int) -> tuple[BatchRun | None, str]:
    sizes = setup.sizes
    config = setup.config(kv_cache="contiguous", max_num_seqs=batch_size, num_kv_blocks=batch_size)
    workload = fixed_workload(setup, batch_size, sizes.memory_input_len, sizes.memory_output_len)
    try:
        return run_on_engine(setup, config, lambda engine: serve_at_once(engine, workload)), ""
    except torch.OutOfMemoryError as error:
        reason = str(error).split("\n")[0].split(". ")[0]
    release_memory(setup.device)  # the error's frames held the partial allocation until here
    return None, f"allocation failed: {reason}"
