"""``tokenmill quantize``: a float checkpoint (a Hugging Face folder, a GGUF file, an installed model) written
as a pre-quantized one, its projections rounded with calibration (GPTQ) or to nearest.

The folder holds what a published compressed-tensors checkpoint holds (the layout vLLM reads), so
tokenmill loads it as published: ``config.json`` with a ``quantization_config`` (``int-quantized`` int8
or ``float-quantized`` e4m3 weights, one scale per output channel, dynamic per-token activations, the LM
head left float),
safetensors under Hugging Face names (each projection's ``weight`` in 8 bits and its ``weight_scale``
``[out, 1]``; every other tensor as the source gives it), the tokenizer, ``generation_config.json`` with
the end-of-sequence ids, and ``tokenmill_quantize.json`` saying how the weights were rounded.

Memory: the float model, one float32 ``[in, in]`` matrix per projection, and one shard of output
(``SHARD_BYTES``, written as soon as it is full) are held at once.
"""

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

from tokenmill.engine.hardware_defaults import resolve_device
from tokenmill.errors import ModelLoadError
from tokenmill.export.calibration import projection_hessians, sampled_calibration
from tokenmill.loading import load_model
from tokenmill.loading.checkpoint import Checkpoint
from tokenmill.loading.loader import MODEL_TYPE_ARCHITECTURES
from tokenmill.loading.presets import load_preset
from tokenmill.loading.source import resolve_source
from tokenmill.models import CausalLM
from tokenmill.models.layers.linear import LinearBase
from tokenmill.quantization import published_quantization
from tokenmill.quantization.gptq import WeightFormat, gptq_round
from tokenmill.quantization.rounding import quantize_fp8_per_channel, quantize_int8_per_channel

Rounding = Literal["gptq", "nearest"]
SHARD_BYTES = 2 << 30
INFO_FILE = "tokenmill_quantize.json"


@dataclass(frozen=True)
class QuantizeOptions:
    """``fmt``: int8 or fp8 (e4m3) weights; ``rounding``: GPTQ against calibration inputs, or to nearest
    (what ``quantization=int8|fp8`` does at load); ``calibration_tokens``: text the float model samples to
    calibrate on; ``device``: where the float model runs (``auto``: a GPU if there is one)."""

    fmt: WeightFormat = "int8"
    rounding: Rounding = "gptq"
    calibration_tokens: int = 4096
    seed: int = 0
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.fmt not in ("int8", "fp8"):
            raise ValueError(f"quantization '{self.fmt}' is not one of: int8, fp8")
        if self.rounding not in ("gptq", "nearest"):
            raise ValueError(f"rounding '{self.rounding}' is not one of: gptq, nearest")
        if self.calibration_tokens < 16:
            raise ValueError(f"calibration_tokens must be >= 16, got {self.calibration_tokens}")


@dataclass(frozen=True)
class QuantizeSummary:
    source: str
    output: str
    options: QuantizeOptions
    quantized_tensors: int
    calibration_tokens: int
    seconds: float


def write_quantized_checkpoint(
    model: str | Path | None, output: str | Path, options: QuantizeOptions
) -> QuantizeSummary:
    """Write ``model`` (None: the embedded default) to the new folder ``output``, quantized as ``options``."""
    started = time.perf_counter()
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder; name a new folder")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty; name a new folder")
    try:
        source = resolve_source(model)
    except ModelLoadError:
        if model is not None and load_preset(str(model)) is not None:  # the loader's hint names a flag
            raise ModelLoadError(
                f"'{model}' is a dummy-weight preset: quantize needs a checkpoint with real weights"
            ) from None
        raise
    if not isinstance(source, Checkpoint):
        raise ModelLoadError("dummy weights have nothing to calibrate or keep: name a real checkpoint")
    if published_quantization(source.hf_config(), str(source.config_file)) is not None:
        raise ModelLoadError(f"{source.path} is quantized already: quantize takes a float checkpoint")
    options = replace(options, device=str(resolve_device(options.device)))
    try:  # now, not after minutes of calibration
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"{out} cannot be created: {error.strerror or error}") from None
    dtype = "float32" if options.device == "cpu" else "bfloat16"
    loaded = load_model(model, device=options.device, dtype=dtype, quantization="none")
    hessians: dict[str, torch.Tensor] = {}
    calibration = 0
    if options.rounding == "gptq":
        sequences = sampled_calibration(loaded, options.calibration_tokens, options.seed)
        calibration = sum(map(len, sequences))
        hessians = projection_hessians(loaded.model, sequences)
    count = _write_weights(source, loaded.model, hessians, options, out)
    _write_config(source, options, out)
    if loaded.tokenizer is not None:
        loaded.tokenizer.hf_tokenizer.save_pretrained(str(out))
    eos = list(dict.fromkeys(loaded.eos_token_ids))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2) + "\n")
    summary = QuantizeSummary(
        str(loaded.source), str(out), options, count, calibration, time.perf_counter() - started
    )
    (out / INFO_FILE).write_text(json.dumps(asdict(summary), indent=2) + "\n")
    return summary


def _write_weights(
    source: Checkpoint,
    model: CausalLM,
    hessians: dict[str, torch.Tensor],
    options: QuantizeOptions,
    out: Path,
) -> int:
    """Every checkpoint tensor to ``out``'s shards, the projections' weights quantized; how many were."""
    projections = _projection_modules(model)
    shards = _ShardWriter(out)
    count = 0
    for name, tensor in source.weights():
        module = _projection_of(model, name, tensor, projections)
        if module is None:
            shards.add(name, tensor)
            continue
        codes, scale = _quantize(tensor, hessians.get(module), options)
        shards.add(name, codes)
        shards.add(name.removesuffix("weight") + "weight_scale", scale[:, None])
        count += 1
    shards.close()
    return count


class _ShardWriter:
    """Tensors to ``model.safetensors``, or to shards of at most ``SHARD_BYTES`` (each written once full)
    named as transformers names them, with their index."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.written: list[tuple[Path, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.pending and self.size + tensor.nbytes > SHARD_BYTES:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.size += tensor.nbytes

    def _flush(self) -> None:
        path = self.out / f"shard-{len(self.written) + 1:05d}.partial"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.written.append((path, list(self.pending)))
        self.pending, self.size = {}, 0

    def close(self) -> None:
        if not self.written:
            save_file(self.pending, str(self.out / "model.safetensors"), metadata={"format": "pt"})
            return
        self._flush()
        weight_map = {}
        for index, (path, names) in enumerate(self.written, start=1):
            file = f"model-{index:05d}-of-{len(self.written):05d}.safetensors"
            path.rename(self.out / file)
            weight_map.update(dict.fromkeys(names, file))
        index_json = {"metadata": {}, "weight_map": weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")


def _projection_modules(model: CausalLM) -> set[str]:
    return {name for name, module in model.named_modules() if isinstance(module, LinearBase)}


def _projection_of(model: CausalLM, name: str, tensor: torch.Tensor, projections: set[str]) -> str | None:
    """The projection module a checkpoint tensor is the weight of (None: not a projection weight)."""
    if not name.endswith(".weight"):
        return None
    target, _ = model.checkpoint_target(name)
    module = target.removesuffix(".weight")
    if module not in projections:
        return None
    renamed, laid_out = model.checkpoint_tensor(name, tensor)
    if renamed != name or laid_out.shape != tensor.shape or laid_out.dim() != 2:
        raise ModelLoadError(
            f"{type(model).__name__} re-lays its checkpoint's projection '{name}' out; quantize supports "
            "checkpoints whose projections are stored [out, in] (Llama, Mistral, Qwen, Gemma 3)"
        )
    return module


def _quantize(
    weight: torch.Tensor, hessian: torch.Tensor | None, options: QuantizeOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    if options.rounding == "gptq":
        assert hessian is not None
        device = torch.device(options.device)
        codes, scale = gptq_round(weight.to(device), hessian.to(device), options.fmt)
        return codes.cpu(), scale.cpu()
    if options.fmt == "int8":
        return quantize_int8_per_channel(weight.float())
    return quantize_fp8_per_channel(weight.float())


def _write_config(source: Checkpoint, options: QuantizeOptions, out: Path) -> None:
    config: dict[str, Any] = dict(source.hf_config())
    if "model_type" not in config:  # a GGUF's config names only its architecture; transformers wants both
        model_types = {arch: name for name, arch in MODEL_TYPE_ARCHITECTURES.items()}
        config["model_type"] = model_types.get(config["architectures"][0])
    config["quantization_config"] = compressed_tensors_config(options.fmt)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def compressed_tensors_config(fmt: WeightFormat) -> dict[str, Any]:
    """compressed-tensors' ``quantization_config`` for 8-bit channel-wise weights and dynamic per-token
    activations (its W8A8 int8 scheme, or FP8_DYNAMIC for e4m3), the LM head left float."""
    kind = "int" if fmt == "int8" else "float"
    weights = {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": False, "strategy": "channel"}
    activations = {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": True, "strategy": "token"}
    return {
        "quant_method": "compressed-tensors",
        "format": f"{kind}-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}
        },
        "ignore": ["lm_head"],
    }
