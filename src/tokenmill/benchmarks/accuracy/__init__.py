"""``tokenmill bench accuracy``: perplexity and top-1 agreement of each quantized mode against the
unquantized model, teacher-forced on a fixed public-domain text, and greedy continuations compared.

The description and options are in :mod:`tokenmill.benchmarks.accuracy.command`."""

from tokenmill.benchmarks.lazy import lazy_command

__all__ = ["add_arguments", "main", "run"]
__getattr__ = lazy_command(__name__)
