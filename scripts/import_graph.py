"""The package's import graph, read from the source (AST), not by importing it.

Every ``import``/``from ... import`` inside ``dtorch_mpi`` counts, at module level or inside a
function (a lazy import still ties the modules together), except those under
``if TYPE_CHECKING:`` (annotations only). ``python scripts/import_graph.py`` prints the
package-level graph (subpackages, and top-level modules such as ``dtensor``), its cycles (the
strongly connected components), and the module-level cycles; ``--modules`` prints every edge.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "dtorch_mpi"
PACKAGE = "dtorch_mpi"


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> its file (a package is its ``__init__.py``)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements anywhere in ``tree`` except the body of an ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for other in node.orelse:
                yield from _imports(ast.Module(body=[other], type_ignores=[]))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _imports(node)


def _resolve(name: str, node: ast.ImportFrom | ast.Import, known: dict[str, Path]) -> list[str]:
    """The package modules ``node`` (in module ``name``) imports."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == PACKAGE]
    if node.level:
        base = name.split(".") if known[name].name == "__init__.py" else name.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != PACKAGE:
        return []
    subs = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in known]
    return subs if subs and len(subs) == len(node.names) else [target, *subs]


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package modules it imports (TYPE_CHECKING imports excluded)."""
    known = modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = {t for node in _imports(tree) for t in _resolve(name, node, known)
                       if t != name and t in known}
    return graph


def unit(module: str, known: dict[str, Path]) -> str:
    """The package-level unit: a subpackage (``nn``) or a top-level module (``dtensor``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    known = {name: Path() for name in graph}
    out: dict[str, set[str]] = {}
    for name, targets in graph.items():
        src = unit(name, known)
        out.setdefault(src, set()).update(unit(t, known) for t in targets if unit(t, known) != src)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(found)


def in_one_cycle(graph: dict[str, set[str]], a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` reach each other (directly or through other nodes)."""
    return any(a in comp and b in comp for comp in cycles(graph))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", action="store_true", help="print every module-level edge too")
    args = parser.parse_args()
    mods = module_graph()
    pkgs = package_graph(mods)
    print("package import graph (TYPE_CHECKING imports excluded; lazy imports included):")
    for src in sorted(pkgs):
        print(f"  {src:<12} -> {', '.join(sorted(pkgs[src])) or '-'}")
    print("package cycles:", cycles(pkgs) or "none")
    print("module cycles:", cycles(mods) or "none")
    if args.modules:
        for src in sorted(mods):
            print(f"  {src} -> {', '.join(sorted(mods[src])) or '-'}")


if __name__ == "__main__":
    main()
