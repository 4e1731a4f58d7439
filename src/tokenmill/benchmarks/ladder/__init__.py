"""The optimization ladder: one workload through a list of engine configs, each changing one toggle.

The description and options are in :mod:`tokenmill.benchmarks.ladder.command`."""

from tokenmill.benchmarks.ladder.rungs import BASELINE_RUNG, RUNGS, LadderSetup, Rung, rung_configs
from tokenmill.benchmarks.lazy import lazy_command

__all__ = ["BASELINE_RUNG", "RUNGS", "LadderSetup", "Rung", "add_arguments", "main", "run", "rung_configs"]
__getattr__ = lazy_command(__name__)
