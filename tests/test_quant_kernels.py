"""The 8-bit weight kernels against PyTorch references: the GEMV reading int8 / float8 weights with a scale
per row, per-token activation quantization, and the W8A8 projections built on them.

Without CUDA the Triton kernels run in the interpreter on small CPU tensors. The interpreter converts
float32 to float8 wrongly (124.3 becomes 64), so the float8 quantization kernel is checked on CUDA only;
float8 *loads* (the GEMV's weights) convert correctly there and are checked everywhere.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from tokenmill.kernels import interpreter_enabled, triton_available

if not triton_available():
    pytest.skip("triton cannot run here (no CUDA, TRITON_INTERPRET unset)", allow_module_level=True)

import tokenmill.kernels._common as kernel_helpers
from tokenmill.kernels.gemv import GemvConfig, gated_gemv, gemv, rms_norm_gemv
from tokenmill.kernels.quantize_rows import Q_MAX, quantize_rows, quantize_rows_reference
from tokenmill.kernels.scaled_matmul import fp8_linear, int8_linear, w8a8_linear_reference
from tokenmill.kernels.w8a8_gemm import (
    COUNTERS_OWNER,
    W8A8GemmConfig,
    default_w8a8_gemm_config,
    w8a8_gemm,
    w8a8_gemm_fits,
)
from tokenmill.models.layers.activation import SiluAndMul
from tokenmill.models.layers.norm import RMSNorm

ON_CUDA = torch.cuda.is_available() and not interpreter_enabled()
DEVICE = "cuda" if ON_CUDA else "cpu"
ACT_DTYPE = torch.bfloat16 if ON_CUDA else torch.float32
WEIGHT_DTYPES = [torch.int8, torch.float8_e4m3fn]
SMALL_GEMV = GemvConfig(block_n=8, block_k=32, num_warps=4, num_stages=1)
# kernels/gemv_tensor_core.py: the weight tiles go through tl.dot (16 rows of the repeated input)
SMALL_TENSOR_CORE = GemvConfig(block_n=16, block_k=32, num_warps=4, num_stages=2, tensor_cores=True)


def quantize_per_channel(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive per-output-channel symmetric quantization the layers' loaders make."""
    scale = weight.float().abs().amax(dim=1) / Q_MAX[dtype]
    scaled = weight.float() / scale[:, None]
    quantized = scaled.round().to(dtype) if dtype == torch.int8 else scaled.to(dtype)
    return quantized, scale


def dequantized(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return weight.float() * scale[:, None]


def _close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Float32 accumulation of the same products; rounded once to the activation dtype."""
    largest = expected.abs().max().item()
    atol = 2**-7 * largest if out.dtype == torch.bfloat16 else 1e-5 * largest
    torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=atol)


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("shape", [(40, 96), (33, 200), (130, 1000)])
@pytest.mark.parametrize("config", [None, SMALL_GEMV, SMALL_TENSOR_CORE], ids=["default", "small", "tc"])
def test_gemv_reads_8bit_weights(weight_dtype: torch.dtype, shape: tuple[int, int], config) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(1)
    out_features, in_features = shape
    x = torch.randn(1, in_features, device=DEVICE, dtype=ACT_DTYPE)
    weight, scale = quantize_per_channel(torch.randn(out_features, in_features, device=DEVICE), weight_dtype)
    bias = torch.randn(out_features, device=DEVICE, dtype=ACT_DTYPE)
    out = gemv(x, weight, bias, config, weight_scale=scale)
    assert out.dtype == ACT_DTYPE
    _close(out, x.float() @ dequantized(weight, scale).t() + bias.float())


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("config", [None, SMALL_TENSOR_CORE], ids=["default", "tc"])
def test_fused_gemvs_read_8bit_weights(weight_dtype: torch.dtype, config: GemvConfig | None) -> None:
    """The RMSNorm and SwiGLU prologues are unchanged by the weight's format (the tensor-core kernel
    takes the norm; a gated prologue stays on the CUDA cores whatever the config); the new residual is
    written once, whole."""
    torch.manual_seed(2)
    x = torch.randn(1, 96, device=DEVICE, dtype=ACT_DTYPE)
    residual = torch.randn_like(x)
    norm = RMSNorm(96, 1e-6).to(device=DEVICE, dtype=ACT_DTYPE)
    torch.nn.init.normal_(norm.weight)
    weight, scale = quantize_per_channel(torch.randn(40, 96, device=DEVICE), weight_dtype)
    out, new_residual = rms_norm_gemv(
        x, weight, norm.weight, norm.eps, residual, config=config, weight_scale=scale
    )
    normed, expected_residual = norm(x.clone(), residual.clone())
    _close(out, normed.float() @ dequantized(weight, scale).t())
    assert torch.equal(new_residual, expected_residual)
    gate_up = torch.randn(1, 192, device=DEVICE, dtype=ACT_DTYPE)
    out = gated_gemv(gate_up, weight, "silu", config=config, weight_scale=scale)
    _close(out, SiluAndMul()(gate_up).float() @ dequantized(weight, scale).t())


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
def test_wide_8bit_projections_default_to_the_tensor_cores(weight_dtype: torch.dtype) -> None:
    """At the width of a gate/up projection 8-bit weights default to the tensor-core kernel (narrower
    projections stay on the CUDA cores); either way the result is the reference's."""
    from tokenmill.kernels.gemv import TENSOR_CORE_MIN_FEATURES, default_gemv_config

    assert default_gemv_config(TENSOR_CORE_MIN_FEATURES, 64, 1).tensor_cores
    assert not default_gemv_config(TENSOR_CORE_MIN_FEATURES - 1, 64, 1).tensor_cores
    assert not default_gemv_config(TENSOR_CORE_MIN_FEATURES, 64, 2).tensor_cores
    torch.manual_seed(3)
    x = torch.randn(1, 64, device=DEVICE, dtype=ACT_DTYPE)
    weight, scale = quantize_per_channel(
        torch.randn(TENSOR_CORE_MIN_FEATURES, 64, device=DEVICE), weight_dtype
    )
    _close(gemv(x, weight, weight_scale=scale), x.float() @ dequantized(weight, scale).t())


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
def test_every_8bit_code_converts_exactly(weight_dtype: torch.dtype) -> None:
    """The GEMV forms each 8-bit weight in float32 by integer and bit operations (``as_float32`` in
    kernels/gemv_tiles.py), not conversion instructions: every one of the 256 codes (e4m3's two NaNs
    excepted) must come out as PyTorch's conversion of it. One-hot inputs pick out one column at a time; a
    power-of-two scale and a float32 output keep the products exact."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if weight_dtype == torch.float8_e4m3fn:
        codes[(codes & 0x7F) == 0x7F] = 0
    weight = codes.view(torch.int8).view(weight_dtype).reshape(4, 64).to(DEVICE)
    expected = weight.float().t()  # [64 inputs, 4 outputs]
    scale = torch.full((4,), 0.5, device=DEVICE)
    one_hot = torch.eye(64, device=DEVICE, dtype=torch.float32)
    out = torch.cat([gemv(one_hot[k : k + 1], weight, weight_scale=scale) for k in range(64)])
    assert torch.equal(out, expected * 0.5)


def test_gemv_refuses_an_8bit_weight_without_its_scale() -> None:
    x = torch.randn(1, 16, device=DEVICE)
    weight = torch.zeros(8, 16, device=DEVICE, dtype=torch.int8)
    with pytest.raises(ValueError, match="needs a float32 scale per row"):
        gemv(x, weight)
    with pytest.raises(ValueError, match="needs a float32 scale per row"):
        gemv(x, weight, weight_scale=torch.ones(4, device=DEVICE))
    with pytest.raises(ValueError, match="8-bit weights only"):
        gemv(x, torch.zeros(8, 16, device=DEVICE), weight_scale=torch.ones(8, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", [(5, 96), (3, 3000), (1, 7)])
def test_quantize_rows_matches_the_reference(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    if dtype == torch.float8_e4m3fn and not ON_CUDA:
        pytest.skip("the interpreter's float32 -> float8 conversion is wrong (see the module docstring)")
    torch.manual_seed(3)
    x = torch.randn(*shape, device=DEVICE, dtype=ACT_DTYPE) * 3
    x[0, : shape[1] // 2] = 0  # a partly zero row, and below a whole zero row
    if shape[0] > 2:
        x[2] = 0
    q, scales = quantize_rows(x, dtype)
    q_ref, scales_ref = quantize_rows_reference(x, dtype)
    assert q.dtype == dtype and scales.shape == (shape[0], 1)
    assert torch.equal(scales, scales_ref)
    assert torch.equal(q.float(), q_ref.float())
    # Dequantized, each row is within half a step (of its own scale) of the input.
    step = scales if dtype == torch.int8 else scales * 32  # e4m3: 3 mantissa bits, values up to 448
    assert bool(((q.float() * scales - x.float()).abs() <= step / 2 + 1e-6).all())


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_int8_linear_matches_the_w8a8_reference(rows: int) -> None:
    """Padded to the rows ``torch._int_mm`` takes, then cut back: the row count does not change a row."""
    torch.manual_seed(4)
    x = torch.randn(rows, 64, device=DEVICE, dtype=ACT_DTYPE)
    weight, scale = quantize_per_channel(torch.randn(48, 64, device=DEVICE), torch.int8)
    bias = torch.randn(48, device=DEVICE, dtype=ACT_DTYPE)
    out = int8_linear(x, weight, scale, bias)
    _close(out, w8a8_linear_reference(x, weight, scale, bias))
    _close(int8_linear(x[:1], weight, scale, bias), out[:1])


@pytest.mark.skipif(not ON_CUDA, reason="float8 quantization kernel: CUDA only (see the module docstring)")
@pytest.mark.parametrize("rows", [1, 16, 40])
def test_fp8_linear_matches_the_w8a8_reference(rows: int) -> None:
    torch.manual_seed(5)
    x = torch.randn(rows, 64, device=DEVICE, dtype=ACT_DTYPE)
    weight, scale = quantize_per_channel(torch.randn(48, 64, device=DEVICE), torch.float8_e4m3fn)
    bias = torch.randn(48, device=DEVICE, dtype=ACT_DTYPE)
    _close(fp8_linear(x, weight, scale, bias), w8a8_linear_reference(x, weight, scale, bias))


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("rows", [2, 40, 178])
def test_w8a8_linear_takes_decode_batches_through_tokenmills_gemm(
    weight_dtype: torch.dtype, rows: int
) -> None:
    """Whole tiles of the default configs (N and K multiples of 256): tokenmill's 8-bit GEMM, not
    ``torch._scaled_mm`` / ``torch._int_mm``, and the same result as the reference."""
    if weight_dtype == torch.float8_e4m3fn and not ON_CUDA:
        pytest.skip("float8 quantization kernel: CUDA only (see the module docstring)")
    torch.manual_seed(6)
    x = torch.randn(rows, 256, device=DEVICE, dtype=ACT_DTYPE)
    weight, scale = quantize_per_channel(torch.randn(512, 256, device=DEVICE), weight_dtype)
    bias = torch.randn(512, device=DEVICE, dtype=ACT_DTYPE)
    assert w8a8_gemm_fits(rows, weight)
    linear = fp8_linear if weight_dtype == torch.float8_e4m3fn else int8_linear
    _close(linear(x, weight, scale, bias), w8a8_linear_reference(x, weight, scale, bias))


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
def test_narrow_projections_at_small_batches_split_their_input_features(weight_dtype: torch.dtype) -> None:
    """A narrow weight with long rows at a few rows (down_proj's shape at a small batch): the default
    config splits its 8,192 input features four ways, and the linear still equals the reference."""
    if weight_dtype == torch.float8_e4m3fn and not ON_CUDA:
        pytest.skip("float8 quantization kernel: CUDA only (see the module docstring)")
    torch.manual_seed(8)
    x = torch.randn(3, 8192, device=DEVICE, dtype=ACT_DTYPE)
    weight, scale = quantize_per_channel(torch.randn(64, 8192, device=DEVICE), weight_dtype)
    assert default_w8a8_gemm_config(3, 64, 8192).split_k == 4
    assert default_w8a8_gemm_config(65, 64, 8192).split_k == 1  # beyond SPLIT_MAX_ROWS
    assert default_w8a8_gemm_config(3, 8192, 8192).split_k == 1  # wide outputs make enough tiles
    linear = fp8_linear if weight_dtype == torch.float8_e4m3fn else int8_linear
    _close(linear(x, weight, scale), w8a8_linear_reference(x, weight, scale))


SMALL_W8A8_GEMM = W8A8GemmConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("rows", [2, 17, 40])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("split_k", [1, 3])
def test_w8a8_gemm_matches_float32_products_of_the_same_operands(
    weight_dtype: torch.dtype, rows: int, with_bias: bool, split_k: int
) -> None:
    """Already-quantized operands (converted by PyTorch, so the interpreter's float8 conversion plays no
    part): float32 products and sums, the scales and bias applied once; rows past a whole row tile (17, 40
    with 16-row tiles) are masked. Split three ways over the input features, the same; the arrival
    counters are left at zero for the next launch, which gives the same bits."""
    torch.manual_seed(7)
    x = torch.randn(rows, 96, device=DEVICE)
    x_q, x_scale = quantize_per_channel(x, weight_dtype)  # one scale per row of x, as quantize_rows makes
    weight, scale = quantize_per_channel(torch.randn(64, 96, device=DEVICE), weight_dtype)
    bias = torch.randn(64, device=DEVICE, dtype=ACT_DTYPE) if with_bias else None
    config = SMALL_W8A8_GEMM._replace(split_k=split_k)
    out = w8a8_gemm(x_q, weight, x_scale[:, None], scale, bias, torch.float32, config)
    expected = dequantized(x_q, x_scale) @ dequantized(weight, scale).t()
    if bias is not None:
        expected += bias.float()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    again = w8a8_gemm(x_q, weight, x_scale[:, None], scale, bias, torch.float32, config)
    assert torch.equal(again, out)
    assert not kernel_helpers._ARRIVALS[(COUNTERS_OWNER, x.device)].any()


def test_w8a8_gemm_takes_only_decode_batches_of_whole_tiles() -> None:
    """One row is the GEMV's; beyond W8A8_GEMM_MAX_ROWS, or with partial tiles, cuBLAS's."""
    weight = torch.zeros(4096, 4096, dtype=torch.float8_e4m3fn)
    assert [w8a8_gemm_fits(rows, weight) for rows in (1, 2, 256, 257)] == [False, True, True, False]
    assert not w8a8_gemm_fits(16, torch.zeros(4096, 4000, dtype=torch.int8))
    assert not w8a8_gemm_fits(16, torch.zeros(4000, 4096, dtype=torch.int8))
    assert not w8a8_gemm_fits(16, weight.t())  # columns not contiguous
    with pytest.raises(ValueError, match="does not take 300 rows"):
        rows = torch.zeros(300, 4096, dtype=torch.float8_e4m3fn)
        w8a8_gemm(rows, weight, torch.ones(300), torch.ones(4096), None, torch.bfloat16)
    with pytest.raises(ValueError, match="does not take 16 rows"):  # int8 rows through a float8 weight
        w8a8_gemm(torch.zeros(16, 4096, dtype=torch.int8), weight, torch.ones(16), torch.ones(4096), None,
                  torch.bfloat16)  # fmt: skip


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
def test_gemv_converts_every_8bit_value_exactly(weight_dtype: torch.dtype) -> None:
    """The GEMV's integer-add conversions (not the conversion instructions) give every finite value,
    subnormal float8 included: a weight column of all of them times 1.0."""
    every_byte = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    values = every_byte if weight_dtype == torch.int8 else every_byte.view(torch.float8_e4m3fn)
    values = values[~values.float().isnan()]
    weight = values.view(-1, 1).to(DEVICE)
    x = torch.ones(1, 1, device=DEVICE, dtype=ACT_DTYPE)
    out = gemv(x, weight, out_dtype=torch.float32, weight_scale=torch.ones(len(values), device=DEVICE))
    assert torch.equal(out.view(-1).cpu(), values.float())


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_a_quantized_model_decodes_through_the_gemv(mode: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Every one-row projection of a quantized tiny Llama (fused norm and activation prologues, the LM
    head) runs the GEMV on its 8-bit weight, and gives the dequantized reference's logits."""
    from tiny_models import save_tiny_model
    from tokenmill.attention import AttentionMetadata, ForwardContext, TorchAttentionBackend, forward_context
    from tokenmill.kernels import gemv as gemv_module
    from tokenmill.kernels.options import KernelOptions
    from tokenmill.loading import load_model

    save_tiny_model("llama3", tmp_path)
    model = load_model(tmp_path, quantization=mode, device=DEVICE, dtype="float32").model
    calls: list[bool] = []
    for name in ("gemv", "rms_norm_gemv", "gated_gemv"):
        kernel = getattr(gemv_module, name)

        def counting(*args, _kernel=kernel, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(kwargs.get("weight_scale") is not None)
            return _kernel(*args, **kwargs)

        setattr(gemv_module, name, counting)
    try:
        with_gemv = model.with_kernels(KernelOptions(gemv=True))
    finally:
        for name in ("gemv", "rms_norm_gemv", "gated_gemv"):
            setattr(gemv_module, name, getattr(gemv_module, name).__kwdefaults__["_kernel"])
    tokens, positions = torch.tensor([17], device=DEVICE), torch.tensor([0], device=DEVICE)
    results = []
    for configured in (model, with_gemv):
        metadata = AttentionMetadata.for_prefill([1], DEVICE)
        with torch.inference_mode(), forward_context(ForwardContext(metadata, TorchAttentionBackend())):
            results.append(configured.compute_logits(configured(tokens, positions)))
    num_layers = len(model.model.layers)
    assert len(calls) == 4 * num_layers + 1 and all(calls)  # qkv, o, gate_up, down per layer; the head
    torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-4)
