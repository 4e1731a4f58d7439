"""Before a route reads a body: the API key (a wrong key is a 401 whatever the body), then a JSON
Content-Type (``curl -d`` without ``-H 'Content-Type: application/json'`` gets a 415 naming what it sent
and the header to add). And every curl line of the README works against a running server."""

import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine_helpers import engine_for
from tokenmill.server import ServerSettings, ServerThread, create_app

API_KEY = "gate-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
README = Path(__file__).resolve().parents[1] / "README.md"
README_URL = "http://127.0.0.1:8000"
JSON_ROUTES = ["/v1/completions", "/v1/chat/completions", "/generate", "/tokenize", "/detokenize"]
BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/generate": {"prompt": "Hi", "max_tokens": 2},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [19556]},
}


@pytest.fixture(scope="module")
def keyed(smollm2) -> Iterator[ServerThread]:  # type: ignore[no-untyped-def]
    engine = engine_for(smollm2, max_model_len=128, max_num_seqs=2, cpu_kv_cache_gib=0.05)
    app = create_app(engine, ServerSettings(served_model_name="smollm2-gate", api_key=API_KEY))
    with ServerThread(app) as thread:
        yield thread


@pytest.fixture(scope="module")
def open_server(smollm2) -> Iterator[ServerThread]:  # type: ignore[no-untyped-def]
    """No key, and the served name a plain ``tokenmill serve`` has (the one the README's lines send)."""
    engine = engine_for(smollm2, max_model_len=256, max_num_seqs=2, cpu_kv_cache_gib=0.05)
    with ServerThread(create_app(engine)) as thread:
        yield thread


def _post(server: ServerThread, path: str, content: bytes, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", content=content, headers=headers, timeout=60)


def _error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["type"]
    return str(error["message"])


@pytest.mark.parametrize("path", JSON_ROUTES)
def test_a_form_content_type_is_a_415_that_names_it_and_the_fix(keyed: ServerThread, path: str) -> None:
    body = json.dumps(BODIES[path]).encode()
    form = {**AUTH, "Content-Type": "application/x-www-form-urlencoded"}  # what curl -d sends
    message = _error(_post(keyed, path, body, form), 415)
    assert (
        "'application/x-www-form-urlencoded'" in message and "-H 'Content-Type: application/json'" in message
    )
    assert "no Content-Type" in _error(_post(keyed, path, body, AUTH), 415)
    json_with_charset = {**AUTH, "Content-Type": "application/json; charset=utf-8"}
    assert _post(keyed, path, body, json_with_charset).status_code == 200


def test_a_wrong_key_is_a_401_whatever_the_body(keyed: ServerThread) -> None:
    malformed = b'{"prompt": "Hi", "max_tokens": '
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for content_type in ("application/json", "text/plain"):
            response = _post(keyed, "/v1/completions", malformed, {**headers, "Content-Type": content_type})
            assert "API key" in _error(response, 401)
    right_key = {**AUTH, "Content-Type": "application/json"}
    assert "not valid JSON" in _error(_post(keyed, "/v1/completions", malformed, right_key), 400)
    assert _error(httpx.get(f"{keyed.base_url}/v1/models"), 401)
    assert httpx.get(f"{keyed.base_url}/health").status_code == 200
    assert httpx.get(f"{keyed.base_url}/metrics").status_code == 200


def test_the_openai_client_passes_the_gate(keyed: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    completion = client.completions.create(model="smollm2-gate", prompt="Hi", max_tokens=2)
    assert completion.usage is not None and completion.usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key="wrong", max_retries=0).models.list()


def readme_curl_commands() -> list[str]:
    """The curl lines of the README's bash blocks, continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    commands = []
    for block in blocks:
        for command in block.replace("\\\n", " ").splitlines():
            if command.startswith("curl "):
                commands.append(command)
    return commands


def test_the_readme_shows_curl_for_every_route_it_promises() -> None:
    shown = " ".join(readme_curl_commands())
    for route in [*JSON_ROUTES, "/v1/models", "/health", "/metrics"]:
        assert f"{README_URL}{route} " in shown + " ", route


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs the curl command")
@pytest.mark.parametrize("command", readme_curl_commands())
def test_each_readme_curl_line_works(open_server: ServerThread, command: str) -> None:
    argv = shlex.split(command.replace(README_URL, open_server.base_url))
    result = subprocess.run([*argv, "--silent", "--show-error", "--fail"], capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr
    output = result.stdout.decode()
    if "/metrics" in command:
        assert "tokenmill:" in output
    elif '"stream": true' in command:
        assert output.rstrip().endswith("data: [DONE]")
    elif "/health" not in command:
        assert isinstance(json.loads(output), dict)
