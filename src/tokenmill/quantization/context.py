"""The quantization methods of the model being built, as layers see them.

``build_model`` sets them for the duration of the model's construction (:func:`building_with`); each
linear layer asks :func:`linear_method`, the LM head :func:`lm_head_method`, so model files never pass a
quantization argument around (as :mod:`tokenmill.distributed` gives layers their rank). Outside a build
both are the unquantized method.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tokenmill.quantization.method import UNQUANTIZED, LinearMethod


@dataclass
class _BuildState:
    linear: LinearMethod = UNQUANTIZED
    lm_head: LinearMethod = UNQUANTIZED


_STATE = _BuildState()


@contextmanager
def building_with(linear: LinearMethod, lm_head: LinearMethod) -> Iterator[None]:
    """Layers built inside take ``linear`` (projections) and ``lm_head`` (the output head)."""
    previous = _BuildState(_STATE.linear, _STATE.lm_head)
    _STATE.linear, _STATE.lm_head = linear, lm_head
    try:
        yield
    finally:
        _STATE.linear, _STATE.lm_head = previous.linear, previous.lm_head


def linear_method() -> LinearMethod:
    return _STATE.linear


def lm_head_method() -> LinearMethod:
    return _STATE.lm_head
