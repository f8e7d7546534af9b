"""Compiled step-table graphs kept across runs, so that a warm start neither traces nor
lowers them.

JAX's persistent compilation cache is keyed by the lowered program: a warm start still
traces every graph in Python and lowers it, only to find the executable cached (at batch
16 with auto, 89 graphs: about a third of a warm start-up went there). This cache is keyed
by what determines the program instead, so it can be looked up before tracing:

- the *manifest* of a step table: the eagle-jax and pallas_kernels sources (a digest of
  every source file, so any code change misses), the jax, jaxlib and flax versions, the
  backend and its devices, the XLA flags and the JAX settings that change programs, the
  target's and draft's classes and configs, and every table setting a graph closes over
  (execution plan, shapes, buckets, sync, proposer, sharding rules);
- per graph: its key, the shapes, dtypes and shardings of its arguments (the parameters'
  included, so other panel layouts or dtypes miss) and its output shardings and donation.

Only executables XLA compiled in this process are stored: one JAX read back from its own
persistent cache serializes without its kernels on XLA:CPU (jax 0.12; loaded again it
fails with "Function ... not found"), so a graph JAX's cache already holds is stored the
next time it compiles cold.

An entry holds the executable as ``jax.experimental.serialize_executable`` writes it
(native code, like JAX's own cache entries, and as trusted: both live in the user's cache
directory and are never read from a checkpoint or a download), and its memory analysis
(scratch and code bytes, for the start-up line: asking a loaded executable again cost
about 20 ms a graph, a second of a warm start at batch 16). An entry that cannot be
read is reported with a warning and compiled again, never a crash. The cache lives beside
JAX's (``<jax_compilation_cache_dir>/eagle-jax-executables``), is on wherever that one is
(the CLI turns it on, ``defaults.enable_compilation_cache``), and is off with
``EAGLE_JAX_EXECUTABLE_CACHE=off`` or across processes. It keeps at most
``EAGLE_JAX_EXECUTABLE_CACHE_MB`` (default 2048) MiB, dropping the least recently used
tables first.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import struct
import time
import warnings
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import jax

from eagle_jax.environment import source_digest

FORMAT = 2
MAGIC = b"EJXEXE2\n"


def cache_root() -> Path | None:
    """Where executables are kept, or None when the cache is off: JAX's compilation cache
    is not configured (or disabled), or ``EAGLE_JAX_EXECUTABLE_CACHE=off``."""
    setting = os.environ.get("EAGLE_JAX_EXECUTABLE_CACHE", "on").lower()
    if setting not in ("on", "off"):
        raise ValueError(f"EAGLE_JAX_EXECUTABLE_CACHE={setting!r} must be on or off")
    base = jax.config.jax_compilation_cache_dir
    if setting == "off" or not base or not jax.config.jax_enable_compilation_cache:
        return None
    return Path(base) / "eagle-jax-executables"


def _limit_bytes() -> int:
    return int(os.environ.get("EAGLE_JAX_EXECUTABLE_CACHE_MB", "2048")) * 2**20


def _versions() -> dict[str, str]:
    import flax
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__}


def describe_tree(tree: Any) -> str:
    """Shapes, dtypes and shardings of a pytree of arrays or ShapeDtypeStructs, with its
    structure: what a graph's signature depends on (never the values)."""
    def leaf(x):
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            sharding = getattr(x, "sharding", None)
            return f"{tuple(x.shape)}:{x.dtype}:{sharding!r}"
        return repr(x)

    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: x is None)
    return f"{treedef}|{'|'.join(map(leaf, leaves))}"


class ExecutableCache:
    """The executables of one step-table manifest (``manifest``: a JSON-able dict that
    names everything the table's graphs depend on, besides each graph's own signature)."""

    def __init__(self, root: Path, manifest: dict):
        full = {"format": FORMAT, "source": source_digest(), **_versions(), "backend": _backend(),
                "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax_config": _jax_settings(), **manifest}
        self.manifest = full
        text = json.dumps(full, sort_keys=True, default=repr)
        self.root = root
        self.dir = root / hashlib.sha256(text.encode()).hexdigest()[:32]
        self._text = text
        self.written = 0

    @classmethod
    def for_manifest(cls, manifest: dict) -> ExecutableCache | None:
        root = cache_root()
        return None if root is None else cls(root, manifest)

    def key(self, graph_key: tuple, signature: str) -> str:
        return hashlib.sha256(f"{graph_key!r}\0{signature}".encode()).hexdigest()[:40]

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}.exe"

    def has(self, key: str) -> bool:
        return self._path(key).is_file()

    def load(self, key: str, name: str, devices: Sequence[Any] | None = None) -> tuple[Any, dict | None] | None:
        """(the compiled executable stored under ``key``, its memory analysis as stored:
        ``{"temp": bytes, "code": bytes}`` or None), or None (not stored, or unreadable:
        then a warning names ``name`` and the file, which is removed). ``devices``: the
        ones it runs on, in its mesh's order (default: every device of the backend, which
        is wrong for a mesh over some of them: a graph over 1 of 2 devices loaded that way
        failed at its first call, "execute with 2 argument lists when local device count
        is 1")."""
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            warnings.warn(f"eagle-jax: cannot read the cached executable of {name} ({path}): {e}; compiling it again",
                          stacklevel=2)
            return None
        try:
            payload, in_tree, out_tree, memory = _unframe(data)
            from jax.experimental import serialize_executable

            compiled = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=list(devices) if devices is not None else None)
        except Exception as e:  # noqa: BLE001 - any unreadable entry is compiled again, said out loud
            warnings.warn(f"eagle-jax: the cached executable of {name} ({path}) could not be loaded "
                          f"({type(e).__name__}: {e}); compiling it again", stacklevel=2)
            path.unlink(missing_ok=True)
            return None
        return compiled, memory

    def store(self, key: str, compiled, name: str, memory: dict | None = None) -> bool:
        """Write ``compiled`` under ``key`` (atomically), with its ``memory`` analysis
        (``{"temp": bytes, "code": bytes}``; None: not known); False, with a debug log, when the
        executable cannot be serialized: one holding constants, or one that calls back into
        Python (the Pallas interpreter on CPU, ``jax.pure_callback``): its callbacks are
        closures of this process, and pickling them fails (AttributeError in Python 3.12)
        or, where it would not, a loaded copy would call nothing registered."""
        import logging

        from jax.experimental import serialize_executable

        unloaded = getattr(getattr(compiled, "_executable", None), "_unloaded_executable", None)
        if unloaded is not None and getattr(unloaded, "host_callbacks", None):
            logging.getLogger(__name__).debug("not caching the executable of %s: it calls back into Python", name)
            return False
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        except (ValueError, NotImplementedError, TypeError, AttributeError, pickle.PicklingError) as e:
            logging.getLogger(__name__).debug("not caching the executable of %s: %s", name, e)
            return False
        self.dir.mkdir(parents=True, exist_ok=True)
        manifest = self.dir / "manifest.json"
        if not manifest.exists():
            _atomic_write(manifest, self._text.encode())
        _atomic_write(self._path(key), _frame(payload, pickle.dumps(in_tree), pickle.dumps(out_tree),
                                              json.dumps(memory).encode()))
        self.written += 1
        return True

    def touch(self) -> None:
        """Mark this manifest used now (eviction drops the least recently used first)."""
        if self.dir.is_dir():
            os.utime(self.dir, None)

    def prune(self) -> list[Path]:
        """Drop whole manifests, least recently used first (never this one), until the
        cache holds at most the configured size; the directories removed."""
        if not self.root.is_dir():
            return []
        dirs = [(d.stat().st_mtime, d, sum(f.stat().st_size for f in d.iterdir() if f.is_file()))
                for d in self.root.iterdir() if d.is_dir()]
        total, removed = sum(size for *_, size in dirs), []
        for _, d, size in sorted(dirs, key=lambda x: x[0]):
            if total <= _limit_bytes():
                break
            if d == self.dir:
                continue
            shutil.rmtree(d, ignore_errors=True)
            total -= size
            removed.append(d)
        return removed


def _backend() -> dict:
    devices = jax.devices()
    return {"platform": devices[0].platform, "platform_version": devices[0].client.platform_version,
            "devices": [(d.id, d.device_kind) for d in devices], "processes": jax.process_count()}


def _jax_settings() -> dict:
    names = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl", "jax_threefry_partitionable",
             "jax_numpy_rank_promotion", "jax_use_shardy_partitioner")
    return {n: repr(getattr(jax.config, n, None)) for n in names}


def _frame(*parts: bytes) -> bytes:
    return MAGIC + b"".join(struct.pack("<Q", len(p)) + p for p in parts)


def _unframe(data: bytes) -> tuple[bytes, Any, Any, dict | None]:
    if not data.startswith(MAGIC):
        raise ValueError("not an eagle-jax executable file")
    parts, at = [], len(MAGIC)
    for _ in range(4):
        if at + 8 > len(data):
            raise ValueError("truncated")
        (n,) = struct.unpack_from("<Q", data, at)
        at += 8
        if at + n > len(data):
            raise ValueError("truncated")
        parts.append(data[at:at + n])
        at += n
    if at != len(data):
        raise ValueError("trailing bytes")
    # The trees name the step table's own pytree classes (SpecState, SamplingArrays); the
    # file is this user's cache, as trusted as the native code it holds.
    memory = json.loads(parts[3])
    if memory is not None and not (isinstance(memory, dict) and all(isinstance(memory.get(k), int) for k in ("temp", "code"))):
        raise ValueError(f"memory record {memory!r}")
    return parts[0], pickle.loads(parts[1]), pickle.loads(parts[2]), memory


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
