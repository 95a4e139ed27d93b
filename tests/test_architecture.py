"""The package's import graph: no cycles between modules or between packages, and the layering
docs/architecture.md states (each package imports only what sits below it)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "eagle3"

# package (top-level module or sub-package of eagle3) -> packages it may not import (the table in
# docs/architecture.md). Leaves first; every import the code makes, at any depth of a function.
MAY_NOT = {
    "errors": "*", "settings": "*", "paths": {"*", "settings"}, "threads": {"*", "settings"},
    "memory": {"*", "settings"}, "sampling": {"*", "errors"},
    "checks": {"*", "errors"}, "engines": {"*", "errors"},
    "kernels": {"*", "errors", "paths", "settings"},
    "config": {"*", "errors", "settings", "kernels"},
    "models": {"*", "errors", "paths"},
    "runtime": {"draft", "speculative", "generate", "engines", "export", "layouts", "api", "cli", "serve",
                "bench", "doctor", "train", "adapters"},
    "draft": {"speculative", "generate", "export", "layouts", "api", "cli", "serve", "bench", "doctor", "train"},
    "speculative": {"generate", "export", "layouts", "api", "cli", "serve", "bench", "doctor", "train",
                    "adapters"},
    "generate": {"export", "layouts", "api", "cli", "serve", "bench", "doctor", "train"},
    "layouts": {"speculative", "generate", "export", "api", "cli", "serve", "bench", "doctor", "train",
                "learn", "adapters"},
    "export": {"generate", "api", "serve", "bench", "doctor", "train"},
    "train": {"generate", "api", "serve", "bench", "doctor", "export"},
    "learn": {"api", "cli", "serve", "bench", "doctor"},
    "serve": {"bench", "doctor", "train", "cli"},
    "bench": {"serve", "doctor", "train", "cli"},
    "doctor": {"serve", "bench", "train", "cli"},
}


def module_name(path: Path) -> str:
    parts = ["eagle3", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Modules of eagle3 that `path` imports (relative imports resolved; names that are modules)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("eagle3")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("eagle3"):
                continue
            found.add(target)
            found |= {f"{target}.{a.name}" for a in node.names}
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    return {m: {i for i in imports_of(p) if i in modules and i != m} for m, p in modules.items()}


def find_cycle(edges: dict[str, set[str]]):
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(edges):
        if n not in state and (c := visit(n)):
            return c
    return None


def package_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "eagle3"


def package_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for m, deps in edges.items():
        p = package_of(m)
        out.setdefault(p, set()).update(package_of(d) for d in deps if package_of(d) != p)
    out.pop("eagle3", None)
    return {p: deps - {"eagle3"} for p, deps in out.items()}


def test_no_module_imports_itself_through_a_cycle():
    # a package's __init__ re-exporting its modules is not a cycle of the code: leave those edges out
    edges = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph().items()}
    assert find_cycle(edges) is None, f"import cycle: {' -> '.join(find_cycle(edges))}"


def test_no_package_cycle():
    cycle = find_cycle(package_graph(graph()))
    assert cycle is None, f"package import cycle: {' -> '.join(cycle)}"


@pytest.mark.parametrize("package", sorted(MAY_NOT))
def test_package_imports_only_what_sits_below_it(package):
    deps = package_graph(graph()).get(package, set())
    rule = MAY_NOT[package]
    if "*" in rule:
        bad = deps - (set(rule) - {"*"})
    else:
        bad = deps & rule
    assert not bad, f"eagle3.{package} imports {sorted(bad)} (docs/architecture.md: may not)"


def test_the_checker_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def public_classes(path: Path) -> list[str]:
    """Public classes defined at the top of a module (a name without a leading underscore)."""
    return [n.name for n in ast.parse(path.read_text()).body
            if isinstance(n, ast.ClassDef) and not n.name.startswith("_")]


def defined_twice(paths) -> dict[str, list[str]]:
    where: dict[str, list[str]] = {}
    for path in paths:
        for name in public_classes(path):
            where.setdefault(name, []).append(module_name(path))
    return {name: mods for name, mods in where.items() if len(mods) > 1}


def test_no_public_class_name_is_defined_in_two_modules():
    # one name, one meaning: `Engine` is the generation engine, not also a table of peer engines
    twice = defined_twice(sorted(ROOT.rglob("*.py")))
    assert not twice, f"public class names defined in more than one module: {twice}"


def test_the_checker_sees_a_name_defined_twice(tmp_path):
    (tmp_path / "a.py").write_text("class Shared:\n    pass\nclass _Private:\n    pass\n")
    (tmp_path / "b.py").write_text("class Shared:\n    pass\nclass _Private:\n    pass\n")
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        assert defined_twice(sorted(tmp_path.glob("*.py"))) == {"Shared": ["eagle3.a", "eagle3.b"]}
    finally:
        ROOT = root
