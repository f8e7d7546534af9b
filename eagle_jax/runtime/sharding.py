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

Several hosts (``initialize_distributed``): JAX's multi-controller runtime. Every process
runs the same program (the same engine, host loop and requests); the mesh is built over
the devices of all of them (``jax.devices()``), each process loads only the slices its
own devices hold, and what the host loop reads back (tokens, accept lengths) is
replicated, so every process sees all rows. Decisions the host loop takes must be the
same in every process: a policy that decides from measured step times is refused there
(each process would measure its own).

The mesh's axes are ``AxisType.Auto`` (GSPMD propagates shardings from the pinned
inputs and outputs of each compiled step); ``jax.make_mesh`` defaults to Explicit axes,
under which every ambiguous product would need an ``out_sharding`` in the model code.
"""

from __future__ import annotations

import logging
import math
import os
import re
from typing import Mapping

import jax
from jax.sharding import AxisType, Mesh

from eagle_jax.errors import ConfigError
from eagle_jax.models.target import DEFAULT_AXIS_RULES
from eagle_jax.validate import is_int, one_of

log = logging.getLogger(__name__)

MESH_AXES = ("data", "expert", "model")
# What EngineConfig.mesh holds after validation: (data, model) when expert is 1,
# (data, expert, model) otherwise, or "auto" (every device on model, resolved when
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
            and all(is_int(v) and v >= 1 for v in value)):
        return _canonical(*mesh_sizes(tuple(value)))
    raise ConfigError(
        f"mesh={value!r} must be (data, model) or (data, expert, model) positive integers, 'auto' or 'data=D,model=M'"
    )


def describe_mesh(mesh: Mesh) -> str:
    expert = mesh.shape.get("expert", 1)
    return f"data={mesh.shape['data']}," + (f"expert={expert}," if expert > 1 else "") + f"model={mesh.shape['model']}"


# How the draft is placed on the mesh (``EngineConfig.draft_sharding``, ``StepTable``):
# whole on every device (its rows on "data"), or split over "model" like the target.
DRAFT_SHARDINGS = ("replicated", "model")


def check_draft_sharding(value) -> str:
    """``draft_sharding``: "replicated" or "model" (a ``ConfigError`` otherwise)."""
    return one_of("draft_sharding", value, DRAFT_SHARDINGS)


# The environment variables ``initialize_distributed`` reads where no flag is given (JAX
# itself reads JAX_COORDINATOR_ADDRESS, and detects SLURM, Open MPI and other clusters).
DISTRIBUTED_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> str | None:
    """Join this process to a multi-process JAX runtime (``jax.distributed.initialize``),
    from the arguments (the CLI's ``--coordinator``, ``--num-processes``, ``--process-id``)
    or else ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``.

    Nothing given: a single process, nothing is initialized, returns None. Some given and
    others missing: a ``ConfigError`` naming them. ``coordinator="auto"`` lets JAX's
    cluster detection (SLURM, Open MPI, ...) fill in all three. On CPUs the collectives
    between processes run over gloo. Must run before anything touches a device. Returns
    a line for the log."""
    env = {k: os.environ.get(k) for k in DISTRIBUTED_ENV}
    coordinator = coordinator or env["JAX_COORDINATOR_ADDRESS"]
    try:
        num_processes = num_processes if num_processes is not None else (
            int(env["JAX_NUM_PROCESSES"]) if env["JAX_NUM_PROCESSES"] else None)
        process_id = process_id if process_id is not None else (
            int(env["JAX_PROCESS_ID"]) if env["JAX_PROCESS_ID"] else None)
    except ValueError as e:
        raise ConfigError(f"JAX_NUM_PROCESSES / JAX_PROCESS_ID must be integers: {e}") from None
    if coordinator is None and num_processes is None and process_id is None:
        return None
    kwargs = {}
    if coordinator != "auto":  # "auto": JAX's cluster detection (SLURM, Open MPI, ...) fills every value in
        missing = [n for n, v in (("coordinator address", coordinator), ("number of processes", num_processes),
                                  ("process id", process_id)) if v is None]
        if missing:
            raise ConfigError(
                f"multi-process run: {', '.join(missing)} missing (flags --coordinator HOST:PORT --num-processes N "
                f"--process-id I, or {', '.join(DISTRIBUTED_ENV)}; --coordinator auto detects a cluster)"
            )
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise ConfigError(f"process id {process_id} of {num_processes} processes: need 0 <= id < processes >= 1")
        kwargs = dict(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    # Which collectives a CPU process uses is fixed before the backend starts: gloo, the
    # implementation that runs over TCP on any host (it is ignored by GPU backends).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)
    line = (f"process {jax.process_index()} of {jax.process_count()} (coordinator {coordinator}); "
            f"{jax.local_device_count()} local of {jax.device_count()} devices")
    log.info("distributed: %s", line)
    return line


def spans_processes(mesh: Mesh) -> bool:
    """Whether ``mesh`` holds devices of more than one process."""
    return len({d.process_index for d in mesh.devices.flat}) > 1


def make_mesh(shape: MeshShape, devices=None) -> Mesh:
    """The ``(data, expert, model)`` mesh over the first ``D * E * M`` of ``devices``
    (default: every device of every process, ``jax.devices()``; one process: its local
    devices); ``"auto"`` puts every one of them on ``model``. In a multi-process run the
    mesh must hold devices of every process (each runs the same steps)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = check_mesh_shape(shape)
    sizes = (1, 1, len(devices)) if shape == "auto" else mesh_sizes(shape)
    need = math.prod(sizes)
    if need > len(devices):
        named = ",".join(f"{a}={n}" for a, n in zip(MESH_AXES, sizes) if a != "expert" or n > 1)
        raise ConfigError(
            f"mesh {named} needs {need} devices; {len(devices)} "
            f"{'is' if len(devices) == 1 else 'are'} available ({devices[0].platform})"
        )
    if jax.process_count() > 1:
        used = {d.process_index for d in devices[:need]}
        if len(used) < jax.process_count():
            raise ConfigError(
                f"mesh of {need} devices uses processes {sorted(used)} of {jax.process_count()}: every process runs "
                f"the same steps, so the mesh needs devices of each ({jax.device_count()} devices in all, "
                f"{jax.local_device_count()} per process here)"
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
