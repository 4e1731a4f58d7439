"""Own forward code vs transformers on tiny random models of every architecture (float32, CPU)."""

from pathlib import Path

import pytest
import torch

from tiny_models import VOCAB, save_tiny_model, tiny_configs
from tokenmill.loading import load_model
from tokenmill.reference import greedy_generate

LOGIT_TOLERANCE = (
    1e-4  # float32 end to end; observed errors are ~1e-6, summation order being the only difference
)
NEW_TOKENS = 48
ARCHITECTURES = sorted(tiny_configs())


def hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """transformers' greedy continuation by full forward passes over the growing sequence: the model's
    definition. (Its cached ``generate`` drifts from this for Gemma 3 once a sequence outgrows the
    sliding window, so it is not used as the reference.)"""
    sequence = list(prompt)
    with torch.no_grad():
        first_logits = model(torch.tensor([sequence])).logits[0, -1]
        for step in range(new_tokens):
            logits = first_logits if step == 0 else model(torch.tensor([sequence])).logits[0, -1]
            sequence.append(int(logits.argmax()))
    return first_logits, sequence[len(prompt) :]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp(request.param)
    reference = save_tiny_model(request.param, folder)
    return request.param, folder, reference


@pytest.mark.parametrize("prompt_len", [1, 7, 40])
def test_logits_and_greedy_tokens_match_transformers(tiny_pair, prompt_len: int) -> None:  # type: ignore[no-untyped-def]
    name, folder, reference = tiny_pair
    ours = load_model(folder, dtype="float32").model
    prompt = torch.randint(
        0, VOCAB, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)
    ).tolist()
    ref_logits, ref_tokens = hf_greedy(reference, prompt, NEW_TOKENS)
    out = greedy_generate(ours, prompt, NEW_TOKENS)
    assert torch.allclose(out.prompt_logits, ref_logits, atol=LOGIT_TOLERANCE, rtol=0), name
    assert out.token_ids == ref_tokens, name


def test_sharded_checkpoint_loads_like_single_file(tmp_path: Path) -> None:
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    save_tiny_model("llama3", single)
    save_tiny_model("llama3", sharded, max_shard_size="100KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert (sharded / "model.safetensors.index.json").is_file()
    a, b = load_model(single).model, load_model(sharded).model
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name


def test_context_longer_than_sliding_window_matches(tmp_path: Path) -> None:
    """Gemma's sliding layers (window 16) and Mistral's (24) must mask exactly as the reference does."""
    for name in ("gemma3", "mistral"):
        reference = save_tiny_model(name, tmp_path / name)
        prompt = torch.randint(0, VOCAB, (70,), generator=torch.Generator().manual_seed(3)).tolist()
        ref_logits, ref_tokens = hf_greedy(reference, prompt, 30)
        out = greedy_generate(load_model(tmp_path / name).model, prompt, 30)
        assert torch.allclose(out.prompt_logits, ref_logits, atol=LOGIT_TOLERANCE, rtol=0), name
        assert out.token_ids == ref_tokens, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_loads_and_tracks_float32(tmp_path: Path, dtype: torch.dtype) -> None:
    save_tiny_model("qwen3", tmp_path)
    half = load_model(tmp_path, dtype=dtype)
    assert all(p.dtype == dtype for p in half.model.parameters())
    prompt = list(range(3, 30))
    full_logits = greedy_generate(load_model(tmp_path).model, prompt, 1).prompt_logits
    half_logits = greedy_generate(half.model, prompt, 1).prompt_logits
    relative = (half_logits - full_logits).norm() / full_logits.norm()
    assert relative < 2e-2
