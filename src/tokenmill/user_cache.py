"""Where tokenmill keeps what it builds once and reuses: ``$XDG_CACHE_HOME/tokenmill`` (an absolute
``XDG_CACHE_HOME`` only, as the XDG spec says), else ``~/.cache/tokenmill``, else the temporary directory
where there is no home. Compiled C kernels, converted tokenizers and default benchmark reports live in
folders under it."""

import os
import tempfile
from pathlib import Path


def user_cache_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME")
    if cache and Path(cache).is_absolute():
        return Path(cache)
    try:
        return Path.home() / ".cache"
    except RuntimeError:  # no home directory to be found
        return Path(tempfile.gettempdir())


def tokenmill_cache_dir(name: str) -> Path:
    """``<cache>/tokenmill/<name>`` (not created here)."""
    return user_cache_dir() / "tokenmill" / name
