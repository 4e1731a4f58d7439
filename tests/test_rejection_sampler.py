"""The rejection sampler against a naive reference, prompt lookup against a naive search, and sampled
speculative outputs against the model's exact distribution (chi-square, many seeds, a tiny vocabulary)."""

import itertools
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, LlamaConfig

from engine_helpers import in_thread
from tokenmill import SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.loading import load_model
from tokenmill.sequence import Sequence as Seq
from tokenmill.speculative.guessing import GuessingRounds
from tokenmill.speculative.ngram import NgramProposer, lookup
from tokenmill.speculative.rejection import Distributions, RowNoise, accepted_prefixes, verify

P_VALUE = 1e-3  # each test draws fresh samples; a correct sampler fails one of them one time in a thousand


def naive_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # most recent earlier occurrence first
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_prompt_lookup_matches_a_naive_search() -> None:
    rng = random.Random(0)
    for _ in range(500):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 5)
        assert lookup(tokens, min_n, max_n, k) == naive_lookup(tokens, min_n, max_n, k), tokens


def exact_outcomes(p: np.ndarray, q: np.ndarray | None, drafts: list[int]) -> dict[tuple[int, ...], float]:
    """Naive reference: the probability of each emitted token list, for fixed draft tokens. Position i
    accepts ``d_i`` with min(1, p_i(d)/q_i(d)); the first rejection emits from max(0, p_i - q_i)
    normalised; all accepted, a bonus token from p_k."""
    outcomes: dict[tuple[int, ...], float] = {}
    reach = 1.0
    for i, d in enumerate(drafts):
        qi = np.eye(p.shape[1])[d] if q is None else q[i]
        accept = min(1.0, p[i, d] / qi[d])
        residual = np.maximum(p[i] - qi, 0)
        residual = residual / residual.sum() if residual.sum() > 0 else p[i]
        for token in range(p.shape[1]):
            if residual[token] > 0 and accept < 1:
                outcomes[(*drafts[:i], token)] = reach * (1 - accept) * residual[token]
        reach *= accept
    for token in range(p.shape[1]):
        if p[-1, token] > 0:
            outcomes[(*drafts, token)] = reach * p[-1, token]
    return outcomes


def run_verify(p: np.ndarray, q: np.ndarray | None, drafts: list[int], copies: int) -> list[tuple[int, ...]]:
    """``copies`` sequences with the same rows, through the batched sampler."""
    rows = len(drafts) + 1
    probs = torch.tensor(np.tile(p, (copies, 1)), dtype=torch.float32)
    target = Distributions(torch.log(probs), probs, torch.zeros(len(probs), dtype=torch.bool))
    draft_ids = torch.tensor([*drafts, -1] * copies)
    draft_probs = None
    if q is not None:
        q_rows = np.concatenate([q, np.zeros((1, p.shape[1]))])
        draft_probs = torch.tensor(np.tile(q_rows, (copies, 1)), dtype=torch.float32)
    accept, tokens = verify(target, draft_ids, draft_probs, RowNoise([]))
    return [tuple(out) for out in accepted_prefixes(accept, tokens, [rows] * copies)]


def assert_fits(observed: list[tuple[int, ...]], expected: dict[tuple[int, ...], float]) -> None:
    """Chi-square of observed outcome counts against expected probabilities (cells pooled below 5)."""
    assert set(observed) <= set(expected), set(observed) - set(expected)
    keys = sorted(expected)
    counts = np.array([observed.count(key) for key in keys], dtype=float)
    want = np.array([expected[key] for key in keys]) * len(observed)
    small = want < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        want = np.append(want[~small], want[small].sum())
    assert chisquare(counts, want * counts.sum() / want.sum()).pvalue > P_VALUE


@pytest.mark.parametrize("drafted", ["one-hot", "draft-distribution"])
def test_rejection_sampler_matches_the_naive_reference(drafted: str) -> None:
    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    vocab, k = 5, 3
    p = rng.dirichlet(np.ones(vocab), size=k + 1)
    q = rng.dirichlet(np.ones(vocab), size=k) if drafted == "draft-distribution" else None
    drafts = [int(np.argmax(p[0])), 1, 3]
    assert_fits(run_verify(p, q, drafts, 20000), exact_outcomes(p, q, drafts))


def test_greedy_rows_keep_the_longest_matching_prefix_and_the_models_token() -> None:
    logits = torch.tensor([[0.0, 3, 1], [2, 0, 1], [0, 0, 5], [1, 0, 0]])
    target = Distributions(logits, None, None)
    accept, tokens = verify(target, torch.tensor([1, 0, 1, -1]), None, RowNoise([]))
    assert accepted_prefixes(accept, tokens, [4]) == [[1, 0, 2]]  # the third guess is wrong: 2 instead
    accept, tokens = verify(target, torch.tensor([1, 0, 2, -1]), None, RowNoise([]))
    assert accepted_prefixes(accept, tokens, [4]) == [[1, 0, 2, 0]]  # all right: the bonus token too


@pytest.mark.parametrize("drafted", ["one-hot", "draft-distribution"])
def test_the_first_emitted_token_is_distributed_as_the_model_whatever_the_drafts(drafted: str) -> None:
    """Drafts drawn from q: the first emitted token is drawn from p exactly (Leviathan et al., thm 1)."""
    torch.manual_seed(1)
    rng = np.random.default_rng(2)
    vocab, copies = 6, 20000
    p = rng.dirichlet(np.ones(vocab) * 0.7, size=2)
    q = rng.dirichlet(np.ones(vocab) * 0.7, size=1)
    firsts = []
    for draft in range(vocab):
        share = round(copies * q[0, draft])
        if share:
            outcomes = run_verify(p, q if drafted == "draft-distribution" else None, [draft], share)
            firsts += [(out[0],) for out in outcomes]
    assert_fits(firsts, {(token,): p[0, token] for token in range(vocab)})


# -- sampled outputs of the engine against the model's exact distribution ------------------------------

VOCAB = 8
PROMPT = [3, 4, 5, 3, 4, 5, 3, 4]
MAX_TOKENS = 3


def tiny_vocab_model(folder: Path, seed: int) -> AutoModelForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(4.0)  # sharper distributions than the init's near-uniform ones
    model.save_pretrained(folder)
    return model


def exact_joint(model: AutoModelForCausalLM, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(first MAX_TOKENS outputs) from transformers' logits, with the request's repetition penalty
    (HF: over prompt and output tokens) and temperature."""
    next_token: dict[tuple[int, ...], list[float]] = {}  # output prefix -> next-token distribution
    for length in range(MAX_TOKENS):
        for prefix in itertools.product(range(VOCAB), repeat=length):
            context = PROMPT + list(prefix)
            with torch.no_grad():
                logits = model(torch.tensor([context])).logits[0, -1].double()
            seen = torch.tensor(sorted(set(context)))
            penalised = logits[seen]
            penalty = params.repetition_penalty
            logits[seen] = torch.where(penalised > 0, penalised / penalty, penalised * penalty)
            next_token[prefix] = torch.softmax(logits / params.temperature, dim=-1).tolist()
    joint: dict[tuple[int, ...], float] = {}
    for outputs in itertools.product(range(VOCAB), repeat=MAX_TOKENS):
        joint[outputs] = float(np.prod([next_token[outputs[:i]][outputs[i]] for i in range(MAX_TOKENS)]))
    return joint


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_sampled_speculative_outputs_follow_the_models_distribution(proposer: str, tmp_path: Path) -> None:
    model = tiny_vocab_model(tmp_path / "target", seed=0)
    tiny_vocab_model(tmp_path / "draft", seed=1)
    params = SamplingParams(
        n=3000, temperature=0.9, repetition_penalty=1.2, max_tokens=MAX_TOKENS, ignore_eos=True, seed=0
    )
    spec: dict[str, object] = {"method": proposer, "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    if proposer == "draft_model":
        spec = {"method": proposer, "model": str(tmp_path / "draft"), "num_speculative_tokens": 2}
    config = EngineConfig(model=str(tmp_path / "target"), device="cpu").with_options(
        speculative_config={**spec, "disable_by_batch_size": 1000},
        cpu_kv_cache_gib=0.05,
        max_num_seqs=256,
        max_model_len=64,
    )
    engine = LLMEngine(config, loaded=load_model(tmp_path / "target", dtype="float32"))
    engine.add_request("r", PROMPT, params)
    outputs: dict[int, list[int]] = {}

    def run() -> None:
        while engine.has_unfinished_requests():
            for delta in engine.step():
                outputs.setdefault(delta.index, []).extend(delta.new_token_ids)

    in_thread(run)
    spec_counts = engine.scheduler_stats().spec_decode
    assert 0 < spec_counts.num_accepted < spec_counts.num_proposed  # both branches of the sampler ran
    joint = exact_joint(model, params)
    samples = [tuple(tokens) for tokens in outputs.values()]
    assert_fits(samples, joint)
    for position in range(MAX_TOKENS):
        marginal: dict[tuple[int, ...], float] = {}
        for outcome, probability in joint.items():
            marginal[(outcome[position],)] = marginal.get((outcome[position],), 0.0) + probability
        assert_fits([(sample[position],) for sample in samples], marginal)


def _decoding(seq_id: str, prompt: list[int], output: list[int]) -> Seq:
    """A sequence whose prompt and output but its last token are computed (its next step is a decode)."""
    seq = Seq(seq_id, prompt, SamplingParams(temperature=0, max_tokens=64), 64)
    for token in output:
        seq.append_token(token)
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


def test_guesses_wait_for_a_step_started_ahead_for_exactly_the_running_sequences() -> None:
    """``GuessingRounds``: guesses are kept when no decode step is started ahead, or when the started one is
    not for exactly the running sequences; they are dropped and deferred when it is (and no step is then
    started ahead); a step without guesses allows one. The kept guesses are prompt lookup's."""
    copying = _decoding("a", [1, 2, 3, 4, 5, 6, 1, 2], [3])  # "2 3" occurred before: guess 4, 5, 6, ...
    novel = _decoding("b", [7, 8, 9], [10])  # nothing to look up
    proposer = NgramProposer(3, 2, 4)
    rounds = GuessingRounds(max_model_len=64, disable_by_batch_size=None)
    for started in (None, [copying], [novel, copying, _decoding("c", [7, 8], [9])]):
        rounds.propose(proposer, [copying, novel], started)
        assert copying.draft_token_ids == lookup(copying.token_ids, 2, 4, 3) == [4, 5, 6]
        assert novel.draft_token_ids == [] and rounds.num_guessing == 1 and not rounds.deferred
        assert not rounds.allows_start_ahead(2)
    rounds.propose(proposer, [copying, novel], [novel, copying])
    assert rounds.deferred and rounds.num_guessing == 0 and copying.draft_token_ids == []
    assert not rounds.allows_start_ahead(2)
    rounds.propose(proposer, [novel], [novel])
    assert not rounds.deferred and rounds.num_guessing == 0 and rounds.allows_start_ahead(1)
    at_cutoff = GuessingRounds(max_model_len=64, disable_by_batch_size=2)
    at_cutoff.propose(proposer, [copying, novel], None)  # no step speculates at 2 sequences
    assert at_cutoff.num_guessing == 0 and at_cutoff.allows_start_ahead(2)
