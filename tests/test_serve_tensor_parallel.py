"""`tokenmill serve --tensor-parallel-size N`: it answers the OpenAI client; Ctrl-C stops it and every rank
cleanly; a worker killed while it serves fails the request with the dead rank named, stops the server
with a non-zero exit, and leaves no process behind. On CPU (gloo: the real SmolLM2 over 3 ranks, a tiny
Llama over 2) and, where two GPUs are, on CUDA (NCCL, CUDA graphs, the symmetric-memory all-reduce)."""

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest
import torch

from cli_helpers import SRC
from tiny_models import save_tiny_model
from tokenmill.benchmarks.dummy_folder import save_tokenizer

pytestmark = pytest.mark.slow
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a synthetic word-level tokenizer: a served model whose heads split over 2 ranks."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    model = save_tiny_model("llama3", folder)
    save_tokenizer(folder, model.config.to_dict())
    return folder


class Server:
    """``tokenmill serve`` in its own process group, started and waited for."""

    def __init__(self, device: str, tp: int, model: Path | None) -> None:
        self.port = _free_port()
        options = [
            "--device",
            device,
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "2",
            "--port",
            str(self.port),
        ]
        if model is not None:
            options += ["--model", str(model)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
        env.pop("TRITON_INTERPRET", None)
        command = [
            sys.executable,
            "-m",
            "tokenmill.cli",
            "serve",
            "--tensor-parallel-size",
            str(tp),
            *options,
        ]
        self.process = subprocess.Popen(
            command, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
        )
        assert self.process.stderr is not None
        self.stderr = self.process.stderr
        seen = []
        for line in self.stderr:
            seen.append(line)
            if "Application startup complete" in line:
                break
        else:
            raise AssertionError(f"the server exited with {self.process.wait()}:\n{''.join(seen)}")
        self.client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0
        )
        self.model = self.client.models.list().data[0].id

    def complete(self, prompt: str) -> int:
        answer = self.client.completions.create(model=self.model, prompt=prompt, max_tokens=4)
        assert answer.usage is not None
        return answer.usage.completion_tokens

    def workers(self) -> list[psutil.Process]:
        """Ranks 1..N-1: the engine process's children (the other child is multiprocessing's tracker)."""
        found = [
            grandchild
            for child in psutil.Process(self.process.pid).children()
            for grandchild in child.children()
        ]
        return [worker for worker in found if "resource_tracker" not in " ".join(worker.cmdline())]

    def everything(self) -> list[psutil.Process]:
        return psutil.Process(self.process.pid).children(recursive=True)


@pytest.fixture
def started() -> Iterator[list[Server]]:
    servers: list[Server] = []
    yield servers
    for server in servers:
        if server.process.poll() is None:
            os.killpg(server.process.pid, signal.SIGKILL)


def _assert_all_gone(processes: list[psutil.Process]) -> None:
    psutil.wait_procs(processes, timeout=15)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes)


@pytest.mark.parametrize(
    ("device", "tp", "tiny"), [("cpu", 3, False), pytest.param("cuda", 2, True, marks=TWO_GPUS)]
)
def test_a_killed_worker_stops_the_server_with_an_error(
    device: str, tp: int, tiny: bool, tiny_llama: Path, started: list[Server]
) -> None:
    server = Server(device, tp, tiny_llama if tiny else None)
    started.append(server)
    assert server.complete("The capital of France is") == 4
    everything, workers = server.everything(), server.workers()
    assert len(workers) == tp - 1
    workers[-1].kill()
    last = f"worker rank {tp - 1}"
    with pytest.raises(openai.InternalServerError, match=f"{last} exited"):
        server.complete("Hello")
    stderr = server.stderr.read()
    assert server.process.wait(60) == 1, stderr
    assert "tokenmill: error: the engine died" in stderr and last in stderr
    _assert_all_gone(everything)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=TWO_GPUS)])
def test_ctrl_c_stops_the_server_and_every_rank(device: str, tiny_llama: Path, started: list[Server]) -> None:
    server = Server(device, 2, tiny_llama)
    started.append(server)
    assert server.complete("the cat") == 4
    everything = server.everything()
    assert len(server.workers()) == 1
    os.killpg(server.process.pid, signal.SIGINT)  # as a terminal does: the whole process group
    stderr = server.stderr.read()
    assert server.process.wait(60) in (0, 130), stderr  # 130: uvicorn re-raises the SIGINT it handled
    assert "Traceback" not in stderr
    _assert_all_gone(everything)
