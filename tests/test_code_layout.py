"""The source tree keeps the shape the README describes: modules of one concept (at most 400 lines each),
and dependencies that point one way (no cycle among the modules' top-level imports; an import inside a
function is a deliberate lazy one and is not counted)."""

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "src"
MAX_MODULE_LINES = 400


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the ``tokenmill`` package."""
    modules = {}
    for path in (SOURCE / "tokenmill").rglob("*.py"):
        parts = path.relative_to(SOURCE).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def top_level_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The tokenmill modules ``path`` imports at its top level (``if TYPE_CHECKING:`` blocks excluded):
    ``from a.b import c`` counts ``a.b.c`` where that is a module, else ``a.b``."""
    imported = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                imported.add(submodule if submodule in modules else node.module)
    return imported & modules.keys()


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as the list of its modules, or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for dependency in sorted(graph[module]):
            if state.get(dependency) == 1:
                return [*path[path.index(dependency) :], dependency]
            if dependency not in state and (cycle := visit(dependency)) is not None:
                return cycle
        state[module] = 2
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)) is not None:
            return cycle
    return None


def test_every_module_is_at_most_400_lines() -> None:
    too_long = {
        name: lines
        for name, path in module_files().items()
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines: {too_long}"


def test_top_level_imports_have_no_cycle() -> None:
    modules = module_files()
    graph = {name: top_level_imports(path, modules) - {name} for name, path in modules.items()}
    assert import_cycle(graph) is None, " -> ".join(import_cycle(graph) or [])


def test_the_cycle_check_finds_a_cycle() -> None:
    """The checker itself, on a graph with a cycle and one without."""
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
