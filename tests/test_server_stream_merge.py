"""Deltas that pile up while a streaming handler is busy reach it merged, one per choice, with nothing lost,
reordered or mixed between choices; an error behind them still ends the stream after their tokens."""

import asyncio
import random
from http import HTTPStatus

import pytest

from tokenmill.outputs import RequestDelta, RowLogprobs
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.engine_loop import EngineLoop, Failed, PromptSpec
from tokenmill.server.errors import APIError
from tokenmill.server.generation import Generation


class _NoEngineLoop(EngineLoop):
    def __init__(self) -> None:  # the generation only asks it whether it is healthy, and to abort
        self.aborted: list[str] = []

    @property
    def is_healthy(self) -> bool:
        return True

    def abort(self, request_ids: list[str]) -> None:  # type: ignore[override]
        self.aborted.extend(request_ids)


def _deltas(request_id: str, index: int, tokens: list[int]) -> list[RequestDelta]:
    out = []
    for position, token in enumerate(tokens):
        last = position == len(tokens) - 1
        out.append(
            RequestDelta(
                request_id,
                index,
                [token],
                f"<{token}>",
                [RowLogprobs(token, -float(position), 1, [])],
                finish_reason="length" if last else None,
                num_output_tokens=position + 1,
            )
        )
    return out


async def _stream(generation: Generation) -> list[tuple[int, RequestDelta]]:
    return [item async for item in generation.deltas()]


def test_piled_up_deltas_come_merged_per_choice() -> None:
    rng = random.Random(0)
    lengths = {(0, 0): 5, (0, 1): 6, (1, 0): 6, (1, 1): 7}  # (prompt, sequence) -> tokens
    streams = [
        _deltas(f"r-{prompt}", seq, [rng.randrange(1000) for _ in range(length)])
        for (prompt, seq), length in lengths.items()
    ]

    async def run() -> list[tuple[int, RequestDelta]]:
        specs = [PromptSpec(f"r-{i}", [1, 2], SamplingParams(n=2)) for i in range(2)]
        generation = Generation(_NoEngineLoop(), specs, 2, None, None)
        for step in range(max(lengths.values())):  # the engine ran ahead: all queued before the handler reads
            for stream in streams:
                if step < len(stream):
                    generation.stream.queue.put_nowait(stream[step])
        return await _stream(generation)

    merged = asyncio.run(run())
    # The naive reference: each choice's deltas joined one by one.
    for choice, deltas in enumerate(streams):
        mine = [delta for index, delta in merged if index == choice]
        assert [t for d in mine for t in d.new_token_ids] == [t for d in deltas for t in d.new_token_ids]
        assert "".join(d.new_text for d in mine) == "".join(d.new_text for d in deltas)
        assert [lp for d in mine for lp in d.new_logprobs or []] == [d.new_logprobs[0] for d in deltas]
        assert mine[-1].finish_reason == "length" and mine[-1].num_output_tokens == len(deltas)
        assert len(mine) < len(deltas)  # merged: fewer chunks than tokens


def test_an_error_behind_piled_up_deltas_ends_the_stream_after_them() -> None:
    async def run() -> tuple[list[int], APIError]:
        generation = Generation(_NoEngineLoop(), [PromptSpec("r", [1], SamplingParams())], 1, None, None)
        for delta in _deltas("r", 0, [7, 8, 9])[:2]:
            generation.stream.queue.put_nowait(delta)
        generation.stream.queue.put_nowait(Failed(HTTPStatus.INTERNAL_SERVER_ERROR, "engine failed"))
        received: list[int] = []
        with pytest.raises(APIError) as caught:
            async for _, delta in generation.deltas():
                received.extend(delta.new_token_ids)
        return received, caught.value

    received, error = asyncio.run(run())
    assert received == [7, 8]
    assert error.status_code == HTTPStatus.INTERNAL_SERVER_ERROR and "engine failed" in str(error)


@pytest.mark.parametrize("interval", [1, 3])
def test_a_stream_interval_groups_tokens_after_the_first(interval: int) -> None:
    tokens = list(range(100, 111))

    async def run() -> list[list[int]]:
        generation = Generation(
            _NoEngineLoop(), [PromptSpec("r", [1], SamplingParams())], 1, None, None, lambda: interval
        )
        chunks: list[list[int]] = []

        async def engine() -> None:  # one token per step; the first waits to be sent, the rest do not
            deltas = _deltas("r", 0, tokens)
            generation.stream.queue.put_nowait(deltas[0])
            while not chunks:
                await asyncio.sleep(0)
            for delta in deltas[1:]:
                while not generation.stream.queue.empty():
                    await asyncio.sleep(0)
                generation.stream.queue.put_nowait(delta)

        feeding = asyncio.create_task(engine())
        async for _, delta in generation.deltas():
            chunks.append(delta.new_token_ids)
            await asyncio.sleep(0)
        await feeding
        return chunks

    chunks = asyncio.run(run())
    assert [t for chunk in chunks for t in chunk] == tokens
    assert chunks[0] == tokens[:1]  # the first token is never held back
    assert all(len(chunk) >= interval for chunk in chunks[1:-1])
    if interval > 1:
        assert len(chunks) < len(tokens)
