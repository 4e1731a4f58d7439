"""Weight loading: Hugging Face folders and hub ids (safetensors), GGUF files, and dummy weights."""

from tokenmill.loading.loader import DTYPES, LoadedModel, build_model, config_from_hf, load_model, parse_dtype
from tokenmill.loading.presets import preset_names

__all__ = [
    "DTYPES",
    "LoadedModel",
    "build_model",
    "config_from_hf",
    "load_model",
    "parse_dtype",
    "preset_names",
]
