"""Scheduling-feature scenarios (``tokenmill bench scenarios``): five workloads, each run with its
feature off and on in the same run; :mod:`tokenmill.benchmarks.scenarios.command` describes them."""

from tokenmill.benchmarks.lazy import lazy_command

__all__ = ["add_arguments", "main", "run"]
__getattr__ = lazy_command(__name__)
