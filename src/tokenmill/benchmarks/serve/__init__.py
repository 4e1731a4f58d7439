"""Load test of an OpenAI-compatible server: streamed ``/v1/completions`` at several concurrency levels.

The description and options are in :mod:`tokenmill.benchmarks.serve.command`."""

from tokenmill.benchmarks.serve.command import add_arguments, main, run

__all__ = ["add_arguments", "main", "run"]
