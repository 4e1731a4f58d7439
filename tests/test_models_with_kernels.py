"""``CausalLM.with_kernels``: configured copies of one loaded model share its weights, not their kernels.

Benchmarks (and engines) configure several copies of one loaded model; each must keep the kernels it was
configured with whatever the others ask for, and none may duplicate the weights or change the original.
"""

from pathlib import Path

import pytest
import torch

from tiny_models import save_tiny_model
from tokenmill.attention import AttentionMetadata, ForwardContext, TorchAttentionBackend, forward_context
from tokenmill.kernels import triton_available
from tokenmill.kernels.options import KernelOptions
from tokenmill.loading import load_model
from tokenmill.models import CausalLM
from tokenmill.models.layers import GatedActivationLinear, PreNormLinear
from tokenmill.models.layers.cpu_linear import supports_prepacking
from tokenmill.models.llama import QKNormAttention

ALL_TRITON = KernelOptions(rms_norm=True, rotary=True, activation=True, gemv=True)
# The kernel functions the layers bind, by module.
KERNELS = {
    "tokenmill.kernels.rmsnorm": ("rms_norm", "add_rms_norm", "head_rms_norm_"),
    "tokenmill.kernels.rotary": ("apply_rotary_",),
    "tokenmill.kernels.activation": ("silu_and_mul", "gelu_tanh_and_mul"),
    "tokenmill.kernels.gemv": ("gemv", "rms_norm_gemv", "gated_gemv"),
}


@pytest.fixture(scope="module", params=["llama3", "gemma3", "qwen3"])
def tiny_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    save_tiny_model(request.param, folder)
    return folder


def logits(model: CausalLM, lens: list[int]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(sum(lens))
    input_ids = torch.randint(3, 300, (sum(lens),), generator=generator)
    positions = torch.cat([torch.arange(n) for n in lens])
    metadata = AttentionMetadata.for_prefill(lens, "cpu")
    with torch.inference_mode(), forward_context(ForwardContext(metadata, TorchAttentionBackend())):
        return model.compute_logits(model(input_ids, positions))


def count_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Patches every layer kernel to record its name when called (before the copies bind them)."""
    import importlib

    calls: list[str] = []
    for module_name, names in KERNELS.items():
        module = importlib.import_module(module_name)
        for name in names:
            kernel = getattr(module, name)

            def counting(*args, _kernel=kernel, _name=name, **kwargs):  # type: ignore[no-untyped-def]
                calls.append(_name)
                return _kernel(*args, **kwargs)

            monkeypatch.setattr(module, name, counting)
    return calls


def assert_shares_tensors_not_layers(copy: CausalLM, original: CausalLM) -> None:
    originals = dict(original.named_parameters()) | dict(original.named_buffers())
    copies = dict(copy.named_parameters()) | dict(copy.named_buffers())
    assert copies.keys() == originals.keys()
    for name, tensor in copies.items():
        assert tensor is originals[name] and tensor.data_ptr() == originals[name].data_ptr(), name
    own_layers = {id(module) for module in copy.modules()}
    for module in copy.modules():
        if isinstance(module, PreNormLinear | GatedActivationLinear):  # refer to the copy's own layers
            assert all(id(layer) in own_layers for layer in module._layers)


@pytest.mark.skipif(not triton_available("cpu"), reason="triton cannot run here")
def test_configured_copies_coexist_and_share_the_weights(
    tiny_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked at one row (every projection a GEMV, the norms and activations fused into them);
    test_kernels.py checks the fused logits of mixed batches."""
    original = load_model(tiny_folder, dtype="float32").model
    reference = logits(original, [1])
    calls = count_kernel_calls(monkeypatch)
    fused = original.with_kernels(ALL_TRITON)
    plain = original.with_kernels(KernelOptions())
    assert (original.kernel_options, plain.kernel_options, fused.kernel_options) == (
        KernelOptions(),
        KernelOptions(),
        ALL_TRITON,
    )
    assert_shares_tensors_not_layers(fused, original)
    assert_shares_tensors_not_layers(plain, original)
    assert torch.allclose(logits(fused, [1]), reference, rtol=0, atol=1e-5)
    assert "apply_rotary_" in calls
    if any(isinstance(module, QKNormAttention) for module in fused.modules()):
        assert "head_rms_norm_" in calls  # both per-head norms in one kernel, in place
    assert {"rms_norm_gemv", "gated_gemv", "gemv"} <= set(calls)
    calls.clear()
    for model in (plain, original):  # the fused copy changed neither
        assert torch.equal(logits(model, [1]), reference)
    assert calls == []


@pytest.mark.skipif(not supports_prepacking(torch.empty(1, 1)), reason="no oneDNN packed linear")
def test_prepacked_copies_share_one_packed_weight(tiny_folder: Path) -> None:
    original = load_model(tiny_folder, dtype="float32").model
    reference = logits(original, [5, 1, 9])
    first = original.with_kernels(KernelOptions(prepacked_cpu_linear=True))
    second = original.with_kernels(KernelOptions(prepacked_cpu_linear=True))
    assert first.lm_head.packed_weight is not None
    assert first.lm_head.packed_weight is second.lm_head.packed_weight
    assert original.lm_head.packed_weight is None
    assert original.with_kernels(KernelOptions()).lm_head.packed_weight is None
    torch.testing.assert_close(logits(first, [5, 1, 9]), reference)
    assert torch.equal(logits(original, [5, 1, 9]), reference)
