"""The seed engines' published tables (KV cache vs recompute, batch scaling, contiguous vs paged KV memory,
serving by concurrent users) regenerated on the machine at hand, beside the seed's numbers.

The description and options are in :mod:`tokenmill.benchmarks.seeds.command`."""

from tokenmill.benchmarks.lazy import lazy_command

__all__ = ["add_arguments", "main", "run"]
__getattr__ = lazy_command(__name__)
