"""Where this process runs: the interpreter, the installed packages, which copy of
eagle-jax is imported (and its git commit), and the machine's CPU. One place for the
facts ``eagle-jax doctor`` reports and the fingerprint every results file records.

Standard library only at module level (``fingerprint`` imports jax on use), so the CLI
stays fast to start."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

# (distribution name, import name). Required ones are project dependencies; optional ones
# are test extras or GPU plugins, reported as "not installed" when absent.
REQUIRED_PACKAGES = (
    ("jax", "jax"),
    ("jaxlib", "jaxlib"),
    ("flax", "flax"),
    ("jaxtyping", "jaxtyping"),
    ("numpy", "numpy"),
    ("safetensors", "safetensors"),
    ("tokenizers", "tokenizers"),
    ("jinja2", "jinja2"),
    ("gguf", "gguf"),
    ("rich", "rich"),
    ("matplotlib", "matplotlib"),
    ("optax", "optax"),
)
OPTIONAL_PACKAGES = (
    ("torch", "torch"),
    ("transformers", "transformers"),
    ("beartype", "beartype"),
    ("hypothesis", "hypothesis"),
    ("pytest", "pytest"),
    # A CUDA plugin whose version differs from jaxlib's is a classic silent-CPU-fallback cause.
    ("jax-cuda12-plugin", "jax_cuda12_plugin"),
    ("jax-cuda12-pjrt", "jax_plugins.xla_cuda12"),
    ("jax-cuda13-plugin", "jax_cuda13_plugin"),
    ("jax-cuda13-pjrt", "jax_plugins.xla_cuda13"),
)
DISTRIBUTION = "eagle-jax"
GIT_TIMEOUT_S = 10


def python_info() -> dict[str, Any]:
    """The interpreter, its prefix and whether it runs in a virtual environment."""
    return {
        "version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
        "prefix": sys.prefix,
        "base_prefix": sys.base_prefix,
        "virtualenv": sys.prefix != sys.base_prefix,
        "VIRTUAL_ENV": os.environ.get("VIRTUAL_ENV"),
        "platform": platform.platform(),
        "sys_path": list(sys.path),
    }


def package_info(dist: str, module: str) -> dict[str, Any]:
    """Version (from the distribution's metadata) and the path the module would import from.

    ``find_spec`` locates the module without importing it (torch takes seconds); for a
    module already imported it returns the loaded one.
    """
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = None
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a parent package is missing
        spec = None
    location = None
    if spec is not None:
        # A package is named by its directory, a single-file module by its file.
        location = spec.submodule_search_locations[0] if spec.submodule_search_locations else spec.origin
        # str(): an imported lazy package (transformers) lists a Path, which JSON refuses.
        location = None if location is None else str(location)
    return {"version": version, "location": location}


def packages_info() -> dict[str, dict[str, Any]]:
    """``package_info`` for every required and optional dependency."""
    return {dist: package_info(dist, module) for dist, module in REQUIRED_PACKAGES + OPTIONAL_PACKAGES}


def install_info() -> dict[str, Any]:
    """eagle-jax's version, whether the install is editable, and its source directory.

    ``source`` is where the installer says the code lives (the editable checkout, or the
    installed copy); ``imported_from`` is where ``eagle_jax`` was actually imported from.
    They differ when another copy shadows the install (a checkout on PYTHONPATH, a stale
    build), which is the first thing to rule out when behaviour makes no sense.
    ``metadata`` lists every copy of the distribution's metadata on sys.path: a build
    leaves ``eagle_jax.egg-info`` in the checkout, which ``importlib.metadata`` finds
    first when Python runs from there.
    """
    import eagle_jax

    imported_from = str(Path(eagle_jax.__file__).resolve().parents[1])
    dists = list(importlib.metadata.distributions(name=DISTRIBUTION))
    # PathDistribution, the only kind on a filesystem, keeps its metadata directory in _path.
    metadata = [
        {"path": str(getattr(d, "_path", "?")), "version": d.version, "installer": (d.read_text("INSTALLER") or "").strip()}
        for d in dists
    ]
    # The installed copy is the one an installer (pip, uv) wrote, not a build's leftover egg-info.
    installed = next((d for d in dists if d.read_text("INSTALLER")), dists[0] if dists else None)
    if installed is None:
        return {"version": None, "editable": False, "source": None, "imported_from": imported_from, "metadata": metadata}
    direct_url = json.loads(installed.read_text("direct_url.json") or "{}")
    editable = bool(direct_url.get("dir_info", {}).get("editable", False))
    url = direct_url.get("url", "")
    if editable and url.startswith("file:"):
        source = str(Path(unquote(urlparse(url).path)).resolve())
    else:
        source = str(Path(installed.locate_file("")).resolve())
    return {
        "version": installed.version,
        "editable": editable,
        "source": source,
        "imported_from": imported_from,
        "metadata": metadata,
    }


def git_info(root: str | Path) -> dict[str, Any]:
    """Commit and dirty flag of the git checkout holding ``root``, or the reason there is none."""
    if any(part in ("site-packages", "dist-packages") for part in Path(root).parts):
        # An installed copy may sit inside some other repository (a venv in a checkout):
        # that repository's commit would say nothing about this code.
        return {"error": "installed copy, not a git checkout"}
    # Without optional locks `git status` does not rewrite the index, so the doctor never
    # writes to (or contends for a lock on) the repository it inspects.
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0")

    def git(*args: str) -> str:
        r = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S, env=env
        )
        if r.returncode:
            raise RuntimeError(r.stderr.strip() or f"git {args[0]} exited with {r.returncode}")
        return r.stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        toplevel = git("rev-parse", "--show-toplevel").strip()
        changed = [line for line in git("status", "--porcelain").splitlines() if line]
    except FileNotFoundError:
        return {"error": "git is not installed"}
    except (subprocess.TimeoutExpired, RuntimeError) as e:
        return {"error": str(e)}
    # The changed paths (relative to the checkout; at most 20) say whether figures came
    # from changed code or only from a checkout whose results/ files were being written.
    paths = [line[3:] for line in changed]
    return {"root": toplevel, "commit": commit, "dirty": bool(changed), "changed_files": len(changed),
            "changed_paths": paths[:20]}


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "asimd", "sve")


def cpu_flags() -> list[str]:
    """The vector extensions the matrix products can use (two CPUs of one model name may
    differ: a VM's "AMD EPYC" with AVX-512 and one with AVX2 only)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return []
    for line in cpuinfo.read_text(errors="replace").splitlines():
        if line.startswith(("flags", "Features")) and ":" in line:
            have = set(line.split(":", 1)[1].split())
            return [f for f in SIMD_FLAGS if f in have]
    return []


def boot_id() -> str | None:
    """Which boot of which machine took the figures: timings are comparable only within
    one (two sessions' VMs of the same CPU model measured 37 and 17 tok/s plain)."""
    f = Path("/proc/sys/kernel/random/boot_id")
    return f.read_text().strip() if f.is_file() else None


# The environment variables that change what runs (never the ones naming paths).
FINGERPRINT_ENV = ("JAX_PLATFORMS", "XLA_FLAGS", "CUDA_VISIBLE_DEVICES", "EAGLE_JAX_LAYERS", "EAGLE_JAX_CPU_MATMUL",
                   "EAGLE_JAX_CPU_ATTENTION", "EAGLE_JAX_CPU_MARCH", "EAGLE_JAX_COMPILE_WORKERS",
                   "EAGLE_JAX_EXECUTABLE_CACHE")


def fingerprint(dtype: str) -> dict[str, Any]:
    """What the figures depend on: versions, source commit, devices, CPU, dtype, seeds."""
    import jax

    install = install_info()
    git = git_info(install["imported_from"])
    git.pop("root", None)  # a machine path
    return {
        "eagle_jax": install["version"],
        "git": git,
        "packages": {dist: info["version"] for dist, info in packages_info().items() if info["version"]},
        "python": platform.python_version(),
        "platform": platform.platform(),
        "jax_backend": jax.default_backend(),
        "devices": [f"{d.platform}:{d.device_kind}" for d in jax.devices()],
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "boot_id": boot_id(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "env": {k: os.environ[k] for k in FINGERPRINT_ENV if k in os.environ},
        "dtype": dtype,
        "seeds": {"sampling": 0, "note": "greedy decoding (temperature 0) draws no random numbers"},
    }


_SOURCE_SUFFIXES = (".py", ".cc", ".h", ".cpp")
_source_digest: str | None = None


def source_digest() -> str:
    """sha256 over every source file of the eagle_jax and pallas_kernels packages (path and
    bytes), once per process: the code a compiled graph was traced from, and a
    calibration measured with (what the executable and calibration caches are keyed by,
    so any change to the code misses both)."""
    global _source_digest
    if _source_digest is None:
        import hashlib

        import eagle_jax
        import pallas_kernels

        h = hashlib.sha256()
        for pkg in (eagle_jax, pallas_kernels):
            root = Path(pkg.__file__).resolve().parent
            for path in sorted(p for p in root.rglob("*") if p.suffix in _SOURCE_SUFFIXES and p.is_file()):
                h.update(f"{pkg.__name__}/{path.relative_to(root).as_posix()}\0".encode())
                h.update(path.read_bytes())
                h.update(b"\0")
        _source_digest = h.hexdigest()
    return _source_digest
