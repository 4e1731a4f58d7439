"""Table 2: output tokens/s by batch size, with the memory each batch took: the allocator's (or the
process's) peak and the KV pool's used bytes. Each batch gets a fresh engine whose paged pool holds just
that batch, so the peak grows with the batch as the seed's does."""

from dataclasses import dataclass
from functools import partial

from tokenmill.benchmarks.seeds.engines import BatchRun, SeedSetup, fastest_of, fixed_workload, run_on_engine
from tokenmill.benchmarks.seeds.published import BATCH_SCALING


@dataclass(frozen=True)
class BatchRow:
    batch_size: int
    run: BatchRun

    def seed(self) -> tuple[float, str] | None:
        return BATCH_SCALING.get(self.batch_size)


def pool_blocks(setup: SeedSetup, batch_size: int, total_len: int) -> int:
    """Blocks for ``batch_size`` sequences of ``total_len`` tokens (the warm-up's are free again by then)."""
    block_size = setup.base.kv.block_size
    return batch_size * -(-total_len // block_size)


def measure_batch_scaling(setup: SeedSetup) -> list[BatchRow]:
    sizes = setup.sizes
    total_len = sizes.batch_input_len + sizes.batch_output_len
    rows = []
    for batch_size in sizes.batch_sizes:
        config = setup.config(
            max_num_seqs=batch_size, num_kv_blocks=pool_blocks(setup, batch_size, total_len)
        )
        workload = fixed_workload(setup, batch_size, sizes.batch_input_len, sizes.batch_output_len)
        run = run_on_engine(setup, config, partial(fastest_of, workload=workload, repeats=sizes.repeats))
        rows.append(BatchRow(batch_size, run))
        print(f"batch table: batch {batch_size}: {run.tokens_per_s:.1f} tok/s", flush=True)
    return rows
