"""The Pallas kernels (tree verify, tree sampling, tree attention) under a device mesh.

GSPMD cannot partition a custom call, so a step over a mesh of several devices runs each
kernel inside ``jax.shard_map``: every device calls the kernel on its own block. The mesh
is the caller's (``mesh=``: the execution plan's, ``kernels.plan.ExecutionPlan.mesh``),
never read from a global context.

- ``shard_rows``: kernels whose rows are independent (``verify_greedy``,
  ``tree_speculative_sample``). Rows split over ``data`` when it divides them (the
  state's own rule, ``sharding.batch_rules``); everything else replicated, so an input
  the step holds split (target probabilities over the vocabulary on ``model``) is
  gathered before the call. No collective inside: a row's result needs only its row.
- ``shard_tree_attention``: rows over ``data`` and query heads over ``model`` (as
  the projections split them). KV heads split over ``model`` too where they divide it;
  where they are replicated (``sharding.model_axis_rules``), each device slices the KV
  heads its query heads read (its ``G = Hq / Hkv`` group) before the call. Head counts
  that allow neither run with every head on every device (correct, no faster).

Without a mesh (``mesh=None``), or on one device, each calls the kernel directly.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
from jax import lax
from jax.sharding import PartitionSpec

from pallas_kernels.tree_attention import tree_attention


def _mesh(mesh):
    """``mesh``, or None when it is None or of one device."""
    if mesh is None or not mesh.axis_names or math.prod(mesh.shape.values()) == 1:
        return None
    return mesh


def _rows_axis(mesh, rows: int) -> str | None:
    n = mesh.shape.get("data", 1)
    return "data" if n > 1 and rows % n == 0 else None


def shard_rows(fn: Callable, *args, mesh=None):
    """``fn(*args)``, where every argument and every output leaf has the batch rows on
    axis 0, per device of ``mesh`` on its rows (see the module docstring)."""
    mesh = _mesh(mesh)
    if mesh is None:
        return fn(*args)
    axis = _rows_axis(mesh, args[0].shape[0])

    def spec(x):
        return PartitionSpec(axis, *([None] * (x.ndim - 1)))

    out = jax.eval_shape(fn, *args)
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(map(spec, args)), out_specs=jax.tree.map(spec, out),
                         check_vma=False)(*args)


def kv_slice(hq: int, hkv: int, shards: int) -> tuple[str, int] | None:
    """How ``shards`` devices on ``model`` split ``hq`` query heads over ``hkv`` KV heads:
    ("split", 0) KV heads split like the query heads; ("slice", n) each device slices
    the n KV heads of its query heads from a replicated cache; None: no split fits."""
    if hq % shards:
        return None
    if hkv % shards == 0:
        return ("split", 0)
    g, local = hq // hkv, hq // shards
    if local % g == 0:
        return ("slice", local // g)
    if g % local == 0:
        return ("slice", 1)
    return None


def shard_tree_attention(q, k_cache, v_cache, seq_lens, tree_mask, *, scale: float, impl: str, mesh=None):
    """``pallas_kernels.tree_attention.tree_attention`` with the same arguments (``q``
    ``[B, T, Hq, D]``, caches ``[B, S, Hkv, D]``, ``seq_lens`` ``[B]``, ``tree_mask``
    ``[B, T, T]``), per device of ``mesh`` on its rows and heads (see the module docstring)."""

    def attend(q, k, v, s, m):
        return tree_attention(q, k, v, s, m, scale=scale, impl=impl)

    mesh = _mesh(mesh)
    if mesh is None:
        return attend(q, k_cache, v_cache, seq_lens, tree_mask)
    rows = _rows_axis(mesh, q.shape[0])
    hq, hkv = q.shape[2], k_cache.shape[2]
    shards = mesh.shape.get("model", 1)
    how = kv_slice(hq, hkv, shards) if shards > 1 else None
    heads = "model" if how is not None else None
    kv_heads = "model" if how == ("split", 0) else None
    local = attend
    if how is not None and how[0] == "slice":
        per = hq // shards
        g, n = hq // hkv, how[1]

        def local(q, k, v, s, m):
            # This device's query heads start at i * per; their KV heads at that // g.
            start = lax.axis_index("model") * per // g
            k, v = (lax.dynamic_slice_in_dim(c, start, n, axis=2) for c in (k, v))
            return attend(q, k, v, s, m)

    in_specs = (PartitionSpec(rows, None, heads, None), PartitionSpec(rows, None, kv_heads, None),
                PartitionSpec(rows, None, kv_heads, None), PartitionSpec(rows), PartitionSpec(rows, None, None))
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=PartitionSpec(rows, None, heads, None),
                         check_vma=False)(q, k_cache, v_cache, seq_lens, tree_mask)
