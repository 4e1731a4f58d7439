"""Tensor parallelism on CPU (gloo): TP=2 and TP=3 engines give the greedy tokens of TP=1 and of
transformers, shard KV heads (or replicate them when there are fewer than ranks), survive preemption,
and end with a clear error, no orphaned process, when a worker dies."""

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_helpers import in_thread
from quant_reference import write_prequantized
from tiny_models import head_split_configs, save_tiny_model
from tokenmill import LLM
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.parallel.launcher import TensorParallelError
from tokenmill.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6)
PROMPTS = {"a": [5, 6, 7, 8, 9], "b": [30, 31, 32], "c": [100, 7, 250, 3, 3, 9, 40]}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    saved = {}
    names = ("llama3", "llama-tied", "mistral", "qwen2", "qwen3", "gemma3", "gpt2", *head_split_configs())
    for name in names:
        saved[name] = tmp_path_factory.mktemp(name)
        save_tiny_model(name, saved[name])
    return saved


def _engine(model: str, tp: int, **options: Any) -> LLMEngine:
    options.setdefault("num_kv_blocks", 64)
    config = EngineConfig(model=model).with_options(device="cpu", tensor_parallel_size=tp, **options)
    return LLMEngine(config)


def _greedy(
    model: str, tp: int, prompts: dict[str, list[int]] = PROMPTS, **options: Any
) -> dict[str, list[int]]:
    """Each prompt's greedy tokens, the prompts batched continuously in one engine."""
    engine = _engine(model, tp, **options)
    try:
        return _run(engine, prompts)
    finally:
        engine.shutdown()


def _run(
    engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams = GREEDY
) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id] += delta.new_token_ids
    return tokens


def _hf_greedy(folder: Path, prompt: list[int], max_tokens: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
    return list(out[0, len(prompt) :].tolist())


@pytest.mark.parametrize(
    ("name", "tp"),
    [
        ("llama3", 2),  # 4 heads, 2 KV heads: one KV head per rank
        ("llama-6h-3kv", 3),  # one KV head per rank of three
        ("llama-6h-1kv", 2),  # one KV head, replicated on both ranks
        ("llama-6h-1kv", 3),  # ... and on three
        ("qwen3", 2),  # q/k norms, tied embeddings
        ("gemma3", 2),  # sliding windows, GeGLU, scaled embeddings
        ("llama-tied", 2),  # tied embeddings, attention biases (added once, on rank 0)
        ("mistral", 2),  # sliding window
        ("qwen2", 2),  # q/k/v biases, sharded with their rows
        ("gpt2", 2),  # learned positions, multi-head attention, fused c_attn
    ],
)
def test_greedy_tokens_match_one_rank(folders: dict[str, Path], name: str, tp: int) -> None:
    model = str(folders[name])
    reference = _greedy(model, 1)
    assert all(len(tokens) == GREEDY.max_tokens for tokens in reference.values())
    assert _greedy(model, tp) == reference


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_int8_quantized_ranks_match_one_rank(folders: dict[str, Path], name: str) -> None:
    """Each rank quantizes its shard as it loads (a row-parallel layer its column slice, with scales of its
    own); llama3's untied LM head is quantized and split over the vocabulary, qwen2 adds q/k/v biases."""
    model = str(folders[name])
    reference = _greedy(model, 1, quantization="int8")
    assert _greedy(model, 2, quantization="int8") == reference


def test_two_ranks_match_transformers(folders: dict[str, Path]) -> None:
    tokens = _greedy(str(folders["llama3"]), 2)
    for request_id, prompt in PROMPTS.items():
        assert tokens[request_id] == _hf_greedy(folders["llama3"], prompt, GREEDY.max_tokens)


def test_each_rank_pools_only_its_kv_heads(folders: dict[str, Path]) -> None:
    one = _engine(str(folders["llama3"]), 1)
    two = _engine(str(folders["llama3"]), 2)
    try:
        assert two.kv_cache.bytes_per_token * 2 == one.kv_cache.bytes_per_token
        assert two.kv_cache.pool_tokens == one.kv_cache.pool_tokens
    finally:
        two.shutdown()


def test_every_rank_sizes_its_pool_when_no_size_is_given(folders: dict[str, Path]) -> None:
    """Without num_kv_blocks each rank sizes its own pool (on a GPU by profiling in step with the others)
    and the ranks agree on the smallest: the workers must join that agreement, or this start-up hangs."""
    one = _engine(str(folders["llama3"]), 1, num_kv_blocks=None)
    two = _engine(str(folders["llama3"]), 2, num_kv_blocks=None)
    try:
        assert two.kv_cache.pool_tokens == one.kv_cache.pool_tokens > 64 * 16
        assert _run(two, PROMPTS) == _run(one, PROMPTS)
    finally:
        two.shutdown()


def _smallest_of_ranks(rank: int, port: int, values: list[int], found: Any) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from tokenmill.distributed import destroy_tensor_parallel, init_tensor_parallel, min_over_ranks

    store = dist.TCPStore("127.0.0.1", port, len(values), is_master=rank == 0)
    timeout = timedelta(seconds=60)
    init_tensor_parallel("gloo", store, rank, len(values), timeout, timeout)
    try:
        found.put((rank, min_over_ranks(values[rank], torch.device("cpu"))))
    finally:
        destroy_tensor_parallel()


def test_min_over_ranks_gives_every_rank_the_smallest_value() -> None:
    from tokenmill.parallel.launcher import _free_port

    context = multiprocessing.get_context("spawn")
    found = context.SimpleQueue()
    values, port = [700, 300, 500], _free_port()
    ranks = [context.Process(target=_smallest_of_ranks, args=(r, port, values, found)) for r in range(3)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    assert sorted(found.get() for _ in ranks) == [(0, 300), (1, 300), (2, 300)]


@pytest.mark.parametrize("name", ["custom_all_reduce", "push_all_reduce"])
def test_symmetric_all_reduces_on_cpu_are_a_clear_error(folders: dict[str, Path], name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} needs CUDA devices"):
        _engine(str(folders["llama3"]), 2, **{name: True})


def test_push_all_reduce_without_custom_all_reduce_is_refused() -> None:
    with pytest.raises(ValueError, match="push_all_reduce"):
        EngineConfig().with_options(push_all_reduce=True, custom_all_reduce=False)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("tokenmill-tp")]


def test_preemption_under_continuous_batching(folders: dict[str, Path]) -> None:
    """A pool too small for every sequence at once: sequences are preempted and recomputed, on every rank
    alike, and the tokens stay those of one rank."""
    prompts = {f"r{i}": [10 + i, 20 + i, 30 + i, 40 + i] * 3 for i in range(4)}
    options = {"num_kv_blocks": 6, "block_size": 4, "max_model_len": 32, "prefix_caching": False}
    params = SamplingParams(temperature=0, max_tokens=8)
    runs = {}
    for tp in (1, 2):
        engine = _engine(str(folders["llama3"]), tp, **options)
        try:
            runs[tp] = _run(engine, prompts, params)
            assert engine.scheduler_stats().num_preemptions > 0
        finally:
            engine.shutdown()
    assert runs[2] == runs[1]


def test_llm_api_takes_tensor_parallel_size(folders: dict[str, Path]) -> None:
    reference = _greedy(str(folders["llama3"]), 1, {"a": PROMPTS["a"]})["a"]
    llm = LLM(str(folders["llama3"]), device="cpu", num_kv_blocks=64, tensor_parallel_size=2)
    try:
        output = llm.generate({"prompt_token_ids": PROMPTS["a"]}, GREEDY)[0]
    finally:
        llm.shutdown()
    assert output.outputs[0].token_ids == reference


def test_killed_worker_ends_the_engine_with_an_error_naming_its_rank(folders: dict[str, Path]) -> None:
    engine = _engine(str(folders["llama-6h-3kv"]), 3)
    assert engine.workers is not None
    processes = list(engine.workers.processes.values())
    _run(engine, {"warm": PROMPTS["a"]})
    os.kill(engine.workers.processes[2].pid or 0, signal.SIGKILL)
    engine.add_request("after", PROMPTS["b"], GREEDY)
    with pytest.raises(TensorParallelError, match="worker rank 2 exited"):
        while engine.has_unfinished_requests():
            engine.step()
    assert not any(process.is_alive() for process in processes)  # rank 1 too: nothing orphaned
    with pytest.raises(TensorParallelError, match="stopped"):
        engine.step()


def test_an_interrupted_step_stops_the_workers_and_says_so_at_once(folders: dict[str, Path]) -> None:
    """Ctrl-C inside a step (here raised between two layers of rank 0, as a SIGINT lands) leaves the ranks
    in different collectives: the workers are stopped, the interrupt reaches the caller, and the next call
    fails at once naming the interruption (it used to hang for the collective timeout, then blame a
    worker)."""
    llm = LLM(str(folders["llama3"]), device="cpu", num_kv_blocks=64, tensor_parallel_size=2)
    assert llm.engine.workers is not None
    processes = list(llm.engine.workers.processes.values())
    layer = next(m for name, m in llm.engine.runner.model.named_modules() if name.endswith("layers.1"))

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    hook = layer.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate({"prompt_token_ids": PROMPTS["a"]}, GREEDY)
    hook.remove()
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match="a step was interrupted \\(KeyboardInterrupt\\)"):
        llm.generate({"prompt_token_ids": PROMPTS["b"]}, GREEDY)
    assert time.monotonic() - started < 5
    assert not any(process.is_alive() for process in processes)


def test_heads_not_divisible_by_ranks_is_a_clear_error(folders: dict[str, Path]) -> None:
    with pytest.raises(
        ValueError, match=r"attention heads \(4\) is not divisible by the tensor-parallel size \(3\)"
    ):
        _engine(str(folders["llama3"]), 3)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("tokenmill-tp")]


def test_preloaded_model_is_refused(folders: dict[str, Path]) -> None:
    from tokenmill.loading import load_model

    loaded = load_model(str(folders["llama3"]), dtype="float32")
    with pytest.raises(ValueError, match="loads each rank's shard"):
        LLMEngine(EngineConfig(tensor_parallel_size=2, device="cpu"), loaded=loaded)


def test_bad_size_is_refused_by_the_config() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        EngineConfig(tensor_parallel_size=0)


SHARED_LOADS = {"smollm2": "smollm2", "gemma3-270m": "gemma3"}  # conftest's fixture of each model


@pytest.mark.slow
@pytest.mark.parametrize(("model", "tp"), [("smollm2", 3), ("gemma3-270m", 2)])
def test_real_models_match_one_rank(model: str, tp: int, request: pytest.FixtureRequest) -> None:
    """SmolLM2: 9 heads, 3 KV heads over 3 ranks; Gemma 3 270M: 4 heads, 1 KV head replicated on 2. Each
    rank loads its shard by the short name; one rank runs over conftest's shared float32 load."""
    prompts = {"a": [1, 504, 3458, 282, 4649, 314], "b": [2, 651, 3087, 576, 6081, 603]}
    options = {"max_model_len": 128, "num_kv_blocks": 16}
    config = EngineConfig().with_options(device="cpu", **options)
    one_rank = LLMEngine(config, loaded=request.getfixturevalue(SHARED_LOADS[model]))
    try:
        reference = in_thread(lambda: _run(one_rank, prompts))
    finally:
        one_rank.shutdown()
    assert all(reference.values())
    assert _greedy(model, tp, prompts, **options) == reference


def _logprob_values(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[float]:
    """The sampled tokens' logprobs and the prompt logprobs of one request, flattened."""
    engine.add_request("lp", prompt, params)
    values: list[float] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            rows = [*(delta.prompt_logprobs or []), *(delta.new_logprobs or [])]
            values += [
                value for row in rows if row is not None for value in (row.logprob, *dict(row.top).values())
            ]
    return values


def test_logprobs_and_prompt_logprobs_match_one_rank(folders: dict[str, Path]) -> None:
    """Prompt logprobs take logits of other rows than sampling does: every rank computes its vocabulary
    slice of those too."""
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1)
    runs = {}
    for tp in (1, 2):
        engine = _engine(str(folders["llama3"]), tp)
        try:
            runs[tp] = _logprob_values(engine, PROMPTS["c"], params)
        finally:
            engine.shutdown()
    assert len(runs[1]) == 6 * 2 + 3 * 3  # 6 predicted prompt positions (itself + top 1), 3 sampled (+ top 2)
    assert runs[2] == pytest.approx(runs[1], abs=1e-4)


def test_one_rank_starts_no_process_group(folders: dict[str, Path]) -> None:
    engine = _engine(str(folders["llama3"]), 1)
    assert engine.workers is None
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
def test_a_hung_worker_times_out_with_an_error(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that stops answering (SIGSTOP) is not dead: the collective's timeout ends the step."""
    monkeypatch.setattr("tokenmill.parallel.launcher.COLLECTIVE_TIMEOUT_S", 3.0)
    engine = _engine(str(folders["llama3"]), 2)
    assert engine.workers is not None
    worker = engine.workers.processes[1]
    os.kill(worker.pid or 0, signal.SIGSTOP)
    engine.add_request("hung", PROMPTS["a"], GREEDY)
    with pytest.raises(TensorParallelError, match="a collective failed"):
        engine.step()
    assert not worker.is_alive()


_ORPHAN_SCRIPT = """
import sys
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
config = EngineConfig(model=sys.argv[1], device="cpu", tensor_parallel_size=2)
engine = LLMEngine(config.with_options(num_kv_blocks=16))
print(*(p.pid for p in engine.workers.processes.values()), flush=True)
sys.stdin.read()
"""


def test_workers_exit_when_rank_zero_is_killed(folders: dict[str, Path]) -> None:
    """No orphans: with rank 0 gone (SIGKILL, no clean-up ran), the workers' wait for its next step fails."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    rank0 = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_SCRIPT, str(folders["llama3"])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert rank0.stdout is not None
    pids = [int(pid) for pid in rank0.stdout.readline().split()]
    assert len(pids) == 1
    rank0.kill()
    rank0.wait()
    deadline = time.monotonic() + 30
    while _running(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(pids[0])


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has finished: its parent died, and init reaps it soon)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("fmt", ["fp8_block", "int8_ct"])
def test_prequantized_checkpoints_shard_like_one_rank(
    folders: dict[str, Path], tmp_path: Path, fmt: str
) -> None:
    """Published formats split as float weights do: fp8 blocks of 16 x 16 (each rank's q/k/v rows and
    row-parallel columns fall on blocks), compressed-tensors per-row scales split with their rows."""
    folder = write_prequantized(folders["llama3"], tmp_path / fmt, fmt, (16, 16))
    reference = _greedy(str(folder), 1)
    assert _greedy(str(folder), 2) == reference
