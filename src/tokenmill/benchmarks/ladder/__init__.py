"""The optimization ladder: one workload through a list of engine configs, each changing one toggle.

The description and options are in :mod:`tokenmill.benchmarks.ladder.command`."""

from tokenmill.benchmarks.ladder.command import add_arguments, main, run
from tokenmill.benchmarks.ladder.rungs import BASELINE_RUNG, RUNGS, LadderSetup, Rung, rung_configs

__all__ = ["BASELINE_RUNG", "RUNGS", "LadderSetup", "Rung", "add_arguments", "main", "run", "rung_configs"]
