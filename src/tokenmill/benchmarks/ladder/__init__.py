"""The optimization ladder: one workload through a list of engine configs, each changing one toggle.

Every rung must produce the first rung's greedy tokens for every request; a rung that does not is not
reported (the mismatch is printed and the command exits non-zero). HF ``generate`` at ``--batch-size`` runs
the same workload in the same process as the peer. Writes ladder.md, ladder.json and ladder.png to
``--report-dir`` (default: ``$TOKENMILL_REPORT_DIR/ladder-<device>``, else
``~/.cache/tokenmill/reports/ladder-<device>``; never the source tree unless named).

    tokenmill bench ladder [--model PATH] [--num-requests 32] [--batch-size 8] [--report-dir DIR]

New optimizations add a ``Rung`` to ``RUNGS`` (``rungs``): a name and a function deriving its config from
the previous. ``command`` measures the rungs and checks their tokens; ``report`` writes the results.
"""

from tokenmill.benchmarks.ladder.command import add_arguments, main, run
from tokenmill.benchmarks.ladder.rungs import BASELINE_RUNG, RUNGS, LadderSetup, Rung, rung_configs

__all__ = ["BASELINE_RUNG", "RUNGS", "LadderSetup", "Rung", "add_arguments", "main", "run", "rung_configs"]
