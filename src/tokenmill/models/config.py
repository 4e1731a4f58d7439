"""The model description tokenmill's layers are built from, parsed from a Hugging Face ``config.json``.

Each architecture module turns the raw config dict into a :class:`ModelConfig`; :class:`ConfigReader`
makes a missing or mistyped field an error that names the file and the field.
"""

from dataclasses import dataclass, field
from typing import Any

from tokenmill.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 scaling
    high_freq_factor: float = 4.0  # llama3 scaling
    original_max_position_embeddings: int = 8192  # llama3 scaling


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

    def rope(self, layer_type: str | None = None, theta_key: str = "rope_theta") -> RopeConfig:
        """Rope settings in either config dialect: transformers 5 ``rope_parameters`` (optionally keyed by
        layer type) or transformers 4 ``rope_theta`` + ``rope_scaling``."""
        params = self.raw.get("rope_parameters")
        if isinstance(params, dict) and layer_type is not None and layer_type in params:
            params = params[layer_type]
        if isinstance(params, dict) and "rope_theta" in params:
            return self._rope_from(params, float(params["rope_theta"]))
        scaling = self.raw.get("rope_scaling") if theta_key == "rope_theta" else None
        return self._rope_from(scaling or {}, self.float_or(theta_key, 10000.0))

    def _rope_from(self, params: dict[str, Any], theta: float) -> RopeConfig:
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise self.error(f"rope type '{rope_type}' is not supported (supported: {SUPPORTED_ROPE_TYPES})")
        return RopeConfig(
            theta=theta,
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        )

    def layer_types(self, num_layers: int) -> list[str] | None:
        types = self.raw.get("layer_types")
        if types is None:
            return None
        if not isinstance(types, list) or len(types) != num_layers:
            raise self.error(f"field 'layer_types' must list one entry per layer ({num_layers})")
        return [str(t) for t in types]
