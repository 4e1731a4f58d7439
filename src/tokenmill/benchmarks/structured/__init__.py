"""What structured outputs cost per grammar backend: host mask times and end-to-end tokens/s.

The description and options are in :mod:`tokenmill.benchmarks.structured.command`."""

from tokenmill.benchmarks.lazy import lazy_command

__all__ = ["add_arguments", "main", "run"]
__getattr__ = lazy_command(__name__)
