"""``quantization="gguf"``: projections loaded as their packed GGUF blocks compute what the float32 model
loaded from the same file computes (bit-identical weights; float32 summation order only), with no float
copy of the weight kept, and the method is refused where it cannot work."""

from pathlib import Path

import gguf
import pytest
import torch
from torch import nn

from engine_helpers import in_thread, llm_for
from gguf_fixtures import GGUF_ARCH, save_hf_model, tiny_gguf_config, write_gguf
from test_gguf_packed import make_blocks, reference
from tiny_models import save_tiny_model
from tokenmill.errors import ModelLoadError
from tokenmill.loading import LoadedModel, load_model
from tokenmill.models.layers.linear import LinearBase
from tokenmill.quantization.gguf_integer_kernel import load_integer_kernel
from tokenmill.quantization.gguf_method import GGUFLinearMethod, packed_nbytes, packed_weight
from tokenmill.quantization.gguf_packed import PackedRows, PackedWeight
from tokenmill.quantization.shards import RowShard
from tokenmill.reference import greedy_generate

Q = gguf.GGMLQuantizationType
PROMPT = [1, 5, 9, 3, 7, 2]

NEEDS_INTEGER_KERNEL = pytest.mark.skipif(
    load_integer_kernel(16) is None, reason="needs a C compiler and AVX2"
)


def _tiny_gguf(tmp_path: Path, name: str, qtype: Q | None) -> Path:
    reference = save_hf_model(tiny_gguf_config(name), tmp_path / "hf")
    return write_gguf(reference, GGUF_ARCH[name], tmp_path / f"{name}.gguf", qtype)


def _projections(loaded: LoadedModel) -> list[LinearBase]:
    return [module for module in loaded.model.modules() if isinstance(module, LinearBase)]


@pytest.mark.parametrize(
    ("name", "qtype"), [("llama3", Q.Q8_0), ("llama3", Q.Q4_0), ("qwen2", Q.Q8_0), ("gemma3", Q.Q8_0)]
)
def test_packed_projections_compute_the_float32_models_logits(name: str, qtype: Q, tmp_path: Path) -> None:
    """llama (q/k rows un-permuted on the blocks), qwen2 (q/k/v biases), Gemma 3; Q8_0 and Q4_0."""
    path = _tiny_gguf(tmp_path, name, qtype)
    float32, packed = load_model(path, quantization="none"), load_model(path, quantization="gguf")
    layers = _projections(packed)
    assert layers and all(isinstance(layer.quant_method, GGUFLinearMethod) for layer in layers)
    floats = dict(float32.model.named_modules())
    for module_name, module in packed.model.named_modules():
        if isinstance(module, LinearBase):
            assert module.weight.numel() == 0  # a placeholder: no float32 copy is kept
            weight = module.quant_method.dequantized_weight(module, torch.float32)
            assert torch.equal(weight, floats[module_name].weight), module_name
    expected, got = greedy_generate(float32.model, PROMPT, 12), greedy_generate(packed.model, PROMPT, 12)
    torch.testing.assert_close(got.prompt_logits, expected.prompt_logits, rtol=0, atol=1e-5)
    assert got.token_ids == expected.token_ids


@pytest.mark.parametrize("name", ["llama-tied", "llama3"])
def test_a_head_stored_in_blocks_is_kept_packed(name: str, tmp_path: Path) -> None:
    """A Q8_0 embedding and head (tied: the head reads token_embd's blocks while the lookups read a float
    copy; untied: output's blocks): the head holds only blocks, equal to the float32 model's head, and
    the logits and greedy tokens are the float32 model's. A float head stays float (the tests above)."""
    reference = save_hf_model(tiny_gguf_config(name), tmp_path / "hf")
    path = write_gguf(reference, GGUF_ARCH[name], tmp_path / f"{name}.gguf", Q.Q8_0, head_qtype=Q.Q8_0)
    float32, packed = load_model(path, quantization="none"), load_model(path, quantization="gguf")
    head = packed.model.lm_head
    assert isinstance(head.quant_method, GGUFLinearMethod) and packed_nbytes(head) > 0
    dequantized = head.quant_method.dequantized_weight(head, torch.float32)
    assert torch.equal(dequantized, float32.model.lm_head.weight)
    tied = packed.model.config.tie_word_embeddings
    assert tied == (name == "llama-tied")
    assert torch.equal(packed.model.model.embed_tokens.weight, float32.model.model.embed_tokens.weight)
    expected, got = greedy_generate(float32.model, PROMPT, 12), greedy_generate(packed.model, PROMPT, 12)
    torch.testing.assert_close(got.prompt_logits, expected.prompt_logits, rtol=0, atol=1e-5)
    assert got.token_ids == expected.token_ids


def test_configured_copies_share_the_packed_weights(tmp_path: Path) -> None:
    loaded = load_model(_tiny_gguf(tmp_path, "llama3", Q.Q4_0), quantization="gguf")
    copy = loaded.model.with_kernels(loaded.model.kernel_options)
    for original, configured in zip(
        _projections(loaded), (m for m in copy.modules() if isinstance(m, LinearBase)), strict=True
    ):
        assert isinstance(packed_weight(original), PackedWeight | PackedRows)
        assert packed_weight(configured) is packed_weight(original)
    expected = greedy_generate(loaded.model, PROMPT, 6).token_ids
    assert greedy_generate(copy, PROMPT, 6).token_ids == expected


def test_gguf_is_refused_where_it_cannot_work(tmp_path: Path) -> None:
    folder = tmp_path / "safetensors"
    save_tiny_model("llama3", folder)
    with pytest.raises(ModelLoadError, match=r"'gguf' keeps a GGUF file's blocks packed and needs a \.gguf"):
        load_model(folder, quantization="gguf")
    with pytest.raises(ModelLoadError, match=r"needs a \.gguf checkpoint; dummy weights"):
        load_model("smollm2-135m", load_format="dummy", quantization="gguf")
    quantized = _tiny_gguf(tmp_path / "q", "llama3", Q.Q8_0)
    with pytest.raises(ModelLoadError, match="'gguf' runs on the CPU only"):
        load_model(quantized, device="cuda", quantization="gguf")
    float_file = _tiny_gguf(tmp_path / "f", "llama3", None)  # F32 projections: nothing packed to keep
    with pytest.raises(ModelLoadError, match="not GGUF blocks: quantization 'gguf' keeps only"):
        load_model(float_file, quantization="gguf")


def test_auto_packs_only_a_float32_gguf_on_the_cpu_in_kernel_formats(tmp_path: Path) -> None:
    """``quantization`` auto (the default): ``gguf`` for a .gguf file whose projections the kernel reads,
    loaded in float32 on the CPU; float weights for other files, dtypes and models; an engine on the CPU
    given no other flags runs the packed projections with float32 inputs."""
    from tokenmill.llm import LLM

    packable = _tiny_gguf(tmp_path / "q", "llama3", Q.Q4_0)
    assert load_model(packable).quantization == "gguf"
    assert load_model(packable, dtype="bfloat16").quantization == "none"
    assert load_model(packable, quantization="none").quantization == "none"
    assert load_model(_tiny_gguf(tmp_path / "f", "llama3", None)).quantization == "none"  # F32 projections
    assert load_model(_tiny_gguf(tmp_path / "g", "gpt2", Q.Q8_0)).quantization == "none"  # Conv1D layout
    folder = tmp_path / "safetensors"
    save_tiny_model("llama3", folder)
    assert load_model(folder).quantization == "none"
    assert load_model("smollm2-135m", load_format="dummy").quantization == "none"
    llm = LLM(str(packable), device="cpu", max_model_len=64)  # a GPU host's auto device is cuda
    assert llm.engine.config.quantization == "gguf"
    assert llm.engine.kernel_options.gguf_activations == "float32"
    assert "; weights gguf packed, float32 inputs;" in llm.engine.describe_startup()
    assert all(layer.weight.numel() == 0 for layer in _projections(llm.engine.loaded))


@pytest.mark.parametrize(
    ("model", "inputs"),
    [
        ("smollm2", "float32"),
        ("gemma3", "float32"),
        pytest.param("smollm2", "int16", marks=NEEDS_INTEGER_KERNEL),
    ],
)
def test_real_models_through_the_gguf_method_decode_the_float32_greedy_tokens(
    model: str, inputs: str, request: pytest.FixtureRequest
) -> None:
    """SmolLM2 Q4_1 (the default model) and Gemma 3 Q4_K_M (Q5_0 q/k beside Q8_0 v: a fused weight in
    two formats) loaded with ``quantization="gguf"``, with float32 inputs (the default), and SmolLM2 with
    int16 ones (Gemma 3's are in the accuracy bench's report): 32 greedy tokens (Gemma 3, whose 262k-token
    head makes each step slow: 16; tests/test_gguf.py compares 48 of its default path with transformers)
    of one sequence and of four together equal those of the float32 engine (over conftest's shared float32
    load of the same file)."""
    from tokenmill.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    path = str(request.getfixturevalue(f"{model}_gguf_path"))
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "List three colors:"]
    params = SamplingParams(max_tokens=32 if model == "smollm2" else 16, temperature=0.0, ignore_eos=True)

    def greedy(llm: LLM, batch: list[str]) -> list[list[int]]:
        return [list(out.outputs[0].token_ids) for out in in_thread(lambda: llm.generate(batch, params))]

    float32 = llm_for(request.getfixturevalue(f"{model}_float32"), max_model_len=128, max_num_seqs=4)
    expected = greedy(float32, prompts[:1]), greedy(float32, prompts)
    del float32
    packed = LLM(
        path, device="cpu", max_model_len=128, max_num_seqs=4, quantization="gguf", gguf_activations=inputs
    )
    layers = [m for m in packed.engine.runner.model.modules() if isinstance(m, LinearBase)]
    assert len(layers) == 4 * packed.engine.model_config.num_layers
    assert all(layer.weight.numel() == 0 for layer in layers)
    assert packed_nbytes(packed.engine.runner.model.lm_head) > 0  # both tie a Q8_0 head to token_embd
    assert (greedy(packed, prompts[:1]), greedy(packed, prompts)) == expected


def test_a_rank_keeps_its_rows_and_block_aligned_columns_of_each_part() -> None:
    """Tensor-parallel shards without processes: a column-parallel rank of a fused weight whose parts
    arrive out of order (and in two formats), and a row-parallel rank's column slice."""
    method = GGUFLinearMethod()
    q, v = make_blocks(Q.Q4_1, 8, 256, seed=1), make_blocks(Q.Q8_0, 4, 256, seed=2)
    fused = nn.Module()
    method.create_weights(fused, 6, 256, lambda *args: None)
    method.load(fused, fused.weight, v, RowShard(4, 2, 2, 4))  # rank 1 of 2: v rows 2-3 go last
    method.load(fused, fused.weight, q, RowShard(8, 4, 4, 0))  # q rows 4-7 go first
    expected = torch.cat([reference(q)[4:8], reference(v)[2:4]])
    assert torch.equal(packed_weight(fused).dequantize(), expected)

    row_parallel = nn.Module()
    method.create_weights(row_parallel, 8, 128, lambda *args: None)
    method.load(row_parallel, row_parallel.weight, q, RowShard(8, 0, 8, 0, (256, 128, 128)))
    assert torch.equal(packed_weight(row_parallel).dequantize(), reference(q)[:, 128:])
    with pytest.raises(ValueError, match="block boundaries"):
        method.load(row_parallel, row_parallel.weight, q, RowShard(8, 0, 8, 0, (256, 16, 128)))
