"""Load test of an OpenAI-compatible server: streamed ``/v1/completions`` at several concurrency levels.

The description and options are in :mod:`tokenmill.benchmarks.serve.command`."""

from tokenmill.benchmarks.lazy import lazy_command

__all__ = ["add_arguments", "main", "run"]
__getattr__ = lazy_command(__name__)
