"""``tokenmill bench tensor-parallel``: tensor parallelism on the GPUs at hand against one GPU, in one run:
greedy tokens of each size against size 1 (float32, same weights), batch-1 decode, the all-reduce's
latency (NCCL against the symmetric-memory path), and offline throughput.

The description and options are in :mod:`tokenmill.benchmarks.tensor_parallel.command`."""

from tokenmill.benchmarks.lazy import lazy_command

__all__ = ["add_arguments", "main", "run"]
__getattr__ = lazy_command(__name__)
