"""The package's shape: no import cycles between its modules, counting imports inside functions."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import shardfn

PACKAGE = Path(shardfn.__file__).parent


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, every import statement counted, at any depth."""
    top = package.name
    files = {_module_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}

    def resolve(name: str) -> str | None:
        while name and name not in files:  # `from .optim import adamw`: the package
            name = name.rpartition(".")[0]
        return name or None

    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                # `from . import _watch` names a module; `from .x import y` may too.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                if t == top or not t.startswith(top + "."):
                    continue
                hit = resolve(t)
                if hit is not None and hit != mod:
                    graph[mod].add(hit)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycles():
    graph = import_graph()
    assert "shardfn._train" in graph["shardfn"] and "shardfn._collectives" in graph["shardfn._engine"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_sees_imports_inside_functions(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("from . import b\ndef f():\n    return b\n")
    (pkg / "b.py").write_text("def g():\n    from .sub.c import h\n    return h\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("import pkg.a\nfrom .. import b\n")
    graph = import_graph(pkg)
    assert graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a", "pkg.b"}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]
    (pkg / "b.py").write_text("")
    assert find_cycle(import_graph(pkg)) is None


def test_one_owner_decides_which_model_a_tree_belongs_to():
    """`_models.model_of` is the one place that looks models up by a tree's names: no other module
    reads the registry of functionalized models or its lookup."""
    readers = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name == "_models.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("_models"):
                if any(a.name in ("candidates", "REGISTRY") for a in node.names):
                    readers.add(path.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "_models":
                if node.attr in ("candidates", "REGISTRY"):
                    readers.add(path.name)
            elif isinstance(node, (ast.FunctionDef, ast.Name)) and getattr(node, "name", getattr(node, "id", "")) == "find_apply":
                readers.add(path.name)  # the lookup's old name: a second owner
    assert readers <= {"_process.py"}, readers  # _process only forgets models nobody holds


def test_the_readme_layout_table_names_every_module():
    """README.md's layout table names every module of the package (a new concern gets a row)."""
    readme = (PACKAGE.parent / "README.md").read_text()
    table = readme[readme.index("## Layout"):]
    table = table[: table.index("\n## ", 1)] if "\n## " in table[1:] else table
    named = set(re.findall(r"`(?:shardfn/)?(?:optim/)?(_?\w+)\.py`", table)) | set(re.findall(r"`(_\w+)\.py`", table))
    missing = [
        p.relative_to(PACKAGE).as_posix() for p in PACKAGE.glob("*.py")
        if p.name != "__init__.py" and p.stem not in named
    ]
    assert not missing, f"README.md's layout table lacks {missing}"
