"""Benchmark packages import their ``command`` module on first use, so importing a package (as the
``tokenmill`` command does to parse the benchmark's flags, see ``benchmarks.arguments``) stays free of
torch."""

import importlib
from collections.abc import Callable
from typing import Any

COMMAND_NAMES = frozenset({"add_arguments", "main", "run", "command"})


def lazy_command(package: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that finds ``add_arguments``, ``main`` and ``run`` (and the
    ``command`` module itself) in ``package.command``."""

    def module_getattr(name: str) -> Any:
        if name not in COMMAND_NAMES:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(f"{package}.command")
        return module if name == "command" else getattr(module, name)

    return module_getattr
