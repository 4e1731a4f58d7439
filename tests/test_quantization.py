"""Quantized weights (tokenmill.quantization) against independent references: naive per-channel
quantization of the float weights, transformers running the dequantized weights, and float checkpoints of
what pre-quantized checkpoints stand for."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.pytorch_utils import Conv1D

from quant_reference import naive_fp8, naive_int8, published_config, write_prequantized
from tiny_models import VOCAB, save_tiny_model, tiny_configs
from tokenmill.errors import ModelLoadError
from tokenmill.loading import load_model
from tokenmill.quantization import Int8LinearMethod
from tokenmill.reference import greedy_generate

NAIVE = {"int8": naive_int8, "fp8": naive_fp8}
PROMPT = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(3)).tolist()
# float32 end to end, like the HF-parity tests: only summation order differs from the reference
LOGIT_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    saved = {}
    for name in sorted(tiny_configs()):
        saved[name] = tmp_path_factory.mktemp(name)
        save_tiny_model(name, saved[name])
    return saved


def _dequantize_like_tokenmill(reference: nn.Module, mode: str) -> None:
    """Replace every projection of the transformers model (and an untied LM head) by its naive per-channel
    quantization, dequantized; q, k and v quantize separately, which per-row scales make equivalent."""
    tied = reference.config.tie_word_embeddings
    for name, module in reference.named_modules():
        if name == "lm_head" and tied:
            continue
        if isinstance(module, nn.Linear):
            quantized, scale = NAIVE[mode](module.weight.data)
            module.weight.data = quantized.float() * scale[:, None]
        elif isinstance(module, Conv1D):  # GPT-2 stores [in, out]: a channel is a column
            quantized, scale = NAIVE[mode](module.weight.data.T)
            module.weight.data = (quantized.float() * scale[:, None]).T.contiguous()


def _prompt_logits(model: nn.Module) -> torch.Tensor:
    return greedy_generate(model, PROMPT, 1).prompt_logits  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["int8", "fp8"])
@pytest.mark.parametrize("name", sorted(tiny_configs()))
def test_quantized_logits_equal_transformers_on_dequantized_weights(
    folders: dict[str, Path], name: str, mode: str
) -> None:
    reference = AutoModelForCausalLM.from_pretrained(folders[name], torch_dtype=torch.float32).eval()
    float_logits = reference(torch.tensor([PROMPT])).logits[0, -1].detach()
    _dequantize_like_tokenmill(reference, mode)
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0, -1]
    ours = _prompt_logits(load_model(folders[name], quantization=mode).model)
    assert torch.allclose(ours, expected, atol=LOGIT_TOLERANCE, rtol=0), (ours - expected).abs().max()
    drift = (ours - float_logits).abs().max() / float_logits.abs().max()
    assert 0 < drift < (0.05 if mode == "int8" else 0.2), drift  # quantized, by its rounding only


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_stored_weights_equal_naive_quantization_of_float_weights(
    folders: dict[str, Path], mode: str
) -> None:
    """llama3: fused q/k/v and gate/up (each shard quantized as it arrives), an untied LM head."""
    floats = load_model(folders["llama3"]).model
    quantized = load_model(folders["llama3"], quantization=mode).model
    float_modules = dict(floats.named_modules())
    checked = 0
    for name, module in quantized.named_modules():
        if getattr(module, "quant_method", None) is None or not module.quant_method.quantized:
            continue
        weight, scale = NAIVE[mode](float_modules[name].weight.data)
        assert module.quant_method.name == mode
        assert module.weight.dtype == weight.dtype and module.weight.is_contiguous()
        assert torch.equal(module.weight.view(torch.int8), weight.view(torch.int8)), name
        assert module.weight_scale.dtype == torch.float32
        torch.testing.assert_close(module.weight_scale, scale, rtol=1e-6, atol=0)
        checked += 1
    assert checked == 3 * 4 + 1  # qkv, o, gate_up, down per layer, and the LM head


def test_tied_lm_head_stays_float_and_untied_is_quantized(folders: dict[str, Path]) -> None:
    tied = load_model(folders["qwen3"], quantization="int8").model
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert tied.lm_head.weight.dtype == torch.float32 and not tied.lm_head.quant_method.quantized
    untied = load_model(folders["llama3"], quantization="int8").model
    assert untied.lm_head.weight.dtype == torch.int8
    assert untied.model.embed_tokens.weight.dtype == torch.float32


def test_int8_cpu_paths_equal_the_dequantized_weight(folders: dict[str, Path]) -> None:
    """One row through ATen's int8 weight-only kernel, more through the dequantized weight."""
    layer = load_model(folders["llama3"], quantization="int8").model.model.layers[0].mlp.down_proj
    assert isinstance(layer.quant_method, Int8LinearMethod)
    assert layer._matmul.func.__name__ == "int8_cpu_linear"
    for rows in (1, 5):
        x = torch.randn(rows, layer.in_local)
        expected = x @ (layer.weight.float() * layer.weight_scale[:, None]).T
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_engine_greedy_tokens_equal_the_reference_loop(folders: dict[str, Path]) -> None:
    """The engine (configured layers, oneDNN option on, paged KV) over a quantized model."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(folders["llama3"]), quantization="int8", device="cpu", num_kv_blocks=32)
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=12))
    reference = greedy_generate(llm.engine.loaded.model, PROMPT, 12).token_ids
    assert out[0].outputs[0].token_ids == reference


@pytest.mark.parametrize("fmt", ["fp8_block", "int8_ct"])
@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_prequantized_checkpoint_equals_its_dequantized_weights(
    folders: dict[str, Path], tmp_path: Path, name: str, fmt: str
) -> None:
    folder = write_prequantized(folders[name], tmp_path / fmt, fmt)
    loaded = load_model(folder)
    layer = loaded.model.model.layers[0].self_attn.qkv_proj
    expected_name = "fp8_block" if fmt == "fp8_block" else "int8"
    assert layer.quant_method.name == expected_name and layer.weight.element_size() == 1
    assert not loaded.model.lm_head.quant_method.quantized  # published float (ignored / not converted)
    ours = _prompt_logits(loaded.model)
    expected = _prompt_logits(load_model(folder / "dequantized").model)
    assert torch.allclose(ours, expected, atol=LOGIT_TOLERANCE, rtol=0), (ours - expected).abs().max()
    same = load_model(
        folder, quantization="fp8" if fmt == "fp8_block" else "int8"
    )  # asking for its own format
    assert torch.equal(_prompt_logits(same.model), ours)


def test_block_scales_must_not_straddle_fused_shards(folders: dict[str, Path], tmp_path: Path) -> None:
    """128-row blocks: llama3's q is 64 rows, so q and k would share a block of scales."""
    folder = write_prequantized(folders["llama3"], tmp_path / "fp8", "fp8_block", (128, 128))
    with pytest.raises(ModelLoadError, match=r"do not fall on 128-(row|element) blocks"):
        load_model(folder)


@pytest.mark.parametrize(
    ("quantization_config", "named"),
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, "'awq'"),
        ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "per-tensor"),
        ({**published_config("fp8_block"), "activation_scheme": "static"}, "static"),
        ({**published_config("int8_ct"), "format": "pack-quantized"}, "pack-quantized"),
        ({**published_config("int8_ct"), "format": "float-quantized"}, "compressed-tensors weights"),
        ({**published_config("int8_ct"), "ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}, "ignore"),
    ],
)
def test_unsupported_published_quantization_is_a_clear_error(
    folders: dict[str, Path], tmp_path: Path, quantization_config: dict, named: str
) -> None:
    shutil.copytree(folders["llama3"], tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=named):
        load_model(tmp_path / "model")


def test_requested_quantization_errors(folders: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="'int4' is not one of"):
        load_model(folders["llama3"], quantization="int4")
    with pytest.raises(ModelLoadError, match="'gguf'"):
        load_model(folders["llama3"], quantization="gguf")
    folder = write_prequantized(folders["llama3"], tmp_path / "fp8", "fp8_block")
    with pytest.raises(ModelLoadError, match="pre-quantized as 'fp8'; quantization 'int8'"):
        load_model(folder, quantization="int8")


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_dummy_weights_load_quantized_and_seeded(mode: str, tmp_path: Path) -> None:
    config = {**tiny_configs()["llama3"].to_dict(), "hidden_size": 256, "intermediate_size": 5000}
    config["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))  # gate_up: 10000 rows, in 3 random chunks
    a = load_model(tmp_path / "config.json", load_format="dummy", quantization=mode, seed=1).model
    b = load_model(tmp_path / "config.json", load_format="dummy", quantization=mode, seed=1).model
    layer = a.model.layers[2].mlp.gate_up_proj
    assert layer.weight.element_size() == 1 and layer.quant_method.name == mode
    std = layer.quant_method.dequantized_weight(layer, torch.float32).std()
    assert 0.015 < std < 0.025  # N(0, 0.02), rounded
    assert torch.equal(
        layer.weight.view(torch.int8), b.model.layers[2].mlp.gate_up_proj.weight.view(torch.int8)
    )
    assert torch.isfinite(greedy_generate(a, [1, 2, 3], 1).prompt_logits).all()


def test_dummy_block_fp8_config_loads(tmp_path: Path) -> None:
    config = tiny_configs()["qwen3"].to_dict()
    config["quantization_config"] = published_config("fp8_block", (32, 32))
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_model(tmp_path / "config.json", load_format="dummy").model
    assert model.model.layers[0].mlp.down_proj.weight_scale_inv.shape == (2, 4)  # [64/32, 128/32]
    assert torch.isfinite(greedy_generate(model, [1, 2, 3], 1).prompt_logits).all()


def test_quantize_at_load_peak_memory_stays_near_the_quantized_size(tmp_path: Path) -> None:
    """Each tensor is quantized as it is stored: the peak is the quantized model plus about one float
    tensor in flight, far below the float model (which a load-then-quantize would hold whole)."""
    config = LlamaConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).save_pretrained(tmp_path)
    float_bytes = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    largest_tensor = 2048 * 512 * 4
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.benchmarks.load_memory", "--model", str(tmp_path),
         "--quantization", "int8", "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    report = json.loads(result.stdout)
    print(f"peak {report['peak_bytes'] / 2**20:.1f} MiB, quantized {report['param_bytes'] / 2**20:.1f} MiB")
    assert report["param_bytes"] < 0.35 * float_bytes  # int8 layers, float32 embedding
    assert report["peak_bytes"] < 1.1 * report["param_bytes"] + 3 * largest_tensor


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_bf16_checkpoint_quantizes_from_its_own_values(tmp_path: Path, dtype: str) -> None:
    """A bf16 checkpoint (as most are published) is quantized from its bf16 values, whatever the model's
    activation dtype; the scales stay float32."""
    reference = save_tiny_model("qwen2", tmp_path / "float")
    reference.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    layer = (
        load_model(tmp_path / "bf16", dtype=dtype, quantization="int8").model.model.layers[1].mlp.down_proj
    )
    weight, scale = naive_int8(reference.model.layers[1].mlp.down_proj.weight.data.float())
    assert torch.equal(layer.weight, weight) and layer.weight_scale.dtype == torch.float32
    torch.testing.assert_close(layer.weight_scale, scale, rtol=1e-6, atol=0)


def test_tensors_of_more_rows_than_a_chunk_quantize_like_whole_ones(tmp_path: Path) -> None:
    """An LM head of 9000 rows is quantized 4096 rows at a time: the same bytes as all at once."""
    config = LlamaConfig(
        vocab_size=9000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    head = load_model(tmp_path).model.lm_head.weight
    quantized = load_model(tmp_path, quantization="int8").model.lm_head
    weight, scale = naive_int8(head)
    assert torch.equal(quantized.weight, weight)
    torch.testing.assert_close(quantized.weight_scale, scale, rtol=1e-6, atol=0)
