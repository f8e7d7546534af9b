"""A per-machine cache of the policy's start-up calibration (``AutoPolicy`` times every
candidate step in every batch bucket: 45-52 s of a 2-core machine's start-up at batch 16).

A record is kept under a key of everything the timings depend on: the machine (CPU model
and flags, core count, JAX backend and devices, library versions), the eagle-jax source
(a digest of the package's files, so a changed kernel or step is measured again), the
models (each directory's files by name, size and modification time), and the engine's
compiled configuration (the step table's description: buckets, shapes, plan, draft sync;
dtype, calibration context and budget, the policy's options). Anything else measures
again: a changed key is a different file, never a stale hit. A record that cannot be
read or does not fit the policy is measured again with a warning, never a crash.
``EngineConfig.recalibrate`` (``--recalibrate``) measures again and replaces the record.

Where: ``$EAGLE_JAX_CALIBRATION_DIR``, else ``calibration/`` under ``$EAGLE_JAX_CACHE``
(default ``~/.cache/eagle-jax``), one JSON file per key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import jax

from eagle_jax.environment import source_digest

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    env = os.environ.get("EAGLE_JAX_CALIBRATION_DIR")
    if env:
        return Path(env)
    root = os.environ.get("EAGLE_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "eagle-jax")
    return Path(root) / "calibration"


def machine() -> dict[str, Any]:
    from eagle_jax.environment import cpu_flags, cpu_model

    return {
        "cpu": cpu_model(), "cpu_flags": hashlib.sha256(" ".join(cpu_flags()).encode()).hexdigest()[:16],
        "cores": os.cpu_count(), "platform": platform.machine(), "python": platform.python_version(),
        "jax": jax.__version__, "backend": jax.devices()[0].platform,
        "devices": [d.device_kind for d in jax.devices()],
    }


def directory_identity(path) -> dict[str, Any] | None:
    """A model directory by its files' names, sizes and modification times (reading
    hundreds of megabytes to hash them would cost more than it saves); None for a model
    given loaded, which has no identity to key on."""
    if path is None:
        return {}
    if not isinstance(path, (str, Path)):
        return None
    p = Path(path).resolve()
    files = sorted(f for f in p.iterdir() if f.is_file())
    return {"path": str(p), "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]}


class CalibrationCache:
    """One engine's record: ``load()`` (None when absent or unusable), ``save(record)``."""

    def __init__(self, parts: dict[str, Any]):
        self.parts = parts
        self.key = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]
        self.path = cache_dir() / f"{self.key}.json"

    @classmethod
    def for_engine(cls, *, target, draft, engine: dict[str, Any]) -> "CalibrationCache | None":
        """The cache entry of an engine over ``target`` / ``draft`` (directories, or
        loaded models: then None, no caching) with the compiled configuration ``engine``."""
        t, d = directory_identity(target), directory_identity(draft)
        if t is None or d is None:
            return None
        return cls({"machine": machine(), "source": source_digest(), "target": t, "draft": d, "engine": engine})

    def load(self) -> dict | None:
        if not self.path.is_file():
            return None
        try:
            data = json.loads(self.path.read_text())
            if data["parts"] != json.loads(json.dumps(self.parts, default=str)):
                raise ValueError("its key's parts differ from this engine's")
            return data["record"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("calibration cache %s unusable (%s): measuring again", self.path, e)
            return None

    def save(self, record: dict) -> None:
        """Write atomically (a temporary file renamed), so a reader never sees half a
        record; a cache that cannot be written is a warning, not a failed start-up."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=self.path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump({"parts": self.parts, "record": record}, f, default=str)
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("calibration cache %s not written: %s", self.path, e)
