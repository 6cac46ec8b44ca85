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


# -- private torch APIs ---------------------------------------------------------------------------

PRIVATE_APIS_DOC = PACKAGE.parent / "docs" / "private-torch-apis.md"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_private_attributes() -> set[str]:
    """Private names that torch's own objects carry (tensors, modules, DTensors, storages, autograd
    Functions, DTensor's op dispatcher), and the attributes `torch.compile` leaves on what it
    wraps: such an attribute read on any object counts as a private torch API."""
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor

    objects = (torch.Tensor, nn.Parameter, nn.Module, nn.Module(), DTensor, DTensor._op_dispatcher,
               torch.UntypedStorage, torch.autograd.Function)
    names = {n for obj in objects for n in dir(obj) if _private(n)}
    return names | {"_orig_mod", "_compiled_call_impl", "_torchdynamo_orig_callable"}


def _private_names_of(full: list[str] | None) -> set[str]:
    """The private names (`dir`) of the torch class at dotted path `full`; none for a path that is
    no class of torch."""
    import importlib

    if not full or full[0] != "torch":
        return set()
    for cut in range(len(full) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(full[:cut]))
        except ImportError:
            continue
        for part in full[cut:]:
            obj = getattr(obj, part, None)
        return {n for n in dir(obj) if _private(n)} if isinstance(obj, type) else set()
    return set()


def private_torch_uses(package: Path = PACKAGE, attributes: set[str] | None = None) -> set[tuple[str, str]]:
    """`{(file relative to the package, name)}`: every private torch API the package uses.

    Counted: a private module or name imported from torch (and every name imported from a private
    module); attribute chains from a name bound to torch (by an import, or `aten = torch.ops.aten`),
    from their first private part on (`torch._C._functorch.is_gradtrackingtensor` gives `_C`,
    `_functorch` and `is_gradtrackingtensor`), `getattr` with a constant name included; a private
    aten op (`torch.ops.aten._log_softmax.default` gives `_log_softmax`), also named in a string;
    and on any object, an attribute torch's own objects carry privately (`t._base`, `m._parameters`).
    """
    import torch

    attributes = _torch_private_attributes() if attributes is None else attributes
    found: set[tuple[str, str]] = set()
    builtin = {n for t in (dict, list, set, tuple, str, object) for n in dir(t)}  # `handlers.get`: no torch API
    own: set[str] = set()  # private attributes the package sets itself (`fn._shardfn = True`)
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr) \
                    and node.attr not in attributes:
                own.add(node.attr)

    def names_of(full: list[str]) -> list[str]:
        if full[:2] == ["torch", "ops"]:  # torch.ops.<namespace>.<op>.<overload>
            return [full[3]] if len(full) > 3 and _private(full[3]) else []
        out, inside = [], False
        for part in full:
            inside = inside or _private(part)
            if inside and part not in builtin and part not in own:
                out.append(part)
        return out

    def chain(node: ast.AST, roots: dict[str, list[str]]) -> list[str] | None:
        """The dotted path `node` reaches from a torch name, or None."""
        parts: list[str] = []
        while True:
            if isinstance(node, ast.Attribute):
                parts.append(node.attr)
                node = node.value
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                parts.append(node.args[1].value)
                node = node.args[0]
            else:
                break
        if isinstance(node, ast.Name) and node.id in roots:
            return roots[node.id] + parts[::-1]
        return None

    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        roots: dict[str, list[str]] = {}  # a name bound to torch or something in it -> its dotted path
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "torch":
                        found.update((rel, n) for n in names_of(a.name.split(".")))
                        roots[a.asname or "torch"] = a.name.split(".") if a.asname else ["torch"]
            elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
                for a in node.names:
                    full = node.module.split(".") + [a.name]
                    found.update((rel, n) for n in names_of(full))
                    roots[a.asname or a.name] = full
        for node in ast.walk(tree):  # `aten = torch.ops.aten`: a name bound to torch too
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                full = chain(node.value, roots)
                if full is not None:
                    roots.setdefault(node.targets[0].id, full)
        for node in ast.walk(tree):  # a subclass of a torch class: the private names it overrides or reads on self
            if isinstance(node, ast.ClassDef):
                inherited = {n for base in node.bases for n in _private_names_of(chain(base, roots))}
                for item in ast.walk(node):
                    if isinstance(item, ast.FunctionDef) and item.name in inherited:
                        found.add((rel, item.name))
                    elif (isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) and item.value.id == "self"
                          and item.attr in inherited):
                        found.add((rel, item.attr))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Attribute, ast.Call)):
                full = chain(node, roots)
                if full is not None:
                    found.update((rel, n) for n in names_of(full))
                elif isinstance(node, ast.Attribute) and node.attr in attributes:
                    found.add((rel, node.attr))
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr") \
                        and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in attributes:
                    found.add((rel, node.args[1].value))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"_[a-z][a-z0-9_]*", node.value):
                if hasattr(torch.ops.aten, node.value):  # an op looked up by name: getattr(aten, "_op")
                    found.add((rel, node.value))
    return found


def _listed(name: str, rel: str, rows: list[tuple[str, str]]) -> tuple[bool, bool]:
    """Whether `name` is in the API cell of some row of the doc's table, and whether one of those
    rows names `rel` (the file) in its Where cell."""
    word = re.compile(rf"(?<![\w]){re.escape(name)}(?![\w])")
    foreach = name.startswith("_foreach_") and f"`{name[len('_foreach_'):]}`"
    hits = [where for api, where in rows if word.search(api) or (foreach and "_foreach_*" in api and foreach in api)]
    stem, file = Path(rel).stem, Path(rel).name
    if "/" in rel:  # `optim/` (`_alias`, ...) or `optim/_alias.py`
        top = rel.split("/")[0]
        named = any(rel in w or (f"`{top}/`" in w and f"`{stem}`" in w) for w in hits)
    else:
        named = any(re.search(rf"(?<![\w/]){re.escape(file)}", w) for w in hits)
    return bool(hits), named


def _doc_rows(text: str) -> list[tuple[str, str]]:
    """(API cell, Where cell) of each row of the doc's table."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 3 and cells[0] != "API":
            rows.append((cells[0], cells[1]))
    return rows


def test_every_private_torch_api_used_is_listed_where_it_is_used():
    """docs/private-torch-apis.md names every private torch API the package uses, each in a row
    whose Where column names every file that uses it: a torch upgrade re-checks that list first."""
    rows = _doc_rows(PRIVATE_APIS_DOC.read_text())
    unlisted, unplaced = set(), set()
    for rel, name in sorted(private_torch_uses()):
        listed, placed = _listed(name, rel, rows)
        if not listed:
            unlisted.add(f"{name} ({rel})")
        elif not placed:
            unplaced.add(f"{name} in {rel}")
    assert not unlisted, f"private torch APIs used but not in docs/private-torch-apis.md: {sorted(unlisted)}"
    assert not unplaced, f"private torch APIs whose row in docs/private-torch-apis.md lacks the file: {sorted(unplaced)}"


def test_private_api_finder_sees_each_form(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "import torch\n"
        "from torch._subclasses.fake_tensor import FakeTensor\n"
        "from torch.distributed._functional_collectives import AsyncCollectiveTensor as ACT\n"
        "from torch.utils import _pytree as pytree\n"
        "from torch.distributed.tensor import DTensor\n"
        "aten = torch.ops.aten\n"
        "def f(t, m):\n"
        "    torch._C._functorch.is_gradtrackingtensor(t)\n"
        "    torch._C._current_graph_task_id()\n"
        "    pytree.tree_leaves(t)\n"
        "    getattr(DTensor, '_op_dispatcher', None)\n"
        "    aten._log_softmax.default, torch.ops.aten.mm.default, getattr(aten, '_local_scalar_dense')\n"
        "    DTensor._op_dispatcher._custom_op_handlers.get(t)\n"
        "    g = getattr(DTensor._op_dispatcher, '_rule', None)\n"
        "    g._mine = getattr(g, '_mine', True)\n"
        "    return t._base, m._parameters, t.shape, torch.nn.functional.relu(t), torch.__version__\n"
        "from torch.utils.module_tracker import ModuleTracker\n"
        "class Tracker(ModuleTracker):\n"
        "    def _fw_pre_hook(self, mod, input):\n"
        "        return self._get_mod_name(mod), self._mine\n"
    )
    assert private_torch_uses(pkg, attributes={"_base", "_parameters"}) == {("a.py", n) for n in (
        "_subclasses", "fake_tensor", "FakeTensor", "_functional_collectives", "AsyncCollectiveTensor", "_pytree",
        "tree_leaves", "_C", "_functorch", "is_gradtrackingtensor", "_current_graph_task_id", "_op_dispatcher",
        "_log_softmax", "_local_scalar_dense", "_base", "_parameters", "_custom_op_handlers", "_rule", "_fw_pre_hook",
        "_get_mod_name",
    )}


def test_no_class_over_400_lines():
    """One owner per concern: no class in the package over 400 lines (a class that grows past it
    holds more than one concern; split it, as the engine was into its schedule, buffers, parameter
    view and unit check)."""
    big = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 400:
                big.append(f"{path.relative_to(PACKAGE.parent)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not big, big
