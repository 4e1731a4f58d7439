"""W8A8 projections whose inputs the RMSNorm before them quantizes (``KernelOptions.input_quant``): the
norm kernel that writes 8-bit rows and their scales gives exactly what the plain norm kernel followed by
``quantize_rows`` gives, and near the PyTorch layer's output quantized naively; on a GPU, a whole int8 /
fp8 engine gives the same results with the fusion on and off.

Without CUDA the kernels run in the Triton interpreter, which converts float32 to float8 wrongly (see
``tests/test_quant_kernels.py``): the float8 rows are checked on CUDA only.
"""

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from tokenmill.kernels import interpreter_enabled, triton_available

if not triton_available():
    pytest.skip("triton cannot run here (no CUDA, TRITON_INTERPRET unset)", allow_module_level=True)

from tokenmill.kernels.quantize_rows import quantize_rows, quantize_rows_reference
from tokenmill.kernels.rmsnorm import add_rms_norm, rms_norm, rms_norm_quantized
from tokenmill.models.layers.norm import RMSNorm

ON_CUDA = torch.cuda.is_available() and not interpreter_enabled()
DEVICE = "cuda" if ON_CUDA else "cpu"
DTYPE = torch.bfloat16 if ON_CUDA else torch.float32
Q_DTYPES = [
    torch.int8,
    pytest.param(
        torch.float8_e4m3fn,
        marks=pytest.mark.skipif(not ON_CUDA, reason="the interpreter's float32 -> float8 is wrong"),
    ),
]


Rows = tuple[torch.Tensor, torch.Tensor]  # 8-bit rows and their scales


def _assert_same_rows(got: Rows, expected: Rows) -> None:
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)
    assert torch.equal(got[0].view(torch.uint8), expected[0].view(torch.uint8))


def _near_naive(q: Rows, values: torch.Tensor, dtype: torch.dtype) -> None:
    """Against ``quantize_rows_reference`` of the PyTorch layer's output: the same scales up to the last
    rounding of the values, and every dequantized value within one step of the format."""
    naive_q, naive_scale = quantize_rows_reference(values, dtype)
    torch.testing.assert_close(q[1], naive_scale, rtol=1e-2, atol=0)
    step = q[1] * (1.0 if dtype == torch.int8 else 32.0)  # an e4m3 step is at most 1/8 of 256 ... 448
    assert ((q[0].float() * q[1] - naive_q.float() * naive_scale).abs() <= step + 1e-6).all()


@pytest.mark.parametrize("dtype", Q_DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("unit_offset", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("shape", [(1, 64), (7, 96), (3, 1000)])
def test_norm_writes_the_rows_the_norm_and_quantize_rows_write(
    dtype: torch.dtype, with_residual: bool, unit_offset: bool, shape: tuple[int, int]
) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape, device=DEVICE, dtype=DTYPE) * 3
    weight = (torch.rand(shape[1], device=DEVICE) + 0.5).to(DTYPE)
    residual = torch.randn(shape, device=DEVICE, dtype=DTYPE) if with_residual else None
    if residual is None:
        normed = rms_norm(x, weight, 1e-6, unit_offset)
    else:
        normed, summed = add_rms_norm(x, residual.clone(), weight, 1e-6, unit_offset)
    q, scale, new_residual = rms_norm_quantized(
        x, weight, 1e-6, dtype, residual.clone() if residual is not None else None, unit_offset
    )
    _assert_same_rows((q, scale), quantize_rows(normed, dtype))
    layer = RMSNorm(shape[1], 1e-6, unit_offset).to(DEVICE)
    layer.weight.data = weight
    if residual is None:
        assert new_residual is None
        _near_naive((q, scale), layer(x).float(), dtype)
    else:
        assert new_residual is not None and torch.equal(new_residual, summed)
        _near_naive((q, scale), layer(x, residual)[0].float(), dtype)


def test_quantized_inputs_refuse_other_formats() -> None:
    x = torch.randn(2, 64, device=DEVICE, dtype=DTYPE)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn"):
        rms_norm_quantized(x, torch.ones(64, device=DEVICE, dtype=DTYPE), 1e-6, torch.float16)


@pytest.mark.skipif(not ON_CUDA, reason="W8A8 projections run on the CUDA tensor cores only")
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
@pytest.mark.parametrize("model", ["llama3", "gemma3"])
def test_engines_with_and_without_quantized_inputs_agree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quantization: str, model: str
) -> None:
    """A batch of greedy requests through a tiny int8 / fp8 model: with the norm kernels quantizing the
    projections' inputs (seen doing so in the prefill steps; a tiny model's decode steps of up to 32 rows
    take the GEMV instead), the same tokens and logprobs as without."""
    from engine_helpers import engine_for, run_to_completion
    from tiny_models import save_tiny_model
    from tokenmill import SamplingParams
    from tokenmill.kernels import rmsnorm
    from tokenmill.loading import load_model

    calls = {"norm": 0}

    def counted(name: str, kernel: Callable[..., object]) -> Callable[..., object]:
        def wrapper(*args: object, **kwargs: object) -> object:
            calls[name] += 1
            return kernel(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(rmsnorm, "rms_norm_quantized", counted("norm", rmsnorm.rms_norm_quantized))
    save_tiny_model(model, tmp_path)
    loaded = load_model(tmp_path, device="cuda", dtype="bfloat16", quantization=quantization)
    greedy = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    requests = {f"r{i}": (list(range(3 + i, 40 + 5 * i)), greedy) for i in range(4)}
    outputs = []
    for on in (False, True):
        engine = engine_for(loaded, device="cuda", fused_input_quant=on, num_kv_blocks=64, max_model_len=128)
        assert engine.runner.model.kernel_options.input_quant == on
        outputs.append(run_to_completion(engine, requests))
    assert calls["norm"] > 0
    for request_id in requests:
        plain, fused = (out[request_id].outputs[0] for out in outputs)
        assert fused.token_ids == plain.token_ids, request_id
        assert fused.logprobs == plain.logprobs, request_id
