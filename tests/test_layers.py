"""The package's layers: each module imports only from its own layer or the layers below
(docs/architecture.md), and no two modules import each other, directly or around a
circle. Read from the source (every ``import``/``from ... import`` of ``eagle_jax``,
module level or inside a function), so a lazy import cannot hide an upward edge."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "eagle_jax"

# Lowest first. A module belongs to the first entry that is its name or a package above it.
LAYERS: list[tuple[str, ...]] = [
    ("eagle_jax", "eagle_jax.errors", "eagle_jax.defaults", "eagle_jax.validate", "eagle_jax.environment"),
    ("eagle_jax.kernels",),
    ("eagle_jax.models",),
    ("eagle_jax.spec",),
    ("eagle_jax.runtime",),
    ("eagle_jax.checkpoint",),
    ("eagle_jax.serving",),
    ("eagle_jax.train", "eagle_jax.experiments", "eagle_jax.server"),
    ("eagle_jax.doctor", "eagle_jax.cli"),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    best = None
    for i, names in enumerate(LAYERS):
        for n in names:
            # "eagle_jax" itself is the package's __init__ only, not everything under it.
            hit = module == n if n == "eagle_jax" else (module == n or module.startswith(n + "."))
            if hit and (best is None or len(n) > best[1]):
                best = (i, len(n))
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS (and docs/architecture.md)")
    return best[0]


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The eagle_jax modules ``path`` imports (``from eagle_jax.x import y`` counts as
    eagle_jax.x.y when that is a module, else eagle_jax.x)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names]
        else:
            continue
        out.update(n for n in names if n == "eagle_jax" or n.startswith("eagle_jax."))
    return out


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: imports_of(p, set(files)) - {m} for m, p in files.items()}


def upward_edges(g: dict[str, set[str]]) -> list[str]:
    return [f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
            for m, deps in sorted(g.items()) for d in sorted(deps)
            if d != "eagle_jax" and layer_of(d) > layer_of(m)]


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                visit(w)
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
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_every_module_is_in_a_layer_and_imports_only_downward():
    g = graph()
    assert len(g) > 30 and "eagle_jax.serving.engine" in g and "eagle_jax.spec.steps" in g
    assert upward_edges(g) == []


def test_no_import_cycles():
    # The package __init__ imports nothing eagerly; leave it out so lazy re-exports
    # (``from eagle_jax import Engine``) do not read as a circle.
    g = {m: d - {"eagle_jax"} for m, d in graph().items() if m != "eagle_jax"}
    assert cycles(g) == []


def test_the_checks_catch_an_upward_edge_and_a_circle():
    """The checker itself: a model importing the engine, and a two-module circle."""
    g = {"eagle_jax.models.llama": {"eagle_jax.serving.engine"}, "eagle_jax.serving.engine": set()}
    assert upward_edges(g) == ["eagle_jax.models.llama (eagle_jax.models) imports eagle_jax.serving.engine (eagle_jax.serving)"]
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("elsewhere.module")
