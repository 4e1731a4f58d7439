"""``load_model``: one entry point for every weight source, producing the same model object."""

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.errors import ModelLoadError
from tokenmill.loading.checkpoint import Checkpoint
from tokenmill.loading.dummy import init_dummy_weights
from tokenmill.loading.source import DummySource, resolve_source
from tokenmill.models import CausalLM, ModelConfig, resolve_architecture
from tokenmill.models.base import WeightLoadingError
from tokenmill.quantization import (
    NO_QUANTIZATION,
    QuantizationConfig,
    building_with,
    published_quantization,
    resolve_quantization,
)

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODEL_TYPE_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: "Tokenizer | None"
    eos_token_ids: tuple[int, ...]
    source: str
    device: torch.device
    dtype: torch.dtype
    load_seconds: float
    quantization: str = "none"  # the method the model was built with (``auto`` decided)
    max_positions: int = 0  # the positions its rotary tables were built for (``max_model_len``); 0: all
    generation_config: dict[str, Any] = field(default_factory=dict)  # the checkpoint's file; {}: none

    def position_limit(self) -> int:
        """How many positions this model can serve: its config's, or fewer where it was loaded for fewer."""
        limit = self.config.max_position_embeddings
        return min(limit, self.max_positions) if self.max_positions else limit


def parse_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype '{dtype}' is not one of: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(
    model: str | os.PathLike[str] | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "auto",
    load_format: str = "auto",
    max_model_len: int | None = None,
    seed: int = 0,
    tokenizer: str | os.PathLike[str] | None = None,
    quantization: str | QuantizationConfig = "auto",
) -> LoadedModel:
    """Load ``model`` (None: the embedded default; a folder, .gguf file, installed model's short name, hub
    id, or with ``load_format="dummy"`` a preset name or config.json) onto ``device`` in ``dtype``.
    ``tokenizer`` names another model whose tokenizer to use instead (as vLLM's ``tokenizer``): how a
    dummy-weight model gets one. ``quantization`` (``auto``, ``none``, ``int8``, ``fp8``, ``gguf``; see
    :mod:`tokenmill.quantization`): float weights are quantized as they are loaded; a checkpoint whose
    config publishes a quantization loads in it; ``auto`` is :func:`packs_by_default`'s choice."""
    start = time.perf_counter()
    device = torch.device(device)
    torch_dtype = parse_dtype(dtype, device)
    source = resolve_source(model, load_format)
    # The named tokenizer first: a wrong name fails before the weights are loaded.
    own_tokenizer: Tokenizer | None = None if tokenizer is None else load_tokenizer(tokenizer)
    extra_eos: tuple[int, ...] = ()
    generation_config: dict[str, Any] = {}
    if quantization == "auto":
        quantization = "gguf" if packs_by_default(source, device, torch_dtype) else "none"
    if isinstance(source, DummySource):
        config = config_from_hf(source.config, source.name)
        quant = resolve_quantization(
            quantization, published_quantization(source.config, source.name), source.name
        )
        quant = _check_gguf(quant, source, device)
        net = build_model(config, device, torch_dtype, max_model_len, quant)
        init_dummy_weights(net, seed)
        name = f"dummy:{source.name}"
    else:
        raw, where = source.hf_config(), str(source.config_file)
        config = config_from_hf(raw, where)
        quant = resolve_quantization(quantization, published_quantization(raw, where), where)
        quant = _check_gguf(quant, source, device)
        net = build_model(config, device, torch_dtype, max_model_len, quant)
        load_checkpoint_weights(net, source)
        extra_eos, name = source.eos_token_ids(), str(source.path)
        generation_config = source.generation_config()
        if own_tokenizer is None:
            own_tokenizer = source.tokenizer()
    if tokenizer is not None and own_tokenizer is not None:
        _check_vocabulary_fits(own_tokenizer, config, str(tokenizer))
    eos = tuple(dict.fromkeys(config.eos_token_ids + extra_eos))
    seconds = time.perf_counter() - start
    net = net.eval()
    return LoadedModel(
        net,
        config,
        own_tokenizer,
        eos,
        name,
        device,
        torch_dtype,
        seconds,
        quant.method,
        max_model_len or 0,
        generation_config,
    )


def packs_by_default(source: "Checkpoint | DummySource", device: torch.device, dtype: torch.dtype) -> bool:
    """``auto``'s choice: keep a GGUF file's blocks packed (``gguf``) where that is the fast path with the
    same weights: a float32 model on the CPU, every projection in a format the packed kernel reads, and
    the kernel built. Decode then reads the 4- and 8-bit codes instead of float32 copies (SmolLM2 Q4_1: 0.6
    bytes a weight, not 4); the inputs become int16 per block of 32 on AVX2 CPUs (``gguf_activations``)."""
    from tokenmill.loading.gguf_checkpoint import GGUFCheckpoint
    from tokenmill.quantization.gguf_cpu_kernel import load_kernel

    if not isinstance(source, GGUFCheckpoint) or device.type != "cpu" or dtype != torch.float32:
        return False
    return source.packs_every_projection() and load_kernel() is not None


def _check_gguf(
    quant: QuantizationConfig, source: "Checkpoint | DummySource", device: torch.device
) -> QuantizationConfig:
    """``gguf`` keeps a GGUF file's blocks for the CPU kernel: refuse it elsewhere before building, and
    ask the file to yield its projections (and the LM head's blocks, where it has them) packed."""
    if quant.method != "gguf":
        return quant
    from tokenmill.loading.gguf_checkpoint import GGUFCheckpoint

    if not isinstance(source, GGUFCheckpoint):
        what = f"dummy weights ({source.name})" if isinstance(source, DummySource) else str(source.path)
        raise ModelLoadError(
            f"quantization 'gguf' keeps a GGUF file's blocks packed and needs a .gguf checkpoint; "
            f"{what} is not one (use 'int8' or 'fp8' to quantize float weights)"
        )
    if device.type != "cpu":
        raise ModelLoadError(
            f"quantization 'gguf' runs on the CPU only (its kernel is a C loop), not on {device}; "
            f"load with device='cpu', or use 'none' / 'int8' / 'fp8' on the GPU"
        )
    source.keep_packed = True
    return replace(quant, packed_head=source.packs_lm_head())


def load_model_for(config: "EngineConfig", device: torch.device) -> LoadedModel:
    """:func:`load_model` with the settings of an engine's config (the engine and every tensor-parallel
    worker load the same way)."""
    return load_model(
        config.model,
        device=device,
        dtype=config.dtype,
        load_format=config.load_format,
        max_model_len=config.max_model_len,
        seed=config.seed,
        tokenizer=config.tokenizer,
        quantization=config.quantization,
    )


def load_tokenizer(name: str | os.PathLike[str]) -> "Tokenizer":
    """The tokenizer of the model ``name``: a model folder (weights not needed), a .gguf file, an installed
    model's short name or a hub id."""
    from tokenmill.tokenizer import Tokenizer

    path = Path(name).expanduser()
    if path.is_dir():
        return Tokenizer.from_pretrained(path)
    source = resolve_source(name)
    assert not isinstance(source, DummySource)
    found = source.tokenizer()
    if found is None:
        raise ModelLoadError(f"tokenizer '{name}': {source.path} carries no tokenizer")
    return found


def _check_vocabulary_fits(tokenizer: "Tokenizer", config: ModelConfig, name: str) -> None:
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(
            f"tokenizer '{name}' has {tokenizer.vocab_size} tokens, more than the model's vocabulary of "
            f"{config.vocab_size}: its ids would run past the embedding"
        )


def config_from_hf(raw: dict[str, Any], source: str) -> ModelConfig:
    architectures = raw.get("architectures")
    if isinstance(architectures, list) and architectures:
        name = str(architectures[0])
    elif raw.get("model_type") in MODEL_TYPE_ARCHITECTURES:
        name = MODEL_TYPE_ARCHITECTURES[str(raw["model_type"])]
    else:
        raise ModelLoadError(f"{source}: config has neither 'architectures' nor a known 'model_type'")
    return resolve_architecture(name, source).config_from_hf(raw, source)


@contextmanager
def _creating_tensors(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int | None = None,
    quantization: QuantizationConfig = NO_QUANTIZATION,
) -> CausalLM:
    """Allocate the model directly on ``device`` in ``dtype``, parameters uninitialized; its linear layers
    (and an untied LM head) take ``quantization``'s method and create their parameters in its format."""
    cls = resolve_architecture(config.architecture, "config")
    linear = quantization.linear_method()
    head = quantization.lm_head_method(config.tie_word_embeddings, linear)
    with _creating_tensors(device, dtype), building_with(linear, head):
        return cls(config, max_positions=max_model_len)  # type: ignore[call-arg]


def load_checkpoint_weights(model: CausalLM, checkpoint: Checkpoint) -> None:
    """Stream tensors into the allocated parameters; each one is converted and copied, then dropped."""
    try:
        with torch.no_grad():
            model.load_weights(checkpoint.weights())
    except WeightLoadingError as exc:
        raise ModelLoadError(f"{checkpoint.current_file}: {exc}") from None
