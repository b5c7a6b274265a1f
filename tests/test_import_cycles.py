"""No import cycles among featcal's own modules: the graph read from the source with `ast`, with
imports inside functions counted as edges too (a lazy import that closes a circle is still one)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> the package name it is installed as
PACKAGES = {
    "featcal_core": "featcal_core",
    "featcal_cli": "featcal_cli",
    "tasks": "featcal.tasks",
    "flows": "featcal.flows",
}


def find_modules(root: Path, packages: dict[str, str]) -> dict[str, Path]:
    """{dotted module name: source file} of every module under the `packages` folders."""
    modules: dict[str, Path] = {}
    for folder, name in packages.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            modules[".".join([name, *(p for p in parts if p != "__init__")])] = path
    return modules


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement in `module` reaches (relative imports resolved)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, *([node.module] if node.module else [])])
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """{module: {imported module: line of the first such import}}: module-level and function-level
    imports alike; a dotted name counts as the deepest module of it that exists; imports of a
    module's own parent packages and of anything outside `modules` are left out."""
    graph: dict[str, dict[str, int]] = {module: {} for module in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            for name in _imported(node, module, is_package):
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != module and not module.startswith(name + "."):
                    graph[module].setdefault(name, node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted (Tarjan's
    algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def describe(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    """A cycle's modules, then each import between them with its line."""
    members = set(component)
    edges = [
        f"    {module} -> {target} (line {line})"
        for module in component
        for target, line in sorted(graph[module].items())
        if target in members
    ]
    return "  " + " <-> ".join(component) + "\n" + "\n".join(edges)


def test_no_import_cycles():
    modules = find_modules(ROOT, PACKAGES)
    assert "featcal_core.io.outputs" in modules and "featcal.flows.pipeline" in modules
    graph = import_graph(modules)
    found = cycles(graph)
    assert not found, (
        f"{len(found)} import cycle(s) (imports inside functions count); move what both sides "
        "need into the lower module or a new one:\n"
        + "\n".join(describe(component, graph) for component in found)
    )


def test_the_detector_finds_a_cycle(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg.a import VALUE\n",  # a parent package: no edge back to it
        "a.py": "from pkg import b\nVALUE = 1\n",
        "b.py": "def late():\n    from .a import VALUE\n    return VALUE\n",  # lazy, relative
        "c.py": "import pkg.a.VALUE\nimport os\n",  # the deepest module that exists: pkg.a
        "sub/__init__.py": "from . import d\n",
        "sub/d.py": "from .. import c\nfrom pkg.sub import e\n",
        "sub/e.py": "import pkg.sub\n",  # its own parent package: no edge
    }
    for name, text in files.items():
        (package / name).write_text(text)
    modules = find_modules(tmp_path, {"pkg": "pkg"})
    graph = import_graph(modules)
    assert graph["pkg.c"] == {"pkg.a": 1}
    assert graph["pkg.sub.d"] == {"pkg.c": 1, "pkg.sub.e": 2}
    assert graph["pkg.sub.e"] == {}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
    assert "pkg.a -> pkg.b" in describe(["pkg.a", "pkg.b"], graph)

    (package / "sub/e.py").write_text("def f():\n    from pkg.sub.d import c\n")
    assert cycles(import_graph(find_modules(tmp_path, {"pkg": "pkg"}))) == [
        ["pkg.a", "pkg.b"],
        ["pkg.sub.d", "pkg.sub.e"],
    ]
