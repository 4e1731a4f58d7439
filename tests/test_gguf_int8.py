"""``gguf_int8_activations``: packed GGUF projections whose inputs are rounded to int8 per block of 32
and multiplied as integers (``quantization/gguf_int8_kernel.py``), against a naive PyTorch reference of
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
from tokenmill.quantization.gguf_int8_kernel import load_int8_kernel
from tokenmill.quantization.gguf_packed import pack_blocks
from tokenmill.quantization.gguf_prologue import GATE_PROLOGUES, NormPrologue, run_fused

pytestmark = pytest.mark.skipif(load_int8_kernel() is None, reason="needs a C compiler and an AVX2 CPU")
Q = GGMLQuantizationType


def naive_int8_linear(x: torch.Tensor, qtype: GGMLQuantizationType, blocks: object) -> torch.Tensor:
    """``sum_g scale * step * sum(code * q) + offset * sum(x)`` in float64, from the decoded codes: each
    row of ``x`` rounded to int8 per block of 32 (step = max|x| / 127, round half to even)."""
    decoded = decode_blocks(blocks)  # type: ignore[arg-type]
    rows, cols = x.shape
    chunks = x.view(rows, cols // 32, 32)
    amax = chunks.abs().amax(-1, keepdim=True)
    # a tensor divided by a tensor: ``127.0 / amax`` is computed as 127 * (1 / amax), rounded twice
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(chunks * inverse).double().view(rows, cols)
    step = (amax / 127.0).double().repeat_interleave(32, 1).view(rows, cols)
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


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_the_kernel_computes_the_naive_int8_products_and_rows_do_not_depend_on_the_batch(
    qtype: GGMLQuantizationType,
) -> None:
    """Every format (4-bit with and without offsets, 8-bit, K-quants with groups of 32 and 16); 544 input
    features = 17 blocks: the 8-block loop, then pairs, then a single block."""
    cols = 512 if qtype in (Q.Q4_K, Q.Q6_K) else 544  # K-quants come in super-blocks of 256
    blocks = make_blocks(qtype, 37, cols)
    packed = pack_blocks(blocks)
    x = torch.randn(9, cols)
    x[3] = 0.0  # an all-zero row: step 0, codes 0
    kernel = load_int8_kernel().gguf_linear_int8  # type: ignore[union-attr]
    out, total = run_fused(kernel, x, packed.codes, packed.scale, packed.offset, packed.group)
    assert total is None
    error = (out.double() - naive_int8_linear(x, qtype, blocks)).abs()
    assert (error <= _bound(x, blocks) + 1e-6).all()
    for rows in (1, 2, 3, 4, 5, 8):
        assert torch.equal(packed.linear(x[:rows], int8_activations=True), out[:rows])


def test_int8_inputs_stay_close_to_the_float_products() -> None:
    """The rounding of the inputs costs about 1% of an output's scale, not more (Q8_0 weights)."""
    blocks = make_blocks(Q.Q8_0, 64, 1024)
    packed = pack_blocks(blocks)
    x = torch.randn(4, 1024)
    exact = F.linear(x, packed.dequantize())
    rounded = packed.linear(x, int8_activations=True)
    assert (rounded - exact).norm() / exact.norm() < 0.02
    assert not torch.equal(rounded, packed.linear(x))  # the toggle does change the arithmetic


@pytest.mark.parametrize(("unit_offset", "with_residual"), [(False, True), (True, False)])
def test_the_norm_prologue_normalizes_the_sum_before_rounding(unit_offset: bool, with_residual: bool) -> None:
    blocks = make_blocks(Q.Q4_1, 40, 256)
    packed = pack_blocks(blocks)
    hidden, residual, weight = torch.randn(5, 256), torch.randn(5, 256), torch.rand(256) + 0.5
    prologue = NormPrologue(weight, 1e-5, unit_offset, residual if with_residual else None)
    out, total = packed.fused_linear(hidden, prologue, int8_activations=True)  # type: ignore[misc]
    summed = hidden + residual if with_residual else hidden
    assert total is not None and torch.equal(total, summed)
    normed = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5)
    normed = normed * (1.0 + weight if unit_offset else weight)
    expected = naive_int8_linear(normed, Q.Q4_1, blocks)
    # the C norm sums the squares in another order: an input may round to the neighbouring code
    one_code = packed.dequantize().abs().amax() * normed.abs().amax() / 127
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=float(4 * one_code))


@pytest.mark.parametrize("kind", sorted(GATE_PROLOGUES))
def test_the_gate_prologue_multiplies_the_activation_into_the_up_half(kind: str) -> None:
    blocks = make_blocks(Q.Q8_0, 24, 256)
    packed = pack_blocks(blocks)
    gate_up = torch.randn(3, 512)
    out, total = packed.fused_linear(gate_up, GATE_PROLOGUES[kind], int8_activations=True)  # type: ignore[misc]
    assert total is None
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) if kind == "silu" else F.gelu(gate, approximate="tanh")
    expected = naive_int8_linear(act * up, Q.Q8_0, blocks)
    one_code = packed.dequantize().abs().amax() * (act * up).abs().amax() / 127
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=float(4 * one_code))


def test_the_real_default_model_with_int8_inputs_agrees_with_the_float32_model(
    request: pytest.FixtureRequest,
) -> None:
    """SmolLM2 Q4_1 with ``quantization="gguf"`` and ``gguf_int8_activations``: teacher-forced over a
    prompt of 54 tokens, its top-1 token agrees with the float32 engine's at >= 90% of the positions (the
    accuracy benchmark measures this on 4,096 tokens), and the greedy continuation starts the same."""
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
    packed = LLM(str(request.getfixturevalue("smollm2_gguf_path")), max_model_len=256, max_num_seqs=1,
                 quantization="gguf", gguf_int8_activations=True)  # fmt: skip
    assert packed.engine.config.kernels.gguf_int8_activations
    assert packed.engine.runner.model.model._decode_blocks is not None  # decode steps take the C blocks
    top, tokens = run(packed)
    agreement = sum(a == b for a, b in zip(top, expected_top, strict=True)) / len(top)
    assert len(top) >= 50 and agreement >= 0.9, agreement
    assert tokens[:4] == expected_tokens[:4]


def test_inputs_of_the_wrong_shape_are_refused_before_the_c_loop_reads_them() -> None:
    packed = pack_blocks(make_blocks(Q.Q8_0, 8, 64))
    with pytest.raises(ValueError, match=r"the weight takes \[rows, 128\] float32"):
        packed.fused_linear(
            torch.randn(2, 64), GATE_PROLOGUES["silu"], int8_activations=True
        )  # a gate needs 2K
    with pytest.raises(ValueError, match=r"norm weight of shape \(32,\)"):
        packed.fused_linear(torch.randn(2, 64), NormPrologue(torch.ones(32), 1e-6, False, None))
    with pytest.raises(ValueError, match="residual of shape"):
        packed.fused_linear(torch.randn(2, 64), NormPrologue(torch.ones(64), 1e-6, False, torch.ones(3, 64)))
    assert packed.linear(torch.randn(0, 64), int8_activations=True).shape == (0, 8)


@pytest.mark.parametrize("int8", [True, False], ids=["int8-inputs", "float-inputs"])
@pytest.mark.parametrize(("name", "qtype", "in_c"), [("llama3", Q.Q4_0, True), ("qwen2", Q.Q8_0, False)])
def test_decode_steps_through_the_c_blocks_give_the_python_paths_tokens_and_logprobs_bit_for_bit(
    name: str,
    qtype: GGMLQuantizationType,
    in_c: bool,
    int8: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``gguf_decode_blocks`` calls the same kernels in the same order as the Python blocks, with int8 or
    float32 inputs: three sequences of different lengths decode the same tokens with the same logprobs.
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
        llm = LLM(path, max_model_len=64, max_num_seqs=3, quantization="gguf", gguf_int8_activations=int8,
                  **options)  # fmt: skip
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
