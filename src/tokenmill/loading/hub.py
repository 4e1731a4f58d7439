"""Hugging Face hub ids: resolved from the local cache first, downloaded only when the hub is reachable."""

import os
from pathlib import Path

from tokenmill.errors import ModelLoadError

_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=_PATTERNS, local_files_only=True))
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise ModelLoadError(
            f"model '{repo_id}' is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) "
            "and HF_HUB_OFFLINE is set; download it on a connected machine or pass a local folder"
        )
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_PATTERNS))
    except Exception as exc:
        raise ModelLoadError(
            f"model '{repo_id}' is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) "
            f"and could not be downloaded from the hub: {type(exc).__name__}: {_first_line(exc)}"
        ) from None


def _first_line(exc: Exception) -> str:
    lines = str(exc).splitlines()
    return lines[0][:200] if lines else ""
