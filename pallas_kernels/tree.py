"""The draft tree shared by drafting and verification, and XLA helpers over it.

Per sequence ``b`` a tree has ``T`` slots. Slot 0 is the root (the last verified
token, not a draft). ``parents[b, t]`` is the parent slot of ``t``: ``-1`` for the root,
``-2`` for padding slots that are not part of the tree (never accepted), otherwise a
slot ``< t`` (parents come before children). ``candidates[b, t]`` is the token at
slot ``t``. Children of a node are ordered by slot index; that is the order in which
verification tries them.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

ROOT_PARENT = -1
PAD_PARENT = -2


def _first_true(mask: Bool[Array, "... N"]) -> Int[Array, "..."]:
    """Index of the first True along the last axis, ``-1`` when there is none."""
    idx = jnp.argmax(mask, axis=-1).astype(jnp.int32)
    return jnp.where(mask.any(axis=-1), idx, -1)


def tree_links(
    parents: Int[Array, "B T"],
) -> tuple[Int[Array, "B T"], Int[Array, "B T"]]:
    """SGLang's ``retrive_next_token`` / ``retrive_next_sibling`` arrays.

    Returns ``(first_child, next_sibling)``: ``first_child[b, t]`` is the smallest slot
    whose parent is ``t``; ``next_sibling[b, t]`` the smallest slot ``> t`` with the same
    parent as ``t``; ``-1`` where there is none (root and padding have no siblings).
    """
    t = parents.shape[-1]
    slots = jnp.arange(t, dtype=jnp.int32)
    # is_child[b, p, c]: slot c hangs under slot p. O(T^2) per row; T is small.
    is_child = parents[:, None, :] == slots[None, :, None]
    first_child = _first_true(is_child)
    same_parent = (parents[:, :, None] == parents[:, None, :]) & (parents[:, :, None] >= 0)
    later = slots[None, :] > slots[:, None]
    next_sibling = _first_true(same_parent & later[None])
    return first_child, next_sibling


def tree_depths(parents: Int[Array, "B T"]) -> Int[Array, "B T"]:
    """Depth of each slot (root 0, its children 1, ...); ``-1`` for padding slots."""
    t = parents.shape[-1]
    depth = jnp.where(parents == ROOT_PARENT, 0, -1).astype(jnp.int32)
    # Parents come before children, so one pass in slot order settles every depth.
    for s in range(1, t):
        p = parents[:, s]
        pd = jnp.take_along_axis(depth, jnp.clip(p, 0, t - 1)[:, None], axis=1)[:, 0]
        depth = depth.at[:, s].set(jnp.where(p >= 0, pd + 1, depth[:, s]))
    return depth


def tree_ancestor_mask(parents: Int[Array, "B T"]) -> Bool[Array, "B T T"]:
    """``mask[b, t, s]``: slot ``s`` is ``t`` itself or an ancestor of ``t``.

    This is the attention mask inside the tree for the verify forward. Padding slots
    see only themselves.
    """
    b, t = parents.shape
    slots = jnp.arange(t, dtype=jnp.int32)
    mask = jnp.broadcast_to(slots[:, None] == slots[None, :], (b, t, t))
    cur = jnp.broadcast_to(slots, (b, t))
    for _ in range(t - 1):  # a chain of T slots has at most T-1 ancestors
        cur = jnp.where(cur >= 0, jnp.take_along_axis(parents, jnp.clip(cur, 0, t - 1), axis=1), -1)
        mask = mask | ((cur[:, :, None] == slots[None, None, :]) & (cur[:, :, None] >= 0))
    return mask
