"""The package as a user installs it: pyproject ships every file the package reads at run
time, and the wheel and the sdist, each installed into a fresh virtualenv (not editable,
nothing from the checkout on the path), run ``eagle-jax doctor`` and ``eagle-jax
generate`` on a tiny checkpoint made here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("eagle_jax", "pallas_kernels")
TOP_LEVEL = ("pyproject.toml", "README.md", "LICENSE")


def package_files() -> list[str]:
    """The packages' files (repository-relative, POSIX), as git tracks them; without git
    (an unpacked sdist), every file but bytecode."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "ls-files", "--", *PACKAGES], capture_output=True, text=True,
                             check=True, timeout=60).stdout
        files = out.split()
    except (OSError, subprocess.SubprocessError):
        files = []
    if not files:
        files = [str(p.relative_to(REPO).as_posix()) for pkg in PACKAGES for p in (REPO / pkg).rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts]
    assert files, f"no files found under {PACKAGES} in {REPO}"
    return sorted(files)


def test_package_data_covers_every_non_python_file():
    """Each non-Python file of the packages (kernel sources, evaluation suites) matches a
    pyproject package-data pattern, so a wheel ships it."""
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {str((REPO / pkg / f).relative_to(REPO).as_posix())
               for pkg, patterns in data.items() for pattern in patterns
               for f in (REPO / pkg.replace(".", "/")).glob(pattern)}
    needed = [f for f in package_files() if not f.endswith(".py")]
    assert any(f.endswith("cpu_attention.cc") for f in needed)
    assert [f for f in needed if f not in shipped] == [], "add these to [tool.setuptools.package-data]"


def test_license_is_declared_and_shipped():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and "LICENSE" in project["license-files"]
    assert "Apache License" in (REPO / "LICENSE").read_text()[:200]


# ----------------------------------------------------------------------------- build and install


def _run(cmd, cwd, timeout=600, env=None):
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                       env=env or _clean_env())
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _clean_env() -> dict:
    """The environment without anything that would put the checkout on sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
    return {**env, "JAX_PLATFORMS": "cpu", "PYTHONNOUSERSITE": "1"}


def _build_backend(src: Path, hook: str, out: Path) -> Path:
    """Run setuptools' PEP 517 ``hook`` (build_sdist or build_wheel) in ``src``, without
    build isolation (the test environment has setuptools; nothing is downloaded)."""
    code = f"from setuptools import build_meta as b; print(b.{hook}({str(out)!r}))"
    name = _run([sys.executable, "-c", code], cwd=src).stdout.strip().splitlines()[-1]
    return out / name


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict:
    """The sdist, built from a copy of the tracked sources, and the wheel built from the
    sdist (as ``python -m build`` does)."""
    root = tmp_path_factory.mktemp("dist")
    src = root / "src"
    for rel in [*TOP_LEVEL, *package_files()]:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, src / rel)
    out = root / "out"
    out.mkdir()
    t0 = time.perf_counter()
    sdist = _build_backend(src, "build_sdist", out)
    with tarfile.open(sdist) as tar:
        tar.extractall(root / "unpacked", filter="data")
    [unpacked] = (root / "unpacked").iterdir()
    wheel = _build_backend(unpacked, "build_wheel", out)
    print(f"built {sdist.name} and {wheel.name} in {time.perf_counter() - t0:.1f} s")
    return {"sdist": sdist, "wheel": wheel}


@pytest.mark.slow
def test_wheel_and_sdist_hold_every_package_file_and_the_license(dists):
    with zipfile.ZipFile(dists["wheel"]) as z:
        names = set(z.namelist())
    missing = [f for f in package_files() if f not in names]
    assert missing == [], f"the wheel lacks {missing}"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)[-10:]
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    with zipfile.ZipFile(dists["wheel"]) as z:
        assert "License-Expression: Apache-2.0" in z.read(meta).decode()
    with tarfile.open(dists["sdist"]) as tar:
        top = tar.getnames()[0].split("/")[0]
        in_sdist = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert top.startswith("eagle_jax-")
    missing = [f for f in [*TOP_LEVEL, *package_files()] if f not in in_sdist]
    assert missing == [], f"the sdist lacks {missing}"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from hf_factories import make_hf_model, write_word_tokenizer

    path = tmp_path_factory.mktemp("tiny_model")
    hf = make_hf_model("llama_tied", seed=2)
    hf.save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, hf.config.vocab_size)
    return path


def fresh_venv(where: Path) -> Path:
    """A new virtualenv whose own site-packages comes first and which sees this test
    environment's installed dependencies through a path line in a .pth file. Such a line
    adds the directory but does not run that directory's own .pth files, so the
    editable-install hook of the checkout never loads: ``eagle_jax`` can only come from
    what is installed into the new environment."""
    _run([sys.executable, "-m", "venv", "--without-pip", where], cwd=where.parent)
    py = where / "bin" / "python"
    site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=where).stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_test_dependencies.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    return py


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_installed_package_runs_doctor_and_generate(kind, dists, tiny_model, tmp_path):
    venv = tmp_path / "venv"
    py = fresh_venv(venv)
    t0 = time.perf_counter()
    _run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation", "--ignore-installed",
          dists[kind]], cwd=tmp_path)
    print(f"{kind} installed in {time.perf_counter() - t0:.1f} s")
    cli = venv / "bin" / "eagle-jax"
    assert cli.is_file(), "the console script was not installed"
    where = _run([py, "-c", "import eagle_jax, pallas_kernels; print(eagle_jax.__file__); print(pallas_kernels.__file__)"],
                 cwd=tmp_path).stdout.split()
    assert all(Path(w).is_relative_to(venv) for w in where), where

    r = _run([cli, "doctor", "--model", tiny_model, "--json"], cwd=tmp_path)
    report = json.loads(r.stdout)
    assert report["ok"], [c for c in report["checks"] if c["status"] != "ok"]
    assert report["eagle_jax"]["editable"] is False and Path(report["eagle_jax"]["imported_from"]).is_relative_to(venv)

    r = _run([cli, "generate", "--model", tiny_model, "--prompt", "w5 w9 w13", "--max-new-tokens", "4",
              "--no-speculation", "--output", tmp_path / "out.jsonl"], cwd=tmp_path)
    row = json.loads((tmp_path / "out.jsonl").read_text())
    assert 1 <= len(row["token_ids"]) <= 4
    # The start-up line: the kernel sources shipped (a missing one would fall back to XLA, saying so).
    assert "matrix products:" in r.stderr and "kernel source missing" not in r.stderr, r.stderr[-2000:]
