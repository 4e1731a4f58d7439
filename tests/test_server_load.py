"""Many concurrent streaming clients, some of which leave midway, and ``tokenmill bench serve`` against a
real server on 127.0.0.1."""

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine_helpers import engine_for, llm_for
from tokenmill import SamplingParams
from tokenmill.cli import main as tokenmill_main
from tokenmill.server import ServerSettings, ServerThread, create_app
from tokenmill.server.generation import ServerContext

MODEL = "smollm2-load"
MAX_MODEL_LEN = 128
NUM_CLIENTS = 64
LEAVING_EVERY = 8  # clients 0, 8, 16, ... disconnect after a few chunks
OUTPUT_TOKENS = 16
LEAVING_MAX_TOKENS = 100
PROMPTS = [f"Fact number {i}: the" if i % 2 else f"Question {i}: what is" for i in range(NUM_CLIENTS)]


@pytest.fixture(scope="module")
def server(smollm2) -> Iterator[ServerThread]:  # type: ignore[no-untyped-def]
    engine = engine_for(smollm2, max_model_len=MAX_MODEL_LEN, max_num_seqs=NUM_CLIENTS)
    app = create_app(engine, ServerSettings(served_model_name=MODEL))
    with ServerThread(app) as thread:
        yield thread


@pytest.fixture(scope="module")
def references(smollm2) -> list[str]:  # type: ignore[no-untyped-def]
    """Offline greedy texts. Computed in a thread of its own: with the CPU oversubscribed, torch's OpenMP
    ran the model about 10x slower in pytest's main thread than in any other."""
    llm = llm_for(smollm2, max_model_len=MAX_MODEL_LEN, max_num_seqs=NUM_CLIENTS)
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS)
    texts: list[str] = []
    thread = threading.Thread(
        target=lambda: texts.extend(o.outputs[0].text for o in llm.generate(PROMPTS, params))
    )
    thread.start()
    thread.join()
    return texts


def metric(server: ServerThread, name: str) -> float:
    for line in httpx.get(f"{server.base_url}/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split(" ")[1])
    raise KeyError(name)


async def _one_client(client: openai.AsyncOpenAI, index: int) -> str | None:
    leaving = index % LEAVING_EVERY == 0
    stream = await client.completions.create(
        model=MODEL,
        prompt=PROMPTS[index],
        max_tokens=LEAVING_MAX_TOKENS if leaving else OUTPUT_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True} if leaving else None,
    )
    pieces = []
    async for chunk in stream:
        pieces.append(chunk.choices[0].text)
        if leaving and len(pieces) == 3:
            await stream.close()  # hang up midway
            return None
    return "".join(pieces)


async def _run_clients(base_url: str) -> list[str | None]:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=300)
    async with client:
        return list(await asyncio.gather(*(_one_client(client, i) for i in range(NUM_CLIENTS))))


def test_concurrent_streams_with_disconnects(server: ServerThread, references: list[str]) -> None:
    context: ServerContext = server.app.state.context
    tokens_before = metric(server, "tokenmill:generation_tokens_total")
    results = asyncio.run(_run_clients(server.base_url))
    for index, (text, expected) in enumerate(zip(results, references, strict=True)):
        if index % LEAVING_EVERY:
            assert text == expected, index
    deadline = time.monotonic() + 5
    while metric(server, "tokenmill:num_requests_running") or metric(
        server, "tokenmill:num_requests_waiting"
    ):
        assert time.monotonic() < deadline, "requests still running after every client finished or left"
        time.sleep(0.05)
    assert metric(server, "tokenmill:kv_cache_usage_perc") == 0
    kv_cache = context.engine.kv_cache
    assert kv_cache is not None
    assert context.engine_loop.call(lambda engine: kv_cache.manager.num_used_blocks).result(timeout=10) == 0
    # The clients that left were aborted, not run to their 100 tokens.
    generated = metric(server, "tokenmill:generation_tokens_total") - tokens_before
    num_leaving = len(range(0, NUM_CLIENTS, LEAVING_EVERY))
    assert generated < (NUM_CLIENTS - num_leaving) * OUTPUT_TOKENS + num_leaving * LEAVING_MAX_TOKENS // 2
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_bench_serve_writes_its_report(server: ServerThread, tmp_path: Path) -> None:
    report_dir = tmp_path / "report"
    status = tokenmill_main(
        ["bench", "serve", "--url", f"{server.base_url}/v1", "--concurrency", "1,4", "--num-prompts", "4",
         "--input-len", "8", "--output-len", "4", "--ignore-eos", "--report-dir", str(report_dir)]
    )  # fmt: skip
    assert status == 0
    report = json.loads((report_dir / "serve.json").read_text())
    assert report["model"] == MODEL
    assert [level["concurrency"] for level in report["levels"]] == [1, 4]
    for level in report["levels"]:
        assert (level["completed"], level["failed"]) == (4, 0)
        assert level["mean_output_tokens"] == 4 and level["output_throughput"] > 0
        assert level["ttft_ms"]["p50"] > 0 and level["tpot_ms"]["p99"] > 0 and level["itl_ms"]["mean"] > 0
    table = (report_dir / "serve.md").read_text()
    assert "| concurrency |" in table and "TTFT p99 (ms)" in table
    assert (report_dir / "serve.png").stat().st_size > 0
