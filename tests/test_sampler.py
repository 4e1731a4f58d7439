"""Sampler and SamplingParams against naive float64 references written here, independent of the sampler."""

import dataclasses
import math
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from tokenmill.runner.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    SamplingRow,
    apply_penalties,
    apply_top_k_top_p_min_p,
    compute_prompt_logprobs,
    filters,
    top_k_values,
)
from tokenmill.runner.sampler.filters import filter_sorted
from tokenmill.runner.sampler.inverse_cdf import inverse_cdf_draw
from tokenmill.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# Small vocabulary, deliberately unsorted so that filters must find the order themselves.
SMALL_LOGITS = [0.3, 2.0, -1.2, 1.0, -3.0, 1.5, 0.0, -0.6]
NUM_DRAWS = 40_000
Z_LIMIT = 5.0  # per-token deviation allowed, in binomial standard deviations
CHI2_Z = 4.75  # one-sided normal quantile (~1e-6) for the chi-square critical value


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


def _with(params: SamplingParams, **changes: Any) -> SamplingParams:
    return dataclasses.replace(params, **changes)


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow], fused: bool = False) -> SamplerOutput:
    batch = SamplingBatch.build(rows, logits.shape[1], logits.device)
    return Sampler(fused=fused)(logits, batch)


def triton_runs_on(device: torch.device) -> bool:
    from tokenmill.kernels import triton_available

    return triton_available(device)


@pytest.fixture
def fused_device(device: torch.device) -> torch.device:
    """The device, for tests of the Triton draw (compiled on CUDA, interpreted on CPU)."""
    if not triton_runs_on(device):
        pytest.skip(f"Triton kernels cannot run on {device} here")
    return device


# ---- naive references -------------------------------------------------------------------------------------


def reference_probs(
    logits: Sequence[float], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> list[float]:
    """The target distribution, token by token in float64: temperature, top-k, top-p, then min-p."""
    scaled = [value / temperature for value in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    kept = order[:top_k] if top_k > 0 else order
    probs = _softmax_over(scaled, kept)
    if top_p < 1.0:
        mass, nucleus = 0.0, []
        for token in kept:
            if mass >= top_p:
                break
            nucleus.append(token)
            mass += probs[token]
        kept = nucleus
        probs = _softmax_over(scaled, kept)
    if min_p > 0.0:
        largest = max(probs)
        kept = [token for token in kept if probs[token] >= min_p * largest]
        probs = _softmax_over(scaled, kept)
    return probs


def _softmax_over(logits: Sequence[float], kept: Sequence[int]) -> list[float]:
    top = max(logits[i] for i in kept)
    weights = [math.exp(logits[i] - top) if i in kept else 0.0 for i in range(len(logits))]
    total = sum(weights)
    return [w / total for w in weights]


def reference_penalised(
    logits: Sequence[float],
    params: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
    banned: Sequence[int],
) -> list[float]:
    values = [float(v) for v in logits]
    for token, bias in (params.logit_bias or {}).items():
        values[token] += bias
    for token in banned:
        values[token] = -math.inf
    if params.allowed_token_ids is not None:
        values = [v if t in params.allowed_token_ids else -math.inf for t, v in enumerate(values)]
    for token in set(prompt) | set(output):
        penalty = params.repetition_penalty
        values[token] = values[token] / penalty if values[token] > 0 else values[token] * penalty
    for token in set(output):
        count = output.count(token)
        values[token] -= params.frequency_penalty * count + params.presence_penalty
    return values


def assert_matches_distribution(tokens: torch.Tensor, probs: Sequence[float]) -> None:
    counts = torch.bincount(tokens.cpu(), minlength=len(probs)).tolist()
    total = sum(counts)
    chi2, support = 0.0, 0
    for token, (count, p) in enumerate(zip(counts, probs, strict=True)):
        if p == 0.0:
            assert count == 0, f"token {token} is filtered out yet was drawn {count} times"
            continue
        expected = total * p
        std = math.sqrt(total * p * (1 - p)) or 1.0
        assert abs(count - expected) <= Z_LIMIT * std + 1, (
            f"token {token}: {count} draws, expected {expected:.0f}"
        )
        chi2 += (count - expected) ** 2 / expected
        support += 1
    df = support - 1
    if df > 0:  # Wilson-Hilferty approximation of the chi-square quantile
        critical = df * (1 - 2 / (9 * df) + CHI2_Z * math.sqrt(2 / (9 * df))) ** 3
        assert chi2 < critical, f"chi-square {chi2:.1f} over {critical:.1f} with {df} degrees of freedom"


# ---- distributions ----------------------------------------------------------------------------------------

FILTER_CASES: list[dict[str, Any]] = [
    {"temperature": 1.0},
    {"temperature": 0.5},
    {"temperature": 2.5},
    {"top_k": 3},
    {"top_k": 1},
    {"top_k": -1},
    {"top_k": 100},
    {"top_p": 0.8},
    {"top_p": 0.3},
    {"min_p": 0.1},
    {"min_p": 0.2},  # token 0.3 sits just under the threshold (ratio 0.18)
    {"min_p": 0.3, "temperature": 1.7},
    {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.05},
    {"temperature": 1.3, "top_k": 4, "top_p": 0.6},
    {"temperature": 2.0, "top_p": 0.95, "min_p": 0.08},
]


@pytest.mark.parametrize("case", FILTER_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_sampled_frequencies_match_target_distribution(case: dict[str, Any], device: torch.device) -> None:
    torch.manual_seed(1234)
    logits = torch.tensor([SMALL_LOGITS], device=device).expand(NUM_DRAWS, -1)
    rows = [SamplingRow(SamplingParams(**case))] * NUM_DRAWS
    reference_kwargs = {**case, "top_k": max(case.get("top_k", 0), 0)}
    assert_matches_distribution(
        sample(logits, rows).token_ids, reference_probs(SMALL_LOGITS, **reference_kwargs)
    )


def test_rows_with_different_filters_in_one_batch(device: torch.device) -> None:
    """Per-row parameters must not leak between rows: two filter settings interleaved in one call."""
    torch.manual_seed(99)
    a: dict[str, Any] = {"temperature": 0.8, "top_k": 3}
    b: dict[str, Any] = {"temperature": 1.5, "top_p": 0.7, "min_p": 0.02}
    row_a, row_b = SamplingRow(SamplingParams(**a)), SamplingRow(SamplingParams(**b))
    rows = [row_a if i % 2 else row_b for i in range(NUM_DRAWS)]
    logits = torch.tensor([SMALL_LOGITS], device=device).expand(NUM_DRAWS, -1)
    tokens = sample(logits, rows).token_ids
    assert_matches_distribution(tokens[1::2], reference_probs(SMALL_LOGITS, **a))
    assert_matches_distribution(tokens[0::2], reference_probs(SMALL_LOGITS, **b))


def test_seeded_rows_follow_the_target_distribution(device: torch.device) -> None:
    """One draw from each of many seeds: the seed-to-noise mapping must not bias the samples."""
    case: dict[str, Any] = {"temperature": 0.9, "top_p": 0.9}
    rows = [SamplingRow(SamplingParams(seed=seed, **case)) for seed in range(5000)]
    logits = torch.tensor([SMALL_LOGITS], device=device).expand(len(rows), -1)
    assert_matches_distribution(sample(logits, rows).token_ids, reference_probs(SMALL_LOGITS, **case))


# ---- the inverse-CDF draw ---------------------------------------------------------------------------------


def _naive_inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> list[int]:
    """Per row: the first token whose float64 running sum exceeds ``u`` times the row's total."""
    picked = []
    for row, u in zip(weights.double().tolist(), uniforms.tolist(), strict=True):
        total, target, running = math.fsum(row), u * math.fsum(row), 0.0
        assert total > 0
        for token, weight in enumerate(row):
            running += weight
            if running > target and weight > 0:
                picked.append(token)
                break
    return picked


@pytest.mark.parametrize("vocab", [7, 1024, 2500, 5000])
def test_inverse_cdf_draw_matches_a_naive_running_sum(vocab: int, device: torch.device) -> None:
    """Rows over one or several chunks (a padded last chunk included), with runs of zero weights and
    whole chunks of zeros, against a token-by-token float64 running sum."""
    generator = torch.Generator().manual_seed(vocab)
    weights = torch.rand(64, vocab, generator=generator) ** 6
    weights[:, torch.rand(vocab, generator=generator) < 0.3] = 0.0
    weights[::4, : vocab // 2] = 0.0  # the first half empty (whole chunks at the larger vocabularies)
    weights[1::4, vocab // 2 :] = 0.0
    weights[:, -1] += 1e-3  # every row keeps some weight
    uniforms = torch.rand(64, dtype=torch.float64, generator=generator)
    drawn = inverse_cdf_draw(weights.to(device), uniforms.to(device))
    assert drawn.tolist() == _naive_inverse_cdf(weights, uniforms)


def test_inverse_cdf_draw_never_picks_a_zero_weight() -> None:
    """At the ends of [0, 1) and with zeros at both ends of the row and across a chunk boundary."""
    weights = torch.zeros(3, 3000)
    weights[0, 5] = weights[0, 2047] = 1.0
    weights[1, 1023] = 1e-30
    weights[2, 1024:2048] = 0.5
    for u in (0.0, 1e-300, 0.5, 1.0 - 2.0**-53):
        drawn = inverse_cdf_draw(weights, torch.full((3,), u, dtype=torch.float64))
        assert all(weights[row, token] > 0 for row, token in enumerate(drawn.tolist())), (u, drawn)


def test_inverse_cdf_frequencies_over_several_chunks(device: torch.device) -> None:
    """Chi-square of many draws from one 3,000-token distribution (three chunks, the last padded)."""
    generator = torch.Generator().manual_seed(7)
    weights = torch.rand(3000, generator=generator) ** 8
    weights[::3] = 0.0
    big = weights.clone()
    big[:40] *= 400.0  # a few tokens hold most of the mass, the tail still counts
    probs = big / big.sum()
    uniforms = torch.rand(NUM_DRAWS, dtype=torch.float64, device=device)
    tokens = inverse_cdf_draw(big.expand(NUM_DRAWS, -1).to(device), uniforms)
    counts = torch.bincount(tokens.cpu(), minlength=3000).double()
    assert counts[probs == 0].sum() == 0
    expected = probs.double() * NUM_DRAWS
    frequent = expected >= 5  # chi-square's usual validity rule; the rest pooled into one bin
    observed = torch.cat([counts[frequent], counts[~frequent].sum().view(1)])
    wanted = torch.cat([expected[frequent], expected[~frequent].sum().view(1)])
    chi2 = ((observed - wanted) ** 2 / wanted).sum().item()
    dof = len(observed) - 1
    assert chi2 < dof + CHI2_Z * math.sqrt(2 * dof), (chi2, dof)


# ---- greedy -----------------------------------------------------------------------------------------------


def test_greedy_is_argmax(device: torch.device) -> None:
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(0)).to(device)
    out = sample(logits, [SamplingRow(SamplingParams(temperature=0.0, top_k=5, top_p=0.5))] * 16)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def test_greedy_only_batch_builds_no_device_tensors(device: torch.device) -> None:
    """All-greedy rows without edits: nothing is copied to the device and the draw is one argmax."""
    rows = [SamplingRow(SamplingParams(temperature=0.0, top_p=0.5, seed=3), [1, 2], [3])] * 4
    batch = SamplingBatch.build(rows, 300, device)
    assert batch.all_greedy and batch.draw is None and batch.penalties is None
    assert not batch.needs_logit_edits
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)).to(device)
    assert torch.equal(Sampler()(logits, batch).token_ids, logits.argmax(dim=-1))


def test_a_given_argmax_is_taken_only_where_nothing_edits_the_logits(device: torch.device) -> None:
    """Decode graphs hand the sampler the logits' argmax: plain greedy rows take it as it is; a ban,
    a bias or a penalty changes the logits, so those batches find their own argmax; sampled rows draw."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(6)).to(device)
    given = logits.argmax(dim=-1)
    greedy = SamplingParams(temperature=0.0)
    assert (
        Sampler()(logits, SamplingBatch.build([SamplingRow(greedy)] * 3, 50, device), given).token_ids
        is given
    )
    banned = [SamplingRow(greedy, banned_token_ids=[int(t)]) for t in given]
    out = Sampler()(logits, SamplingBatch.build(banned, 50, device), given).token_ids
    assert not torch.equal(out, given) and torch.equal(
        out, logits.scatter(1, given[:, None], -torch.inf).argmax(-1)
    )
    hot = torch.zeros(3, 50, device=device)
    hot[:, 7] = 30.0  # a sampled row draws token 7 almost surely, whatever argmax it is handed
    sampled = SamplingBatch.build([SamplingRow(SamplingParams(temperature=1.0, seed=1))] * 3, 50, device)
    assert (
        Sampler()(hot, sampled, torch.zeros(3, dtype=torch.int64, device=device)).token_ids.tolist()
        == [7] * 3
    )


def test_fused_greedy_only_batch_is_the_argmax(fused_device: torch.device) -> None:
    """The fused argmax over several column ranges per row, ties to the lowest id like torch's."""
    logits = torch.randn(5, 5000, generator=torch.Generator().manual_seed(2)).to(fused_device)
    logits[1, [10, 4000]] = 9.0
    logits[2] = 1.0
    logits[3, 4999] = 9.0
    rows = [SamplingRow(SamplingParams(temperature=0.0))] * 5
    out = sample(logits, rows, fused=True).token_ids
    assert torch.equal(out, logits.argmax(dim=-1))
    assert out[1:4].tolist() == [10, 0, 4999]


@pytest.mark.parametrize(("rows", "vocab", "k"), [(1, 128256, 50), (3, 1001, 7), (2, 999, 1), (40, 3000, 20)])
def test_top_k_values_in_two_rounds_equal_topk(device: torch.device, rows: int, vocab: int, k: int) -> None:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)).to(device)
    logits[0, -3:] = 50.0  # the largest values in the columns past the last whole chunk
    logits[-1, :40] = 7.0  # ties across chunks
    assert torch.equal(top_k_values(logits, k), logits.topk(k, dim=-1).values)


def test_greedy_rows_mixed_with_sampled_rows(device: torch.device) -> None:
    torch.manual_seed(5)
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1)).to(device)
    greedy_rows = [i % 3 == 0 for i in range(64)]
    rows = [SamplingRow(SamplingParams(temperature=0.0 if g else 5.0)) for g in greedy_rows]
    tokens = sample(logits, rows).token_ids
    argmax = logits.argmax(dim=-1)
    mask = torch.tensor(greedy_rows, device=device)
    assert torch.equal(tokens[mask], argmax[mask])
    assert not torch.equal(tokens[~mask], argmax[~mask]), "hot rows should not all land on the argmax"


def test_input_logits_are_left_unchanged(device: torch.device) -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2)).to(device)
    before = logits.clone()
    params = SamplingParams(temperature=0.7, top_k=4, repetition_penalty=1.3, logit_bias={3: 2.0}, logprobs=2)
    sample(logits, [SamplingRow(params, [1, 2], [3], banned_token_ids=[4])] * 4)
    assert torch.equal(logits, before)


# ---- penalties, bias, bans --------------------------------------------------------------------------------


def penalty_rows(vocab: int) -> list[tuple[SamplingParams, list[int], list[int], list[int]]]:
    g = torch.Generator().manual_seed(7)

    def ids(count: int) -> list[int]:
        return torch.randint(0, vocab, (count,), generator=g).tolist()

    return [
        (SamplingParams(), ids(5), ids(4), []),
        (SamplingParams(repetition_penalty=1.5), ids(6), ids(7), []),
        (SamplingParams(repetition_penalty=0.7), ids(3), [], []),
        (SamplingParams(presence_penalty=0.8, frequency_penalty=0.4), ids(4), ids(12), []),
        (SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.3), ids(2), ids(9), []),
        (SamplingParams(logit_bias={0: 5.0, 7: -3.5, 11: 0.25}), ids(3), ids(3), []),
        (SamplingParams(), ids(3), ids(2), [2, 5, 9]),
        (SamplingParams(allowed_token_ids=[1, 5, 6, 20]), ids(3), ids(2), []),
        (SamplingParams(allowed_token_ids=[0, 3, 4, 9], logit_bias={4: 2.0, 8: 9.0}), ids(4), ids(3), [3]),
        (
            SamplingParams(
                repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=1.0, logit_bias={4: 1.0}
            ),
            ids(8),
            ids(15),
            [1],
        ),
    ]


def test_penalties_match_naive_per_row_loop(device: torch.device) -> None:
    vocab = 24
    cases = penalty_rows(vocab)
    logits = torch.randn(len(cases), vocab, generator=torch.Generator().manual_seed(3)) * 3
    rows = [SamplingRow(p, prompt, output, banned) for p, prompt, output, banned in cases]
    batch = SamplingBatch.build(rows, vocab, device)
    got = apply_penalties(logits.to(device), batch).cpu().double()
    expected = torch.tensor(
        [reference_penalised(logits[i].tolist(), *case) for i, case in enumerate(cases)], dtype=torch.float64
    )
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(got[finite], expected[finite], atol=1e-5, rtol=1e-5)


def test_greedy_after_penalties_matches_reference(device: torch.device) -> None:
    vocab = 24
    cases = penalty_rows(vocab)
    logits = torch.randn(len(cases), vocab, generator=torch.Generator().manual_seed(4))
    rows = [
        SamplingRow(_with(p, temperature=0.0), prompt, output, banned) for p, prompt, output, banned in cases
    ]
    tokens = sample(logits.to(device), rows).token_ids.tolist()
    for i, case in enumerate(cases):
        values = reference_penalised(logits[i].tolist(), *case)
        assert tokens[i] == max(range(vocab), key=lambda t: values[t])


def test_banned_tokens_are_never_sampled(device: torch.device) -> None:
    torch.manual_seed(11)
    vocab = 10
    logits = torch.zeros(2000, vocab, device=device)
    logits[:, 3] = 8.0  # by far the most likely token, and banned
    rows = [SamplingRow(SamplingParams(temperature=1.0), banned_token_ids=[3, 7]) for _ in range(2000)]
    tokens = sample(logits, rows).token_ids
    assert not torch.isin(tokens, torch.tensor([3, 7], device=device)).any()
    assert len(tokens.unique()) == vocab - 2


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    params = SamplingParams(min_tokens=3, stop_token_ids=[9, 4])
    assert params.banned_token_ids(0, eos_token_ids=[2]) == [2, 4, 9]
    assert params.banned_token_ids(2, eos_token_ids=[2]) == [2, 4, 9]
    assert params.banned_token_ids(3, eos_token_ids=[2]) == []
    assert _with(params, ignore_eos=True).banned_token_ids(0, eos_token_ids=[2]) == [4, 9]


def test_large_logit_bias_forces_the_token(device: torch.device) -> None:
    torch.manual_seed(12)
    logits = torch.randn(500, 40, generator=torch.Generator().manual_seed(5)).to(device)
    rows = [SamplingRow(SamplingParams(temperature=1.0, logit_bias={17: 100.0}))] * 500
    assert (sample(logits, rows).token_ids == 17).all()


def test_out_of_vocabulary_bias_or_ban_is_rejected() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingBatch.build([SamplingRow(SamplingParams(logit_bias={50: 1.0}))], vocab_size=50)
    with pytest.raises(ValueError, match="banned_token_ids"):
        SamplingBatch.build([SamplingRow(SamplingParams(), banned_token_ids=[50])], vocab_size=50)


# ---- seeds ------------------------------------------------------------------------------------------------


def run_seeded_request(
    device: torch.device,
    seeded: SamplingParams,
    seeded_logits: torch.Tensor,
    position: int,
    others: int,
    fused: bool = False,
) -> list[int]:
    """Decode 6 steps of one seeded request placed at ``position`` among ``others`` random requests."""
    g = torch.Generator().manual_seed(position * 100 + others)
    vocab = seeded_logits.shape[0]
    other_params = [
        SamplingParams(temperature=0.9, top_k=50),
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.5, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(seed=777, min_p=0.1),
        SamplingParams(logit_bias={1: 3.0}, logprobs=3),
    ]
    outputs: list[int] = []
    for _ in range(6):
        rows = [SamplingRow(other_params[i % len(other_params)], [1, 2], [3] * i) for i in range(others)]
        rows.insert(position, SamplingRow(seeded, [5, 6, 7], list(outputs)))
        logits = torch.randn(len(rows), vocab, generator=g)
        logits[position] = seeded_logits
        outputs.append(int(sample(logits.to(device), rows, fused).token_ids[position]))
    return outputs


@pytest.mark.parametrize(
    "filters",
    [{"top_k": 100, "min_p": 0.001}, {"top_p": 0.99}, {"temperature": 1.5}],
    ids=["top_k+min_p", "top_p", "plain"],
)
def test_seeded_request_does_not_depend_on_the_batch(filters: dict[str, Any], device: torch.device) -> None:
    """Alone, the request may take a filtering path (no sort) other than in a batch with top-p rows."""
    seeded_logits = torch.randn(1000, generator=torch.Generator().manual_seed(8))
    params = SamplingParams(seed=42, **filters)
    alone = run_seeded_request(device, params, seeded_logits, position=0, others=0)
    assert len(set(alone)) > 1, "a seeded request must still vary from step to step"
    torch.manual_seed(0)
    assert run_seeded_request(device, params, seeded_logits, position=0, others=7) == alone
    torch.manual_seed(1)
    assert run_seeded_request(device, params, seeded_logits, position=3, others=9) == alone
    other_seed = run_seeded_request(device, _with(params, seed=43), seeded_logits, position=0, others=0)
    assert other_seed != alone


TOP_P_ROWS = [
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 0.7, "top_p": 0.5, "top_k": 40},
    {"temperature": 1.3, "top_p": 0.95, "min_p": 0.01},
    {"temperature": 1.0, "top_p": 0.999},
    {"temperature": 1.0},  # top-p off, beside rows with it
]
MASS_TOLERANCE = 1e-5  # float32 running sums: a token this close to the cut may fall either side


def _naive_top_p_masses(row: list[float], params: SamplingParams) -> list[tuple[float, bool]]:
    """Per token: the float64 probability mass ahead of it (top-k applied, the row in descending order,
    ties in id order; inf for tokens top-k drops), and whether min-p keeps it."""
    order = sorted(range(len(row)), key=lambda token: (-row[token], token))
    kth = row[order[params.top_k - 1]] if params.top_k > 0 else -math.inf
    weights = [math.exp(row[t] - row[order[0]]) if row[t] >= kth else 0.0 for t in range(len(row))]
    total, ahead, masses = math.fsum(weights), 0.0, [math.inf] * len(row)
    for token in order:
        if weights[token] > 0:
            masses[token] = ahead / total
        ahead += weights[token]
    floor = row[order[0]] + math.log(params.min_p) if params.min_p > 0 else -math.inf
    return [(mass, row[t] >= floor) for t, mass in enumerate(masses)]


@pytest.mark.parametrize("candidates", [None, (64, 512)], ids=["default-widths", "three-levels"])
@pytest.mark.parametrize("spread", [0.5, 4.0], ids=["flat", "peaked"])
def test_cpu_top_p_keeps_what_a_naive_sorted_sum_keeps(
    spread: float, candidates: tuple[int, int] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU's top-p over a row's largest logits against a float64 walk of the row in order: flat rows
    whose cut lies past the first candidates (with narrow widths: past the second too), peaked rows, and
    ties across the cut (kept in id order). Only tokens within float32 rounding of the cut may differ; the
    sorting filter (the GPU's) is held to the same reference."""
    if candidates is not None:
        monkeypatch.setattr(filters, "_TOP_P_CANDIDATES", candidates)
    generator = torch.Generator().manual_seed(int(spread * 10))
    logits = torch.randn(40, 5000, generator=generator) * spread
    logits[::5, 300:340] = logits[::5].amax(dim=-1, keepdim=True) + 0.3  # 40 tokens tied at the top
    logits[1::5] = (logits[1::5] * 4).round() / 4  # many ties everywhere
    params = [SamplingParams(**TOP_P_ROWS[i % len(TOP_P_ROWS)]) for i in range(40)]
    batch = SamplingBatch.build([SamplingRow(p) for p in params], 5000, torch.device("cpu"))
    scaled = logits / batch.require_draw().temperature.unsqueeze(1)
    for kept in (apply_top_k_top_p_min_p(scaled, batch), filter_sorted(scaled, batch)):
        for row, row_params in enumerate(params):
            top_p = row_params.top_p if row_params.top_p < 1 else math.inf
            reference = _naive_top_p_masses(scaled[row].tolist(), row_params)
            finite_row = kept[row].isfinite().tolist()
            for token, ((mass, min_p_keeps), finite) in enumerate(zip(reference, finite_row, strict=True)):
                if abs(mass - top_p) > MASS_TOLERANCE:
                    assert finite == (mass < top_p and min_p_keeps), (row, token, mass)
    assert int(torch.isfinite(apply_top_k_top_p_min_p(scaled, batch))[0, 300:340].sum()) == 40


def test_cpu_top_p_at_a_cold_temperature() -> None:
    """Scaled logits near 3,000 (logits near 30 at temperature 0.01): the CPU's top-p takes probabilities
    as softmax does, from the row's largest logit; exp(x - logsumexp) rounds each one by ulp(3,000)."""
    logits = torch.randn(16, 5000, generator=torch.Generator().manual_seed(3)) * 0.05 + 30
    params = SamplingParams(temperature=0.01, top_p=0.9999)
    batch = SamplingBatch.build([SamplingRow(params)] * 16, 5000, torch.device("cpu"))
    scaled = logits / 0.01
    for kept in (apply_top_k_top_p_min_p(scaled, batch), filter_sorted(scaled, batch)):
        for row in range(16):
            reference = _naive_top_p_masses(scaled[row].tolist(), params)
            for token, (mass, _) in enumerate(reference):
                if abs(mass - params.top_p) > MASS_TOLERANCE:
                    assert bool(kept[row, token].isfinite()) == (mass < params.top_p), (row, token, mass)


def test_filter_paths_agree_bitwise(device: torch.device) -> None:
    """A top-k / min-p row gets the same filtered logits whether or not a top-p row forces a sort."""
    logits = torch.randn(2, 3000, generator=torch.Generator().manual_seed(6)).to(device)
    logits[0, 100:140] = 10.0  # the 40 largest, tied across the top-k boundary
    row = SamplingRow(SamplingParams(top_k=25, min_p=0.05))
    unsorted = apply_top_k_top_p_min_p(logits[:1], SamplingBatch.build([row], 3000, device))
    with_top_p = SamplingBatch.build([row, SamplingRow(SamplingParams(top_p=0.5))], 3000, device)
    assert torch.equal(apply_top_k_top_p_min_p(logits, with_top_p)[:1], unsorted)
    assert int(torch.isfinite(unsorted).sum()) == 40, "every token tied with the k-th largest is kept"


# ---- logprobs ---------------------------------------------------------------------------------------------


def test_logprobs_come_from_raw_logits(device: torch.device) -> None:
    torch.manual_seed(21)
    vocab = 64
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(9)) * 2
    params = [
        SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.4),
        SamplingParams(),
        SamplingParams(logprobs=0, top_k=3),
        SamplingParams(logprobs=20, temperature=0.0, logit_bias={2: 4.0}),
        SamplingParams(logprobs=2, top_p=0.5, presence_penalty=1.0),
    ]
    rows = [SamplingRow(p, [1, 2, 3], [4, 4]) for p in params]
    out = sample(logits.to(device), rows)
    assert out.logprobs is not None
    reference = torch.log_softmax(logits.double(), dim=-1)
    per_row = out.logprobs.to_rows([p.logprobs for p in params])
    for i, (p, row) in enumerate(zip(params, per_row, strict=True)):
        token = int(out.token_ids[i])
        assert row.token_id == token
        assert row.logprob == pytest.approx(float(reference[i, token]), abs=1e-5)
        assert row.rank == 1 + int((reference[i] > reference[i, token]).sum())
        wanted = p.logprobs or 0
        top_values, top_ids = reference[i].topk(wanted)
        assert [t for t, _ in row.top] == top_ids.tolist()
        assert [v for _, v in row.top] == pytest.approx(top_values.tolist(), abs=1e-5)


def test_no_logprobs_when_none_asked(device: torch.device) -> None:
    out = sample(torch.randn(3, 10, device=device), [SamplingRow(SamplingParams())] * 3)
    assert out.logprobs is None


def test_prompt_logprobs(device: torch.device) -> None:
    vocab, length = 16, 1500  # longer than one chunk
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(length, vocab, generator=g)
    prompt = torch.randint(0, vocab, (length,), generator=g)
    result = compute_prompt_logprobs(logits.to(device), prompt.tolist(), num_top=4)
    reference = torch.log_softmax(logits.double(), dim=-1)[:-1]
    targets = prompt[1:]
    expected = reference.gather(1, targets.unsqueeze(1)).squeeze(1)
    assert result.logprobs.shape == (length - 1,)
    torch.testing.assert_close(result.logprobs.cpu().double(), expected, atol=1e-5, rtol=0)
    assert torch.equal(result.token_ids.cpu(), targets)
    assert torch.equal(result.ranks.cpu(), (reference > expected.unsqueeze(1)).sum(dim=1) + 1)
    top_values, top_ids = reference.topk(4, dim=1)
    assert torch.equal(result.top_ids.cpu(), top_ids)
    torch.testing.assert_close(result.top_logprobs.cpu().double(), top_values, atol=1e-5, rtol=0)
    single = compute_prompt_logprobs(logits[:1].to(device), prompt[:1].tolist(), num_top=4)
    assert single.logprobs.shape == (0,)


# ---- the fused (Triton) draw -----------------------------------------------------------------------------

FUSED_DRAWS = 20_000  # fewer than NUM_DRAWS: on CPU the kernel runs in Triton's interpreter
FUSED_CASES: list[dict[str, Any]] = [
    {"temperature": 0.5},
    {"top_k": 3, "temperature": 1.4},
    {"min_p": 0.2},
    {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.05},
]


@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_fused_draw_matches_target_distribution(case: dict[str, Any], fused_device: torch.device) -> None:
    torch.manual_seed(4321)
    logits = torch.tensor([SMALL_LOGITS], device=fused_device).expand(FUSED_DRAWS, -1)
    rows = [SamplingRow(SamplingParams(**case))] * FUSED_DRAWS
    expected = reference_probs(SMALL_LOGITS, **{**case, "top_k": max(case.get("top_k", 0), 0)})
    assert_matches_distribution(sample(logits, rows, fused=True).token_ids, expected)


def test_fused_draw_mixes_greedy_and_filtered_rows(fused_device: torch.device) -> None:
    torch.manual_seed(77)
    a: dict[str, Any] = {"temperature": 0.8, "top_k": 3}
    b: dict[str, Any] = {"temperature": 1.5, "min_p": 0.02}
    params = [SamplingParams(**a), SamplingParams(**b), SamplingParams(temperature=0.0)]
    rows = [SamplingRow(params[i % 3]) for i in range(3 * 6000)]
    logits = torch.tensor([SMALL_LOGITS], device=fused_device).expand(len(rows), -1)
    tokens = sample(logits, rows, fused=True).token_ids
    assert_matches_distribution(tokens[0::3], reference_probs(SMALL_LOGITS, **a))
    assert_matches_distribution(tokens[1::3], reference_probs(SMALL_LOGITS, **b))
    assert (tokens[2::3] == SMALL_LOGITS.index(max(SMALL_LOGITS))).all()


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "triton"])
def test_draws_keep_to_allowed_token_ids(device: torch.device, fused: bool) -> None:
    """Rows with allowed ids draw only those (the likeliest token left out on purpose), rows without draw
    from the whole vocabulary, in one batch."""
    if fused and not triton_runs_on(device):
        pytest.skip(f"Triton kernels cannot run on {device} here")
    vocab, allowed = 50, [3, 17, 40]
    logits = torch.zeros(600, vocab, device=device)
    logits[:, 7] = 3.0
    rows = [SamplingRow(SamplingParams(allowed_token_ids=allowed if i % 2 else None)) for i in range(600)]
    tokens = sample(logits, rows, fused=fused).token_ids.cpu()
    assert set(tokens[1::2].tolist()) == set(allowed)
    assert 7 in tokens[0::2].tolist() and len(set(tokens[0::2].tolist())) > 10


def test_fused_draw_keeps_only_what_the_pytorch_filters_keep(fused_device: torch.device) -> None:
    """Over a wide vocabulary (several column ranges per row), every drawn token survives the PyTorch
    filters at the same temperature, ties at the top-k boundary included; greedy rows are the argmax."""
    vocab = 3000
    logits = torch.randn(24, vocab, generator=torch.Generator().manual_seed(12)).to(fused_device)
    logits[:, 100:140] = 3.5  # tied across the top-k boundary
    params = [
        SamplingParams(temperature=0.9, top_k=25),
        SamplingParams(temperature=1.3, min_p=0.3),
        SamplingParams(temperature=0.6, top_k=50, min_p=0.1, seed=5),
        SamplingParams(temperature=0.0),
    ] * 6
    rows = [SamplingRow(p) for p in params]
    batch = SamplingBatch.build(rows, vocab, fused_device)
    draw = batch.require_draw()
    kept = torch.isfinite(apply_top_k_top_p_min_p(logits / draw.temperature.unsqueeze(1), batch))
    for _ in range(3):
        tokens = sample(logits, rows, fused=True).token_ids
        assert kept.gather(1, tokens.unsqueeze(1)).all()
        assert torch.equal(tokens[3::4], logits[3::4].argmax(dim=-1))


def test_fused_top_p_draws_only_inside_the_top_p_set(fused_device: torch.device) -> None:
    """The rejecting top-p kernel over rows of several tiles: flat rows and low p (most first draws fall
    outside the set and are drawn again), ties across the cut, top-k and min-p beside top-p; every token
    drawn is one a float64 walk of the sorted row keeps (tokens within rounding of the cut excepted)."""
    vocab = 5000
    generator = torch.Generator().manual_seed(21)
    logits = torch.randn(8, vocab, generator=generator) * 0.5
    logits[1::4, 2000:2100] = logits[1::4].amax(dim=-1, keepdim=True)  # 100 tied at the top
    params = [
        SamplingParams(temperature=1.0, top_p=0.05),
        SamplingParams(temperature=0.8, top_p=0.3, seed=3),
        SamplingParams(temperature=1.2, top_p=0.2, top_k=300, min_p=0.5),
        SamplingParams(temperature=0.0, top_p=0.5),
    ] * 2
    rows = [SamplingRow(p) for p in params]
    for _ in range(2):
        tokens = sample(logits.to(fused_device), rows, fused=True).token_ids.tolist()
        for row, (token, row_params) in enumerate(zip(tokens, params, strict=True)):
            if row_params.is_greedy:
                assert token == int(logits[row].argmax())
                continue
            scaled = (logits[row] / row_params.temperature).tolist()
            mass, min_p_keeps = _naive_top_p_masses(scaled, row_params)[token]
            assert min_p_keeps and mass < row_params.top_p + MASS_TOLERANCE, (row, token, mass)


@pytest.mark.parametrize("vocab", [300, 3000])
def test_top_p_kernel_draws_what_sorting_then_drawing_draws(
    vocab: int, fused_device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rejecting top-p kernel and the sorting filter followed by the Gumbel-max draw, on the same rows
    and seeds, give the same tokens: the engine picks one or the other by batch size, and a seeded
    request must not depend on its batch."""
    from tokenmill.runner.sampler import fused

    generator = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(24, vocab, generator=generator) * 1.5).to(fused_device)
    params = [
        SamplingParams(temperature=1.0, top_p=0.3, seed=1),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.3, top_p=0.6, top_k=40, seed=2),
        SamplingParams(temperature=0.9, top_p=0.8, min_p=0.05),
        SamplingParams(temperature=1.1, top_k=20),
        SamplingParams(temperature=0.0, top_p=0.5),
    ] * 4
    rows = [SamplingRow(p) for p in params]
    drawn = {}
    for name, min_rows in (("kernel", 1), ("sorting", 10**9)):
        monkeypatch.setattr(fused, "TOP_P_KERNEL_MIN_ROWS", min_rows)
        torch.manual_seed(5)  # the unseeded rows' noise keys
        drawn[name] = sample(logits, rows, fused=True).token_ids.tolist()
    assert drawn["kernel"] == drawn["sorting"]
    assert len(set(drawn["kernel"])) > 6


def test_a_top_p_that_rounds_to_zero_keeps_the_largest_token(
    fused_device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """top_p = 1e-50 passes validation but is 0 in float32: every path keeps the largest token (no empty
    set, no kernel round that repeats forever), and a fully masked row ends too."""
    from tokenmill.kernels.top_p_sampling import top_p_draw
    from tokenmill.runner.sampler import fused

    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3)).to(fused_device)
    rows = [SamplingRow(SamplingParams(temperature=1.0, top_p=1e-50, seed=seed)) for seed in range(4)]
    assert sample(logits.cpu(), rows).token_ids.tolist() == logits.argmax(dim=-1).tolist()
    for min_rows in (1, 10**9):  # the kernel, then the sorting path
        monkeypatch.setattr(fused, "TOP_P_KERNEL_MIN_ROWS", min_rows)
        assert sample(logits, rows, fused=True).token_ids.tolist() == logits.argmax(dim=-1).tolist()
    masked = torch.full((1, 300), float("-inf"), device=fused_device)
    one = torch.ones(1, device=fused_device)
    floor = torch.full((1,), float("-inf"), device=fused_device)
    seeds = torch.zeros(1, dtype=torch.int64, device=fused_device)
    greedy = torch.zeros(1, dtype=torch.bool, device=fused_device)
    assert top_p_draw(masked, one, greedy, seeds, one * 0.5, floor, floor).tolist() == [0]


def test_fused_greedy_ties_go_to_the_lowest_id(fused_device: torch.device) -> None:
    """Greedy rows beside a sampled one go through the kernel: ties break like ``torch.argmax``."""
    logits = torch.zeros(4, 2500, device=fused_device)
    logits[0, [7, 2100]] = 1.0
    logits[1, [1500, 2499]] = 2.0
    logits[2] = 5.0  # all tied
    rows = [SamplingRow(SamplingParams(temperature=0.0))] * 3 + [SamplingRow(SamplingParams())]
    out = sample(logits, rows, fused=True)
    assert out.token_ids[:3].tolist() == [7, 1500, 0]


@pytest.mark.parametrize(
    "filters", [{"top_k": 100, "min_p": 0.001}, {"top_p": 0.99}], ids=["top_k+min_p", "top_p"]
)
def test_fused_seeded_request_does_not_depend_on_the_batch(
    filters: dict[str, Any], fused_device: torch.device
) -> None:
    seeded_logits = torch.randn(1000, generator=torch.Generator().manual_seed(8))
    params = SamplingParams(seed=42, **filters)

    def run(position: int, others: int, seeded: SamplingParams = params) -> list[int]:
        return run_seeded_request(fused_device, seeded, seeded_logits, position, others, fused=True)

    alone = run(0, 0)
    assert len(set(alone)) > 1, "a seeded request must still vary from step to step"
    assert run(2, 5) == alone
    assert run(0, 0, _with(params, seed=43)) != alone


def test_the_draw_is_bound_at_construction() -> None:
    sampler = Sampler()
    assert not sampler.fused
    with pytest.raises(AttributeError):
        sampler.fused = True  # type: ignore[misc]


NO_TRITON_SCRIPT = """
import sys
sys.modules["triton"] = None  # any import of triton now raises ImportError
import torch
from tokenmill.runner.sampler import Sampler, SamplingBatch, SamplingRow
from tokenmill.sampling_params import SamplingParams
rows = [SamplingRow(SamplingParams(top_k=3, seed=1)), SamplingRow(SamplingParams(temperature=0.0))]
print(Sampler()(torch.randn(2, 10), SamplingBatch.build(rows, 10)).token_ids.shape[0])
try:
    Sampler(fused=True)
except ImportError:
    print("fused-needs-triton")
"""


def test_only_a_fused_sampler_imports_triton() -> None:
    """With triton unimportable the package imports and samples; ``Sampler(fused=True)`` fails when built
    (where it imports the kernel module), not at its first call."""
    result = subprocess.run([sys.executable, "-c", NO_TRITON_SCRIPT], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["2", "fused-needs-triton"]


# ---- SamplingParams ---------------------------------------------------------------------------------------

INVALID_PARAMS = [
    ({"n": 0}, "n"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"frequency_penalty": 3.0}, "frequency_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"seed": 1.5}, "seed"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logit_bias": {5: 101.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [3, -1]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"spaces_between_special_tokens": None}, "spaces_between_special_tokens"),
]


@pytest.mark.parametrize(("kwargs", "name"), INVALID_PARAMS, ids=[f"{n}={v}" for (v, n) in INVALID_PARAMS])
def test_invalid_params_raise_naming_the_parameter(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        SamplingParams(**kwargs)


def test_params_defaults_and_normalisation() -> None:
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (params.max_tokens, params.min_tokens, params.stop, params.stop_token_ids) == (16, 0, (), [])
    assert params.logprobs is None and params.skip_special_tokens and not params.ignore_eos
    assert params.spaces_between_special_tokens and not params.include_stop_str_in_output
    assert (params.allowed_token_ids, params.bad_words) == (None, [])
    assert SamplingParams(bad_words=["a", "b", "a"]).bad_words == ["a", "b"]  # as vLLM, each word once
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    vllm_style: dict[str, Any] = {"stop": None}  # accepted at run time, though typed as Sequence[str]
    assert SamplingParams(**vllm_style).stop == ()
    assert SamplingParams(max_tokens=None, min_tokens=50).max_tokens is None
    assert SamplingParams(temperature=0.0).is_greedy and not SamplingParams(temperature=0.1).is_greedy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused", [False, True], ids=["torch", "triton"])
def test_no_host_device_sync_on_cuda(fused: bool) -> None:
    """Building the batch and sampling, penalties, seeds, filters and logprobs included, never waits on the
    GPU: CUDA's sync debug mode turns any synchronising call into an error."""
    vocab = 5000
    logits = torch.randn(8, vocab, device="cuda")
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(top_k=20, top_p=0.9, min_p=0.05, seed=3),
        SamplingParams(
            repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2, logit_bias={5: 2.0}
        ),
        SamplingParams(temperature=0.6, top_p=0.8),
    ] * 2
    rows = [SamplingRow(p, [1, 2, 3], [4, 5, 4], banned_token_ids=[7]) for p in params]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = SamplingBatch.build(rows, vocab, logits.device)
        out = Sampler(fused=fused)(logits, batch)
        greedy_rows = [SamplingRow(SamplingParams(temperature=0.0))] * 8
        greedy = Sampler(fused=fused)(logits, SamplingBatch.build(greedy_rows, vocab, logits.device))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.token_ids.shape == (8,)
    assert torch.equal(greedy.token_ids, logits.argmax(dim=-1))
