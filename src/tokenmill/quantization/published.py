"""Pre-quantized checkpoints, recognised from ``config.json``'s ``quantization_config``.

Three published formats load as they are:

* ``{"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}``:
  block-scaled fp8 (see :mod:`.block_fp8` for the tensors and their sources).
* compressed-tensors INT8 W8A8, ``{"quant_method": "compressed-tensors", "format": "int-quantized",
  "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "int", "symmetric": true, "strategy":
  "channel"}, "input_activations": {"num_bits": 8, "type": "int", "dynamic": true, "strategy": "token"},
  "targets": ["Linear"]}}, "ignore": ["lm_head"]}``: ``<name>.weight`` int8 ``[out, in]`` and
  ``<name>.weight_scale`` ``[out, 1]`` (the weight is ``weight * weight_scale``), as llm-compressor
  writes them and vLLM's ``CompressedTensorsW8A8Int8`` reads them (``ChannelQuantScaleParameter`` of shape
  ``[out, 1]``); the compressed-tensors repository's ``QuantizationArgs`` defines the fields.

* compressed-tensors FP8 dynamic (``"format": "float-quantized"``, the same group with ``"type": "float"``
  for weights and activations): ``<name>.weight`` float8_e4m3fn ``[out, in]`` and ``weight_scale``
  ``[out, 1]``, as llm-compressor's ``FP8_DYNAMIC`` scheme writes them (and ``tokenmill quantize``).

Anything else (awq, gptq, bitsandbytes, fp8 with per-tensor or static scales, other compressed-tensors
schemes) is refused with a :class:`ModelLoadError` that names what the checkpoint asks for.
"""

from typing import Any

from tokenmill.errors import ModelLoadError
from tokenmill.quantization.config import QuantizationConfig


def published_quantization(raw: dict[str, Any], source: str) -> QuantizationConfig | None:
    """The format a checkpoint's ``config.json`` publishes its weights in (None: float weights)."""
    spec = raw.get("quantization_config")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ModelLoadError(f"{source}: quantization_config must be a JSON object")
    method = str(spec.get("quant_method", "<missing>"))
    if method == "fp8":
        return _block_fp8(spec, source)
    if method == "compressed-tensors":
        return _compressed_tensors_8bit(spec, source)
    raise ModelLoadError(
        f"{source}: the checkpoint is quantized with '{method}', which tokenmill does not load (supported: "
        "fp8 with weight_block_size, compressed-tensors int8 W8A8 or fp8 dynamic per channel)"
    )


def _refuse(source: str, what: str) -> ModelLoadError:
    return ModelLoadError(f"{source}: quantization_config: {what} is not supported")


def _block_fp8(spec: dict[str, Any], source: str) -> QuantizationConfig:
    block = spec.get("weight_block_size")
    if block is None:
        raise _refuse(source, "fp8 without weight_block_size (per-tensor scales)")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelLoadError(f"{source}: quantization_config.weight_block_size must be two positive ints")
    scheme = spec.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _refuse(source, f"fp8 activation_scheme '{scheme}' (static input scales)")
    if spec.get("fmt", "e4m3") != "e4m3":
        raise _refuse(source, f"fp8 fmt '{spec.get('fmt')}'")
    return QuantizationConfig(
        "fp8", prequantized=True, weight_block=(block[0], block[1]), quantize_lm_head=False
    )


_COMPRESSED_FORMATS = {"int-quantized": ("int", "int8"), "float-quantized": ("float", "fp8")}


def _compressed_tensors_8bit(spec: dict[str, Any], source: str) -> QuantizationConfig:
    fmt = spec.get("format")
    if fmt not in _COMPRESSED_FORMATS:
        raise _refuse(source, f"compressed-tensors format '{fmt}' (only int-quantized, float-quantized)")
    kind, method = _COMPRESSED_FORMATS[str(fmt)]
    groups = spec.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise _refuse(source, "compressed-tensors with other than one config group")
    group = next(iter(groups.values()))
    _check_weights(group.get("weights") or {}, kind, source)
    _check_activations(group.get("input_activations"), kind, source)
    if "Linear" not in (group.get("targets") or []):
        raise _refuse(source, f"compressed-tensors targets {group.get('targets')} (only Linear)")
    ignore = list(spec.get("ignore") or [])
    if set(ignore) - {"lm_head"}:
        raise _refuse(source, f"compressed-tensors ignore list {ignore} (only lm_head may stay float)")
    if spec.get("kv_cache_scheme"):
        raise _refuse(source, "a quantized KV cache (kv_cache_scheme)")
    return QuantizationConfig(method, prequantized=True, quantize_lm_head="lm_head" not in ignore)


def _check_weights(weights: dict[str, Any], kind: str, source: str) -> None:
    wanted = {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "channel"}
    found = {key: weights.get(key) for key in wanted}
    if found != wanted:
        raise _refuse(source, f"compressed-tensors weights {found} (only {wanted})")


def _check_activations(activations: dict[str, Any] | None, kind: str, source: str) -> None:
    if activations is None:
        return
    if activations.get("num_bits") != 8 or activations.get("type") != kind or not activations.get("dynamic"):
        raise _refuse(
            source, f"compressed-tensors input activations {activations} (only dynamic 8-bit {kind})"
        )
