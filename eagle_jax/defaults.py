"""Shared defaults for the command line, the scripts and the train commands: where the
default model and draft live, integer parsing for flags, the compilation cache.

A leaf module (standard library only at import time), so ``cli``, ``doctor`` and
``train.commands`` can all use it without importing each other.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_DRAFT_NAME = "smollm2-135m-instruct-eagle3"


def default_model_dir() -> Path:
    """$EAGLE_JAX_MODEL, else checkpoints/<default> in the working directory, else beside the package."""
    env = os.environ.get("EAGLE_JAX_MODEL")
    if env:
        return Path(env)
    here = Path.cwd() / "checkpoints" / DEFAULT_MODEL_NAME
    if here.is_dir():
        return here
    return Path(__file__).resolve().parents[1] / "checkpoints" / DEFAULT_MODEL_NAME


def default_draft_dir() -> Path:
    """The released draft for the default model ($EAGLE_JAX_DRAFT overrides)."""
    env = os.environ.get("EAGLE_JAX_DRAFT")
    if env:
        return Path(env)
    return default_model_dir().parent / DEFAULT_DRAFT_NAME


def positive_int(s: str) -> int:
    """argparse type: an integer >= 1."""
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{s} must be >= 1")
    return v


def enable_compilation_cache() -> None:
    """Reuse compiled graphs across runs (start-up compiles every bucket)."""
    import jax

    # A directory already set (JAX_COMPILATION_CACHE_DIR, or a program or test session
    # that configured JAX) is kept: JAX opens its cache once per process, so moving the
    # setting afterwards would only make it name a directory nothing is written to.
    if not jax.config.jax_compilation_cache_dir:
        base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        jax.config.update("jax_compilation_cache_dir", str(base / "eagle-jax" / "jax"))
    # JAX keeps only graphs that took >= 1 s to compile by default: the engine's many small
    # ones (row inserts, resizes, zeros, small prefill chunks) then compiled again at
    # every start (50 of 89 graphs came back at batch 16). Keep them all, unless set.
    if not os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def compile_workers() -> int:
    """XLA compiles a step table runs at once at start-up: $EAGLE_JAX_COMPILE_WORKERS, else
    one per core this process may use, up to four (each compile holds its own memory)."""
    env = os.environ.get("EAGLE_JAX_COMPILE_WORKERS")
    if env:
        n = int(env)
        if n < 1:
            raise ValueError(f"EAGLE_JAX_COMPILE_WORKERS={env} must be >= 1")
        return n
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cores))


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# The largest prefill chunk compiled by default (EngineConfig.prompt_buckets and
# runtime.plan.prompt_buckets_for; runtime.plan.default_max_chunk picks by backend):
# longer prompts go in several chunks. On a CPU, 128: prefill is compute-bound from 64 rows on, and a larger chunk adds attention over its own tokens
# (dense within the chunk) without a faster product (scripts/bench_prefill.py, 2-core
# AMD EPYC: a 1,024-token prompt in 3.69 s in chunks of 128, 4.23 s in chunks of 512;
# docs/measuring.md, prefill chunks); the fewer chunk lengths are also fewer graphs to
# compile. Elsewhere 512 (not measured on an accelerator yet).
DEFAULT_MAX_CHUNK = 512
CPU_MAX_CHUNK = 128
# On a CPU, prefill chunk lengths also go in steps of CPU_CHUNK_STEP between the smallest
# and the largest (64, 96, 128), not only in powers of two: a CPU's prefill is
# compute-bound, so a padded token costs what a real one does, and real chat prompts are
# short (the 400 held-out prompts with SmolLM2's template: median 86 tokens). Their
# padding falls from 24% to 14% of the prefill's tokens (steps of 16: 9%, for three more
# chunk graphs per prefill batch; docs/measuring.md, "Prefill chunks"). None elsewhere.
CPU_CHUNK_STEP = 32

