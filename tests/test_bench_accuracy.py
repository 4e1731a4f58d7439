"""``tokenmill bench accuracy``'s measurements on a tiny model: scoring against an independent computation
(transformers' full-sequence logits), agreement and greedy comparison by their definitions."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tiny_models import VOCAB, save_tiny_model
from tokenmill.benchmarks.accuracy.measure import compare_greedy, greedy_continuations, score_text
from tokenmill.loading import load_model
from tokenmill.quantization import QuantizationConfig

TOKENS = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    saved = tmp_path_factory.mktemp("llama3")
    save_tiny_model("llama3", saved)
    return saved


def test_teacher_forced_perplexity_equals_transformers_in_windows(folder: Path) -> None:
    """Windows of 150 tokens (scored in chunks through the KV cache) against full forward passes."""
    scored = score_text(load_model(folder).model, TOKENS, window=150)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    nll, predictions = 0.0, []
    with torch.no_grad():
        for first in range(0, len(TOKENS) - 1, 150):
            piece = torch.tensor([TOKENS[first : first + 151]])
            logits = reference(piece[:, :-1]).logits[0]
            nll -= float(torch.log_softmax(logits, -1).gather(1, piece[0, 1:, None]).sum())
            predictions.append(logits.argmax(-1))
    assert len(scored.targets) == len(TOKENS) - 1
    assert scored.perplexity == pytest.approx(torch.tensor(nll / (len(TOKENS) - 1)).exp().item(), rel=1e-4)
    assert scored.agreement(scored) == 1.0
    assert (scored.predictions == torch.cat(predictions)).float().mean() > 0.99  # float32 near-ties aside


def test_w8a8_emulation_rounds_activations_and_stays_close(folder: Path) -> None:
    weight_only = score_text(load_model(folder, quantization="fp8").model, TOKENS, window=150)
    w8a8 = load_model(folder, quantization=QuantizationConfig("fp8", dynamic_activations=True)).model
    emulated = score_text(w8a8, TOKENS, window=150)
    assert emulated.perplexity != weight_only.perplexity
    assert abs(emulated.perplexity / weight_only.perplexity - 1) < 0.05
    assert emulated.agreement(weight_only) > 0.8


def test_greedy_comparison_counts_and_first_divergence(folder: Path) -> None:
    model = load_model(folder).model
    reference = greedy_continuations(model, [[5, 6, 7], [9]], 6)
    assert compare_greedy(reference, reference).identical == 2
    changed = [[*reference[0][:3], (reference[0][3] + 1) % VOCAB, *reference[0][4:]], reference[1]]
    compared = compare_greedy(changed, reference)
    assert (compared.identical, compared.matching_tokens, compared.total_tokens) == (1, 11, 12)
    assert compared.first_divergence == [3, None]
