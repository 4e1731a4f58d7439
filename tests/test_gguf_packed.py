"""GGUF weights kept packed: the raw blocks, their slices, and the packed linear layer, each compared with
gguf-py's float32 dequantization of the same bytes (the independent reference)."""

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tokenmill.loading.gguf_checkpoint import unpermute_rotary_rows
from tokenmill.loading.gguf_file import GGUFFile
from tokenmill.quantization.gguf_blocks import GGUFBlocks, concat_rows, decode_blocks
from tokenmill.quantization.gguf_packed import (
    PackedRows,
    PackedWeight,
    pack_blocks,
    pack_gguf_tensor,
    pack_parts,
)

Q = GGMLQuantizationType
QTYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K)
# Where the fp16 factors sit in a block of the formats gguf-py cannot quantize (the rest is random bits).
_K_QUANT_FP16_FIELDS = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}


def make_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> GGUFBlocks:
    rng = np.random.default_rng(seed)
    if qtype in _K_QUANT_FP16_FIELDS:
        block_size, block_bytes = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (rows, cols // block_size, block_bytes), dtype=np.uint8)
        for field in _K_QUANT_FP16_FIELDS[qtype]:
            factors = (rng.standard_normal((rows, cols // block_size, 1)) * 0.01).astype(np.float16)
            raw[:, :, field : field + 2] = factors.view(np.uint8)
        raw = raw.reshape(rows, -1)
    else:
        raw = quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    return GGUFBlocks(raw, qtype, rows, cols)


def reference(blocks: GGUFBlocks) -> torch.Tensor:
    return torch.from_numpy(dequantize(np.ascontiguousarray(blocks.data), blocks.qtype)).view(
        blocks.rows, blocks.cols
    )


def summation_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The float32 rounding any summation order may incur: K * eps * sum |x| |w| per output."""
    return x.abs() @ weight.abs().t() * weight.shape[1] * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_decoded_codes_rebuild_the_reference_weights_bit_for_bit(qtype: GGMLQuantizationType) -> None:
    blocks = make_blocks(qtype, 6, 512)
    decoded = decode_blocks(blocks)
    weight = decoded.codes.float() * decoded.scale.repeat_interleave(decoded.group, 1)
    if decoded.offset is not None:
        weight = weight + decoded.offset.repeat_interleave(decoded.group, 1)
    assert torch.equal(weight, reference(blocks))


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_packed_linear_uses_the_reference_weights_and_rows_do_not_depend_on_the_batch(
    qtype: GGMLQuantizationType,
) -> None:
    blocks = make_blocks(qtype, 40, 512)
    weight, packed = reference(blocks), pack_blocks(blocks)
    assert (packed.out_features, packed.in_features) == (40, 512)
    assert torch.equal(packed.dequantize(), weight)
    # A one-hot row picks one weight column: exact only if the kernel forms exactly the reference weights.
    assert torch.equal(packed.linear(torch.eye(512)), weight.t())
    x = torch.randn(9, 512)
    out = packed.linear(x)
    assert ((out - F.linear(x, weight)).abs() <= summation_bound(x, weight)).all()
    for rows in (1, 2, 3, 4, 5, 8):
        assert torch.equal(packed.linear(x[:rows]), out[:rows])
    bias = torch.randn(40)
    assert torch.equal(packed.linear(x.view(3, 3, 512), bias), (out + bias).view(3, 3, 40))


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_calls_of_many_rows_multiply_the_exact_weights_formed_a_slice_at_a_time(
    qtype: GGMLQuantizationType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From ``DEQUANTIZED_MIN_ROWS`` rows the kernel writes the float32 weight out (bit for bit gguf-py's)
    and BLAS multiplies it, in slices of output rows; in either input mode."""
    from tokenmill.quantization import gguf_packed
    from tokenmill.quantization.gguf_cpu_kernel import load_kernel, run_dequantize
    from tokenmill.quantization.gguf_integer_kernel import load_integer_kernel

    library = load_kernel()
    assert library is not None
    blocks = make_blocks(qtype, 40, 512)
    weight, packed = reference(blocks), pack_blocks(blocks)
    assert torch.equal(
        run_dequantize(library, packed.codes, packed.scale, packed.offset, packed.group), weight
    )
    monkeypatch.setattr(gguf_packed, "_DEQUANTIZED_SLICE", 512 * 7)  # slices of 7 rows: the last one short
    x = torch.randn(gguf_packed.DEQUANTIZED_MIN_ROWS, 512)
    for activations in ("float32", "int16", "int8"):
        out = packed.linear(x, activations=activations)  # type: ignore[arg-type]
        assert ((out - F.linear(x, weight)).abs() <= summation_bound(x, weight)).all()
    if load_integer_kernel(16) is not None:  # below the threshold the integer kernels round the inputs
        few = x[: gguf_packed.DEQUANTIZED_MIN_ROWS - 1]
        for activations in ("int16", "int8"):
            assert not torch.equal(packed.linear(few, activations=activations), packed.linear(few))  # type: ignore[arg-type]


@pytest.mark.parametrize("prologue", ["norm", "norm, residual, unit offset", "silu", "gelu_tanh"])
def test_float_inputs_form_the_norm_or_gate_rows_in_the_projections_call(prologue: str) -> None:
    """``fused_linear`` with float32 inputs: the rows the PyTorch norm / gated activation would form,
    times the exact weights (the C loop sums the squares and applies the activation in its own order)."""
    from tokenmill.quantization.gguf_prologue import GATE_PROLOGUES, NormPrologue

    blocks = make_blocks(Q.Q4_1, 40, 256)
    weight, packed = reference(blocks), pack_blocks(blocks)
    hidden, residual, scale = torch.randn(5, 256), torch.randn(5, 256), torch.rand(256) + 0.5
    if prologue in GATE_PROLOGUES:
        out, total = packed.fused_linear(torch.cat([hidden, residual], -1), GATE_PROLOGUES[prologue])  # type: ignore[misc]
        act = F.silu(hidden) if prologue == "silu" else F.gelu(hidden, approximate="tanh")
        rows = act * residual
        assert total is None
    else:
        unit = "unit" in prologue
        added = residual if "residual" in prologue else None
        out, total = packed.fused_linear(hidden, NormPrologue(scale, 1e-5, unit, added))  # type: ignore[misc]
        summed = hidden if added is None else hidden + added
        assert total is not None and torch.equal(total, summed)
        rows = (
            summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5) * (1 + scale if unit else scale)
        )
    expected = F.linear(rows, weight)
    # the rows themselves may differ in their last bits: a few float32 steps of each product, summed
    torch.testing.assert_close(out, expected, rtol=0, atol=float(8 * summation_bound(rows, weight).max()))


@pytest.mark.parametrize("activations", ["float32", "int16", "int8"])
def test_the_norm_prologue_may_store_its_sum_over_its_residual(activations: str) -> None:
    """The C decode blocks pass the residual stream as both the norm's residual and the buffer of its sum:
    at two threads, one row (shared by column blocks) and four rows (shared by rows) give what separate
    buffers give, the sum stored only once every thread has read the row."""
    from tokenmill.quantization.gguf_packed import fused_kernel
    from tokenmill.quantization.gguf_prologue import RMS_NORM, NormPrologue, run_fused

    function = fused_kernel(activations)  # type: ignore[arg-type]
    if function is None:
        pytest.skip(f"no kernel for {activations} inputs on this machine")
    packed = pack_blocks(make_blocks(Q.Q4_1, 64, 512))
    for rows in (1, 4):
        hidden, residual, scale = torch.randn(rows, 512), torch.randn(rows, 512), torch.rand(512) + 0.5
        expected, total = run_fused(
            function, hidden, packed.codes, packed.scale, packed.offset, packed.group,
            NormPrologue(scale, 1e-5, False, residual),
        )  # fmt: skip
        for _ in range(20):  # a race shows in some calls only
            in_place, out = residual.clone(), torch.empty(rows, 64)
            status = function(
                hidden.data_ptr(), rows, 512, packed.codes.data_ptr(), packed.scale.data_ptr(),
                packed.offset.data_ptr(), 64, packed.group, int(packed.codes.dtype == torch.uint8),
                int(packed.scale.dtype == torch.float16), out.data_ptr(), 2, RMS_NORM,
                in_place.data_ptr(), in_place.data_ptr(), scale.data_ptr(), 1e-5, 0,
            )  # fmt: skip
            assert status == 0 and torch.equal(in_place, total) and torch.equal(out, expected)


def test_packed_bytes_per_weight() -> None:
    sizes = {q: pack_blocks(make_blocks(q, 4, 512)).nbytes / (4 * 512) for q in QTYPES}
    assert sizes[Q.Q4_1] == sizes[Q.Q4_0] == 0.625  # nibbles + fp16 scale and offset per 32
    assert sizes[Q.Q8_0] == sizes[Q.Q5_0] == 1.0625  # int8 + an fp16 scale per 32
    assert sizes[Q.Q4_K] == 0.75  # its products of fp16 and 6-bit scales need float32
    assert sizes[Q.Q6_K] == 1.25  # int8 + a float32 scale per 16


@pytest.mark.parametrize("qtype", (Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K), ids=lambda q: q.name)
def test_shards_are_slices_of_the_weight_and_row_parallel_parts_sum_to_the_whole(
    qtype: GGMLQuantizationType,
) -> None:
    blocks = make_blocks(qtype, 24, 1024, seed=1)
    weight = reference(blocks)
    top, bottom = blocks.narrow_rows(0, 10), blocks.narrow_rows(10, 14)
    assert torch.equal(pack_blocks(top).dequantize(), weight[:10])
    assert torch.equal(reference(bottom), weight[10:])
    left, right = blocks.narrow_cols(0, 512), blocks.narrow_cols(512, 512)
    assert torch.equal(pack_blocks(right).dequantize(), weight[:, 512:])
    x = torch.randn(4, 1024)
    partial = pack_blocks(left).linear(x[:, :512]) + pack_blocks(right).linear(x[:, 512:])
    assert ((partial - F.linear(x, weight)).abs() <= summation_bound(x, weight)).all()
    corner = blocks.narrow_rows(4, 8).narrow_cols(256, 256)
    assert torch.equal(pack_blocks(corner).dequantize(), weight[4:12, 256:512])


def test_slices_off_block_boundaries_or_outside_the_tensor_are_refused() -> None:
    blocks = make_blocks(Q.Q4_K, 4, 512)
    with pytest.raises(ValueError, match="block boundaries"):
        blocks.narrow_cols(32, 256)
    with pytest.raises(ValueError, match="outside"):
        blocks.narrow_cols(256, 512)
    with pytest.raises(ValueError, match="outside"):
        blocks.narrow_rows(2, 3)
    with pytest.raises(ValueError, match="do not hold"):
        GGUFBlocks(blocks.data, Q.Q4_K, 4, 256)


def test_row_order_undoes_the_rotary_permutation_on_the_blocks() -> None:
    blocks = make_blocks(Q.Q4_1, 16, 64)
    order = unpermute_rotary_rows(torch.arange(16), num_heads=2)
    assert torch.equal(reference(blocks.take_rows(order)), unpermute_rotary_rows(reference(blocks), 2))


def test_unsupported_formats_are_named() -> None:
    raw = np.zeros((2, 64 * 4), dtype=np.uint8)
    with pytest.raises(NotImplementedError, match="F32 weights cannot be kept packed"):
        pack_gguf_tensor(raw, Q.F32, (2, 64))


def _one_tensor_per_qtype(file: GGUFFile) -> list[str]:
    first: dict[GGMLQuantizationType, str] = {}
    for name, info in file.tensors.items():
        if len(info.shape) == 2 and info.qtype in QTYPES and not name.startswith("token_embd"):
            first.setdefault(info.qtype, name)
    return list(first.values())


@pytest.mark.parametrize("fixture", ["smollm2_gguf_path", "gemma3_gguf_path"])
def test_real_model_tensors_pack_exactly(fixture: str, request: pytest.FixtureRequest) -> None:
    """SmolLM2 Q4_1 (its layers) and Gemma 3 Q4_K_M (Q5_0, Q8_0, Q4_K, Q6_K), read from the files."""
    file = GGUFFile(Path(request.getfixturevalue(fixture)))
    names = _one_tensor_per_qtype(file)
    assert names
    for name in names:
        info = file.tensors[name]
        packed = pack_gguf_tensor(file.read_blocks(info), info.qtype, info.shape)
        weight = torch.from_numpy(file.read_float32(info))
        assert torch.equal(packed.dequantize(), weight), name
        x = torch.randn(3, info.shape[1])
        assert ((packed.linear(x) - F.linear(x, weight)).abs() <= summation_bound(x, weight)).all(), name


def test_fused_parts_stack_by_rows_in_one_format_or_side_by_side_in_several() -> None:
    q, k, v = (
        make_blocks(Q.Q5_0, 8, 256, seed=2),
        make_blocks(Q.Q5_0, 4, 256, seed=3),
        make_blocks(Q.Q8_0, 4, 256),
    )
    weight = torch.cat([reference(q), reference(k), reference(v)])
    fused = pack_parts([q, k, v])
    assert isinstance(fused, PackedRows) and len(fused.parts) == 2 and fused.out_features == 16
    assert torch.equal(fused.dequantize(), weight)
    x, bias = torch.randn(3, 256), torch.randn(16)
    assert (
        (fused.linear(x, bias) - F.linear(x, weight, bias)).abs() <= summation_bound(x, weight) + 1e-6
    ).all()
    single = pack_parts([q, k])
    assert isinstance(single, PackedWeight) and torch.equal(single.dequantize(), weight[:12])
    assert torch.equal(pack_blocks(concat_rows([q, k])).codes, single.codes)
    with pytest.raises(ValueError, match="share format"):
        concat_rows([q, v])


def test_without_a_compiler_the_same_weights_run_through_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    import tokenmill.quantization.gguf_packed as gguf_packed

    blocks = make_blocks(Q.Q4_1, 8, 256)
    weight, packed = reference(blocks), pack_blocks(blocks)
    monkeypatch.setattr(gguf_packed, "load_kernel", lambda: None)
    assert torch.equal(packed.linear(torch.eye(256)), weight.t())
