"""A GGUF file (llama.cpp's format) as a checkpoint: its metadata becomes a Hugging Face config
(``loading/gguf_config.py``), and its
tensors are dequantized to float32 one at a time, renamed, and laid out as a Hugging Face checkpoint has them.

Three conventions of llama.cpp's converter are undone on the way:

- ``llama`` files: the q and k rows of each head are permuted for llama.cpp's interleaved rotary layout;
- Gemma: RMSNorm weights are stored as ``1 + w``, since llama.cpp's norm has no unit offset;
- GPT-2: the Conv1D weights are stored transposed, as ordinary linear weights.
"""

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.errors import UnsupportedArchitectureError
from tokenmill.loading.checkpoint import Checkpoint
from tokenmill.loading.gguf_config import (
    ROPE_FREQS,
    GGUFMetadata,
    gemma3_config,
    gpt2_config,
    llama_config,
    present,
)
from tokenmill.loading.gguf_file import GGUFFile
from tokenmill.loading.gguf_packing import keeps_packed, projection_blocks, unpermute_rotary_rows
from tokenmill.models.registry import GGUF_ARCHITECTURES, resolve_architecture

if TYPE_CHECKING:
    from tokenmill.tokenizer import Tokenizer

_TENSOR_NAME = re.compile(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)")
_EMBEDDING, _OUTPUT = "token_embd.weight", "output.weight"


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


@dataclass(frozen=True)
class _ArchSpec:
    """How one GGUF architecture maps back to its Hugging Face form."""

    naming: _TensorNaming
    config: Callable[[GGUFMetadata, GGUFFile], dict[str, Any]]
    permuted_qk: bool = False
    norm_offset: float = 0.0
    transposed_stems: tuple[str, ...] = ()


_ARCH_SPECS: dict[str, _ArchSpec] = {
    "llama": _ArchSpec(_LLAMA_NAMING, llama_config, permuted_qk=True),
    "qwen2": _ArchSpec(_LLAMA_NAMING, llama_config),
    "qwen3": _ArchSpec(_LLAMA_NAMING, llama_config),
    "gemma3": _ArchSpec(_GEMMA3_NAMING, gemma3_config, norm_offset=1.0),
    "gpt2": _ArchSpec(
        _GPT2_NAMING, gpt2_config, transposed_stems=("attn_qkv", "attn_output", "ffn_up", "ffn_down")
    ),
}


class GGUFCheckpoint(Checkpoint):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.file = GGUFFile(path)
        self.meta = GGUFMetadata(self.file.metadata, path)
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
                **present(
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
            if name == ROPE_FREQS:
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
            if name == ROPE_FREQS:
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
