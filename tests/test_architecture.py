"""The package's import graph has no cycle, and no module imports another module's private name (read from the ast)."""

from __future__ import annotations

import ast
import pathlib
import tomllib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "grpo_kernels"
# Compiled submodules (no .py file): the C extensions pyproject.toml declares, e.g. grpo_kernels._cpu_rows
EXTENSIONS = {
    ext["name"]
    for ext in tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"].get(
        "ext-modules", []
    )
}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """(imported grpo_kernels module, names taken from it) for every import in the file, in functions too."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "grpo_kernels":
                continue
            names = [a.name for a in node.names]
            # `from . import x` / `from .ops import torch_rows`: x may be a module itself
            submodules = [
                n
                for n in names
                if (PACKAGE.parent / base.replace(".", "/") / f"{n}.py").exists() or f"{base}.{n}" in EXTENSIONS
            ]
            found += [(f"{base}.{n}", []) for n in submodules]
            others = [n for n in names if n not in submodules]
            if others:  # `from . import wire` alone takes nothing from the package's __init__
                found.append((base, others))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.split(".")[0] == "grpo_kernels"]
    return found


def graph() -> dict[str, dict[str, list[str]]]:
    edges: dict[str, dict[str, list[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        here = module_name(path)
        edges[here] = {}
        for target, names in imports(path):
            if target != here:
                edges[here].setdefault(target, []).extend(names)
    return edges


def find_cycle(edges: dict[str, dict[str, list[str]]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in edges.get(node, {}):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in edges:
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_graph_has_no_cycle():
    edges = graph()
    assert "grpo_kernels.api" in edges and "grpo_kernels.compile_op" in edges["grpo_kernels.api"]  # the walk works
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_imports_a_private_name_of_another():
    private = [
        f"{here} imports {name} from {target}"
        for here, targets in graph().items()
        for target, names in targets.items()
        for name in names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert not private, "\n".join(private)


def test_the_checker_sees_a_cycle_and_a_private_import():
    """The two checks above can fail: a made-up graph with both faults."""
    edges = {"a": {"b": ["_helper"]}, "b": {"c": []}, "c": {"a": []}}
    assert find_cycle(edges) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": []}, "b": {}}) is None
