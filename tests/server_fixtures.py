"""A running server on the default model and the official ``openai`` client for it, for the modules that
check tokenmill's server against vLLM's API. Import ``server_fixture`` and ``client_fixture`` into a test
module: they are its ``server`` and ``client`` fixtures."""

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from engine_helpers import engine_for
from tokenmill.server import ServerSettings, ServerThread, create_app

MODEL = "smollm2-vllm-api"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module", name="server")
def server_fixture(smollm2) -> Iterator[ServerThread]:  # type: ignore[no-untyped-def]
    engine = engine_for(smollm2, max_model_len=MAX_MODEL_LEN, max_num_seqs=4)
    app = create_app(engine, ServerSettings(served_model_name=MODEL))
    with ServerThread(app) as thread:
        yield thread


@pytest.fixture(scope="module", name="client")
def client_fixture(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def post(server: ServerThread, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120)


def tokenize(server: ServerThread, **body: Any) -> dict[str, Any]:
    response = post(server, "/tokenize", body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer
