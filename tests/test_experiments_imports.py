"""The measurement code's shape: the experiment commands (bench, ablate, eval-draft) share
``eagle_jax/experiments/harness.py`` and never import one another; the scripts under
``scripts/`` import the installed package only (no ``sys.path`` edits, no script importing
another), and each of them at least imports and answers ``--help``."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "eagle_jax" / "experiments"
SCRIPTS = REPO / "scripts"
SHARED = {"eagle_jax.experiments.harness"}


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, module level or inside a function
    (``from a.b import c`` counts as both a.b and a.b.c: c may be a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def experiments_edges() -> dict[str, set[str]]:
    modules = {f"eagle_jax.experiments.{p.stem}": p for p in EXPERIMENTS.glob("*.py") if p.stem != "__init__"}
    return {m: (imported_modules(p) & set(modules)) - {m} for m, p in modules.items()}


def test_experiment_commands_import_only_the_harness():
    edges = experiments_edges()
    assert {"eagle_jax.experiments.bench", "eagle_jax.experiments.ablate", "eagle_jax.experiments.evaluate"} <= set(edges)
    bad = {m: sorted(d - SHARED) for m, d in edges.items() if d - SHARED}
    assert bad == {}, "an experiment command imports another: move what they share into harness.py"
    assert edges["eagle_jax.experiments.harness"] == set(), "the harness is the base: it imports no command"
    for command in ("bench", "ablate", "evaluate"):
        assert edges[f"eagle_jax.experiments.{command}"] == SHARED


def test_the_check_sees_lazy_and_from_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def run():\n    from eagle_jax.experiments import ablate\n    import eagle_jax.experiments.evaluate\n")
    assert {"eagle_jax.experiments.ablate", "eagle_jax.experiments.evaluate"} <= imported_modules(f)


def script_files() -> list[Path]:
    return sorted(SCRIPTS.glob("*.py"))


def test_no_script_edits_sys_path_or_imports_another_script():
    python = sorted(SCRIPTS.rglob("*.py"))
    assert len(script_files()) >= 10
    stems = {p.stem for p in python}
    for p in python:
        text = p.read_text()
        tree = ast.parse(text, str(p))
        for node in ast.walk(tree):
            # sys.path.insert(...), sys.path.append(...), sys.path = [...], sys.path[:0] = ...
            if isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
                    and node.value.id == "sys":
                raise AssertionError(f"{p.relative_to(REPO)}:{node.lineno} touches sys.path: import the package instead")
        siblings = {m.split(".")[0] for m in imported_modules(p)} & (stems - {p.stem})
        assert not siblings, f"{p.relative_to(REPO)} imports the script(s) {sorted(siblings)}: share code through eagle_jax"
    for sh in sorted(SCRIPTS.rglob("*.sh")):
        assert "PYTHONPATH=scripts" not in sh.read_text(), f"{sh.relative_to(REPO)} puts scripts/ on the path"


DRIVER = r"""
import contextlib, io, json, runpy, sys
out = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(path, run_name="__main__")
        out[path] = "ran without exiting"
    except SystemExit as e:
        out[path] = "ok" if e.code in (0, None) and "usage:" in buf.getvalue() else f"exit {e.code}: {buf.getvalue()[-300:]}"
    except BaseException as e:
        out[path] = f"{type(e).__name__}: {e}"
print("RESULT " + json.dumps(out))
"""


def test_every_script_imports_and_answers_help():
    """Each script compiles, imports what it names and prints its usage for --help: one
    interpreter runs them all (jax is imported once), each as ``__main__``."""
    paths = [str(p) for p in script_files()]
    subprocess.run([sys.executable, "-m", "py_compile", *paths], check=True)
    r = subprocess.run([sys.executable, "-c", DRIVER, *paths], capture_output=True, text=True, cwd=REPO, timeout=600)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, r.stderr[-2000:]
    results = json.loads(line[len("RESULT "):])
    assert {Path(p).name: v for p, v in results.items() if v != "ok"} == {}
    assert len(results) == len(paths)
