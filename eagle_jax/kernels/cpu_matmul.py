"""CPU kernels for XLA:CPU through the XLA FFI: packed-weight matrix products
(``cpu_matmul.cc``) and the prefix part of decode/verify attention (``cpu_attention.cc``,
at the end of this module), built into one library.

On a CPU a speculative step's verify forward runs 4 to 16 rows through every weight
matrix. XLA:CPU's GEMM re-packs the weights on each call, so those few rows cost about 2x
a one-row decode step although both only need to stream the weights once. With the
weights packed once into column panels (``pack``), ``packed_matmul`` streams each panel
once while the rows accumulate in registers. SmolLM2's body products alone
(``scripts/ab_cpu_matmul.sh``, ``results/cpu-matmul-ab/``, 2-core Xeon with AVX-512, two
rounds): XLA 19.0 / 20.0 ms on 1 row and 35.1 / 36.9 on 6, packed 16.8 / 17.3 and
18.4 / 19.1: six rows cost 1.1x one row (XLA: 1.85x), about the time of streaming the
weights once from memory.

The kernel is compiled on first use with the system C++ compiler and ``-march=native``
(AVX-512 or AVX2 intrinsics for the CPU at hand, generic vectors elsewhere; ``march``),
cached by a hash of the source, compiler, flags and CPU, and registered as an FFI target. ``status()`` says whether it is
available and, if not, why (no compiler, a build error); the engine's start-up line
prints it. ``EAGLE_JAX_CPU_MATMUL=xla`` switches it off (XLA's own dot everywhere),
``=packed`` makes a failed build an error instead of a fallback.

Only inference uses it: the step table packs the parameters it binds (``pack_params``),
and so does draft training's feature extraction, which needs no gradient
(``runtime.plan.bind_for_inference``); training keeps the plain ``[in, out]`` kernels (no
gradient is defined for the custom call).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.errors import ConfigError

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_matmul.cc")
# Built into the same library: the decode attention over each row's cached prefix.
ATTENTION_SOURCE = Path(__file__).with_name("cpu_attention.cc")
SOURCES = (SOURCE, ATTENTION_SOURCE)
TARGET = "eagle_packed_matmul"
TARGET_BF16 = "eagle_packed_matmul_bf16"  # bfloat16 panels, float32 arithmetic
ATTENTION_TARGET = "eagle_prefix_attention"
PREFILL_ATTENTION_TARGET = "eagle_prefill_attention"  # a prefill chunk's whole (causal) attention
# The same over one layer of stacked arrays (a target bound with its layers stacked):
# panels [L, P, K, nb], caches [B, L, S, KV, D], and the layer as an int32 scalar operand.
LAYER_TARGETS = {t: t + "_layer" for t in (TARGET, ATTENTION_TARGET, PREFILL_ATTENTION_TARGET)}
LAYER_TARGETS[TARGET_BF16] = "eagle_packed_matmul_layer_bf16"
FLAGS = ("-O3", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC", "-w")
MODES = ("auto", "packed", "xla")


@functools.lru_cache(maxsize=None)
def _cpu_signature() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _cache_dir() -> Path:
    root = os.environ.get("EAGLE_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "eagle-jax")
    return Path(root) / "cpu_matmul"


def march() -> str:
    """The ``-march`` the kernels are built for: ``native`` (the CPU at hand), or
    ``EAGLE_JAX_CPU_MARCH`` (e.g. ``haswell`` builds the AVX2 code on an AVX-512 machine,
    ``x86-64`` the generic-vector code: how the tests check every code path on one CPU)."""
    m = os.environ.get("EAGLE_JAX_CPU_MARCH", "native")
    if not m or not all(c.isalnum() or c in "-_." for c in m):
        raise ConfigError(f"EAGLE_JAX_CPU_MARCH={m!r} is not a -march value")
    return m


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def library_path() -> Path | None:
    """The shared library in use, once ``status`` has loaded it (for the doctor)."""
    return _load()[2] if _load.cache_info().currsize else None


@functools.lru_cache(maxsize=None)
def _load() -> tuple[int | None, str, Path | None]:
    """(panel width, description, library file) once the library is built, loaded and
    registered, or (None, the reason it is not, None)."""
    # An install that lacks a source (a wheel built without it) runs XLA's dot instead,
    # and the start-up line says why: never a crash.
    try:
        sources = [f.read_text() for f in SOURCES]
    except OSError as e:
        return None, f"kernel source missing from this install ({e.filename or e})", None
    cxx = _compiler()
    if cxx is None:
        return None, "no C++ compiler found (set CXX)", None
    include = jax.ffi.include_dir()
    flags = (*FLAGS, f"-march={march()}")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{cxx} --version failed: {e}", None
    key = hashlib.sha256(
        "\0".join([*sources, cxx, version, " ".join(flags), include, jax.__version__, _cpu_signature()]).encode()
    ).hexdigest()[:16]
    lib_path = _cache_dir() / f"libeagle_cpu_matmul-{key}.so"
    if not lib_path.is_file():
        try:
            lib_path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib_path.parent)
        except OSError as e:
            return None, f"cannot write the kernel cache {lib_path.parent}: {e} (set EAGLE_JAX_CACHE)", None
        os.close(fd)
        cmd = [cxx, *flags, "-I", include, *map(str, SOURCES), "-o", tmp]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            os.unlink(tmp)
            return None, f"building {' + '.join(f.name for f in SOURCES)} failed: {e}", None
        if res.returncode != 0:
            os.unlink(tmp)
            return None, f"building the CPU kernels failed ({' '.join(cmd)}): {res.stderr.strip()[-800:]}", None
        os.replace(tmp, lib_path)  # atomic: concurrent builders each write their own temp file
    try:
        lib = ctypes.cdll.LoadLibrary(str(lib_path))
    except OSError as e:  # a cached build this machine cannot load
        return None, f"loading {lib_path} failed: {e}", None
    nb = int(lib.eagle_packed_matmul_nb())
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.eagle_packed_matmul), platform="cpu")
    jax.ffi.register_ffi_target(TARGET_BF16, jax.ffi.pycapsule(lib.eagle_packed_matmul_bf16), platform="cpu")
    jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.eagle_prefix_attention), platform="cpu")
    jax.ffi.register_ffi_target(PREFILL_ATTENTION_TARGET, jax.ffi.pycapsule(lib.eagle_prefill_attention), platform="cpu")
    for name in LAYER_TARGETS.values():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
    lib.eagle_packed_matmul_isa.restype = ctypes.c_char_p
    isa = lib.eagle_packed_matmul_isa().decode()
    return nb, f"packed-weight CPU kernel ({isa}, {nb}-column panels)", lib_path


def mode() -> str:
    m = os.environ.get("EAGLE_JAX_CPU_MATMUL", "auto")
    if m not in MODES:
        raise ConfigError(f"EAGLE_JAX_CPU_MATMUL={m!r} must be one of {', '.join(MODES)}")
    return m


def status(backend: str) -> tuple[bool, str]:
    """(use the packed kernel?, one line saying what the matrix products run on) on
    ``backend`` (``runtime.plan.resolve_plan`` asks, with the backend it resolved)."""
    if backend != "cpu":
        return False, f"XLA dot ({backend})"
    m = mode()
    if m == "xla":
        return False, "XLA dot (EAGLE_JAX_CPU_MATMUL=xla)"
    nb, why, _ = _load()
    if nb is None:
        if m == "packed":
            raise ConfigError(f"EAGLE_JAX_CPU_MATMUL=packed, but the kernel is unavailable: {why}")
        log.warning("packed CPU matmul unavailable, using XLA's dot: %s", why)
        return False, f"XLA dot (packed kernel unavailable: {why})"
    if attention_mode() == "xla":
        return True, f"{why}; prefix attention in XLA (EAGLE_JAX_CPU_ATTENTION=xla)"
    return True, f"{why} and prefix-attention kernel"


def panel_width() -> int:
    nb, why, _ = _load()
    if nb is None:
        raise ConfigError(f"the packed CPU matmul is unavailable: {why}")
    return nb


def pack(w: np.ndarray | jax.Array, nb: int | None = None) -> jax.Array:
    """``[..., K, N]`` (``y = x @ w``) to panels ``[..., N / nb, K, nb]``; N must divide
    by nb. Leading axes (the layers of a stacked kernel) stay in front."""
    nb = nb or panel_width()
    *lead, k, n = w.shape
    if n % nb:
        raise ConfigError(f"cannot pack a [{k}, {n}] matrix into {nb}-column panels")
    return jnp.swapaxes(jnp.asarray(w).reshape(*lead, k, n // nb, nb), -3, -2)


def unpack(wp: jax.Array) -> jax.Array:
    """Panels ``[..., P, K, nb]`` back to ``[..., K, P * nb]``."""
    *lead, p, k, nb = wp.shape
    return jnp.swapaxes(wp, -3, -2).reshape(*lead, k, p * nb)


def packable(w) -> bool:
    nb = panel_width()
    # float32 only: a model loaded in bfloat16 computes in it (bfloat16 panels come from
    # float32 weights, ``pack_params(dtype="bfloat16")``).
    return getattr(w, "ndim", 0) == 2 and w.dtype == jnp.float32 and w.shape[1] % nb == 0 and w.shape[1] >= nb


def packed_matmul(x: jax.Array, wp: "jax.Array | LayerOf") -> jax.Array:
    """``x [..., K] @ unpack(wp)`` -> ``[..., N]``, float32, through the FFI kernel
    (float32 or bfloat16 panels; the arithmetic is float32 either way). ``wp`` may be one
    layer of stacked panels (``LayerOf``): the kernel reads that layer in place, where
    slicing it out would copy the layer's weights on every step."""
    layer = None
    if isinstance(wp, LayerOf):
        wp, layer = wp.stack, wp.index
    p, k, nb = wp.shape[-3:]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).astype(jnp.float32)
    target = TARGET_BF16 if wp.dtype == jnp.bfloat16 else TARGET
    out = jax.ShapeDtypeStruct((x2.shape[0], p * nb), jnp.float32)
    if layer is None:
        y = jax.ffi.ffi_call(target, out)(x2, wp)
    else:
        y = jax.ffi.ffi_call(LAYER_TARGETS[target], out)(x2, wp, jnp.asarray(layer, jnp.int32))
    return y.reshape(*lead, p * nb)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerOf:
    """Layer ``index`` (an int32 scalar, traced inside the layer loop) of an array that
    stacks every layer along ``axis``: packed panels ``[L, P, K, nb]`` (axis 0) or a
    KV cache ``[B, L, S, KV, D]`` (axis 1). The CPU kernels read the layer in place;
    ``get()`` slices it out (a copy, for XLA's own paths)."""

    stack: jax.Array
    index: jax.Array
    axis: int = dataclasses.field(default=0, metadata=dict(static=True))

    def get(self) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(self.stack, self.index, axis=self.axis, keepdims=False)

    def __getitem__(self, key):
        # ``variable[...]`` on an NNX parameter bound to a ``LayerOf`` gives the LayerOf.
        if key is not Ellipsis:
            raise TypeError("a LayerOf is indexed only with [...]")
        return self

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stack.shape[:self.axis] + self.stack.shape[self.axis + 1:]

    @property
    def ndim(self) -> int:
        return self.stack.ndim - 1

    @property
    def dtype(self):
        return self.stack.dtype


# id(source array) -> its packed copy, dropped when the source is collected: every step
# table built over one target (a Generator keeps one engine per call shape) shares one
# packed copy instead of packing, and holding, its own.
_PACKED: dict[tuple[int, str], jax.Array] = {}


def _packed_once(w: jax.Array, dtype: str) -> jax.Array:
    key = (id(w), dtype)
    if key not in _PACKED:
        _PACKED[key] = pack(jnp.asarray(w).astype(dtype))
        weakref.finalize(w, _PACKED.pop, key, None)
    return _PACKED[key]


def pack_params(state, dtype: str = "float32") -> tuple[object, int]:
    """A copy of an NNX state whose float32 Linear kernels (``...kernel`` leaves, and the
    ``lm_head`` arrays) are packed, as ``dtype`` panels ("float32" or "bfloat16");
    returns (state, number packed). Modules merged from it run those products through
    ``packed_matmul`` (``Linear`` and the heads check the kernel's rank). Each source
    array is packed once per process and dtype (``_packed_once``)."""
    count = 0

    def f(path, leaf):
        nonlocal count
        name = getattr(path[-1], "key", getattr(path[-1], "name", None)) if path else None
        if name == "value" and len(path) > 1:  # nnx Variable leaves end in .value
            name = getattr(path[-2], "key", getattr(path[-2], "name", None))
        if name in ("kernel", "lm_head") and packable(leaf):
            count += 1
            return _packed_once(leaf, dtype)
        return leaf

    out = jax.tree_util.tree_map_with_path(f, state)
    return out, count


def matmul(x: jax.Array, w: "jax.Array | LayerOf") -> jax.Array:
    """``x @ w`` for a plain ``[K, N]`` kernel or a packed ``[P, K, nb]`` one, or one
    layer of stacked kernels (``LayerOf``: packed ones read in place)."""
    if isinstance(w, LayerOf):
        if w.stack.ndim == 4:
            return packed_matmul(x, w)
        w = w.get()
    if w.ndim == 3:
        return packed_matmul(x, w)
    return x @ w


# ----------------------------------------------------------------------------- attention
# The prefix part of decode and verify attention (``cpu_attention.cc``), for the same
# inference-only step tables that bind packed weights (``model.Attention`` uses it where
# the execution plan says so: ``kernels.plan``). ``EAGLE_JAX_CPU_ATTENTION=xla`` keeps
# XLA's blocked loop.

ATTENTION_MODES = ("auto", "xla")
ATTENTION_MAX_QUERIES = 64  # T * G per (row, kv head) on the decode path: the kernel's scratch size
ATTENTION_MAX_HEAD_DIM = 256
# A causal forward of at least this many tokens (a prefill chunk: ``scheduler.chunk_plan``
# cuts prompts into chunks of 64 and more) takes the kernel's prefill path: its queries in
# tiles, scored as small matrix products, over the prefix and the chunk in one call. That
# path's arithmetic differs from the decode path's, so a forward that is not causal and
# wider than the decode path takes (a tree's verify) stays on XLA's loop: a verify query
# and the plain step's query at the same position never mix the two paths' bits, and a
# tree's verify keeps the bits it had before the prefill path existed.
ATTENTION_PREFILL_MIN_TOKENS = 64


def attention_mode() -> str:
    m = os.environ.get("EAGLE_JAX_CPU_ATTENTION", "auto")
    if m not in ATTENTION_MODES:
        raise ConfigError(f"EAGLE_JAX_CPU_ATTENTION={m!r} must be one of {', '.join(ATTENTION_MODES)}")
    return m


def prefix_attention_fits(t: int, g: int, d: int, dtype, causal: bool = False) -> bool:
    """Whether the kernel takes a forward of T queries per head, G heads per kv head, head
    dimension D and this cache dtype (float32 only; D a multiple of 16, so of either
    build's vector width): T * G up to ``ATTENTION_MAX_QUERIES`` (decode and verify), or,
    ``causal`` (a ``PrefixMask.is_causal`` block), T from ``ATTENTION_PREFILL_MIN_TOKENS``
    (prefill chunks). The shapes only: whether the kernel is used at all is the execution
    plan's (``kernels.plan``)."""
    return (
        (t * g <= ATTENTION_MAX_QUERIES or (causal and t >= ATTENTION_PREFILL_MIN_TOKENS))
        and d <= ATTENTION_MAX_HEAD_DIM and d % 16 == 0 and jnp.dtype(dtype) == jnp.float32
    )


def prefix_attention_supported(t: int, g: int, d: int, dtype, causal: bool = False) -> bool:
    """``prefix_attention_fits`` and ``EAGLE_JAX_CPU_ATTENTION`` leaves the kernel on."""
    return attention_mode() == "auto" and prefix_attention_fits(t, g, d, dtype, causal)


def prefix_attention_state(
    qg: jax.Array, k_cache: jax.Array, v_cache: jax.Array, prefix_len: jax.Array, causal: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Online-softmax state of queries ``qg [B, T, KV, G, D]`` (scale already applied)
    over slots ``0 .. prefix_len[b] - 1`` of ``k/v_cache [B, S, KV, D]``: running max
    ``m [B, KV, G, T]``, denominator ``l`` (same) and unnormalised ``acc [B, KV, G, T, D]``.
    A row with no prefix gives m = -inf, l = 0, acc = 0.

    ``causal``: a prefill chunk's whole attention (the tiled path whatever T): the chunk's
    T keys are already in the cache at ``prefix_len[b] + t`` and query t sees slots
    ``0 .. prefix_len[b] + t``, so ``acc / l`` is the attention output."""
    nb, why, _ = _load()  # registers the target (a no-op once loaded)
    if nb is None:
        raise ConfigError(f"the CPU prefix-attention kernel is unavailable: {why}")
    b, t, kv, g, d = qg.shape
    nq = t * g
    f32 = jnp.float32
    target = PREFILL_ATTENTION_TARGET if causal else ATTENTION_TARGET
    args = (qg.astype(f32), k_cache, v_cache, prefix_len.astype(jnp.int32))
    if isinstance(k_cache, LayerOf):  # one layer of stacked caches [B, L, S, KV, D], read in place
        if not isinstance(v_cache, LayerOf) or k_cache.axis != 1 or v_cache.axis != 1:
            raise ValueError("prefix_attention_state: k and v must both be LayerOf caches stacked on axis 1")
        target = LAYER_TARGETS[target]
        args = (args[0], k_cache.stack, v_cache.stack, args[3], jnp.asarray(k_cache.index, jnp.int32))
    m, l, acc = jax.ffi.ffi_call(
        target,
        (jax.ShapeDtypeStruct((b, kv, nq), f32), jax.ShapeDtypeStruct((b, kv, nq), f32),
         jax.ShapeDtypeStruct((b, kv, nq, d), f32)),
    )(*args)
    # The kernel writes a head's queries g-major (g * T + t): the caller's layout.
    return m.reshape(b, kv, g, t), l.reshape(b, kv, g, t), acc.reshape(b, kv, g, t, d)
