"""The device mesh and the sharding rules a model can use on it.

The mesh has three axes: ``data`` (batch rows), ``expert`` (expert parallelism: a
mixture-of-experts target's routed experts split into groups, one per shard; size 1
unless asked for) and ``model`` (tensor parallelism inside each matrix product). Logical axis names on parameters and caches (``target.ArraySpec``
axes, the ``logical_axes`` metadata of every NNX parameter) map to mesh axes through a
rules dict (``target.DEFAULT_AXIS_RULES``); this module builds the mesh from
``EngineConfig.mesh`` / ``--mesh`` and checks, before anything is compiled, that the
model's sizes divide the axes the rules put them on:

- ``model_axis_rules``: the rules for one target on one mesh. Heads, MLP width and
  vocabulary must divide ``model`` (a ``ConfigError`` names the sizes that would work).
  KV heads that do not divide ``model`` while the query heads do are *replicated* over
  ``model``: every shard computes every KV head's projection and holds the whole KV
  cache. That is correct (a shard's query heads read only their own KV group, which it
  then holds) and costs ``model`` times the KV cache and the k/v projections. (vLLM
  instead copies each KV head onto ``model / kv_heads`` shards, which needs ``model`` to
  be a multiple of ``kv_heads`` and a cache layout of ``model`` heads; not done here.)
- ``replicated_rules``: batch on ``data``, everything else replicated (the draft's).
- ``batch_rules``: a batch of ``b`` rows goes on ``data`` only when ``data`` divides
  ``b``; otherwise its rows are replicated over ``data`` (every data group runs the
  same rows: correct, and no faster than ``data=1``). Batch buckets that are multiples
  of ``data`` are the ones that use it.

The mesh's axes are ``AxisType.Auto`` (GSPMD propagates shardings from the pinned
inputs and outputs of each compiled step); ``jax.make_mesh`` defaults to Explicit axes,
under which every ambiguous product would need an ``out_sharding`` in the model code.
"""

from __future__ import annotations

import math
import re
from typing import Mapping

import jax
from jax.sharding import AxisType, Mesh

from eagle_jax.errors import ConfigError
from eagle_jax.target import DEFAULT_AXIS_RULES

MESH_AXES = ("data", "expert", "model")
# What EngineConfig.mesh holds after validation: (data, model) when expert is 1,
# (data, expert, model) otherwise, or "auto" (every local device on model, resolved when
# the mesh is built).
MeshShape = tuple[int, int] | tuple[int, int, int] | str


def _canonical(data: int, expert: int, model: int) -> MeshShape:
    return (data, model) if expert == 1 else (data, expert, model)


def mesh_sizes(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """``(data, model)`` or ``(data, expert, model)`` -> ``(data, expert, model)``."""
    return (shape[0], 1, shape[1]) if len(shape) == 2 else tuple(shape)


def parse_mesh(text: str) -> MeshShape:
    """``"auto"`` or ``"data=D,model=M"`` / ``"data=D,expert=E,model=M"`` (any order; an
    axis left out is 1) -> ``"auto"``, ``(D, M)`` or ``(D, E, M)``."""
    s = text.strip().lower()
    if s == "auto":
        return "auto"
    sizes = {}
    for part in s.split(","):
        m = re.fullmatch(r"\s*(data|expert|model)\s*=\s*(\d+)\s*", part)
        if m is None or m.group(1) in sizes:
            raise ConfigError(
                f"mesh {text!r}: expected 'auto' or 'data=D,model=M' (optionally expert=E; positive integers, each axis once)"
            )
        sizes[m.group(1)] = int(m.group(2))
    shape = (sizes.get("data", 1), sizes.get("expert", 1), sizes.get("model", 1))
    if min(shape) < 1:
        raise ConfigError(f"mesh {text!r}: axis sizes must be >= 1")
    return _canonical(*shape)


def check_mesh_shape(value) -> MeshShape:
    """An ``EngineConfig.mesh`` value (``(D, M)``, ``(D, E, M)``, ``"auto"`` or the string
    form) in its canonical form, or a ``ConfigError``."""
    if isinstance(value, str):
        return parse_mesh(value)
    if (isinstance(value, (tuple, list)) and len(value) in (2, 3)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)):
        return _canonical(*mesh_sizes(tuple(value)))
    raise ConfigError(
        f"mesh={value!r} must be (data, model) or (data, expert, model) positive integers, 'auto' or 'data=D,model=M'"
    )


def describe_mesh(mesh: Mesh) -> str:
    expert = mesh.shape.get("expert", 1)
    return f"data={mesh.shape['data']}," + (f"expert={expert}," if expert > 1 else "") + f"model={mesh.shape['model']}"


def make_mesh(shape: MeshShape, devices=None) -> Mesh:
    """The ``(data, expert, model)`` mesh over the first ``D * E * M`` of ``devices``
    (default: the local devices); ``"auto"`` puts every one of them on ``model``."""
    devices = list(jax.local_devices() if devices is None else devices)
    shape = check_mesh_shape(shape)
    sizes = (1, 1, len(devices)) if shape == "auto" else mesh_sizes(shape)
    need = math.prod(sizes)
    if need > len(devices):
        named = ",".join(f"{a}={n}" for a, n in zip(MESH_AXES, sizes) if a != "expert" or n > 1)
        raise ConfigError(
            f"mesh {named} needs {need} devices; {len(devices)} "
            f"{'is' if len(devices) == 1 else 'are'} available ({devices[0].platform})"
        )
    # Auto axes: see the module docstring.
    return jax.make_mesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices[:need])


def model_axis_rules(sizes: Mapping[str, int], mesh: Mesh, *, what: str = "target",
                     rules: Mapping[str, str | None] = DEFAULT_AXIS_RULES) -> dict[str, str | None]:
    """The rules for a model whose logical axes have these ``sizes`` (in the units that
    may be split: ``heads`` and ``kv_heads`` count heads, ``mlp`` the MLP width, ``vocab``
    the vocabulary), on ``mesh``.

    Every size whose axis the rules put on a mesh axis of size n > 1 must be a multiple
    of n, except ``kv_heads``, which is replicated instead when the query heads divide
    (see the module docstring); a ``ConfigError`` names the failing sizes and the
    ``model`` sizes (up to the devices present) that would work."""
    out = dict(rules)
    unknown = [k for k in sizes if k not in rules]
    if unknown:
        raise ConfigError(f"{what}: logical axes {unknown} have no sharding rule; known: {', '.join(rules)}")
    if mesh.shape.get("expert", 1) > 1 and "experts" not in sizes:
        raise ConfigError(
            f"mesh {describe_mesh(mesh)} does not fit the {what}: expert={mesh.shape['expert']} splits routed experts "
            "and this model has none; use expert=1"
        )
    bad = {}
    for name, n in sizes.items():
        axis = rules[name]
        if axis is None or mesh.shape[axis] == 1 or n % mesh.shape[axis] == 0:
            continue
        if name == "kv_heads":
            out[name] = None  # replicated KV heads (correct; see the module docstring)
            continue
        bad[name] = (n, axis)
    if bad:
        on_model = {k: n for k, n in sizes.items() if rules[k] == "model" and k != "kv_heads"}
        usable = [m for m in range(1, len(jax.devices()) + 1) if all(n % m == 0 for n in on_model.values())]
        parts = ", ".join(f"{k} {n} is not a multiple of {axis}={mesh.shape[axis]}" for k, (n, axis) in bad.items())
        raise ConfigError(
            f"mesh {describe_mesh(mesh)} does not fit the {what}: {parts}; model sizes it can use "
            f"(dividing {', '.join(f'{k} {n}' for k, n in on_model.items())}, up to the {len(jax.devices())} "
            f"devices): {', '.join(map(str, usable))}"
        )
    return out


def replicated_rules(rules: Mapping[str, str | None]) -> dict[str, str | None]:
    """``rules`` with every axis but ``batch`` replicated."""
    return {k: (v if k == "batch" else None) for k, v in rules.items()}


def batch_rules(rules: Mapping[str, str | None], mesh: Mesh, batch: int) -> dict[str, str | None]:
    """``rules`` for a state of ``batch`` rows: rows on their mesh axis only when its
    size divides ``batch`` (else replicated; see the module docstring)."""
    axis = rules["batch"]
    if axis is None or batch % mesh.shape[axis] == 0:
        return dict(rules)
    return {**rules, "batch": None}
