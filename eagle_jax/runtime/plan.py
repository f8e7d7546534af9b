"""Resolving the execution plan (``eagle_jax.kernels.plan.ExecutionPlan``): the one place
in eagle_jax that asks the backend which kernels to run.

``resolve_plan`` reads the backend (``jax.default_backend()`` unless given), the
requested ``kernel_impl``, the mesh and what the CPU kernel library says
(``cpu_matmul.status``: built, switched off by ``EAGLE_JAX_CPU_MATMUL`` /
``EAGLE_JAX_CPU_ATTENTION``, or why it is unavailable), and applies the rules listed in
``kernels.plan``. The step table resolves one plan per table and passes it to every
graph; ``xla_plan`` is XLA's own kernels for this backend (training and feature
extraction, which need gradients or plain kernels).
"""

from __future__ import annotations

import dataclasses
import os

import jax
from jax.sharding import Mesh

from eagle_jax.errors import ConfigError
from eagle_jax.kernels import cpu_matmul
from eagle_jax.kernels.plan import LAYERS, LAYERS_ENV, ExecutionPlan, check_kernel_impl
from eagle_jax.models.llama import BoundModules


def default_max_chunk(backend: str | None = None) -> int:
    """The largest default prefill chunk on ``backend`` (default: JAX's default backend):
    ``defaults.CPU_MAX_CHUNK`` on a CPU (measured: larger chunks prefill no faster there),
    ``defaults.DEFAULT_MAX_CHUNK`` elsewhere."""
    from eagle_jax.defaults import CPU_MAX_CHUNK, DEFAULT_MAX_CHUNK

    return CPU_MAX_CHUNK if (backend or jax.default_backend()) == "cpu" else DEFAULT_MAX_CHUNK


def default_chunk_step(backend: str | None = None) -> int | None:
    """The step between prefill chunk lengths below the largest on ``backend`` (default:
    JAX's default backend): ``defaults.CPU_CHUNK_STEP`` on a CPU, where a padded token
    costs a real one's compute; None (powers of two only) elsewhere."""
    from eagle_jax.defaults import CPU_CHUNK_STEP

    return CPU_CHUNK_STEP if (backend or jax.default_backend()) == "cpu" else None


def prompt_buckets_for(longest: int, max_seq_len: int, smallest: int = 64, max_chunk: int | None = None,
                       step: int | None = None) -> tuple[int, ...]:
    """Prefill chunk lengths: powers of two from ``smallest`` up to the one that holds
    ``longest``, capped at ``max_chunk`` (default ``default_max_chunk()``) and
    ``max_seq_len`` (a longer prompt goes in several chunks), so a short prompt in a file
    of long documents costs what it costs alone. With a ``step`` (default
    ``default_chunk_step()``: 32 on a CPU, none elsewhere; 0: powers of two only), the multiples of it between
    the smallest length and twice it (and a step below the largest) are lengths too:
    (64, 96, 128) on a CPU, so a 70-token prompt runs one chunk of 96, not 128. (Past
    the first octave a prompt's last chunk pads by less than the smallest length, a
    small share of a long prompt.)"""
    from eagle_jax.defaults import pow2_at_least

    top = min(pow2_at_least(longest), max_seq_len, default_max_chunk() if max_chunk is None else max_chunk)
    out, v = [], min(smallest, top)
    while v < top:
        out.append(v)
        v *= 2
    step = default_chunk_step() if step is None else step
    if step and out:
        lo = out[0]
        out += [m for m in range((lo // step + 1) * step, min(2 * lo, top - step + 1), step)]
    return tuple(sorted(out)) + (top,)


def resolve_plan(*, kernel_impl: str = "auto", mesh: Mesh | None = None, backend: str | None = None,
                 compute_capability: str | None = None, dtype: str | None = None) -> ExecutionPlan:
    """The plan for graphs on ``backend`` (default: JAX's default backend) over ``mesh``
    (None: one device) with verify kernels ``kernel_impl`` ("auto", "kernel",
    "reference"; a ``ConfigError`` otherwise). ``compute_capability``: the GPU's
    (default: the first device's, on a GPU backend). ``dtype``: the weights' dtype asked
    for ("bfloat16" on a CPU with the packed kernel: bfloat16 panels, float32
    arithmetic; see ``model_dtype``). Rules: ``kernels.plan``."""
    check_kernel_impl(kernel_impl)
    backend = backend or jax.default_backend()
    devices = 1 if mesh is None else mesh.size
    if backend == "gpu" and compute_capability is None:
        compute_capability = getattr(jax.devices()[0], "compute_capability", None)
    # On a CPU the weight products run through the packed-weight kernel when it builds
    # (cpu_matmul: XLA's GEMM re-packs the weights on every few-row product).
    packed, note = cpu_matmul.status(backend)
    if packed and devices > 1:
        # GSPMD cannot partition a custom call: a sharded table would need it under
        # shard_map. Unpacked weights keep the prefix attention in XLA too.
        packed, note = False, f"XLA dot and prefix attention in XLA (the CPU kernels are single-device; mesh of {devices})"
    return ExecutionPlan(
        backend=backend,
        kernel_impl=kernel_impl,
        verify_kernel="kernel" if kernel_impl == "kernel" or (kernel_impl == "auto" and backend == "gpu") else "reference",
        # The tree-attention kernel on GPUs; elsewhere the target's PrefixMask path.
        tree_attention="auto" if backend == "gpu" and kernel_impl != "reference" else None,
        matmul="packed" if packed else "xla",
        # The prefix-attention FFI kernel goes with the packed (inference-only) binding.
        prefix_attention="cpu" if packed and cpu_matmul.attention_mode() == "auto" else "xla",
        mesh=mesh if devices > 1 else None,
        devices=devices,
        matmul_note=note,
        compute_capability=compute_capability,
        packed_dtype="bfloat16" if packed and dtype == "bfloat16" else "float32",
        layers=layers_for(backend, devices),
    )


def layers_for(backend: str, devices: int = 1) -> str:
    """How a step table binds the target's layers on ``backend`` over ``devices``
    (``ExecutionPlan.layers``): "stacked" on one CPU device, where the loop compiled
    SmolLM2's steps in a quarter to a half of the time and ran them as fast or faster (the
    CPU kernels read each layer in place); "unrolled" elsewhere: on GPUs until a loan has
    measured the loop, and on a mesh of several devices, which stands in on CPUs for the
    GPU's tensor-parallel graphs. ``EAGLE_JAX_LAYERS`` overrides."""
    v = os.environ.get(LAYERS_ENV, "auto")
    if v not in ("auto",) + LAYERS:
        raise ConfigError(f"{LAYERS_ENV}={v!r} must be one of auto, {', '.join(LAYERS)}")
    if v != "auto":
        return v
    return "stacked" if backend == "cpu" and devices == 1 else "unrolled"


def bind_for_inference(plan: ExecutionPlan, target, draft=None):
    """How ``plan`` binds a target (and draft) for inference: (the plan, with "unrolled"
    layers where the target family has no stacked form; the target as bound: its
    ``stacked()`` form where the plan stacks layers; ``BoundModules`` packed where the
    plan packs). The step table's binding, and feature extraction's, which needs no
    gradient either."""
    if plan.layers == "stacked":
        if callable(getattr(target, "stacked", None)):
            target = target.stacked(plan.packed_dtype if plan.matmul == "packed" else None)
        else:
            plan = dataclasses.replace(plan, layers="unrolled")
    bound = BoundModules(target, draft, pack=plan.matmul == "packed", pack_dtype=plan.packed_dtype)
    return dataclasses.replace(plan, packed=bound.packed), target, bound


def model_dtype(plan: ExecutionPlan, dtype: str | None) -> str | None:
    """The dtype to load the models in under ``plan`` for weights of ``dtype``: float32
    where the plan packs bfloat16 panels (the activations and caches stay float32: the
    CPU's bfloat16 arithmetic is emulated, about 10x slower than float32 on a 2-core
    Xeon), ``dtype`` otherwise."""
    return "float32" if plan.packed_dtype == "bfloat16" else dtype


def xla_plan(backend: str | None = None) -> ExecutionPlan:
    """XLA's own kernels on ``backend`` (default: JAX's), one device: no FFI or Pallas
    custom call, so gradients flow (training, feature extraction)."""
    return ExecutionPlan(backend=backend or jax.default_backend())
