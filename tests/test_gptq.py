"""Calibrated (GPTQ) rounding and ``tokenmill quantize``, against independent references: the rounding
against a naive optimal-brain-surgeon loop written here (one column at a time, the inverse Hessian updated
by elimination rather than factored once), the written checkpoints against transformers running the
weights they stand for and against naive round-to-nearest."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from cli_helpers import run_cli
from quant_reference import FP8, naive_fp8, naive_int8
from tiny_models import VOCAB, save_tiny_model
from tokenmill.errors import ModelLoadError
from tokenmill.export import QuantizeOptions, write_quantized_checkpoint
from tokenmill.loading import load_model
from tokenmill.quantization import QuantizationConfig
from tokenmill.quantization.gptq import gptq_round
from tokenmill.reference import greedy_generate

PROMPT = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(5)).tolist()


def correlated_inputs(rows: int, columns: int, seed: int) -> torch.Tensor:
    """Inputs whose features correlate and differ in size, as a layer's do."""
    generator = torch.Generator().manual_seed(seed)
    mixing = torch.randn(columns, columns, generator=generator) / columns**0.5
    sizes = torch.rand(columns, generator=generator) * 3 + 0.1
    return (torch.randn(rows, columns, generator=generator) @ mixing) * sizes


def naive_obs(
    weight: torch.Tensor, hessian: torch.Tensor, fmt: str, order: torch.Tensor, damping: float
) -> torch.Tensor:
    """GPTQ's rounding by its definition: columns in ``order``, each rounded, its error spread over the
    columns left through the inverse Hessian, from which the column is then eliminated."""
    scale = weight.abs().max(dim=1).values.double() / (127 if fmt == "int8" else 448)
    w = weight.double() / scale[:, None]
    h = hessian.double().clone()
    h += damping * h.diagonal().mean() * torch.eye(len(h), dtype=h.dtype)
    inverse = torch.linalg.inv(h)
    codes = torch.zeros_like(w)
    left = list(order.tolist())
    while left:
        i = left.pop(0)
        if fmt == "int8":
            codes[:, i] = w[:, i].round().clamp(-127, 127)
        else:
            codes[:, i] = w[:, i].clamp(-448, 448).to(FP8).double()
        error = (w[:, i] - codes[:, i]) / inverse[i, i]
        for j in left:
            w[:, j] -= error * inverse[i, j]
        inverse = inverse - torch.outer(inverse[:, i], inverse[i, :]) / inverse[i, i]
    return codes


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("order_by_input", [True, False])
def test_gptq_rounds_as_the_naive_loop(fmt: str, order_by_input: bool) -> None:
    weight = torch.randn(24, 300, generator=torch.Generator().manual_seed(1))
    x = correlated_inputs(500, 300, seed=2)
    hessian = x.T @ x
    codes, scale = gptq_round(weight, hessian, fmt, 0.03, order_by_input)  # 300 columns: 3 blocks
    assert codes.dtype == (torch.int8 if fmt == "int8" else FP8) and scale.dtype == torch.float32
    order = torch.argsort(hessian.diagonal(), descending=True) if order_by_input else torch.arange(300)
    expected = naive_obs(weight, hessian, fmt, order, 0.03)
    assert torch.equal(codes.double(), expected)
    assert torch.allclose(scale, weight.abs().max(dim=1).values / (127 if fmt == "int8" else 448))


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_gptq_moves_outputs_less_than_nearest_rounding(fmt: str) -> None:
    """On inputs from the calibration's distribution but not in it, GPTQ's outputs are closer to the float
    layer's than round-to-nearest's (the same format, the same scales)."""
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    inputs = correlated_inputs(2000, 256, seed=4)
    calibration, held_out = inputs[:1000], inputs[1000:]
    codes, scale = gptq_round(weight, calibration.T @ calibration, fmt)
    nearest_codes, nearest_scale = (naive_int8 if fmt == "int8" else naive_fp8)(weight)
    reference = held_out @ weight.T
    gptq_error = (held_out @ (codes.float() * scale[:, None]).T - reference).norm()
    nearest_error = (held_out @ (nearest_codes.float() * nearest_scale[:, None]).T - reference).norm()
    assert gptq_error < 0.8 * nearest_error, (gptq_error, nearest_error)


def test_gptq_input_that_never_fires_and_bad_shapes() -> None:
    weight = torch.randn(8, 32, generator=torch.Generator().manual_seed(6))
    x = correlated_inputs(100, 32, seed=7)
    x[:, 5] = 0  # a feature never seen in calibration: its column is rounded to nearest
    codes, _ = gptq_round(weight, x.T @ x, "int8")
    assert torch.equal(codes[:, 5], naive_int8(weight)[0][:, 5])
    with pytest.raises(ValueError, match="the Hessian is"):
        gptq_round(weight, torch.eye(16), "int8")


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama3")
    save_tiny_model("llama3", folder)
    return folder


def _dequantized_copy(quantized: Path, out: Path) -> Path:
    """A float checkpoint of the weights ``quantized`` stands for (codes times scales), for transformers."""
    out.mkdir()
    tensors = load_file(quantized / "model.safetensors")
    floats = {}
    for name, tensor in tensors.items():
        if name.endswith(".weight_scale"):
            continue
        scale = tensors.get(name.removesuffix("weight") + "weight_scale")
        floats[name] = tensor if scale is None else tensor.float() * scale
    save_file(floats, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((quantized / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantized_checkpoint_loads_as_published_and_equals_its_weights(
    llama_folder: Path, tmp_path: Path, fmt: str
) -> None:
    options = QuantizeOptions(fmt=fmt, calibration_tokens=64)  # type: ignore[arg-type]
    summary = write_quantized_checkpoint(llama_folder, tmp_path / "q", options)
    layers = json.loads((llama_folder / "config.json").read_text())["num_hidden_layers"]
    assert summary.quantized_tensors == 7 * layers  # q, k, v, o, gate, up, down; the LM head stays float
    assert summary.calibration_tokens >= 32
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert config["format"] == ("int-quantized" if fmt == "int8" else "float-quantized")
    loaded = load_model(tmp_path / "q")
    layer = loaded.model.model.layers[1].mlp.gate_up_proj
    assert loaded.quantization == fmt and layer.quant_method.prequantized and layer.weight.element_size() == 1
    reference = AutoModelForCausalLM.from_pretrained(_dequantized_copy(tmp_path / "q", tmp_path / "float"))
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0, -1]
    ours = greedy_generate(loaded.model, PROMPT, 1).prompt_logits
    assert torch.allclose(ours, expected, atol=1e-4, rtol=0), (ours - expected).abs().max()
    source = load_file(llama_folder / "model.safetensors")
    written = load_file(tmp_path / "q" / "model.safetensors")
    weight = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(
        written[weight].float(), (naive_int8 if fmt == "int8" else naive_fp8)(source[weight])[0].float()
    )
    assert torch.equal(written["model.norm.weight"], source["model.norm.weight"])


@pytest.mark.parametrize("name", ["llama-tied", "mistral", "qwen2", "qwen3", "gemma3"])
def test_every_architecture_written_equals_transformers_on_its_weights(tmp_path: Path, name: str) -> None:
    """Each family's checkpoint names and layouts (biases, q/k norms, Gemma's norms, tied heads) survive
    the writing: the folder, loaded as published, equals transformers on the weights it stands for."""
    save_tiny_model(name, tmp_path / "float")
    write_quantized_checkpoint(tmp_path / "float", tmp_path / "q", QuantizeOptions(rounding="nearest"))
    reference = AutoModelForCausalLM.from_pretrained(_dequantized_copy(tmp_path / "q", tmp_path / "deq"))
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0, -1]
    ours = greedy_generate(load_model(tmp_path / "q").model, PROMPT, 1).prompt_logits
    assert torch.allclose(ours, expected, atol=1e-4, rtol=0), (ours - expected).abs().max()


def test_nearest_rounding_writes_naive_per_row_codes(llama_folder: Path, tmp_path: Path) -> None:
    write_quantized_checkpoint(llama_folder, tmp_path / "q", QuantizeOptions(rounding="nearest"))
    source, written = (
        load_file(llama_folder / "model.safetensors"),
        load_file(tmp_path / "q" / "model.safetensors"),
    )
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        codes, scale = naive_int8(source[name])
        assert torch.equal(written[name], codes)
        assert torch.allclose(written[name.removesuffix("weight") + "weight_scale"][:, 0], scale)
    assert written["lm_head.weight"].dtype == torch.float32  # compressed-tensors' "ignore": ["lm_head"]


def test_a_published_checkpoint_takes_the_w8a8_emulation_when_asked(
    llama_folder: Path, tmp_path: Path
) -> None:
    write_quantized_checkpoint(llama_folder, tmp_path / "q", QuantizeOptions(fmt="fp8", rounding="nearest"))
    emulated = load_model(tmp_path / "q", quantization=QuantizationConfig("fp8", dynamic_activations=True))
    method = emulated.model.model.layers[0].self_attn.qkv_proj.quant_method
    assert method.prequantized and method.dynamic_activations
    plain = load_model(tmp_path / "q")
    assert not plain.model.model.layers[0].self_attn.qkv_proj.quant_method.dynamic_activations
    emulated_logits = greedy_generate(emulated.model, PROMPT, 1).prompt_logits
    assert not torch.equal(emulated_logits, greedy_generate(plain.model, PROMPT, 1).prompt_logits)


def test_quantize_refuses_what_it_cannot_write(llama_folder: Path, tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ValueError, match="not empty"):
        write_quantized_checkpoint(llama_folder, tmp_path / "full", QuantizeOptions())
    gpt2 = tmp_path / "gpt2"
    save_tiny_model("gpt2", gpt2)
    with pytest.raises(ModelLoadError, match="re-lays"):
        write_quantized_checkpoint(gpt2, tmp_path / "g", QuantizeOptions(rounding="nearest"))
    write_quantized_checkpoint(llama_folder, tmp_path / "q", QuantizeOptions(rounding="nearest"))
    with pytest.raises(ModelLoadError, match="quantized already"):
        write_quantized_checkpoint(tmp_path / "q", tmp_path / "qq", QuantizeOptions(rounding="nearest"))
    with pytest.raises(ValueError, match="'int4' is not one of"):
        QuantizeOptions(fmt="int4")  # type: ignore[arg-type]
    (tmp_path / "a-file").write_text("")  # checked before any loading or calibration:
    with pytest.raises(ValueError, match="exists and is not a folder"):
        write_quantized_checkpoint(llama_folder, tmp_path / "a-file", QuantizeOptions())
    with pytest.raises(ValueError, match="cannot be created: Not a directory"):
        write_quantized_checkpoint(llama_folder, tmp_path / "a-file" / "sub", QuantizeOptions())
    with pytest.raises(ValueError, match="'tpu' is not a valid torch device"):
        write_quantized_checkpoint(llama_folder, tmp_path / "t", QuantizeOptions(device="tpu"))
    assert not (tmp_path / "t").exists()


def test_calibration_sequences_fit_the_models_context(llama_folder: Path) -> None:
    """More tokens than one sequence per prompt can hold in the model's 512 positions: more sequences,
    none longer than the context (it used to ask for a max_model_len past the model's limit)."""
    from tokenmill.export.calibration import sampled_calibration

    loaded = load_model(llama_folder, dtype="float32")
    limit = loaded.config.max_position_embeddings
    sequences = sampled_calibration(loaded, 4 * limit + 100)
    assert max(map(len, sequences)) <= limit and sum(map(len, sequences)) >= 4 * limit + 100


def test_large_checkpoints_are_written_in_shards(
    llama_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenmill.export import quantized_checkpoint

    monkeypatch.setattr(quantized_checkpoint, "SHARD_BYTES", 50_000)
    write_quantized_checkpoint(llama_folder, tmp_path / "q", QuantizeOptions(rounding="nearest"))
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(index.values()))
    assert len(files) > 3 and files[-1].endswith(f"-of-{len(files):05d}.safetensors")
    assert not list((tmp_path / "q").glob("*.partial"))
    whole = load_model(llama_folder, quantization="int8")
    sharded = load_model(tmp_path / "q")
    # the untied LM head: quantized at load, left float in the published layout; compare a layer instead
    layer, expected = sharded.model.model.layers[1].mlp.down_proj, whole.model.model.layers[1].mlp.down_proj
    assert torch.equal(layer.weight, expected.weight)


def test_quantize_command_checks_flags_before_loading(tmp_path: Path) -> None:
    result = run_cli("quantize", "--output", str(tmp_path / "q"), "--quantization", "int4")
    assert result.returncode == 2 and "invalid choice: 'int4'" in result.stderr
    assert "imported: nothing heavy" in result.stderr
    preset = run_cli("quantize", "--model", "llama-3.2-1b", "--output", str(tmp_path / "q"))
    assert preset.returncode == 2 and "dummy-weight preset: quantize needs a checkpoint" in preset.stderr
    missing = run_cli("quantize", "--model", str(tmp_path / "nowhere"), "--output", str(tmp_path / "q"))
    assert (
        missing.returncode == 2
        and "tokenmill: error:" in missing.stderr
        and "Traceback" not in missing.stderr
    )


def test_a_gguf_model_written_as_a_folder_keeps_its_tokenizer_and_weights(
    smollm2_gguf_path: Path, tmp_path: Path
) -> None:
    """The real SmolLM2 GGUF written with round-to-nearest int8: the folder's tokenizer encodes and
    templates as the GGUF's, its end-of-sequence ids are kept, and (its LM head tied to the embedding,
    which both leave float) it computes what quantizing the GGUF at load computes."""
    # Written from the float32 weights that quantizing at load rounds (on a GPU it would round bfloat16)
    options = QuantizeOptions(rounding="nearest", device="cpu")
    write_quantized_checkpoint(smollm2_gguf_path, tmp_path / "q", options)
    at_load = load_model(smollm2_gguf_path, quantization="int8")
    written = load_model(tmp_path / "q")
    assert written.quantization == "int8" and written.eos_token_ids == at_load.eos_token_ids
    assert json.loads((tmp_path / "q" / "config.json").read_text())["model_type"] == "llama"
    assert at_load.tokenizer is not None and written.tokenizer is not None
    text = "The capital of France is Paris.\n\nDef fibonacci(n):"
    assert written.tokenizer.encode(text) == at_load.tokenizer.encode(text)
    chat = [{"role": "user", "content": "Hi there"}]
    assert written.tokenizer.apply_chat_template(chat, True) == at_load.tokenizer.apply_chat_template(
        chat, True
    )
    prompt = at_load.tokenizer.encode(text)
    ours = greedy_generate(written.model, prompt, 8)
    expected = greedy_generate(at_load.model, prompt, 8)
    assert ours.token_ids == expected.token_ids
    assert torch.allclose(ours.prompt_logits, expected.prompt_logits, atol=1e-5, rtol=0)
