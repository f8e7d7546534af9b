"""The target-model seam: what the step math, the step table, the engine, the loader and
the doctor need from a target, and the table families register into (``register_target``;
``eagle_jax.models.registry`` looks a checkpoint's ``architectures`` up in it).

A target is an NNX module with:

- ``config``: its frozen config (``vocab_size``, ``hidden_size``, ``num_hidden_layers``,
  ``max_position_embeddings``, ``eos_token_ids``, ``feature_layer_ids``, ``architecture``);
- ``dtype``: the compute dtype;
- ``__call__(tokens [B, T], positions [B, T], cache, cache_slots [B, T], mask [B, T, S] | None,
  *, return_features, tree, plan)`` -> ``(hidden [B, T, H], features [B, T, F] | None, cache)``:
  one forward for prefill, decode and tree verification, writing the new tokens' cache
  entries at ``cache_slots`` (slots past the end are dropped), with the kernels the
  execution plan names (``kernels.plan``; default ``XLA_PLAN``);
- ``logits(hidden [..., H])`` -> ``[..., V]`` float32;
- ``cache_spec(batch, max_len)``: the *abstract* cache, a pytree of ``ArraySpec`` (shape,
  dtype, logical axes). Zero-initialisation, sharding and the step table's shapes all
  derive from it (as jax-llm-examples does), so a new attention kind (MLA's latent
  cache, say) only describes its cache here;
- ``axis_sizes()``: the size of each logical axis its parameters and cache split over
  the mesh, in the units that may be split (``heads``: attention heads, not
  ``heads * head_dim``), which ``sharding.model_axis_rules`` checks against the mesh;
- every NNX parameter carries ``logical_axes`` metadata (one name per dimension, keys of
  ``DEFAULT_AXIS_RULES``), from which the step table places it on the mesh.

The cache contract the step math relies on: every leaf is ``[B, S, ...]``, batch on axis
0 and cache slot on axis 1, so rows can be inserted and gathered and a tree commit can
move slots with one ``tree.map``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eagle_jax.errors import ConfigError

# Logical axis names used by caches and parameters, and where each goes on the mesh
# (axes "data", "expert" and "model", built by ``eagle_jax.runtime.sharding.make_mesh``). None: replicated.
# Parameters carry theirs as ``logical_axes`` metadata (``model.Linear`` and friends);
# ``sharding.model_axis_rules`` adapts these rules to a model and mesh (KV heads that do
# not divide "model" are replicated) and checks the sizes divide.
DEFAULT_AXIS_RULES: dict[str, str | None] = {
    "batch": "data",
    "cache_seq": None,
    "layers": None,  # the layer axis of a target bound with its layers stacked (llama.LayerStack)
    "kv_heads": "model",
    "heads": "model",  # the flattened heads * head_dim of a projection: whole heads per shard
    "head_dim": None,
    "embed": None,
    "mlp": "model",
    "vocab": "model",
    "draft_vocab": "model",  # the draft's reduced vocabulary (the draft runs replicated today)
    "features": None,  # the draft's fc input: the target's concatenated feature layers
    "latent": None,  # MLA's low-rank widths (q_lora_rank, kv_lora_rank) and its latent cache
    "experts": "expert",  # the routed experts of a mixture-of-experts layer (expert parallelism)
}


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """An array described, not allocated: shape, dtype and one logical axis name per dim."""

    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...]

    def __post_init__(self):
        if len(self.axes) != len(self.shape):
            raise ValueError(f"ArraySpec: {len(self.axes)} axis names for shape {self.shape}")

    def zeros(self) -> jax.Array:
        # jnp.zeros, not jnp.empty: uninitialised slots can hold NaN, and masked-out NaN
        # still poisons a softmax (0 * NaN).
        return jnp.zeros(self.shape, self.dtype)

    def struct(self, sharding=None) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape, self.dtype, sharding=sharding)


def is_spec(x) -> bool:
    return isinstance(x, ArraySpec)


def init_from_spec(spec_tree):
    """Zeros for every ``ArraySpec`` leaf of ``spec_tree`` (other leaves kept as they are)."""
    return jax.tree.map(lambda s: s.zeros() if is_spec(s) else s, spec_tree, is_leaf=is_spec)


def slot_axis(cache) -> int:
    """The slot axis of a cache's leaves: 1 (the cache contract), or the cache class's
    ``SLOT_AXIS`` (a stacked cache ``[B, L, S, ...]``: 2)."""
    return getattr(cache, "SLOT_AXIS", 1)


def cache_len(cache) -> int:
    """Slots in a target or draft cache (``slot_axis`` of its leaves)."""
    return jax.tree.leaves(cache)[0].shape[slot_axis(cache)]


def default_mesh() -> Mesh:
    """A (data=1, expert=1, model=1) mesh on the first device (``EngineConfig.mesh``'s default)."""
    return Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ("data", "expert", "model"))


def partition_spec(axes: tuple[str | None, ...], rules: dict[str, str | None] = DEFAULT_AXIS_RULES) -> PartitionSpec:
    """Logical axes -> a ``PartitionSpec`` (unknown names: an error, not replicated by accident)."""
    out = []
    for a in axes:
        if a is not None and a not in rules:
            raise ConfigError(f"logical axis {a!r} has no sharding rule; known: {', '.join(rules)}")
        out.append(None if a is None else rules[a])
    return PartitionSpec(*out)


def shardings_for(spec_tree, mesh: Mesh, rules: dict[str, str | None] = DEFAULT_AXIS_RULES):
    """A ``NamedSharding`` for every ``ArraySpec`` leaf, from its logical axes."""
    return jax.tree.map(lambda s: NamedSharding(mesh, partition_spec(s.axes, rules)), spec_tree, is_leaf=is_spec)


@runtime_checkable
class TargetModel(Protocol):
    """What the step table, engine, loader and doctor use of a target (see the module doc)."""

    config: Any
    dtype: Any

    def __call__(self, tokens, positions, cache, cache_slots, mask, *, return_features: bool = False, tree=None,
                 plan=None): ...  # plan: a kernels.plan.ExecutionPlan (each family defaults to XLA_PLAN)

    def logits(self, hidden): ...

    def cache_spec(self, batch: int, max_len: int): ...

    def axis_sizes(self) -> dict[str, int]: ...


# ----------------------------------------------------------------------------- registry


@dataclasses.dataclass(frozen=True)
class TargetFamily:
    """One implementation: how to read its config and build its module.

    ``config_from_hf(d)`` validates a config.json dict (raising ``ConfigError`` that names
    the field) and returns the frozen config; ``module(cfg, dtype=)`` builds the module;
    ``param_names(cfg)`` maps module parameter paths to checkpoint tensor names (with a
    transpose flag), which the loader and the doctor share."""

    name: str
    config_from_hf: Callable[[dict], Any]
    module: Callable[..., Any]
    param_names: Callable[[Any], dict]


_FAMILIES: dict[str, TargetFamily] = {}


def register_target(architectures: tuple[str, ...], family: TargetFamily) -> None:
    for arch in architectures:
        if arch in _FAMILIES and _FAMILIES[arch] is not family:
            raise ValueError(f"architecture {arch!r} is registered twice")
        _FAMILIES[arch] = family


def checkpoint_shapes(names: dict, shapes: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> its shape in the file, from a family's ``param_names`` map
    and the module's parameter shapes (path -> shape).

    A map entry is ``(name, transpose)``, or ``((name_0, ..., name_{E-1}), transpose)`` for
    a parameter stacked from one tensor per expert (``[E, ...]``: tensor e is slice e).
    Transposed tensors are stored PyTorch-style ``[out, in]``, the reverse of our kernels."""
    out = {}
    for path, (name, transpose) in names.items():
        shape = tuple(int(n) for n in shapes[path])
        if isinstance(name, tuple):
            if len(name) != shape[0]:
                raise RuntimeError(f"{path}: {len(name)} stacked tensors for a leading axis of {shape[0]}")
            inner = shape[1:][::-1] if transpose else shape[1:]
            out.update({n: inner for n in name})
        else:
            out[name] = shape[::-1] if transpose else shape
    return out
