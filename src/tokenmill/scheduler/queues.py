"""The order in which sequences wait and run (``SchedulerConfig.policy``), as swappable objects.

``fcfs``: new sequences join the back of the waiting queue, a preempted one returns to its front, and
running sequences are served in admission order. ``priority``: both are kept sorted by
:func:`scheduling_key` (priority, then arrival), and a waiting sequence may preempt a running one of a
strictly worse priority. Either way the last running sequence is the next preemption victim.
"""

import bisect
from collections import deque

from tokenmill.sequence import Sequence


def scheduling_key(seq: Sequence) -> tuple[int, float]:
    """Under the ``priority`` policy: the smaller, the sooner served and the later preempted."""
    return seq.priority, seq.arrival_time


class SchedulingQueues:
    """FCFS: the waiting queue and the running list in arrival / admission order."""

    def __init__(self) -> None:
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in serving order: the last one is the preemption victim

    def add_waiting(self, seq: Sequence, preempted: bool) -> None:
        if preempted:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        self.running.append(seq)

    def may_preempt_for(self, newcomer: Sequence, victim: Sequence) -> bool:
        """Whether ``newcomer``, waiting, may take the place of ``victim``, running."""
        return False


class PrioritySchedulingQueues(SchedulingQueues):
    """Both queues sorted by :func:`scheduling_key`."""

    def add_waiting(self, seq: Sequence, preempted: bool) -> None:
        bisect.insort(self.waiting, seq, key=scheduling_key)

    def add_running(self, seq: Sequence) -> None:
        bisect.insort(self.running, seq, key=scheduling_key)

    def may_preempt_for(self, newcomer: Sequence, victim: Sequence) -> bool:
        return victim.priority > newcomer.priority


def create_queues(policy: str) -> SchedulingQueues:
    return PrioritySchedulingQueues() if policy == "priority" else SchedulingQueues()
