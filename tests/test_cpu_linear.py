"""oneDNN prepacked projections (``KernelOptions.prepacked_cpu_linear``) against ``F.linear`` and
transformers."""

import pytest
import torch
import torch.nn.functional as F

from test_models_tiny import ARCHITECTURES, LOGIT_TOLERANCE, NEW_TOKENS, hf_greedy
from tiny_models import VOCAB, save_tiny_model
from tokenmill.kernels.options import KernelOptions
from tokenmill.loading import load_model
from tokenmill.models.layers.cpu_linear import pack_weight, packed_linear, supports_prepacking
from tokenmill.models.layers.linear import LinearProjection
from tokenmill.reference import greedy_generate

pytestmark = pytest.mark.skipif(
    not supports_prepacking(torch.empty(1, 1)), reason="this torch has no oneDNN packed linear"
)


@pytest.mark.parametrize("rows", [1, 5, 16, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear_up_to_float32_rounding(rows: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(300, 96, generator=generator)
    b = torch.randn(300, generator=generator) if bias else None
    x = torch.randn(rows, 96, generator=generator)
    torch.testing.assert_close(packed_linear(x, pack_weight(weight), b), F.linear(x, weight, b))


def test_a_rows_result_does_not_depend_on_the_rows_beside_it() -> None:
    generator = torch.Generator().manual_seed(0)
    packed = pack_weight(torch.randn(256, 64, generator=generator))
    x = torch.randn(40, 64, generator=generator)
    full = packed_linear(x, packed, None)
    for rows in (1, 3, 17):
        assert torch.equal(packed_linear(x[:rows], packed, None), full[:rows])


def test_only_float32_cpu_weights_are_packed() -> None:
    assert supports_prepacking(torch.empty(4, 4))
    assert not supports_prepacking(torch.empty(4, 4, dtype=torch.bfloat16))
    assert not supports_prepacking(torch.empty(4))


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_prepacked_model_matches_transformers(name: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    reference = save_tiny_model(name, tmp_path)
    loaded = load_model(tmp_path, dtype="float32").model
    model = loaded.with_kernels(KernelOptions(prepacked_cpu_linear=True))
    projections = [m for m in model.modules() if isinstance(m, LinearProjection)]
    assert projections and all(m.packed_weight is not None for m in projections)
    prompt = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(7)).tolist()
    ref_logits, ref_tokens = hf_greedy(reference, prompt, NEW_TOKENS)
    out = greedy_generate(model, prompt, NEW_TOKENS)
    assert torch.allclose(out.prompt_logits, ref_logits, atol=LOGIT_TOLERANCE, rtol=0), name
    assert out.token_ids == ref_tokens, name
    assert all(m.packed_weight is None for m in loaded.modules() if isinstance(m, LinearProjection))
