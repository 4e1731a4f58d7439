"""One-sequence prefill graphs, on CPU: the graph runner runs the captured computation eagerly over the
same static, padded buffers (a real sequence plus a padding one), and the engine's tokens and logprobs are
checked against the single-sequence reference loop, with prompts of every length around the buckets,
prefix-cache hits (a prefill that starts after cached context) and chunked prompts. The capture itself
needs a GPU (the last test)."""

from typing import Any

import pytest
import torch

from engine_helpers import engine_for, run_to_completion
from tiny_models import save_tiny_model
from tokenmill import SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.loading import load_model
from tokenmill.reference import greedy_generate
from tokenmill.runner.prefill_graphs import PrefillGraphRunner, prefill_graph_sizes
from tokenmill.runner.step_inputs import batch_step_arrays, one_chunk_arrays
from tokenmill.scheduler.output import ScheduledChunk

SIZES = (8, 16, 32)


@pytest.fixture(scope="module", params=["llama3", "gemma3"])
def tiny(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    """Llama 3, and Gemma 3 for its sliding-window layers."""
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    save_tiny_model(request.param, folder)
    return load_model(folder, dtype="float32")


def _with_prefill_graphs(engine: LLMEngine) -> list[int]:
    """Give the engine's runner prefill graphs (uncaptured on CPU); the chunk lengths they ran. Each
    chunk's inputs, built by the one-chunk builder, are checked against the batch builder's (at the
    graphs' table width and at the sequence's own, as eager one-sequence steps build them)."""
    runner = engine.runner
    assert runner.kv.layers is not None
    graphs = PrefillGraphRunner(
        runner.model, runner.backend, runner.kv.layers, runner.kv.manager, SIZES, engine.max_model_len
    )
    runs: list[int] = []
    run = graphs.run

    def counted(chunk: ScheduledChunk) -> torch.Tensor:
        runs.append(chunk.num_tokens)
        for width in (graphs.table_width, None):  # the graphs' fixed width, and eager steps' own
            fast = one_chunk_arrays(chunk, graphs.kv, width)
            general = batch_step_arrays([chunk], graphs.kv, table_width=width)
            assert fast.keys() == general.keys()
            for name, array in general.items():
                assert fast[name].dtype == array.dtype and fast[name].tolist() == array.tolist(), name
        return run(chunk)

    graphs.run = counted  # type: ignore[method-assign]
    runner.prefill_graphs = graphs
    return runs


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize(
    "options", [{}, {"prefix_caching": True}, {"chunked_prefill": True, "max_num_batched_tokens": 12}]
)
def test_prefills_through_the_padded_buffers_match_the_reference_loop(tiny, options: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    engine = engine_for(tiny, block_size=4, num_kv_blocks=96, max_model_len=64, max_num_seqs=1, **options)
    runs = _with_prefill_graphs(engine)
    shared = list(range(40, 57))  # a 17-token prefix: later prompts hit the cache past it
    prompts = {f"len{n}": list(range(5, 5 + n)) for n in (2, 7, 8, 15, 16, 31)}
    prompts |= {f"shared{i}": shared + list(range(90 + i, 95 + 2 * i)) for i in range(3)}
    for request_id, prompt in prompts.items():  # one at a time: each prefill is the step's only chunk
        output = run_to_completion(engine, {request_id: (prompt, _greedy(4))})[request_id].outputs[0]
        reference = greedy_generate(tiny.model, prompt, 4)
        assert output.token_ids == reference.token_ids, request_id
        first = reference.prompt_logits.log_softmax(-1)[output.token_ids[0]].item()
        assert output.logprobs is not None
        assert abs(output.logprobs[0][output.token_ids[0]].logprob - first) < 1e-4, request_id
    assert runs and max(runs) < SIZES[-1] and 31 not in runs  # 31 tokens need a 32+1 bucket: eager
    if options.get("prefix_caching"):
        assert any(n < 8 for n in runs[-2:])  # the last shared prompts prefilled only past the hit
    assert engine.kv_cache.manager.num_used_blocks == 0


def test_batches_and_prompt_logprobs_stay_eager(tiny) -> None:  # type: ignore[no-untyped-def]
    engine = engine_for(tiny, block_size=4, num_kv_blocks=96, max_model_len=64)
    runs = _with_prefill_graphs(engine)
    two = {f"r{i}": (list(range(3, 9 + i)), _greedy(2)) for i in range(2)}
    run_to_completion(engine, two)  # both prompts in one step
    asking = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    run_to_completion(engine, {"p": (list(range(3, 12)), asking)})
    assert runs == []


def test_buckets_follow_the_config() -> None:
    """Buckets up to the first that holds the longest chunk (the token budget or the context)."""
    config = EngineConfig().with_options(max_num_batched_tokens=100, chunked_prefill=True, max_num_seqs=8)
    cuda = torch.device("cuda")
    on = config.with_options(cuda_graphs=True)
    assert prefill_graph_sizes(on, cuda, 4096) == (16, 32, 64, 128)  # a chunk of 100 needs the 128
    assert prefill_graph_sizes(on, cuda, 40) == (16, 32, 64)
    assert prefill_graph_sizes(on.with_options(max_num_batched_tokens=8192), cuda, 192) == (
        16,
        32,
        64,
        128,
        256,
    )
    assert prefill_graph_sizes(on.with_options(max_num_batched_tokens=8192), cuda, 4096) == (
        16,
        32,
        64,
        128,
        256,
        512,
    )
    assert prefill_graph_sizes(on.with_options(cuda_graph_prefill=False), cuda, 4096) == ()
    assert prefill_graph_sizes(config.with_options(cuda_graphs=False), cuda, 4096) == ()
    assert prefill_graph_sizes(on, torch.device("cpu"), 4096) == ()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="capturing CUDA graphs needs a GPU")
def test_captured_prefill_graphs_match_the_reference_loop(tiny_llama_folder) -> None:  # type: ignore[no-untyped-def]
    loaded = load_model(tiny_llama_folder, device="cuda", dtype="float32")
    engine = engine_for(
        loaded, device="cuda", attention_backend="triton", cuda_graphs=True, block_size=4,
        num_kv_blocks=96, max_model_len=40, max_num_seqs=1,
    )  # fmt: skip
    graphs = engine.runner.prefill_graphs
    assert graphs is not None and sorted(graphs.graphs) == [16, 32, 64]  # the 64 bucket is past the context
    for n in (2, 9, 17, 33):
        prompt = list(range(5, 5 + n))
        output = run_to_completion(engine, {f"r{n}": (prompt, _greedy(3))})[f"r{n}"].outputs[0]
        assert output.token_ids == greedy_generate(loaded.model, prompt, 3).token_ids, n


def test_batch_one_verification_steps_run_through_the_prefill_graph_buffers(tiny) -> None:  # type: ignore[no-untyped-def]
    """Speculative decoding at batch 1: a step of the last token and its guesses is one sequence's chunk
    of 1 + k tokens, which the prefill graph runs; its 1 + k last rows are verified."""
    engine = engine_for(
        tiny,
        block_size=4,
        num_kv_blocks=96,
        max_model_len=64,
        max_num_seqs=1,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    )
    runs = _with_prefill_graphs(engine)
    prompt = [5, 6, 7, 8] * 4
    outputs = run_to_completion(engine, {"r": (prompt, _greedy(20))})
    assert outputs["r"].outputs[0].token_ids == greedy_generate(tiny.model, prompt, 20).token_ids
    spec = engine.scheduler_stats().spec_decode
    assert spec.num_proposed > 0 and spec.num_steps > 0
    assert sum(1 for length in runs if length <= 4) >= spec.num_steps  # the verification chunks
