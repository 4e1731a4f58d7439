"""The five scenario workloads, as sessions of turns released at set times.

A ``Session`` arrives at ``arrival_time`` and sends its turns one after another: turn k's prompt is the
whole history (every earlier prompt and answer) followed by turn k's user tokens, sent once the answer to
turn k-1 has arrived (plus ``think_time_s``). Single-turn workloads are sessions of one turn. Prompts are
slices of the built-in English corpus when a tokenizer is at hand, else random token ids (dummy weights).

- ``continuous_batching``: prompts and outputs of mixed lengths, Poisson arrivals.
- ``burst``: the same kind of requests, all arriving at t=0.
- ``chunked_prefill``: short-prompt streams with long outputs start at t=0; requests with long prompts
  (``long_fraction`` of all) arrive while they decode, at Poisson times.
- ``prefix_caching``: every prompt is one shared prefix followed by a suffix of its own; Poisson arrivals.
- ``multi_turn``: conversations started at Poisson times, each re-sending its growing history every turn.
"""

import random
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.benchmarks.scenarios.sizes import Sizes
from tokenmill.benchmarks.workload import (
    PromptSource,
    TextEncoder,
    WorkloadSpec,
    build_workload,
    corpus_slice,
    corpus_token_ids,
    resolve_prompt_source,
)

# Slices of the ~1,100-token corpus may start at the same place; prompts meant to differ are drawn again
# until their first tokens do (a shared first block would be a prefix-cache hit nobody intended).
_DISTINCT_HEAD = 16
_MAX_DRAWS = 1000


@dataclass(frozen=True)
class Turn:
    user_token_ids: list[int]  # appended to the history, then the whole history is sent
    output_len: int


@dataclass(frozen=True)
class Session:
    session_id: str
    arrival_time: float  # seconds after the start of the run, when its first turn is sent
    turns: list[Turn]

    def request_id(self, turn_index: int) -> str:
        return self.session_id if len(self.turns) == 1 else f"{self.session_id}/turn-{turn_index}"

    @property
    def max_total_len(self) -> int:
        """The last turn's prompt (every user message and earlier answer) plus its output."""
        return sum(len(turn.user_token_ids) + turn.output_len for turn in self.turns)


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    sessions: list[Session]
    prompt_source: str  # "text" or "random", as used
    think_time_s: float = 0.0

    @property
    def num_requests(self) -> int:
        return sum(len(session.turns) for session in self.sessions)

    @property
    def max_output_tokens(self) -> int:
        return sum(turn.output_len for session in self.sessions for turn in session.turns)

    @property
    def max_total_len(self) -> int:
        return max(session.max_total_len for session in self.sessions)

    def warmup_prompts(self) -> list[list[int]]:
        """The shortest and the longest first prompt, reversed: the prompt sizes of the run, but sharing
        no block with any of its prompts, so a warm-up leaves no prefix-cache hit behind."""
        firsts = sorted((s.turns[0].user_token_ids for s in self.sessions), key=len)
        return [list(reversed(firsts[0])), list(reversed(firsts[-1]))]


@dataclass(frozen=True)
class TokenSource:
    """Where prompt tokens come from: corpus slices (``text``) or random ids below ``vocab_size``."""

    kind: str
    corpus_ids: list[int]
    vocab_size: int
    tokenizer: TextEncoder | None

    def take(self, length: int, rng: random.Random) -> list[int]:
        if self.kind == "text":
            return corpus_slice(self.corpus_ids, length, rng)
        return [rng.randrange(self.vocab_size) for _ in range(length)]

    def take_distinct(self, lengths: list[int], rng: random.Random) -> list[list[int]]:
        """One slice per length, no two starting with the same ``_DISTINCT_HEAD`` tokens."""
        slices: list[list[int]] = []
        heads: set[tuple[int, ...]] = set()
        for length in lengths:
            for _ in range(_MAX_DRAWS):
                tokens = self.take(length, rng)
                if tuple(tokens[:_DISTINCT_HEAD]) not in heads:
                    break
            else:
                raise ValueError(f"cannot draw {len(lengths)} distinct prompts from the {self.kind} source")
            heads.add(tuple(tokens[:_DISTINCT_HEAD]))
            slices.append(tokens)
        return slices


def token_source(source: PromptSource, tokenizer: TextEncoder | None, vocab_size: int) -> TokenSource:
    kind = resolve_prompt_source(source, tokenizer)
    corpus = corpus_token_ids(tokenizer) if kind == "text" and tokenizer is not None else []
    return TokenSource(kind, corpus, vocab_size, tokenizer)


def poisson_times(count: int, rate: float, rng: random.Random, first_at_zero: bool = True) -> list[float]:
    """``count`` arrival times at ``rate`` per second: the first at 0, or itself one interval in."""
    times, now = [], 0.0 if first_at_zero else rng.expovariate(rate)
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


# -- the workloads ----------------------------------------------------------------------------------------


def continuous_batching(sizes: Sizes, source: TokenSource, seed: int) -> Scenario:
    return _batching("continuous_batching", sizes, source, seed, sizes.batching_rate)


def burst(sizes: Sizes, source: TokenSource, seed: int) -> Scenario:
    return _batching("burst", sizes, source, seed, None)


def _batching(name: str, sizes: Sizes, source: TokenSource, seed: int, rate: float | None) -> Scenario:
    spec = WorkloadSpec(
        sizes.batching_requests,
        sizes.batching_input_len,
        sizes.batching_output_len,
        seed,
        prompt_source="text" if source.kind == "text" else "random",
        request_rate=rate,
    )
    workload = build_workload(spec, source.tokenizer, source.vocab_size)
    sessions = [
        Session(r.request_id, r.arrival_time, [Turn(r.prompt_token_ids, r.output_len)])
        for r in workload.requests
    ]
    return Scenario(name, workload.describe(), sessions, workload.prompt_source)


def chunked_prefill(sizes: Sizes, source: TokenSource, seed: int) -> Scenario:
    rng = random.Random(seed)
    num_long = round(sizes.long_fraction * sizes.chunked_requests)
    num_streams = sizes.chunked_requests - num_long
    if not 1 <= num_long < sizes.chunked_requests:
        raise ValueError(
            f"--long-fraction {sizes.long_fraction} of {sizes.chunked_requests} requests leaves "
            f"{num_long} long prompts and {num_streams} streams; each needs at least one"
        )
    stream_prompts = source.take_distinct([sizes.stream_input_len] * num_streams, rng)
    long_prompts = source.take_distinct([sizes.long_input_len] * num_long, rng)
    streams = [
        Session(f"stream-{i}", 0.0, [Turn(prompt, sizes.stream_output_len)])
        for i, prompt in enumerate(stream_prompts)
    ]
    arrivals = poisson_times(num_long, sizes.long_rate, rng, first_at_zero=False)
    longs = [
        Session(f"long-{i}", arrival, [Turn(prompt, sizes.long_output_len)])
        for i, (prompt, arrival) in enumerate(zip(long_prompts, arrivals, strict=True))
    ]
    description = (
        f"{num_streams} short-prompt stream{_plural(num_streams)} ({sizes.stream_input_len}-token prompts, "
        f"{sizes.stream_output_len} output tokens) from t=0, and {num_long} long-prompt "
        f"request{_plural(num_long)} "
        f"({num_long / sizes.chunked_requests:.0%}; {sizes.long_input_len}-token prompts, "
        f"{sizes.long_output_len} output tokens) arriving at {sizes.long_rate:g} req/s (Poisson)"
    )
    return Scenario("chunked_prefill", _with_common(description, source, seed), streams + longs, source.kind)


def prefix_caching(sizes: Sizes, source: TokenSource, seed: int) -> Scenario:
    rng = random.Random(seed)
    prefix = source.take(sizes.prefix_len, rng)
    suffix_lens = [rng.randint(*sizes.suffix_len) for _ in range(sizes.prefix_requests)]
    suffixes = source.take_distinct(suffix_lens, rng)
    arrivals = poisson_times(sizes.prefix_requests, sizes.prefix_rate, rng)
    sessions = [
        Session(f"req-{i}", arrival, [Turn(prefix + suffix, sizes.prefix_output_len)])
        for i, (suffix, arrival) in enumerate(zip(suffixes, arrivals, strict=True))
    ]
    low, high = sizes.suffix_len
    description = (
        f"{sizes.prefix_requests} requests sharing a {sizes.prefix_len}-token prefix, each then a suffix of "
        f"its own ({low}-{high} tokens), {sizes.prefix_output_len} output tokens, arriving at "
        f"{sizes.prefix_rate:g} req/s (Poisson)"
    )
    return Scenario("prefix_caching", _with_common(description, source, seed), sessions, source.kind)


def multi_turn(sizes: Sizes, source: TokenSource, seed: int) -> Scenario:
    rng = random.Random(seed)
    firsts = source.take_distinct([sizes.first_turn_len] * sizes.conversations, rng)
    arrivals = poisson_times(sizes.conversations, sizes.conversation_rate, rng)
    sessions = []
    for index, (first, arrival) in enumerate(zip(firsts, arrivals, strict=True)):
        later = [source.take(sizes.turn_len, rng) for _ in range(sizes.turns - 1)]
        turns = [Turn(user, sizes.answer_len) for user in [first, *later]]
        sessions.append(Session(f"conv-{index}", arrival, turns))
    description = (
        f"{sizes.conversations} conversations of {sizes.turns} turns starting at "
        f"{sizes.conversation_rate:g}/s (Poisson); first user message {sizes.first_turn_len} tokens, later "
        f"ones {sizes.turn_len}, answers {sizes.answer_len}; each turn re-sends the whole history and is "
        f"sent {sizes.think_time:g} s after the previous answer arrived"
    )
    return Scenario(
        "multi_turn", _with_common(description, source, seed), sessions, source.kind, sizes.think_time
    )


def _plural(count: int) -> str:
    return "" if count == 1 else "s"


def _with_common(description: str, source: TokenSource, seed: int) -> str:
    return f"{description}; {source.kind} token ids, ignore_eos, greedy, seed {seed}"


BUILDERS: dict[str, Callable[[Sizes, TokenSource, int], Scenario]] = {
    "continuous_batching": continuous_batching,
    "burst": burst,
    "chunked_prefill": chunked_prefill,
    "prefix_caching": prefix_caching,
    "multi_turn": multi_turn,
}
WORKLOADS: tuple[str, ...] = tuple(BUILDERS)


def build_scenario(name: str, sizes: Sizes, source: TokenSource, seed: int) -> Scenario:
    if name not in BUILDERS:
        raise ValueError(f"unknown workload '{name}'; known: {', '.join(WORKLOADS)}")
    return BUILDERS[name](sizes, source, seed)
