"""Configs of real models shipped with tokenmill, for dummy-weight benchmarks without the weights."""

import json
from importlib import resources
from typing import Any

PRESETS_PACKAGE = __name__


def preset_names() -> list[str]:
    files = resources.files(PRESETS_PACKAGE).iterdir()
    return sorted(f.name.removesuffix(".json") for f in files if f.name.endswith(".json"))


def load_preset(name: str) -> dict[str, Any] | None:
    resource = resources.files(PRESETS_PACKAGE).joinpath(f"{name}.json")
    if not resource.is_file():
        return None
    config: dict[str, Any] = json.loads(resource.read_text())
    return config
