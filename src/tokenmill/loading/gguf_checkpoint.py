"""A GGUF file (llama.cpp's format) as a checkpoint: its metadata becomes a Hugging Face config, and its
tensors are dequantized to float32 one at a time, renamed, and laid out as a Hugging Face checkpoint has them.

Three conventions of llama.cpp's converter are undone on the way:

- ``llama`` files: the q and k rows of each head are permuted for llama.cpp's interleaved rotary layout;
- Gemma: RMSNorm weights are stored as ``1 + w``, since llama.cpp's norm has no unit offset;
- GPT-2: the Conv1D weights are stored transposed, as ordinary linear weights.
"""

import re
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.errors import ModelLoadError, UnsupportedArchitectureError
from tokenmill.loading.checkpoint import Checkpoint
from tokenmill.loading.gguf_file import GGUFFile
from tokenmill.loading.gguf_packing import keeps_packed, projection_blocks, unpermute_rotary_rows
from tokenmill.models.config import RopeConfig
from tokenmill.models.layers.rotary import inverse_frequencies
from tokenmill.models.registry import GGUF_ARCHITECTURES, resolve_architecture

if TYPE_CHECKING:
    from tokenmill.tokenizer import Tokenizer

_TENSOR_NAME = re.compile(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's encoding of Llama 3 rope scaling, read into the config
_EMBEDDING, _OUTPUT = "token_embd.weight", "output.weight"
# Llama 3.x rope scaling: only ``factor`` differs between models, and rope_freqs carries it.
_LLAMA3_ROPE_BANDS: dict[str, Any] = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_GEMMA3_27B_LAYERS = 62


class _Metadata:
    """Typed access to GGUF metadata; ``arch_*`` read keys under the architecture prefix (``llama.``)."""

    def __init__(self, values: dict[str, Any], path: Path) -> None:
        self.values = values
        self.path = path
        self.arch = str(self.require("general.architecture"))

    def error(self, message: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: {message}")

    def require(self, key: str) -> Any:
        if key not in self.values:
            raise self.error(f"GGUF metadata lacks the required key '{key}'")
        return self.values[key]

    def get(self, key: str) -> Any:
        return self.values.get(key)

    def arch_int(self, key: str) -> int:
        full_key = f"{self.arch}.{key}"
        value = self.require(full_key)
        if isinstance(value, list) and value and all(v == value[0] for v in value):
            value = value[0]  # a per-layer list that is uniform
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.error(f"GGUF metadata '{full_key}' must be a positive integer, got {value!r}")
        return value

    def arch_float(self, key: str) -> float:
        full_key = f"{self.arch}.{key}"
        value = self.require(full_key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(f"GGUF metadata '{full_key}' must be a number, got {value!r}")
        return float(value)

    def optional_arch_int(self, key: str) -> int | None:
        return self.arch_int(key) if f"{self.arch}.{key}" in self.values else None

    def optional_arch_float(self, key: str) -> float | None:
        return self.arch_float(key) if f"{self.arch}.{key}" in self.values else None

    def token_id(self, name: str) -> int | None:
        value = self.get(f"tokenizer.ggml.{name}_token_id")
        return value if isinstance(value, int) else None


@dataclass(frozen=True)
class _TensorNaming:
    """GGUF tensor stems → Hugging Face module paths; per-layer stems go under ``{layer_prefix}.{n}.``."""

    global_names: dict[str, str]
    layer_prefix: str
    layer_names: dict[str, str]

    def hf_name(self, layer: int | None, stem: str, kind: str) -> str | None:
        if layer is None:
            module = self.global_names.get(stem)
            return None if module is None else f"{module}.{kind}"
        module = self.layer_names.get(stem)
        return None if module is None else f"{self.layer_prefix}.{layer}.{module}.{kind}"


_LLAMA_NAMING = _TensorNaming(
    global_names={"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"},
    layer_prefix="model.layers",
    layer_names={
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    },
)
_GEMMA3_NAMING = _TensorNaming(
    global_names=_LLAMA_NAMING.global_names,
    layer_prefix="model.layers",
    layer_names={
        **_LLAMA_NAMING.layer_names,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
)
_GPT2_NAMING = _TensorNaming(
    global_names={
        "token_embd": "transformer.wte",
        "position_embd": "transformer.wpe",
        "output_norm": "transformer.ln_f",
        "output": "lm_head",
    },
    layer_prefix="transformer.h",
    layer_names={
        "attn_norm": "ln_1",
        "attn_qkv": "attn.c_attn",
        "attn_output": "attn.c_proj",
        "ffn_norm": "ln_2",
        "ffn_up": "mlp.c_fc",
        "ffn_down": "mlp.c_proj",
    },
)


def _present(config: dict[str, Any]) -> dict[str, Any]:
    """Drop absent optional values, so the config parser applies its own defaults."""
    return {key: value for key, value in config.items() if value is not None}


def _decoder_config(meta: _Metadata, file: GGUFFile) -> dict[str, Any]:
    """Fields shared by the rotary, RMSNorm decoders (Llama family, Qwen, Gemma)."""
    hidden = meta.arch_int("embedding_length")
    heads = meta.arch_int("attention.head_count")
    head_dim = meta.optional_arch_int("attention.key_length") or hidden // heads
    theta = meta.optional_arch_float("rope.freq_base")
    rotary_dim = meta.optional_arch_int("rope.dimension_count")
    if rotary_dim is not None and rotary_dim != head_dim:
        raise meta.error(
            f"partial rotary embeddings ({rotary_dim} of {head_dim} head dims) are not supported"
        )
    return _present(
        {
            "hidden_size": hidden,
            "intermediate_size": meta.arch_int("feed_forward_length"),
            "num_hidden_layers": meta.arch_int("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": meta.optional_arch_int("attention.head_count_kv"),
            "head_dim": head_dim,
            "max_position_embeddings": meta.arch_int("context_length"),
            "rms_norm_eps": meta.arch_float("attention.layer_norm_rms_epsilon"),
            "rope_theta": theta,
            "rope_scaling": _rope_scaling(meta, file, theta or 10000.0, head_dim),
        }
    )


def _rope_scaling(meta: _Metadata, file: GGUFFile, theta: float, head_dim: int) -> dict[str, Any] | None:
    if _ROPE_FREQS in file.tensors:
        return _llama3_rope_scaling(meta, file, theta, head_dim)
    rope_type = meta.get(f"{meta.arch}.rope.scaling.type")
    if rope_type in (None, "none"):
        return None
    # Types other than linear are passed on for the config parser to reject by name.
    return {"rope_type": rope_type, "factor": meta.arch_float("rope.scaling.factor")}


def _llama3_rope_scaling(meta: _Metadata, file: GGUFFile, theta: float, head_dim: int) -> dict[str, Any]:
    """llama.cpp stores Llama 3 rope scaling as the divisor of each rotary frequency; recover the
    parameters (only ``factor`` varies across Llama 3.x) and check they reproduce every divisor."""
    divisors = torch.from_numpy(file.read_float32(file.tensors[_ROPE_FREQS]))
    rope = RopeConfig(theta, "llama3", float(divisors.max()), **_LLAMA3_ROPE_BANDS)
    plain = inverse_frequencies(RopeConfig(theta), head_dim)
    scaled = inverse_frequencies(rope, head_dim)
    if divisors.shape != plain.shape or not torch.allclose(plain / scaled, divisors, rtol=1e-4):
        raise meta.error(f"tensor '{_ROPE_FREQS}' is not a Llama 3 rope scaling this loader can reproduce")
    return {key: value for key, value in asdict(rope).items() if key != "theta"}


def _llama_config(meta: _Metadata, file: GGUFFile) -> dict[str, Any]:
    return {
        **_decoder_config(meta, file),
        "attention_bias": "blk.0.attn_q.bias" in file.tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in file.tensors,
    }


# Gemma 3 settings that GGUF files may not carry (llama.cpp hard-codes them); metadata wins where present.
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "sliding_window_pattern": 6,  # five sliding-window layers, then one global layer
    "rope_local_base_freq": 10000.0,
    "hidden_activation": "gelu_pytorch_tanh",
}


def _gemma3_config(meta: _Metadata, file: GGUFFile) -> dict[str, Any]:
    config = _decoder_config(meta, file)
    # Gemma 3 27B scales attention by hidden/heads (168) rather than by the head dim (128).
    is_27b = config["num_hidden_layers"] == _GEMMA3_27B_LAYERS
    scalar = config["hidden_size"] // config["num_attention_heads"] if is_27b else config["head_dim"]
    config |= {
        "query_pre_attn_scalar": scalar,
        "sliding_window": meta.arch_int("attention.sliding_window"),
        "rope_local_base_freq": meta.optional_arch_float("rope.freq_base_swa"),
        "final_logit_softcapping": meta.optional_arch_float("final_logit_softcapping"),
        **_sliding_layout(meta),
    }
    return {**_GEMMA3_DEFAULTS, **_present(config)}


def _sliding_layout(meta: _Metadata) -> dict[str, Any]:
    """``{arch}.attention.sliding_window_pattern``: every n-th layer global, or one flag per layer."""
    pattern = meta.get(f"{meta.arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        return {"layer_types": ["sliding_attention" if sliding else "full_attention" for sliding in pattern]}
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        return {"sliding_window_pattern": pattern}
    return {}


def _gpt2_config(meta: _Metadata, file: GGUFFile) -> dict[str, Any]:
    return {
        "n_embd": meta.arch_int("embedding_length"),
        "n_inner": meta.arch_int("feed_forward_length"),
        "n_layer": meta.arch_int("block_count"),
        "n_head": meta.arch_int("attention.head_count"),
        "n_positions": meta.arch_int("context_length"),
        "layer_norm_epsilon": meta.arch_float("attention.layer_norm_epsilon"),
    }


@dataclass(frozen=True)
class _ArchSpec:
    """How one GGUF architecture maps back to its Hugging Face form."""

    naming: _TensorNaming
    config: Callable[[_Metadata, GGUFFile], dict[str, Any]]
    permuted_qk: bool = False
    norm_offset: float = 0.0
    transposed_stems: tuple[str, ...] = ()


_ARCH_SPECS: dict[str, _ArchSpec] = {
    "llama": _ArchSpec(_LLAMA_NAMING, _llama_config, permuted_qk=True),
    "qwen2": _ArchSpec(_LLAMA_NAMING, _llama_config),
    "qwen3": _ArchSpec(_LLAMA_NAMING, _llama_config),
    "gemma3": _ArchSpec(_GEMMA3_NAMING, _gemma3_config, norm_offset=1.0),
    "gpt2": _ArchSpec(
        _GPT2_NAMING, _gpt2_config, transposed_stems=("attn_qkv", "attn_output", "ffn_up", "ffn_down")
    ),
}


class GGUFCheckpoint(Checkpoint):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.file = GGUFFile(path)
        self.meta = _Metadata(self.file.metadata, path)
        self.architecture = GGUF_ARCHITECTURES.get(self.meta.arch, self.meta.arch)
        resolve_architecture(self.architecture, str(path))
        if self.meta.arch not in _ARCH_SPECS:
            raise UnsupportedArchitectureError(
                f"{path}: GGUF architecture '{self.meta.arch}' has no tensor mapping in tokenmill "
                f"(GGUF architectures read: {', '.join(sorted(_ARCH_SPECS))})"
            )
        self.spec = _ARCH_SPECS[self.meta.arch]
        self._config: dict[str, Any] | None = None
        # quantization "gguf": projections are yielded as their GGUF blocks, not dequantized float32
        self.keep_packed = False

    def hf_config(self) -> dict[str, Any]:
        if self._config is None:
            self._config = {
                "architectures": [self.architecture],
                **self.spec.config(self.meta, self.file),
                "vocab_size": self._vocab_size(),
                "tie_word_embeddings": _OUTPUT not in self.file.tensors,
                **_present(
                    {"bos_token_id": self.meta.token_id("bos"), "eos_token_id": self.meta.token_id("eos")}
                ),
            }
        return self._config

    def _vocab_size(self) -> int:
        from_metadata = self.meta.optional_arch_int("vocab_size")
        if from_metadata is not None:
            return from_metadata
        tokens = self.meta.get("tokenizer.ggml.tokens")
        if isinstance(tokens, list) and tokens:
            return len(tokens)
        if "token_embd.weight" in self.file.tensors:
            return self.file.tensors["token_embd.weight"].shape[0]
        raise self.meta.error("the vocabulary size is in neither the metadata nor a token_embd tensor")

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        config = self.hf_config()
        for name, info in self.file.tensors.items():
            if name == _ROPE_FREQS:
                continue
            layer, stem, kind = self._split_name(name)
            hf_name = self.spec.naming.hf_name(layer, stem, kind)
            if hf_name is None:
                raise self.meta.error(
                    f"tensor '{name}' has no Hugging Face counterpart in a '{self.meta.arch}' model"
                )
            if self.keep_packed and keeps_packed(hf_name, info, stem in self.spec.transposed_stems):
                blocks = projection_blocks(self.file, info, self._qk_heads(stem, config))
                yield hf_name, blocks  # type: ignore[misc]  # GGUFLinearMethod.load takes blocks
                continue
            tensor = torch.from_numpy(self.file.read_float32(info))
            yield hf_name, self._to_hf_layout(name, stem, tensor, config)
            if name == _EMBEDDING and config["tie_word_embeddings"] and self.packs_lm_head():
                yield "lm_head.weight", projection_blocks(self.file, info, None)  # type: ignore[misc]

    def packs_every_projection(self) -> bool:
        """Whether every projection weight (q/k/v, o, gate/up, down) is stored in a format the packed
        kernel reads, so that ``gguf`` would keep them all as blocks."""
        for name, info in self.file.tensors.items():
            if name == _ROPE_FREQS:
                continue
            layer, stem, kind = self._split_name(name)
            if stem in self.spec.transposed_stems:  # GPT-2's Conv1D layout: its projections stay float
                return False
            hf_name = self.spec.naming.hf_name(layer, stem, kind) or ""
            if hf_name.endswith("_proj.weight") and not keeps_packed(hf_name, info, False):
                return False
        return True

    def packs_lm_head(self) -> bool:
        """Whether, packed, the LM head gets blocks of its own: those of ``output`` or, tied, of the
        embedding (which also loads as float, for the lookups), in a format the kernel reads."""
        info = self.file.tensors.get(_OUTPUT) or self.file.tensors.get(_EMBEDDING)
        return self.keep_packed and info is not None and keeps_packed("lm_head.weight", info, False)

    def _split_name(self, name: str) -> tuple[int | None, str, str]:
        match = _TENSOR_NAME.fullmatch(name)
        if match is None:
            raise self.meta.error(f"tensor '{name}' is not named as a llama.cpp weight or bias")
        layer, stem, kind = match.groups()
        return (None if layer is None else int(layer)), stem, kind

    def _qk_heads(self, stem: str, config: dict[str, Any]) -> int | None:
        """The heads whose rows llama.cpp permuted in this tensor (None: not permuted)."""
        if not (self.spec.permuted_qk and stem in ("attn_q", "attn_k")):
            return None
        heads: int = config["num_attention_heads"]
        return heads if stem == "attn_q" else config.get("num_key_value_heads", heads)

    def _to_hf_layout(
        self, name: str, stem: str, tensor: torch.Tensor, config: dict[str, Any]
    ) -> torch.Tensor:
        heads = self._qk_heads(stem, config)
        if heads is not None:
            tensor = unpermute_rotary_rows(tensor, heads)
        if self.spec.norm_offset and name.endswith("norm.weight"):
            tensor -= self.spec.norm_offset
        if stem in self.spec.transposed_stems and name.endswith(".weight"):
            tensor = tensor.t()
        return tensor

    def tokenizer(self) -> "Tokenizer | None":
        if "tokenizer.ggml.model" not in self.file.metadata:
            return None
        from tokenmill.loading.gguf_tokenizer import gguf_hf_tokenizer
        from tokenmill.tokenizer import Tokenizer
        from tokenmill.tokenizer.chat_templates import FALLBACK_CHAT_TEMPLATES

        try:
            hf_tokenizer = gguf_hf_tokenizer(self.path)
        except Exception as exc:  # transformers raises many kinds; all mean the vocabulary cannot be used
            raise self.meta.error(f"transformers cannot build a tokenizer from this file: {exc}") from None
        template = self.meta.get("tokenizer.chat_template")
        if not isinstance(template, str):
            template = FALLBACK_CHAT_TEMPLATES.get(self.meta.arch)
        if template is not None and not getattr(hf_tokenizer, "chat_template", None):
            hf_tokenizer.chat_template = template
        add_bos = self.meta.get("tokenizer.ggml.add_bos_token")
        return Tokenizer(hf_tokenizer, add_bos=add_bos if isinstance(add_bos, bool) else None)

    def eos_token_ids(self) -> tuple[int, ...]:
        """The end-of-sequence id plus end-of-turn / end-of-message ids where the file names them."""
        ids = [self.meta.token_id(name) for name in ("eos", "eot", "eom")]
        if ids[1] is None:
            ids.append(self._end_of_turn_id())
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    def _end_of_turn_id(self) -> int | None:
        """The id of the architecture's known end-of-turn token (Gemma's ``<end_of_turn>``), if any."""
        from tokenmill.tokenizer.chat_templates import END_OF_TURN_TOKENS

        tokens = self.meta.get("tokenizer.ggml.tokens")
        name = END_OF_TURN_TOKENS.get(self.meta.arch)
        if name is None or not isinstance(tokens, list) or name not in tokens:
            return None
        return tokens.index(name)
