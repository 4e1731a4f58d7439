"""What crosses between the HTTP side and the engine side of the server, in either way of running it.

``PromptSpec`` goes in; ``Accepted`` or ``Failed`` and then ``RequestDelta``s come out. With the engine in
a process of its own (``engine_process.py``), the commands below go down a pipe and one ``StepOutputs``
comes back per engine step, carrying every request's delta of that step: pickled once per step, never
once per token. Deltas travel as plain tuples (``encode_delta``), which pickle in about half the time of
the dataclass they come from.
"""

from dataclasses import dataclass, field
from typing import Any, TypeAlias

from tokenmill.outputs import RequestDelta
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.metrics import EngineStats
from tokenmill.server.request_timeline import StepMetrics
from tokenmill.tokenizer import Tokenizer


@dataclass(frozen=True)
class PromptSpec:
    """One engine request: a prompt (text or token ids), its sampling parameters, priority and cache salt."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None


@dataclass(frozen=True)
class Accepted:
    """Every prompt of the request was queued; their token ids, in order."""

    prompt_token_ids: list[list[int]]


@dataclass(frozen=True)
class Failed:
    """The request was refused or failed; answer ``status_code`` with ``message``."""

    status_code: int
    message: str
    param: str | None = None


StreamItem: TypeAlias = Accepted | Failed | RequestDelta


@dataclass(frozen=True)
class EngineFacts:
    """What the HTTP side needs to know of the engine: limits, names, the KV cache's settings, and the
    tokenizer (pickled across: the same object the engine uses, in milliseconds instead of the seconds a
    GGUF file's tokenizer takes to build)."""

    source: str  # the loaded model's file or folder
    model: str | None  # the --model argument as given
    max_model_len: int
    vocab_size: int
    max_running: int
    cache_labels: dict[str, str]
    eos_token_ids: tuple[int, ...]
    structured_output_backend: str
    tokenizer: Tokenizer | None
    sampling_defaults: dict[str, Any]  # the generation config's, by SamplingParams' names


# -- the HTTP side to the engine process --------------------------------------------------------------


@dataclass(frozen=True)
class AddRequests:
    """Queue ``specs`` as one unit; the answer comes back under ``add_id``."""

    add_id: int
    specs: list[PromptSpec]
    arrival_time: float  # time.monotonic() of the HTTP side: the same clock in both processes on Linux


@dataclass(frozen=True)
class AbortRequests:
    request_ids: list[str]


@dataclass(frozen=True)
class Shutdown:
    pass


EngineCommand: TypeAlias = AddRequests | AbortRequests | Shutdown


# -- the engine process to the HTTP side --------------------------------------------------------------


@dataclass(frozen=True)
class EngineReady:
    facts: EngineFacts


@dataclass(frozen=True)
class EngineStartupFailed:
    """Building the engine failed; ``bad_input``: a TokenmillError or ValueError, whose message says it."""

    message: str
    bad_input: bool


@dataclass(frozen=True)
class EngineCrashed:
    """The engine process's loop broke (not one step: those fail their requests and go on)."""

    message: str


@dataclass
class StepOutputs:
    """Everything one pass of the engine process's loop has to say."""

    stats: EngineStats = field(default_factory=EngineStats)
    metrics: StepMetrics = field(default_factory=StepMetrics)
    added: list[tuple[int, Accepted | Failed]] = field(default_factory=list)
    deltas: list[tuple[Any, ...]] = field(default_factory=list)  # encode_delta'd
    done: list[str] = field(default_factory=list)  # requests whose every sequence finished
    failed: tuple[list[str], Failed] | None = None  # requests a broken step failed (aborted in the engine)


EngineMessage: TypeAlias = EngineReady | EngineStartupFailed | EngineCrashed | StepOutputs


def encode_delta(delta: RequestDelta) -> tuple[Any, ...]:
    """The delta's fields in order (a plain dataclass keeps them so in ``__dict__``)."""
    return tuple(vars(delta).values())


def decode_delta(values: tuple[Any, ...]) -> RequestDelta:
    return RequestDelta(*values)
