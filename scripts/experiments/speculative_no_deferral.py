"""A/B for issue 17: run a tokenmill CLI command (e.g. ``bench speculative``) with guesses never deferred
for a decode step started ahead: as before ``GuessingRounds`` deferred them, the started step is dropped
and the guesses are verified at once.

    python scripts/experiments/speculative_no_deferral.py bench speculative --model M --device cuda ...
"""

import sys
from collections.abc import Collection, Sequence

from tokenmill import cli
from tokenmill.sequence import Sequence as Seq
from tokenmill.speculative.guessing import GuessingRounds
from tokenmill.speculative.proposer import Proposer

_propose = GuessingRounds.propose


def propose_without_deferral(
    self: GuessingRounds, proposer: Proposer, running: Sequence[Seq], started: Collection[Seq] | None
) -> None:
    _propose(self, proposer, running, None)


if __name__ == "__main__":
    GuessingRounds.propose = propose_without_deferral  # type: ignore[method-assign]
    sys.exit(cli.main(sys.argv[1:]))
