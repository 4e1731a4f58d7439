"""Host timers around an engine's methods, for the step-phase explorations in this folder: each wrapped
method adds its wall time (and a call) under its ``Owner.method`` label. The wrappers add their own
cost: compare runs of one kind only."""

import collections
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

SECONDS: dict[str, float] = collections.defaultdict(float)
CALLS: dict[str, int] = collections.defaultdict(int)


def clear() -> None:
    SECONDS.clear()
    CALLS.clear()


def _timed(label: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            SECONDS[label] += time.perf_counter() - started
            CALLS[label] += 1

    return wrapper


def wrap(targets: Sequence[tuple[Any, str]]) -> None:
    """Replace each ``(owner, name)`` (a class or a module, and a function's name in it) by a timed one."""
    for owner, name in targets:
        label = f"{getattr(owner, '__name__', owner)}.{name}".rsplit(".", 2)[-2:]
        setattr(owner, name, _timed(".".join(label), getattr(owner, name)))


def engine_step_targets() -> list[tuple[Any, str]]:
    """The methods of a step both explorations time: the engine's per-token work, the scheduler's
    calls, the runner's forward and sampling."""
    from tokenmill.engine import llm_engine
    from tokenmill.runner import model_runner
    from tokenmill.scheduler import scheduler

    return [
        (llm_engine.LLMEngine, "_token_delta"),
        (scheduler.Scheduler, "schedule"),
        (scheduler.Scheduler, "update"),
        (scheduler.Scheduler, "reserve_next_step"),
        (model_runner.ModelRunner, "execute"),
        (model_runner.ModelRunner, "start_next_step"),
        (model_runner.ModelRunner, "_sample"),
        (model_runner.PendingStep, "result"),
    ]
