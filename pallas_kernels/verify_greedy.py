"""Greedy (temperature 0) verification of a draft tree: the exact rule.

Walk from the root; among the children of the last accepted node (tried in slot
order), accept the first whose token equals the target's argmax at the last accepted
node; stop when none does or after ``max_depth`` accepted drafts. Emit the accepted
draft tokens followed by the bonus token ``target_argmax[last accepted slot]``, so
the output is token for token what plain greedy decoding of the target produces.

Kernel: Mosaic GPU via ``plgpu.kernel`` (see ``pallas_kernels._common`` for why not
``pl.pallas_call``/Triton), one program (one warpgroup) per sequence. It walks
SGLang's first-child / next-sibling links (computed in XLA by ``tree_links``) with
scalar loads, like SGLang's ``verify_tree_greedy``; everything vocabulary-wide (the
argmax) is done by the caller in XLA. Results are built in registers as lane
vectors padded to 128 (Mosaic GPU lays 1-D arrays over the warpgroup's 128 threads)
and written once, then sliced to ``max_depth + 1`` here. The reference is a
different formulation (vector matches per depth) so the two check each other.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Int

from pallas_kernels._common import LANES, Impl, lane_iota, mgpu_kernel, resolve_impl, round_up
from pallas_kernels.tree import _first_true, tree_links


class GreedyVerifyOutput(NamedTuple):
    """Result of greedy tree verification (``P = max_depth + 1``)."""

    accept_index: Int[Array, "B P"]  # tree slots of the accepted path, root first, -1 padded
    accept_length: Int[Array, " B"]  # accepted drafts + 1 (= number of emitted tokens)
    out_tokens: Int[Array, "B P"]  # accepted draft tokens then the bonus token, -1 padded


def _emit(accept_index, n_acc, candidates, bonus):
    """Tokens to emit: candidates along the path (after the root), then the bonus."""
    path = accept_index[:, 1:]
    drafts = jnp.where(path >= 0, jnp.take_along_axis(candidates, jnp.maximum(path, 0), axis=1), -1)
    drafts = jnp.concatenate([drafts, jnp.full_like(drafts[:, :1], -1)], axis=1)
    pos = jnp.arange(drafts.shape[1], dtype=jnp.int32)[None]
    return jnp.where(pos == n_acc[:, None], bonus[:, None], drafts).astype(jnp.int32)


def verify_greedy_reference(
    candidates: Int[Array, "B T"],
    parents: Int[Array, "B T"],
    target_argmax: Int[Array, "B T"],
    *,
    max_depth: int,
) -> GreedyVerifyOutput:
    """Pure-jnp greedy verification: one vectorised match per depth."""
    b, _ = candidates.shape
    last = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    n_acc = jnp.zeros((b,), jnp.int32)
    path = [last]
    for _ in range(max_depth):
        want = jnp.take_along_axis(target_argmax, last[:, None], axis=1)
        match = (parents == last[:, None]) & (candidates == want) & alive[:, None]
        nxt = _first_true(match)  # slot order = the order children are tried
        alive = nxt >= 0
        last = jnp.where(alive, nxt, last)
        n_acc = n_acc + alive
        path.append(jnp.where(alive, nxt, -1))
    accept_index = jnp.stack(path, axis=1).astype(jnp.int32)
    bonus = jnp.take_along_axis(target_argmax, last[:, None], axis=1)[:, 0]
    return GreedyVerifyOutput(accept_index, n_acc + 1, _emit(accept_index, n_acc, candidates, bonus))


def _greedy_kernel_body(max_depth: int, lanes: int):
    """Kernel body for one sequence (grid axis ``"b"``)."""

    def body(cand_ref, targ_ref, first_ref, sib_ref, idx_ref, tok_ref, len_ref):
        b = lax.axis_index("b")
        lane = lane_iota(lanes)

        def find_child(last, want):
            # Walk the sibling list of last's children until a token equals `want`.
            def cond(c_found):
                c, found = c_found
                return (c >= 0) & jnp.logical_not(found)

            def step(c_found):
                c, _ = c_found
                found = cand_ref[b, c] == want
                return jnp.where(found, c, sib_ref[b, c]), found

            return lax.while_loop(cond, step, (first_ref[b, last], jnp.bool_(False)))

        def depth_cond(carry):
            n, _, done, _, _ = carry
            return (n < max_depth) & jnp.logical_not(done)

        def depth_step(carry):
            n, last, _, idx, tok = carry
            want = targ_ref[b, last]
            c, found = find_child(last, want)
            idx = jnp.where(found & (lane == n + 1), c, idx)
            tok = jnp.where(found & (lane == n), want, tok)
            return n + found.astype(jnp.int32), jnp.where(found, c, last), jnp.logical_not(found), idx, tok

        # Built from `lane` so the loop carries keep its layout (a bare constant is a
        # splat, and the Lane semantics then reject the carry's change of layout).
        idx0 = jnp.where(lane == 0, 0, -1)
        tok0 = jnp.where(lane < 0, 0, -1)
        init = (jnp.int32(0), jnp.int32(0), jnp.bool_(False), idx0, tok0)
        n, last, _, idx, tok = lax.while_loop(depth_cond, depth_step, init)
        tok = jnp.where(lane == n, targ_ref[b, last], tok)  # the bonus token
        idx_ref[b] = idx
        tok_ref[b] = tok
        len_ref[b] = n + 1

    return body


def verify_greedy_kernel(
    candidates: Int[Array, "B T"],
    parents: Int[Array, "B T"],
    target_argmax: Int[Array, "B T"],
    *,
    max_depth: int,
    interpret=None,
) -> GreedyVerifyOutput:
    """The Pallas (Mosaic GPU) kernel; ``interpret`` is ``None`` or ``InterpretGPUParams``."""
    b, _ = candidates.shape
    lanes = round_up(max_depth + 1, LANES)
    first_child, next_sibling = tree_links(parents)
    i32 = lambda x: x.astype(jnp.int32)
    out_shapes = (
        jax.ShapeDtypeStruct((b, lanes), jnp.int32),
        jax.ShapeDtypeStruct((b, lanes), jnp.int32),
        jax.ShapeDtypeStruct((b,), jnp.int32),
    )
    call = mgpu_kernel(
        _greedy_kernel_body(max_depth, lanes), out_shapes, grid=(b,), grid_names=("b",), interpret=interpret
    )
    idx, tok, length = call(i32(candidates), i32(target_argmax), first_child, next_sibling)
    p = max_depth + 1
    return GreedyVerifyOutput(idx[:, :p], length, tok[:, :p])


def verify_greedy(
    candidates: Int[Array, "B T"],
    parents: Int[Array, "B T"],
    target_argmax: Int[Array, "B T"],
    *,
    max_depth: int,
    impl: Impl = "auto",
    interpret: bool | None = None,
) -> GreedyVerifyOutput:
    """Greedy verification of a draft tree.

    Args:
      candidates: ``[B, T]`` token at each tree slot (slot 0 = root, not a draft).
      parents: ``[B, T]`` parent slot (root -1, padding -2, else ``< t``).
      target_argmax: ``[B, T]`` the target's argmax next token at each slot.
      max_depth: static number of draft steps ``D``; at most ``D`` drafts are accepted.
      impl: ``"auto"`` (kernel on GPU, reference elsewhere), ``"kernel"`` or ``"reference"``.
      interpret: for the kernel: ``None`` = interpret unless on GPU.

    Returns:
      ``GreedyVerifyOutput(accept_index [B, D+1], accept_length [B], out_tokens [B, D+1])``.
    """
    use_kernel, interp = resolve_impl(impl, interpret)
    if use_kernel:
        return verify_greedy_kernel(candidates, parents, target_argmax, max_depth=max_depth, interpret=interp)
    return verify_greedy_reference(candidates, parents, target_argmax, max_depth=max_depth)
