"""Issue 19, the offline API in vLLM's shape: ``CompletionOutput.logprobs`` and
``RequestOutput.prompt_logprobs`` are ``list[dict[int, Logprob] | None]``, so vLLM code such as
``lp[token_id].logprob`` runs unchanged. Values are checked against log-softmax of the reference model's
logits (``tokenmill.reference``'s plain loop), ranks against counting the tokens more likely."""

import math

import pytest
import torch

from engine_helpers import in_thread, llm_for
from tokenmill import Logprob, SamplingParams
from tokenmill.llm import LLM
from tokenmill.outputs import RequestOutput
from tokenmill.reference import greedy_generate

PROMPT = "The quick brown fox"
NUM_TOP = 3
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def llm(smollm2) -> LLM:  # type: ignore[no-untyped-def]
    return llm_for(smollm2, max_model_len=128)


@pytest.fixture(scope="module")
def output(llm: LLM) -> RequestOutput:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=NUM_TOP, prompt_logprobs=NUM_TOP)
    return in_thread(lambda: llm.generate(PROMPT, params))[0]


def _reference(smollm2, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Log-softmax of the next-token logits after ``ids``."""
    return torch.log_softmax(in_thread(lambda: greedy_generate(smollm2.model, ids, 1).prompt_logits), -1)


def _check_position(position: dict[int, Logprob], token: int, reference: torch.Tensor, text_of) -> None:  # type: ignore[no-untyped-def]
    assert isinstance(position, dict) and all(isinstance(key, int) for key in position)
    assert all(isinstance(entry, Logprob) for entry in position.values())
    assert next(iter(position)) == token  # the chosen token first, as vLLM orders them
    assert abs(position[token].logprob - float(reference[token])) < 1e-3
    assert position[token].rank == 1 + int((reference > reference[token]).sum())
    top = reference.topk(NUM_TOP).indices.tolist()
    assert set(position) == {token, *top}
    assert [position[t].rank for t in top] == list(range(1, NUM_TOP + 1))
    for token_id, entry in position.items():
        assert abs(entry.logprob - float(reference[token_id])) < 1e-3
        assert entry.decoded_token == text_of(token_id)


def test_output_logprobs_are_dicts_of_logprob_by_token_id(smollm2, llm: LLM, output: RequestOutput) -> None:  # type: ignore[no-untyped-def]
    tokenizer = llm.get_tokenizer()
    completion = output.outputs[0]
    assert (
        completion.logprobs is not None
        and len(completion.logprobs) == len(completion.token_ids) == MAX_TOKENS
    )
    context = list(output.prompt_token_ids)
    for position, token in zip(completion.logprobs, completion.token_ids, strict=True):
        _check_position(position, token, _reference(smollm2, context), lambda t: tokenizer.decode([t], False))
        context.append(token)
    # vLLM-style code runs unchanged, and the shortcuts agree with it.
    sampled = [
        lp[token_id].logprob for lp, token_id in zip(completion.logprobs, completion.token_ids, strict=True)
    ]
    assert completion.sampled_logprobs is not None
    assert [entry.logprob for entry in completion.sampled_logprobs] == sampled
    assert completion.cumulative_logprob is not None and math.isclose(
        completion.cumulative_logprob, sum(sampled)
    )


def test_prompt_logprobs_are_dicts_after_a_first_none(smollm2, llm: LLM, output: RequestOutput) -> None:  # type: ignore[no-untyped-def]
    tokenizer = llm.get_tokenizer()
    ids = output.prompt_token_ids
    assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == len(ids)
    assert output.prompt_logprobs[0] is None
    for index in range(1, len(ids)):
        position = output.prompt_logprobs[index]
        assert position is not None
        _check_position(
            position, ids[index], _reference(smollm2, ids[:index]), lambda t: tokenizer.decode([t], False)
        )


def test_without_logprobs_the_fields_stay_none(llm: LLM) -> None:
    out = in_thread(lambda: llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2)))[0]
    assert out.prompt_logprobs is None and out.outputs[0].logprobs is None
    assert out.outputs[0].cumulative_logprob is None and out.outputs[0].sampled_logprobs is None
