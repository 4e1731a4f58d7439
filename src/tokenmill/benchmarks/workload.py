"""Seeded benchmark workloads: N requests, each a prompt of token ids and an output length.

Prompts are slices of a built-in English corpus when the model has a tokenizer (real text exercises the
same token ids a user would send), else random token ids. Every benchmark builds its requests here, so
tokenmill and its peer see exactly the same prompts and output lengths.
"""

import argparse
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.params import StructuredOutputsParams

PromptSource = Literal["auto", "text", "random"]


class TextEncoder(Protocol):
    """What prompt building needs of a tokenizer: a local ``Tokenizer``, or a server's ``/tokenize``."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


CORPUS = """\
The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the one hundred and
twelve steps out of habit rather than necessity. From the lantern room she could see the whole bay: the
fishing boats returning with their nets folded, the ferry crossing toward the mainland, and, on clear
nights, the faint glow of the city forty miles to the south. She kept a logbook of every ship that passed,
its name, its heading and the hour, although nobody had asked to read it in years.

Photosynthesis converts light energy into chemical energy stored in sugar. In the chloroplasts of a leaf,
chlorophyll absorbs mostly red and blue light and reflects green, which is why plants look green to us.
Water molecules are split, releasing oxygen as a by-product, while carbon dioxide from the air is fixed
into three-carbon molecules through the Calvin cycle. A single mature tree can release enough oxygen in a
season to supply a family of four for a year.

To make a simple loaf of bread, mix five hundred grams of flour with ten grams of salt, seven grams of
dried yeast and about three hundred and fifty millilitres of warm water. Knead the dough for ten minutes
until it is smooth and springs back when pressed. Leave it covered in a warm place until it has doubled in
size, then shape it, let it rise again for forty minutes, and bake it at two hundred and twenty degrees
until the crust is deep brown and the base sounds hollow when tapped.

The history of the printing press is often told as the story of one inventor, but movable type had been
used in East Asia centuries earlier. What changed in fifteenth-century Europe was the combination of a
screw press adapted from wine making, oil-based inks, and a metal alloy that could be cast quickly into
uniform letters. Within fifty years, presses were operating in more than two hundred cities, and the
price of books fell so far that reading began to spread beyond monasteries and universities.

When you debug a slow program, measure before you change anything. A profiler shows where the time goes,
and the answer is frequently surprising: a loop that looks expensive may run only once, while a small
helper called a million times dominates the total. Fix the largest cost first, measure again, and stop
when the program is fast enough for its purpose. Optimizing code that nobody waits for only makes it
harder to read.

The city council met on Tuesday to discuss the proposed bicycle lanes along Harbour Street. Shop owners
worried that removing parking spaces would drive customers away, while residents pointed to the three
accidents at the junction with Mill Road last winter. After two hours of debate the council agreed to a
six-month trial, with traffic counts taken before and after, and a promise to publish the results online.

Mountains shape the weather around them. As moist air is pushed up a slope it cools, and the water vapour
condenses into cloud and then rain, so the windward side of a range is often green and wet. By the time
the air descends the far side it has lost most of its moisture and warms as it sinks, leaving a dry
region called a rain shadow. Some of the driest deserts on Earth lie just beyond high mountain ranges.

Dear Sam, thank you for the postcard from Lisbon; it arrived on the same morning as the first frost, which
made the picture of the sunny tiled streets even more welcome. The garden is resting now. I have planted
the tulip bulbs along the fence and moved the lemon tree indoors, where it sulks in the corner by the
window. Write again soon and tell me whether you found the little bookshop by the tram stop.

A good night of sleep moves through several cycles of light, deep and rapid eye movement sleep, each about
ninety minutes long. Deep sleep dominates the early part of the night and helps the body repair tissue,
while dreaming sleep becomes longer toward morning and seems to play a role in memory and mood. Keeping a
regular schedule, a cool dark room and a screen-free hour before bed are the simplest ways to improve it.

In chess, the opening is about three things: developing pieces quickly, controlling the centre and keeping
the king safe. Beginners often move the same piece several times or bring the queen out too early, where
it can be chased around by minor pieces while the opponent develops with tempo. Castling early connects
the rooks and tucks the king behind a wall of pawns, which is why it appears in almost every master game.
"""


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate; length ranges are inclusive (``(n, n)`` for a fixed length)."""

    num_requests: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    seed: int = 0
    ignore_eos: bool = True
    prompt_source: PromptSource = "auto"
    request_rate: float | None = None  # requests/s for Poisson arrivals; None: all arrive at once

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be at least 1, got {self.num_requests}")
        for name, (low, high) in (("input_len", self.input_len), ("output_len", self.output_len)):
            if not 1 <= low <= high:
                raise ValueError(f"{name} range must satisfy 1 <= min <= max, got {low}..{high}")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError(f"request_rate must be positive, got {self.request_rate}")

    @property
    def max_total_len(self) -> int:
        return self.input_len[1] + self.output_len[1]


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: list[int]
    output_len: int
    arrival_time: float = 0.0  # seconds after the start of the run


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    requests: list[BenchRequest]
    prompt_source: str  # "text" or "random", as actually used
    vocab_size: int
    structured_outputs: StructuredOutputsParams | None = None  # one constraint on every request
    params_by_id: dict[str, SamplingParams] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        params = {
            r.request_id: greedy_params(r.output_len, self.spec.ignore_eos, self.structured_outputs)
            for r in self.requests
        }
        object.__setattr__(self, "params_by_id", params)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def prompts(self) -> list[list[int]]:
        return [request.prompt_token_ids for request in self.requests]

    @property
    def total_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def max_output_tokens(self) -> int:
        """Output tokens if no request stops early (exactly the output with ``ignore_eos``)."""
        return sum(r.output_len for r in self.requests)

    @property
    def max_total_len(self) -> int:
        return max(len(r.prompt_token_ids) + r.output_len for r in self.requests)

    def describe(self) -> str:
        spec = self.spec
        arrivals = (
            "all at t=0" if spec.request_rate is None else f"Poisson arrivals at {spec.request_rate:g} req/s"
        )
        plural = "s" if self.num_requests != 1 else ""
        return (
            f"{self.num_requests} request{plural}, prompts {_range_text(spec.input_len)} tokens "
            f"({self.prompt_source} token ids, {self.total_prompt_tokens} in all), outputs "
            f"{_range_text(spec.output_len)} tokens ({self.max_output_tokens} in all), "
            f"{'ignore_eos, ' if spec.ignore_eos else ''}greedy, seed {spec.seed}, {arrivals}"
        )


def greedy_params(
    output_len: int, ignore_eos: bool, structured_outputs: StructuredOutputsParams | None = None
) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=ignore_eos, structured_outputs=structured_outputs
    )


def _range_text(bounds: tuple[int, int]) -> str:
    low, high = bounds
    return str(low) if low == high else f"{low}-{high} (uniform)"


def build_workload(spec: WorkloadSpec, tokenizer: TextEncoder | None, vocab_size: int) -> Workload:
    rng = random.Random(spec.seed)
    source = resolve_prompt_source(spec.prompt_source, tokenizer)
    corpus_ids = corpus_token_ids(tokenizer) if source == "text" and tokenizer is not None else []
    arrival = 0.0
    requests = []
    for index in range(spec.num_requests):
        input_len = rng.randint(*spec.input_len)
        output_len = rng.randint(*spec.output_len)
        if corpus_ids:
            prompt = corpus_slice(corpus_ids, input_len, rng)
        else:
            prompt = [rng.randrange(vocab_size) for _ in range(input_len)]
        if spec.request_rate is not None and index > 0:
            arrival += rng.expovariate(spec.request_rate)
        requests.append(BenchRequest(f"req-{index}", prompt, output_len, arrival))
    return Workload(spec, requests, source, vocab_size)


def resolve_prompt_source(source: PromptSource, tokenizer: TextEncoder | None) -> str:
    if source == "text" and tokenizer is None:
        raise ValueError("text prompts need a tokenizer; this model has none (use random prompts)")
    if source == "auto":
        return "text" if tokenizer is not None else "random"
    return source


def corpus_token_ids(tokenizer: TextEncoder) -> list[int]:
    # Each paragraph is encoded on its own (no BOS), so a prompt is plain text tokens wherever it starts.
    paragraphs = [p.replace("\n", " ").strip() for p in CORPUS.split("\n\n")]
    ids: list[int] = []
    for paragraph in paragraphs:
        ids.extend(tokenizer.encode(paragraph + "\n\n", add_special_tokens=False))
    return ids


def corpus_slice(corpus_ids: Sequence[int], length: int, rng: random.Random) -> list[int]:
    """``length`` consecutive corpus tokens from a random start, wrapping around the end."""
    start = rng.randrange(len(corpus_ids))
    repeats = -(-(start + length) // len(corpus_ids))
    return list((list(corpus_ids) * repeats)[start : start + length])


@dataclass(frozen=True)
class Dataset:
    num_requests: int
    length_range: tuple[int, int]  # input and output lengths, both uniform in it
    ignore_eos: bool
    prompt_source: PromptSource
    seed: int


DATASETS = {
    # nano-vllm's bench.py workload: 256 requests, random prompts and outputs of 100..1024 tokens.
    "nano-vllm": Dataset(256, (100, 1024), True, "random", 0),
}


def parse_length_range(text: str) -> tuple[int, int]:
    """``"64"`` → (64, 64); ``"32-96"``, ``"32:96"`` or ``"32,96"`` → (32, 96)."""
    for separator in ("-", ":", ","):
        if separator in text:
            low, _, high = text.partition(separator)
            return _checked_range(int(low), int(high), text)
    value = int(text)
    return _checked_range(value, value, text)


def _checked_range(low: int, high: int, text: str) -> tuple[int, int]:
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"'{text}' is not a length range MIN-MAX with 1 <= MIN <= MAX")
    return low, high
