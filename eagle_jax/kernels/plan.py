"""The execution plan: which kernel runs each part of a forward and a step, decided once.

An ``ExecutionPlan`` is resolved in one place (``eagle_jax.runtime.plan.resolve_plan``,
from the backend, ``kernel_impl``, the mesh and what the CPU kernel library says) and
passed explicitly (``plan=``) to the model forwards and the step functions, which read
it instead of guessing from the backend, a kernel's rank or a global mesh. The step
table resolves one per table, binds its parameters by it (``matmul="packed"``: CPU
column panels) and prints ``describe()`` in the engine's start-up line.

The rules ``resolve_plan`` applies (today's engine, as measured in the module docstrings
of ``cpu_matmul``, ``spec.steps`` and ``pallas_kernels.tree_attention``):

- matrix products: on a CPU the packed-weight FFI kernel (``cpu_matmul``) when its
  library builds and ``EAGLE_JAX_CPU_MATMUL`` allows it; XLA's dot elsewhere, and on a
  mesh of several devices (GSPMD cannot partition a custom call);
- prefix attention (the cached prefix of a ``PrefixMask`` forward): the CPU FFI kernel
  where the weights are packed (an inference binding: no gradient is defined through
  the call) and ``EAGLE_JAX_CPU_ATTENTION`` allows it, for the shapes the kernel takes
  (``prefix_attention_for``); XLA's block loop otherwise;
- tree attention (the verify forward and the plain step): on a GPU, unless
  ``kernel_impl="reference"``, ``pallas_kernels.tree_attention`` in mode "auto" (the
  Mosaic GPU kernel where the shapes fit, else its XLA reference); elsewhere ``None``:
  the target's ``PrefixMask`` path (faster on a CPU than the kernel's interpreter);
- verify kernels (greedy verify, tree speculative sampling): "kernel" on a GPU or when
  asked for (interpreted off a GPU), "reference" (jnp) otherwise;
- the mesh of several devices the Pallas kernels and an expert-parallel MoE run
  ``shard_map`` over (``eagle_jax.kernels.sharded``); ``None`` on one device;
- the target's layers: "stacked" on a CPU (one layer body in a loop over stacked
  parameters and caches, ``models.llama.LayerStack``: a third to a quarter of the
  compile time, and no slower), "unrolled" elsewhere until a GPU has measured it, and
  for a target family without a stacked form; ``EAGLE_JAX_LAYERS`` overrides.

``XLA_PLAN`` (XLA's own kernels on a CPU, one device) is every forward's and step
function's default, so direct callers and tests keep working without resolving one.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jax.sharding import Mesh

from eagle_jax.kernels import cpu_matmul
from eagle_jax.validate import one_of

KERNEL_IMPLS = ("auto", "kernel", "reference")
MATMULS = ("xla", "packed")
PREFIX_ATTENTIONS = ("xla", "cpu")
LAYERS = ("unrolled", "stacked")
LAYERS_ENV = "EAGLE_JAX_LAYERS"  # "auto" (default), "stacked" or "unrolled": the A/B switch of ``layers``
TREE_ATTENTIONS = (None, "auto", "kernel", "reference")
VERIFY_KERNELS = ("kernel", "reference")
# The tree-attention kernel tiles the cache in blocks of this many slots (its default
# block_k); only a cache whose length is a multiple of it can take the kernel
# (pallas_kernels.tree_attention.select_tree_attention_path), so GPU tables round up.
TREE_ATTENTION_BLOCK = 64


def check_kernel_impl(value) -> str:
    """``kernel_impl`` (``EngineConfig``, ``StepTable``, ``Generator``): "auto" (the
    Pallas kernels on a GPU, their references elsewhere), "kernel" or "reference"."""
    return one_of("kernel_impl", value, KERNEL_IMPLS)


@dataclasses.dataclass(frozen=True)
class ExecutionPlan:
    """Which kernels a step table's graphs run (see the module docstring).

    Fields:
      backend: the JAX backend the plan is for ("cpu", "gpu", "tpu").
      kernel_impl: what was asked for ("auto", "kernel", "reference").
      verify_kernel: ``impl`` of the verify kernels: "kernel" or "reference".
      tree_attention: ``impl`` of ``pallas_kernels.tree_attention`` for the verify
        forward and the plain step, or None (the target's ``PrefixMask`` path).
      matmul: "packed" (bind float32 Linear kernels and heads as CPU column panels,
        ``cpu_matmul.pack_params``) or "xla".
      packed_dtype: the panels' dtype: "float32", or "bfloat16" (``dtype="bfloat16"`` on a
        CPU: half the bytes each step streams, widened in registers; the model runs in
        float32 otherwise, since XLA:CPU emulates bfloat16 arithmetic slowly).
      prefix_attention: "cpu" (the CPU FFI kernel where the shape fits) or "xla".
      mesh: the mesh of several devices the Pallas kernels (and expert-parallel MoE)
        run under ``shard_map`` over; None on one device.
      devices: devices of the table's mesh (1 without one).
      matmul_note: what the matrix products run on, and why (the start-up line).
      packed: matrices the binding packed (filled in by the step table).
      layers: "stacked" (the step table binds the target's ``stacked()`` form: its layers
        run as one loop body over stacked parameters and caches) or "unrolled".
      compute_capability: the GPU's, for the tree-attention kernel's selection.
    """

    backend: str = "cpu"
    kernel_impl: str = "auto"
    verify_kernel: str = "reference"
    tree_attention: str | None = None
    matmul: str = "xla"
    prefix_attention: str = "xla"
    mesh: Mesh | None = None
    devices: int = 1
    matmul_note: str = "XLA dot"
    packed: int = 0
    packed_dtype: str = "float32"
    compute_capability: str | None = None
    layers: str = "unrolled"

    def __post_init__(self):
        check_kernel_impl(self.kernel_impl)
        one_of("verify_kernel", self.verify_kernel, VERIFY_KERNELS)
        one_of("tree_attention", self.tree_attention, TREE_ATTENTIONS)
        one_of("matmul", self.matmul, MATMULS)
        one_of("prefix_attention", self.prefix_attention, PREFIX_ATTENTIONS)
        one_of("packed_dtype", self.packed_dtype, ("float32", "bfloat16"))
        one_of("layers", self.layers, LAYERS)
        if self.packed_dtype == "bfloat16" and self.matmul != "packed":
            raise ValueError("packed_dtype='bfloat16' needs matmul='packed'")

    @property
    def expert_shards(self) -> int:
        """Shards of the mesh's ``expert`` axis (1 without a mesh)."""
        return 1 if self.mesh is None else self.mesh.shape.get("expert", 1)

    @property
    def cache_align(self) -> int:
        """The target cache's default rounding: the tree-attention kernel's block on GPUs."""
        return TREE_ATTENTION_BLOCK if self.backend == "gpu" else 1

    def prefix_attention_for(self, t: int, g: int, d: int, dtype, causal: bool = False) -> str:
        """How a ``PrefixMask`` forward of ``t`` tokens, ``g`` query heads per KV head and
        head dimension ``d`` over a cache of ``dtype`` attends over the cached prefix:
        "cpu" (``cpu_matmul.prefix_attention_state``) or "xla" (the block loop).
        ``causal``: the mask's block is the causal triangle (``PrefixMask.is_causal``): a
        prefill chunk's width then takes the kernel's prefill path."""
        if self.prefix_attention == "cpu" and cpu_matmul.prefix_attention_fits(t, g, d, dtype, causal):
            return "cpu"
        return "xla"

    @property
    def kernel_path(self) -> str:
        """The verify kernels' setting, and whether they run under ``shard_map``."""
        if self.devices > 1 and self.kernel_impl != "reference":
            return f"{self.kernel_impl} (Pallas kernels under shard_map over {self.devices} devices)"
        return self.kernel_impl

    @property
    def matmul_path(self) -> str:
        """What the matrix products run on (and how many matrices were packed)."""
        if self.matmul != "packed":
            return self.matmul_note
        dtype = ", as bfloat16 (float32 arithmetic, activations and cache)" if self.packed_dtype == "bfloat16" else ""
        return f"{self.matmul_note}, {self.packed} matrices packed{dtype}"

    def verify_attention(self, heads: int, cache_shape: Sequence[int], cache_dtype,
                         spec_widths: Sequence[tuple[str, int]], plain: bool) -> str:
        """How verify forwards (and, on the tree-attention kernel, the plain step) attend,
        and why: ``heads`` query heads over a target cache leaf of ``cache_shape``
        (``[B, S, KV, D]``) and ``cache_dtype``; ``spec_widths`` the speculative shapes'
        (name, tree tokens); ``plain``: the plain step is compiled.

        Off the tree-attention kernel a Llama-family verify forward attends through
        ``models.llama.prefix_attention``: the T tree tokens among themselves in XLA, the
        cached prefix in the CPU attention kernel where ``prefix_attention_for`` says so
        (what the model asks too), else in XLA block by block. On GPUs
        ``pallas_kernels.tree_attention`` picks the kernel or its XLA reference by
        ``select_tree_attention_path``, asked here with the real cache shape."""
        if not spec_widths and not (self.tree_attention is not None and plain):
            return "no verify (plain only)"
        if len(cache_shape) != 4:  # not a [B, S, KV, D] cache: neither kernel applies
            return f"XLA (cache leaves of shape {tuple(cache_shape)} are not [B, S, KV, D])"
        if self.tree_attention is None:
            why = self.backend if self.backend != "gpu" else "kernel_impl=reference"
            g = heads // cache_shape[2]
            paths = {name: ("prefix in the CPU attention kernel"
                            if self.prefix_attention_for(t, g, cache_shape[3], cache_dtype) == "cpu"
                            else "prefix in XLA block by block") for name, t in spec_widths}
            return "tree block in XLA, " + "; ".join(f"{k}: {v}" for k, v in paths.items()) + f" ({why})"
        from pallas_kernels.tree_attention import select_tree_attention_path

        paths = {}
        # The plain step attends through the same kernel with a one-slot tree.
        for name, t in ([("plain step", 1)] if plain else []) + list(spec_widths):
            q = (cache_shape[0], t, heads, cache_shape[3])
            path, why = select_tree_attention_path(self.tree_attention, self.backend, q, tuple(cache_shape), cache_dtype,
                                                   compute_capability=self.compute_capability)
            paths[name] = f"{'Pallas tree-attention kernel' if path == 'kernel' else 'XLA reference'} ({why})"
        return "; ".join(f"{k}: {v}" for k, v in paths.items())

    def describe(self, verify_attention: str | None = None) -> str:
        """The start-up line's kernel part: the verify kernels, how verify forwards
        attend (``verify_attention``, from ``verify_attention`` with the table's shapes)
        and what the matrix products run on."""
        return "; ".join([f"kernels {self.kernel_path}"]
                         + ([f"verify attention {verify_attention}"] if verify_attention is not None else [])
                         + [f"matrix products: {self.matmul_path}"]
                         + [f"target layers {self.layers}" + (" (one loop body over stacked parameters and caches)"
                                                               if self.layers == "stacked" else "")])


# XLA's own kernels on a CPU, one device: the default of every forward and step function.
XLA_PLAN = ExecutionPlan()
