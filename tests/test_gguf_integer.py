"""``gguf_activations`` int16 and int8: packed GGUF projections whose inputs are rounded per block of 32
and multiplied as integers (``quantization/gguf_integer_kernel.py``), against a naive PyTorch reference of
the same arithmetic built from gguf-py's decoded codes, and in the engine against the float32 model."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from engine_helpers import in_thread, llm_for
from gguf_fixtures import GGUF_ARCH, save_hf_model, tiny_gguf_config, write_gguf
from test_gguf_packed import QTYPES, make_blocks
from tokenmill.quantization.gguf_blocks import decode_blocks
from tokenmill.quantization.gguf_integer_kernel import integer_function, load_integer_kernel
from tokenmill.quantization.gguf_packed import pack_blocks
from tokenmill.quantization.gguf_prologue import GATE_PROLOGUES, NormPrologue, run_fused

pytestmark = pytest.mark.skipif(load_integer_kernel(8) is None, reason="needs a C compiler and an AVX2 CPU")
Q = GGMLQuantizationType
INPUTS = {8: "int8", 16: "int16"}  # bits -> gguf_activations
BITS = pytest.mark.parametrize("bits", sorted(INPUTS), ids=lambda bits: f"int{bits}")


def naive_integer_linear(
    x: torch.Tensor, qtype: GGMLQuantizationType, blocks: object, bits: int
) -> torch.Tensor:
    """``sum_g scale * step * sum(code * q) + offset * sum(x)`` in float64, from the decoded codes: each
    row of ``x`` rounded to ``bits``-bit integers per block of 32 (step = max|x| / (2^(bits-1) - 1),
    round half to even)."""
    decoded = decode_blocks(blocks)  # type: ignore[arg-type]
    top = float(2 ** (bits - 1) - 1)
    rows, cols = x.shape
    chunks = x.view(rows, cols // 32, 32)
    amax = chunks.abs().amax(-1, keepdim=True)
    # a tensor divided by a tensor: ``top / amax`` is computed as top * (1 / amax), rounded twice
    inverse = torch.where(amax > 0, torch.full_like(amax, top) / amax, torch.zeros_like(amax))
    q = torch.round(chunks * inverse).double().view(rows, cols)
    step = (amax / top).double().repeat_interleave(32, 1).view(rows, cols)
    group = decoded.group
    codes = decoded.codes.double().view(-1, cols // group, group)  # [N, groups, group]
    integer_sums = torch.einsum("ngi,mgi->mng", codes, q.view(rows, cols // group, group))
    group_step = step.view(rows, cols // group, group)[..., 0]  # a group lies inside one block of 32
    out = (integer_sums * decoded.scale.double()[None] * group_step[:, None]).sum(-1)
    if decoded.offset is not None:
        x_sums = x.double().view(rows, cols // group, group).sum(-1)
        out = out + x_sums @ decoded.offset.double().t()
    return out


def _bound(x: torch.Tensor, blocks: object) -> torch.Tensor:
    """Float32 rounding of the kernel's sums in another order: K * eps * sum |x| |w| per output."""
    weight = pack_blocks(blocks).dequantize()  # type: ignore[arg-type]
    return (x.abs() @ weight.abs().t()).double() * x.shape[1] * torch.finfo(torch.float32).eps


@BITS
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_the_kernel_computes_the_naive_integer_products_and_rows_do_not_depend_on_the_batch(
    qtype: GGMLQuantizationType, bits: int
) -> None:
    """Every format (4-bit with and without offsets, 8-bit, K-quants with groups of 32 and 16); 544 input
    features = 17 blocks: the 8-block loop, then pairs, then a single block."""
    cols = 512 if qtype in (Q.Q4_K, Q.Q6_K) else 544  # K-quants come in super-blocks of 256
    blocks = make_blocks(qtype, 37, cols)
    packed = pack_blocks(blocks)
    x = torch.randn(9, cols)
    x[3] = 0.0  # an all-zero row: step 0, codes 0
    out, total = run_fused(integer_function(bits), x, packed.codes, packed.scale, packed.offset, packed.group)
    assert total is None
    error = (out.double() - naive_integer_linear(x, qtype, blocks, bits)).abs()
    assert (error <= _bound(x, blocks) + 1e-6).all()
    for rows in (1, 2, 3, 4, 5, 8):
        assert torch.equal(packed.linear(x[:rows], activations=INPUTS[bits]), out[:rows])


@pytest.mark.parametrize(("bits", "relative_error"), [(8, (2e-3, 2e-2)), (16, (1e-6, 1e-4))])
def test_integer_inputs_stay_close_to_the_float_products(
    bits: int, relative_error: tuple[float, float]
) -> None:
    """The rounding of the inputs costs about 1% of an output's scale at 8 bits and ~1e-5 at 16, more
    than float32's rounding and no more than that (Q8_0 weights)."""
    blocks = make_blocks(Q.Q8_0, 64, 1024)
    packed = pack_blocks(blocks)
    x = torch.randn(4, 1024)
    exact = F.linear(x.double(), packed.dequantize().double())
    rounded = packed.linear(x, activations=INPUTS[bits])
    low, high = relative_error
    assert low < float((rounded.double() - exact).norm() / exact.norm()) < high


def test_the_largest_codes_times_the_largest_16_bit_inputs_neither_overflow_nor_saturate() -> None:
    """8-bit codes of -128 and 127 times inputs rounded to -32767: a lane adds 4 products of up to 128 *
    32767 (below 2^24) as int32, with no 16-bit intermediate to saturate. Unit factors; one input value."""
    packed = pack_blocks(make_blocks(Q.Q8_0, 4, 64))
    codes = packed.codes.clone()
    codes[0], codes[1], codes[2], codes[3] = -128, 127, 1, -1
    x = torch.full((1, 64), -3.0)  # every input rounds to -32767, with a step of 3 / 32767
    out, _ = run_fused(integer_function(16), x, codes, torch.ones_like(packed.scale), None, packed.group)
    step = float(torch.tensor(3.0) / 32767.0)
    expected = torch.tensor([-128.0, 127.0, 1.0, -1.0], dtype=torch.float64) * 64 * -32767.0 * step
    torch.testing.assert_close(out[0].double(), expected, rtol=1e-6, atol=0)


@BITS
@pytest.mark.parametrize(("unit_offset", "with_residual"), [(False, True), (True, False)])
def test_the_norm_prologue_normalizes_the_sum_before_rounding(
    unit_offset: bool, with_residual: bool, bits: int
) -> None:
    blocks = make_blocks(Q.Q4_1, 40, 256)
    packed = pack_blocks(blocks)
    hidden, residual, weight = torch.randn(5, 256), torch.randn(5, 256), torch.rand(256) + 0.5
    prologue = NormPrologue(weight, 1e-5, unit_offset, residual if with_residual else None)
    out, total = packed.fused_linear(hidden, prologue, activations=INPUTS[bits])  # type: ignore[misc]
    summed = hidden + residual if with_residual else hidden
    assert total is not None and torch.equal(total, summed)
    normed = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5)
    normed = normed * (1.0 + weight if unit_offset else weight)
    expected = naive_integer_linear(normed, Q.Q4_1, blocks, bits)
    # the C norm sums the squares in another order: an input may round to the neighbouring code
    one_code = packed.dequantize().abs().amax() * normed.abs().amax() / (2 ** (bits - 1) - 1)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=float(4 * one_code))


@BITS
@pytest.mark.parametrize("kind", sorted(GATE_PROLOGUES))
def test_the_gate_prologue_multiplies_the_activation_into_the_up_half(kind: str, bits: int) -> None:
    blocks = make_blocks(Q.Q8_0, 24, 256)
    packed = pack_blocks(blocks)
    gate_up = torch.randn(3, 512)
    out, total = packed.fused_linear(gate_up, GATE_PROLOGUES[kind], activations=INPUTS[bits])  # type: ignore[misc]
    assert total is None
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) if kind == "silu" else F.gelu(gate, approximate="tanh")
    expected = naive_integer_linear(act * up, Q.Q8_0, blocks, bits)
    one_code = packed.dequantize().abs().amax() * (act * up).abs().amax() / (2 ** (bits - 1) - 1)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=float(4 * one_code))


@pytest.mark.parametrize(("inputs", "least_agreement", "equal_tokens"), [("int16", 1.0, 8), ("int8", 0.9, 4)])
def test_the_real_default_model_with_integer_inputs_agrees_with_the_float32_model(
    inputs: str, least_agreement: float, equal_tokens: int, request: pytest.FixtureRequest
) -> None:
    """SmolLM2 Q4_1 with ``quantization="gguf"``, teacher-forced over a prompt of 54 tokens prefilled 16
    at a time (so that every position goes through the C blocks and the integer kernel): with int16
    inputs every top-1 token and the 8 greedy tokens are the float32 engine's; with int8 inputs the top-1
    agrees at >= 90% of the positions (the accuracy benchmark measures both on 4,096 tokens) and the
    greedy continuation starts the same."""
    from tokenmill.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    text = (
        "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based inks and a wooden press adapted from those used for wine. "
        "Within decades, printers had set up shops across Europe, and the price of books fell sharply."
    )
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=1)

    def run(llm: LLM) -> tuple[list[int], list[int]]:
        output = in_thread(lambda: llm.generate([text], params))[0]
        top = [max(entry.items(), key=lambda kv: kv[1].logprob)[0] for entry in output.prompt_logprobs[1:]]
        return top, list(output.outputs[0].token_ids)

    float32 = llm_for(request.getfixturevalue("smollm2_float32"), max_model_len=256, max_num_seqs=1)
    expected_top, expected_tokens = run(float32)
    del float32
    packed = LLM(str(request.getfixturevalue("smollm2_gguf_path")), device="cpu", max_model_len=256,
                 max_num_seqs=1, max_num_batched_tokens=16, gguf_activations=inputs)  # fmt: skip
    assert packed.engine.kernel_options.gguf_activations == inputs
    assert packed.engine.runner.model.model._decode_blocks is not None  # decode steps take the C blocks
    top, tokens = run(packed)
    agreement = sum(a == b for a, b in zip(top, expected_top, strict=True)) / len(top)
    assert len(top) >= 50 and agreement >= least_agreement, agreement
    assert tokens[:equal_tokens] == expected_tokens[:equal_tokens]


def test_inputs_of_the_wrong_shape_are_refused_before_the_c_loop_reads_them() -> None:
    packed = pack_blocks(make_blocks(Q.Q8_0, 8, 64))
    with pytest.raises(ValueError, match=r"the weight takes \[rows, 128\] float32"):
        packed.fused_linear(
            torch.randn(2, 64), GATE_PROLOGUES["silu"], activations="int16"
        )  # a gate needs 2K
    with pytest.raises(ValueError, match=r"norm weight of shape \(32,\)"):
        packed.fused_linear(torch.randn(2, 64), NormPrologue(torch.ones(32), 1e-6, False, None))
    with pytest.raises(ValueError, match="residual of shape"):
        packed.fused_linear(torch.randn(2, 64), NormPrologue(torch.ones(64), 1e-6, False, torch.ones(3, 64)))
    assert packed.linear(torch.randn(0, 64), activations="int16").shape == (0, 8)


@pytest.mark.parametrize("inputs", ["int16", "int8", "float32"])
@pytest.mark.parametrize(("name", "qtype", "in_c"), [("llama3", Q.Q4_0, True), ("qwen2", Q.Q8_0, False)])
def test_decode_steps_through_the_c_blocks_give_the_python_paths_tokens_and_logprobs_bit_for_bit(
    name: str,
    qtype: GGMLQuantizationType,
    in_c: bool,
    inputs: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``gguf_decode_blocks`` calls the same kernels in the same order as the Python blocks, with integer
    or float32 inputs: three sequences of different lengths decode the same tokens with the same logprobs.
    Plain Llama blocks take the C loop (its runs counted); Qwen2's biased q/k/v keep the Python one."""
    from tokenmill.llm import LLM
    from tokenmill.quantization.gguf_decode_blocks import DecodeBlocks
    from tokenmill.sampling_params import SamplingParams

    reference = save_hf_model(tiny_gguf_config(name), tmp_path / "hf")
    path = str(write_gguf(reference, GGUF_ARCH[name], tmp_path / f"{name}.gguf", qtype))
    prompts = [{"prompt_token_ids": ids} for ids in ([1, 5, 9, 3, 7, 2], [4, 4, 8], list(range(3, 40)))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    ran = []
    original = DecodeBlocks.run
    monkeypatch.setattr(DecodeBlocks, "run", lambda self, *a: ran.append(original(self, *a)) or ran[-1])

    def decode(**options: object) -> list[tuple[list[int], list[dict]]]:
        llm = LLM(path, device="cpu", max_model_len=64, max_num_seqs=3, quantization="gguf",
                  gguf_activations=inputs, **options)  # fmt: skip
        outputs = in_thread(lambda: llm.generate(prompts, params))
        return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]

    python = decode(gguf_decode_blocks=False)
    assert not ran
    c_blocks = decode()
    assert (sum(r is not None for r in ran) >= 11) == in_c
    for (tokens, logprobs), (expected_tokens, expected_logprobs) in zip(c_blocks, python, strict=True):
        assert tokens == expected_tokens
        for got, expected in zip(logprobs, expected_logprobs, strict=True):
            assert {t: lp.logprob for t, lp in got.items()} == {t: lp.logprob for t, lp in expected.items()}


def test_integer_inputs_are_refused_where_the_kernel_cannot_be_built(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenmill.config import KernelConfig
    from tokenmill.engine.hardware_defaults import gguf_activations
    from tokenmill.quantization import gguf_packed

    with pytest.raises(ValueError, match="gguf_activations"):
        KernelConfig(gguf_activations="int4")  # type: ignore[arg-type]
    monkeypatch.setattr(gguf_packed, "load_integer_kernel", lambda bits: None)
    with pytest.raises(ValueError, match="'int16' needs the integer kernel, which needs an AVX2 CPU"):
        gguf_activations("int16")
    assert gguf_activations("float32") == "float32"
