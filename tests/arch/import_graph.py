"""The package's import graph from the source (AST), every import statement counted — module level and the
lazy ones inside functions alike, since a lazy import is still a dependency."""
from __future__ import annotations

import ast
import os

PACKAGE = "nagmoe"
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", PACKAGE)


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def package_modules() -> dict[str, str]:
    """module name -> file path, for every .py file of the package."""
    out = {}
    for dirpath, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                out[_module_name(path)] = path
    return out


def _resolve(target: str, modules: dict) -> str:
    """The package module an imported dotted name lives in (`a.b.c` -> `a.b` when c is a name in a.b)."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target


def imports_of(module: str, path: str, modules: dict) -> set[str]:
    """The package modules `module` imports (anywhere in the file)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    is_pkg = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                parts = parts if is_pkg else parts[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]  # a submodule, or a name resolved to `base`
        for name in names:
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                target = _resolve(name, modules)
                if target and target != module:
                    found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out
