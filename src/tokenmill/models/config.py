"""The model description tokenmill's layers are built from, parsed from a Hugging Face ``config.json``.

Each architecture module turns the raw config dict into a :class:`ModelConfig`; :class:`ConfigReader`
makes a missing or mistyped field an error that names the file and the field.
"""

import math
from dataclasses import dataclass, field
from typing import Any

from tokenmill.errors import ModelLoadError

# transformers' "dynamic" (NTK) rescales only once a sequence outgrows max_position_embeddings, which the
# engine's max_model_len never exceeds: up to there it rotates unscaled, so "dynamic" runs as "default".
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 scaling
    high_freq_factor: float = 4.0  # llama3 scaling
    original_max_position_embeddings: int = 8192  # llama3 and yarn scaling: the pretraining context
    beta_fast: float = 32.0  # yarn: rotations in the original context above which a frequency is kept
    beta_slow: float = 1.0  # yarn: rotations below which it is divided by ``factor``
    truncate: bool = True  # yarn: round the band between them out to whole dimensions
    attention_factor: float = 1.0  # yarn: cos and sin are scaled by it (so attention logits by its square)

    def context_length(self, max_position_embeddings: int) -> int:
        """The positions the model serves: yarn extends its original context ``factor`` times (Qwen's
        configs keep ``max_position_embeddings`` at the unscaled length), as vLLM does."""
        if self.rope_type != "yarn":
            return max_position_embeddings
        return max(max_position_embeddings, int(self.original_max_position_embeddings * self.factor))


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    rope: RopeConfig | None  # None: learned absolute positions (GPT-2)
    attention_scale: float
    sliding_windows: tuple[int | None, ...]  # per layer; None is global attention
    qkv_bias: bool = False
    output_bias: bool = False
    mlp_bias: bool = False
    local_rope: RopeConfig | None = None  # rope of sliding-window layers when it differs (Gemma 3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


class ConfigReader:
    """Typed access to a raw config dict; errors name ``source`` and the offending field."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def error(self, message: str) -> ModelLoadError:
        return ModelLoadError(f"{self.source}: {message}")

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def require_int(self, *keys: str) -> int:
        """The first of ``keys`` present (aliases such as ``n_embd`` / ``hidden_size``) as an int."""
        for key in keys:
            if self.has(key):
                value = self.raw[key]
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise self.error(f"field '{key}' must be a non-negative integer, got {value!r}")
                return value
        raise self.error(f"missing required field '{keys[0]}'")

    def int_or(self, key: str, default: int) -> int:
        return self.require_int(key) if self.has(key) else default

    def float_or(self, key: str, default: float) -> float:
        value = self.raw.get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(f"field '{key}' must be a number, got {value!r}")
        return float(value)

    def bool_or(self, key: str, default: bool) -> bool:
        value = self.raw.get(key, default)
        return default if value is None else bool(value)

    def str_or(self, key: str, default: str) -> str:
        value = self.raw.get(key, default)
        return default if value is None else str(value)

    def token_ids(self, key: str) -> tuple[int, ...]:
        value = self.raw.get(key)
        if value is None:
            return ()
        return tuple(value) if isinstance(value, list) else (int(value),)

    def rope_parameters(self) -> dict[str, Any]:
        """The rope settings in either config dialect: transformers 4's ``rope_scaling`` (with ``rope_theta``
        beside it), else transformers 5's ``rope_parameters``; transformers reads them in this order."""
        for key in ("rope_scaling", "rope_parameters"):
            value = self.raw.get(key)
            if value is not None and not isinstance(value, dict):
                raise self.error(f"field '{key}' must be an object, got {value!r}")
            if value:
                return value
        return {}

    def rope(self, params: dict[str, Any], default_theta: float, nested: bool = False) -> RopeConfig:
        """``params`` (one entry of :meth:`rope_parameters`) as a :class:`RopeConfig`. The theta and the
        original context come from beside it where it lacks them (a top-level ``original_max_position_
        embeddings`` wins unless ``nested``, as in transformers), the context defaulting to
        ``max_position_embeddings``."""
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise self.error(f"rope type '{rope_type}' is not supported (supported: {SUPPORTED_ROPE_TYPES})")
        partial = params.get("partial_rotary_factor", self.raw.get("partial_rotary_factor"))
        if partial is not None and partial != 1:
            raise self.error(
                f"partial_rotary_factor {partial!r} is not supported: these models rotate whole heads"
            )
        number = RopeNumbers(params, self)
        max_positions = self.int_or("max_position_embeddings", 0)
        original = int(number.get("original_max_position_embeddings", max_positions))
        if not nested and self.has("original_max_position_embeddings"):
            original = self.require_int("original_max_position_embeddings")
        if rope_type in ("llama3", "yarn") and original <= 0:
            raise self.error(f"rope type '{rope_type}' needs a positive original_max_position_embeddings")
        # yarn without a factor: the ratio of the served context to the original one
        factor = number.get(
            "factor", max_positions / original if rope_type == "yarn" and max_positions else 1.0
        )
        if factor <= 0:
            raise self.error(f"rope field 'factor' must be positive, got {factor}")
        return RopeConfig(
            theta=number.get("rope_theta", self.float_or("rope_theta", default_theta)),
            rope_type=rope_type,
            factor=factor,
            low_freq_factor=number.get("low_freq_factor", 1.0),
            high_freq_factor=number.get("high_freq_factor", 4.0),
            original_max_position_embeddings=original,
            beta_fast=number.get("beta_fast", 0.0) or 32.0,
            beta_slow=number.get("beta_slow", 0.0) or 1.0,
            truncate=bool(params.get("truncate", True)),
            attention_factor=number.yarn_attention_factor(factor) if rope_type == "yarn" else 1.0,
        )

    def layer_types(self, num_layers: int) -> list[str] | None:
        types = self.raw.get("layer_types")
        if types is None:
            return None
        if not isinstance(types, list) or len(types) != num_layers:
            raise self.error(f"field 'layer_types' must list one entry per layer ({num_layers})")
        return [str(t) for t in types]


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class RopeNumbers:
    """The numbers of one rope dict, each checked: a non-negative number, or an error that names its key."""

    def __init__(self, params: dict[str, Any], reader: ConfigReader) -> None:
        self.params = params
        self.reader = reader

    def get(self, key: str, default: float) -> float:
        value = self.params.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise self.reader.error(f"rope field '{key}' must be a non-negative number, got {value!r}")
        return float(value)

    def yarn_attention_factor(self, factor: float) -> float:
        """YaRN's scale of cos and sin: given, or from ``factor`` (by DeepSeek's ``mscale`` ratio if set)."""
        if self.params.get("attention_factor") is not None:
            return self.get("attention_factor", 1.0)
        mscale, mscale_all_dim = self.get("mscale", 0.0), self.get("mscale_all_dim", 0.0)
        if mscale and mscale_all_dim:
            return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        return _yarn_mscale(factor)
