"""pardec's import graph, read from the source (every import statement, those inside functions included): no module
imports itself through others, the packages import one way, and the model seam knows nothing above it."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pardec

SRC = Path(pardec.__file__).parent.parent


def _modules() -> dict[str, Path]:
    out = {}
    for p in (SRC / "pardec").rglob("*.py"):
        parts = p.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _graph() -> dict[str, set[str]]:
    """module -> the pardec modules it imports (``from pkg import submodule`` counts as the submodule only: the
    package itself is imported first either way)."""
    mods = _modules()

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                targets = subs + ([base] if len(subs) < len(node.names) else [])
            else:
                continue
            for t in targets:
                t = known(t) if t.startswith("pardec") else None
                if t and t != name:
                    edges[name].add(t)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    nodes = set(edges) | {b for bs in edges.values() for b in bs}
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(edges.get(w, ())))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return out


def _packages(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """pardec.<package> -> the pardec packages it imports (the top-level ``pardec`` module left out: every layer may
    read its paths)."""
    top = lambda m: m.split(".")[1] if m.count(".") else None  # noqa: E731
    out: dict[str, set[str]] = defaultdict(set)
    for a, bs in edges.items():
        for b in bs:
            if top(a) and top(b) and top(a) != top(b):
                out[top(a)].add(top(b))
    return out


def test_no_module_imports_itself_through_others():
    assert _cycles(_graph()) == []


def test_the_packages_import_one_way():
    assert _cycles(_packages(_graph())) == []


def test_the_model_seam_and_the_decoders_know_nothing_above_them():
    packages = _packages(_graph())
    above = {"decoding", "evaluation", "training", "tasks", "metrics", "report", "bench", "testing"}
    assert packages["models"] & above == set()
    assert packages["decoding"] & (above - {"decoding"}) == set()
    assert packages["config"] <= {"registry"}


def test_the_checker_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
