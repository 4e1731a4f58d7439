"""`tokenmill serve --tensor-parallel-size 3` on CPU (gloo): it answers, and a worker killed while it
serves fails the request with the dead rank named, stops the server with a non-zero exit, and leaves no
process behind."""

import os
import socket
import subprocess
import sys

import openai
import psutil
import pytest

from cli_helpers import SRC

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_a_killed_worker_stops_the_server_with_an_error() -> None:
    port = _free_port()
    options = ["--device", "cpu", "--max-model-len", "256", "--max-num-seqs", "2", "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    env.pop("TRITON_INTERPRET", None)
    server = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "serve", "--tensor-parallel-size", "3", *options],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert server.stderr is not None
    try:
        for line in server.stderr:
            if "Application startup complete" in line:
                break
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        answer = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4)
        assert answer.usage is not None and answer.usage.completion_tokens == 4
        everything = psutil.Process(server.pid).children(recursive=True)
        # The engine process (rank 0) is the child with children (the other is multiprocessing's tracker).
        workers = [
            grandchild for child in psutil.Process(server.pid).children() for grandchild in child.children()
        ]
        workers = [worker for worker in workers if "resource_tracker" not in " ".join(worker.cmdline())]
        assert len(workers) == 2  # ranks 1 and 2
        workers[-1].kill()
        with pytest.raises(openai.InternalServerError, match="worker rank 2 exited"):
            client.completions.create(model=model, prompt="Hello", max_tokens=4)
        stderr = server.stderr.read()
        assert server.wait(60) == 1, stderr
        assert "tokenmill: error: the engine died" in stderr and "worker rank 2" in stderr
        psutil.wait_procs(everything, timeout=15)
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in everything)
    finally:
        if server.poll() is None:
            server.kill()
