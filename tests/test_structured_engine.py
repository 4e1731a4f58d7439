"""Structured outputs through the engine's features, on the real SmolLM2 under both backends: continuous
batching with unconstrained neighbours (left exactly as they were), chunked prefill with prefix caching
and preemption (the same tokens as a plain run), n > 1, logprobs of the constrained distribution (against
the model's own logits, renormalised over the tokens a reference allows), termination by the grammar,
decode graphs with logits and argmax in them and overlapped steps (constrained rows never take the graph's
argmax), and no structured-output work at all in a batch without a grammar."""

import math
import re
from functools import partial
from typing import Any

import pytest
import torch

from engine_helpers import engine_for, in_thread, run_to_completion
from tokenmill import SamplingParams, StructuredOutputsParams
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.outputs import RequestOutput
from tokenmill.reference import greedy_generate
from tokenmill.runner.cuda_graphs import DecodeGraphRunner
from tokenmill.runner.sampler import SamplingBatch

BACKENDS = ("llguidance", "xgrammar")
PHONE = r"[0-9]{3}-[0-9]{4}"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def chat_ids(smollm2, text: str) -> list[int]:
    return list(smollm2.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True))


def greedy(max_tokens: int = 24, **constraint: Any) -> SamplingParams:
    structured = StructuredOutputsParams(**constraint) if constraint else None
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=structured)


def workload(smollm2) -> dict[str, tuple[list[int], SamplingParams]]:
    """Constrained and unconstrained greedy requests; the first two share a long chat prefix."""
    shared = "You are a careful assistant who answers briefly and exactly as asked. "
    return {
        "person": (chat_ids(smollm2, shared + "Give a person as JSON."), greedy(40, json=PERSON)),
        "phone": (chat_ids(smollm2, shared + "Give a phone number."), greedy(regex=PHONE)),
        "free": (chat_ids(smollm2, "Name a fruit."), greedy(12)),
        "choice": (chat_ids(smollm2, "Is water wet?"), greedy(choice=["yes", "no"])),
        "free2": (smollm2.tokenizer.encode("The capital of France is"), greedy(12)),
    }


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, RequestOutput]:
    return in_thread(partial(run_to_completion, engine, requests))


def texts(outputs: dict[str, RequestOutput]) -> dict[str, list[int]]:
    return {rid: out.outputs[0].token_ids for rid, out in outputs.items()}


@pytest.fixture(scope="module")
def plain(smollm2, backend: str) -> dict[str, list[int]]:
    """The workload on the plain engine, masks filled in each step: the reference the feature runs
    (masks filled ahead by default) must reproduce."""
    engine = engine_for(
        smollm2, max_model_len=256, structured_output_backend=backend, structured_masks_ahead=False
    )
    outputs = run(engine, workload(smollm2))
    assert re.fullmatch(PHONE, outputs["phone"].outputs[0].text)
    assert outputs["choice"].outputs[0].text in ("yes", "no")
    return texts(outputs)


def test_masks_filled_ahead_give_the_same_tokens(smollm2, backend: str, plain) -> None:
    engine = engine_for(smollm2, max_model_len=256, structured_output_backend=backend)
    assert texts(run(engine, workload(smollm2))) == plain
    assert engine.structured_outputs.rows_from_ahead > 0


def test_unconstrained_neighbours_are_left_exactly_as_they_were(smollm2, backend: str, plain) -> None:
    engine = engine_for(smollm2, max_model_len=256, structured_output_backend=backend)
    requests = workload(smollm2)
    alone = texts(run(engine, {rid: requests[rid] for rid in ("free", "free2")}))
    assert alone == {rid: plain[rid] for rid in ("free", "free2")}


def test_chunked_prefill_prefix_caching_and_preemption_keep_the_tokens(smollm2, backend: str, plain) -> None:
    engine = engine_for(
        smollm2, max_model_len=256, structured_output_backend=backend, chunked_prefill=True,
        prefill_chunk_size=16, prefix_caching=True, block_size=8, num_kv_blocks=16, debug_checks=True,
    )  # fmt: skip
    assert texts(run(engine, workload(smollm2))) == plain
    again = {f"{rid}-again": request for rid, request in workload(smollm2).items()}  # prompts now cached
    assert texts(run(engine, again)) == {f"{rid}-again": tokens for rid, tokens in plain.items()}
    stats = engine.scheduler_stats()
    assert stats.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    assert stats.prefix_cache_hits > 0


def test_graph_logits_and_overlapped_steps_keep_the_mask(smollm2, backend: str, plain) -> None:
    """Decode steps through static graph buffers (run eagerly on CPU) that compute the logits and their
    argmax, with the next step started before each is read: the constrained rows' tokens still come from
    masked logits, and every row's tokens are the plain run's."""
    engine = engine_for(smollm2, max_model_len=256, structured_output_backend=backend)
    kv, runner = engine.kv_cache, engine.runner
    assert kv.layers is not None
    graphs = DecodeGraphRunner(
        runner.model, runner.backend, kv.layers, kv.manager, (1, 2, 4, 8), 256, True, runner.sampler.argmax
    )
    runner.decode_graphs, runner.overlap = graphs, True
    argmax_rows: list[int] = []
    graphs.argmax = lambda logits: (argmax_rows.append(len(logits)), logits.argmax(dim=-1))[1]
    assert texts(run(engine, workload(smollm2))) == plain
    assert argmax_rows and graphs.num_reused > 0


def test_n_sequences_each_follow_the_grammar(smollm2, backend: str) -> None:
    engine = engine_for(smollm2, max_model_len=256, structured_output_backend=backend)
    params = SamplingParams(
        n=6, temperature=1.0, seed=7, max_tokens=16, structured_outputs=StructuredOutputsParams(regex=PHONE)
    )
    output = run(engine, {"n": (chat_ids(smollm2, "Give a phone number."), params)})["n"]
    found = [completion.text for completion in output.outputs]
    assert all(re.fullmatch(PHONE, text) for text in found), found
    assert len(set(found)) > 1


def test_logprobs_are_those_of_the_constrained_distribution(smollm2, backend: str) -> None:
    """The first token of ``yes`` / ``no``: its logprobs are the model's logits renormalised over the
    tokens whose text starts one of the choices (found from the vocabulary, not from the backend)."""
    tokenizer = smollm2.tokenizer
    prompt = chat_ids(smollm2, "Is water wet? Answer yes or no.")
    token_texts = [tokenizer.decode([token]) for token in range(tokenizer.vocab_size)]
    allowed = [
        t for t, text in enumerate(token_texts) if text and ("yes".startswith(text) or "no".startswith(text))
    ]
    logits = greedy_generate(smollm2.model, prompt, 1).prompt_logits
    expected = dict(zip(allowed, torch.log_softmax(logits[allowed], dim=0).tolist(), strict=True))
    engine = engine_for(smollm2, max_model_len=256, structured_output_backend=backend)
    params = SamplingParams(
        temperature=0,
        max_tokens=4,
        logprobs=8,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    output = run(engine, {"lp": (prompt, params)})["lp"].outputs[0]
    first = output.logprobs[0]  # type: ignore[index]
    assert len(first) == min(8, len(allowed))  # no token the grammar forbids is an alternative
    for token, entry in first.items():
        assert math.isclose(entry.logprob, expected[token], abs_tol=1e-4), (token, entry, expected[token])
    assert math.isclose(sum(math.exp(entry.logprob) for entry in first.values()), 1.0, abs_tol=1e-4)
    sampled = output.token_ids[0]
    assert sampled == max(expected, key=lambda t: expected[t]) and first[sampled].rank == 1


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_sequence_ends_where_its_grammar_does(smollm2, backend: str, ignore_eos: bool) -> None:
    engine = engine_for(smollm2, max_model_len=256, structured_output_backend=backend)
    constraint = StructuredOutputsParams(choice=["yes", "no"])
    params = SamplingParams(
        temperature=0, max_tokens=50, ignore_eos=ignore_eos, structured_outputs=constraint
    )
    output = run(engine, {"end": (chat_ids(smollm2, "Is water wet?"), params)})["end"].outputs[0]
    assert output.finish_reason == "stop" and output.text in ("yes", "no")
    assert not set(output.token_ids) & set(engine.eos_token_ids)  # ended by the grammar, no EOS sampled
    assert engine.kv_cache.manager.num_used_blocks == 0


def test_min_tokens_cannot_push_a_grammar_past_its_end(smollm2, backend: str) -> None:
    engine = engine_for(smollm2, max_model_len=256, structured_output_backend=backend)
    constraint = StructuredOutputsParams(choice=["yes", "no"])
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=10, structured_outputs=constraint)
    output = run(engine, {"min": (chat_ids(smollm2, "Is water wet?"), params)})["min"].outputs[0]
    assert output.finish_reason == "stop" and output.text in ("yes", "no") and len(output.token_ids) <= 3
    # nothing outside the grammar was drawn where min_tokens banned the only token it allowed (EOS)
    assert output.token_ids == engine.tokenizer.encode(output.text, add_special_tokens=False)


def test_a_stop_string_on_the_grammars_last_token_is_reported(smollm2, backend: str) -> None:  # type: ignore[no-untyped-def]
    """The token that completes the grammar also completes a stop string: the text is cut there and the
    stop string named, as when it ends an unconstrained output (it used to be cut but not named)."""
    engine = engine_for(smollm2, max_model_len=256, structured_output_backend=backend)
    constraint = StructuredOutputsParams(choice=["yes"])
    params = SamplingParams(temperature=0, max_tokens=20, stop=["s"], structured_outputs=constraint)
    output = run(engine, {"s": (chat_ids(smollm2, "Is water wet?"), params)})["s"].outputs[0]
    assert (output.text, output.finish_reason, output.stop_reason) == ("ye", "stop", "s")


def test_a_batch_without_grammars_runs_no_structured_output_code(
    smollm2, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engine_for(smollm2, max_model_len=256)
    batches: list[SamplingBatch] = []
    build = SamplingBatch.build

    def recording_build(*args: Any, **kwargs: Any) -> SamplingBatch:
        batches.append(build(*args, **kwargs))
        return batches[-1]

    monkeypatch.setattr(SamplingBatch, "build", recording_build)
    requests = {rid: request for rid, request in workload(smollm2).items() if rid.startswith("free")}
    run(engine, requests)
    assert batches and all(batch.token_bitmask is None for batch in batches)
    assert engine.structured_outputs._backend is None  # never built
    batches.clear()
    run(engine, {"phone": workload(smollm2)["phone"]})
    assert batches and all(batch.token_bitmask is not None for batch in batches)
