"""Exact tree speculative sampling with a deterministic draft (SGLang's
``tree_speculative_sampling_target_only``).

Rule, per sequence, following SGLang's CUDA kernel: start at the root with
``coin = coins[b, 0]``. At each depth walk the children of the last accepted node in
slot order, keeping ``prob_acc`` = the sum of the target probabilities of the
children tried so far at this depth; accept child ``x`` if
``coin <= prob_acc / threshold_acc`` or ``p(x) >= threshold_single``. On acceptance
the next depth uses ``coin = coins[b, x]`` and ``prob_acc`` restarts at 0; when every
child is rejected (or there are none) the walk stops. At most ``max_depth`` drafts
are accepted. The bonus token is then drawn from the target distribution at the last
accepted node with the rejected children's tokens removed, renormalised.

Coins: SGLang indexes the coin by the slot of the node being expanded
(``coins[b, last]``), i.e. one coin per depth, drawn from the accepted path. We keep
that indexing so the same coins give SGLang's result; with i.i.d. coins it is
distributionally the same as ``coins[b, depth]``.

With both thresholds 1.0 this is lossless: at a node with target distribution ``p``
and children ``x1, x2, ...``, child ``xi`` is accepted with probability ``p(xi)``
(the coin falls in ``(sum_{j<i} p(xj), sum_{j<=i} p(xj)]``), and when all are rejected
the bonus is drawn from ``p`` restricted to the other tokens, so the emitted token is
distributed exactly as ``p``. Thresholds below 1 accept more and bias the output.

Kernel: Mosaic GPU via ``plgpu.kernel`` (see ``pallas_kernels._common``), one
program per sequence, walking first-child / next-sibling links with scalar loads.
The per-child target probabilities, the coins and the vocabulary-wide bonus
sampling (a cumulative sum, which neither Mosaic GPU nor Triton can lower) stay in
XLA. ``rejected`` needs no kernel output: the walk stops only after trying every
child of ``last_slot`` (unless ``max_depth`` drafts were accepted), so the rejected
slots are exactly those children.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels._common import LANES, Impl, lane_iota, mgpu_kernel, resolve_impl, round_up
from pallas_kernels.tree import _first_true, tree_links

# SGLang caps threshold_acc from below before dividing by it.
_MIN_THRESHOLD_ACC = 1e-9


class SamplingVerifyOutput(NamedTuple):
    """Result of tree speculative sampling (``P = max_depth + 1``, ``D = max_depth``)."""

    accept_index: Int[Array, "B P"]  # accepted path's slots, root first, -1 padded
    accept_length: Int[Array, " B"]  # accepted drafts + 1
    accepted_tokens: Int[Array, "B D"]  # accepted draft tokens, -1 padded
    last_slot: Int[Array, " B"]  # last accepted slot (0 = only the root)
    rejected: Bool[Array, "B T"]  # children of last_slot that were tried and rejected


class SpecSampleOutput(NamedTuple):
    """Result of ``tree_speculative_sample``."""

    accept_index: Int[Array, "B P"]
    accept_length: Int[Array, " B"]
    out_tokens: Int[Array, "B P"]  # accepted drafts then the bonus token, -1 padded


def _thresholds(threshold_single, threshold_acc) -> Float[Array, "2"]:
    """``[threshold_single, max(threshold_acc, 1e-9)]`` as f32 (floats or traced)."""
    single = jnp.asarray(threshold_single, jnp.float32)
    acc = jnp.maximum(jnp.asarray(threshold_acc, jnp.float32), _MIN_THRESHOLD_ACC)
    return jnp.stack([single, acc])


def _finish(candidates, parents, accept_index, accept_length, max_depth) -> SamplingVerifyOutput:
    """Derive tokens, last slot and the rejected children from the accepted path."""
    path = accept_index[:, 1:]
    tokens = jnp.where(path >= 0, jnp.take_along_axis(candidates, jnp.maximum(path, 0), axis=1), -1)
    last = jnp.take_along_axis(accept_index, (accept_length - 1)[:, None], axis=1)[:, 0]
    # Children of last are tried (and all rejected) unless the depth budget ran out.
    tried = (accept_length - 1 < max_depth)[:, None]
    rejected = (parents == last[:, None]) & tried
    return SamplingVerifyOutput(accept_index, accept_length, tokens.astype(jnp.int32), last, rejected)


def verify_sampling_reference(
    candidates: Int[Array, "B T"],
    parents: Int[Array, "B T"],
    child_probs: Float[Array, "B T"],
    coins: Float[Array, "B T"],
    *,
    max_depth: int,
    threshold_single=1.0,
    threshold_acc=1.0,
) -> SamplingVerifyOutput:
    """Pure-jnp tree speculative sampling: per depth, a masked running sum over children."""
    b, _ = candidates.shape
    thr = _thresholds(threshold_single, threshold_acc)
    probs = child_probs.astype(jnp.float32)
    last = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    path = [last]
    for _ in range(max_depth):
        coin = jnp.take_along_axis(coins, last[:, None], axis=1).astype(jnp.float32)
        is_child = parents == last[:, None]
        running = jnp.cumsum(jnp.where(is_child, probs, 0.0), axis=1)  # slot order
        ok = (coin <= running / thr[1]) | (probs >= thr[0])
        nxt = _first_true(is_child & ok & alive[:, None])
        alive = nxt >= 0
        last = jnp.where(alive, nxt, last)
        path.append(jnp.where(alive, nxt, -1))
    accept_index = jnp.stack(path, axis=1).astype(jnp.int32)
    accept_length = (accept_index >= 0).sum(axis=1).astype(jnp.int32)
    return _finish(candidates, parents, accept_index, accept_length, max_depth)


def _sampling_kernel_body(max_depth: int, lanes: int):
    """Kernel body for one sequence (grid axis ``"b"``)."""

    def body(prob_ref, coin_ref, first_ref, sib_ref, thr_ref, idx_ref, len_ref):
        b = lax.axis_index("b")
        lane = lane_iota(lanes)
        thr_single = thr_ref[0]
        thr_acc = thr_ref[1]

        def try_children(last):
            coin = coin_ref[b, last]

            def cond(state):
                c, _, accepted = state
                return (c >= 0) & jnp.logical_not(accepted)

            def step(state):
                c, prob_acc, _ = state
                p = prob_ref[b, c]
                prob_acc = prob_acc + p
                accepted = (coin <= prob_acc / thr_acc) | (p >= thr_single)
                return jnp.where(accepted, c, sib_ref[b, c]), prob_acc, accepted

            c, _, accepted = lax.while_loop(cond, step, (first_ref[b, last], jnp.float32(0.0), jnp.bool_(False)))
            return c, accepted

        def depth_cond(carry):
            n, _, done, _ = carry
            return (n < max_depth) & jnp.logical_not(done)

        def depth_step(carry):
            n, last, _, idx = carry
            c, accepted = try_children(last)
            idx = jnp.where(accepted & (lane == n + 1), c, idx)
            return n + accepted.astype(jnp.int32), jnp.where(accepted, c, last), jnp.logical_not(accepted), idx

        init = (jnp.int32(0), jnp.int32(0), jnp.bool_(False), jnp.where(lane == 0, 0, -1))
        n, _, _, idx = lax.while_loop(depth_cond, depth_step, init)
        idx_ref[b] = idx
        len_ref[b] = n + 1

    return body


def verify_sampling_kernel(
    candidates: Int[Array, "B T"],
    parents: Int[Array, "B T"],
    child_probs: Float[Array, "B T"],
    coins: Float[Array, "B T"],
    *,
    max_depth: int,
    threshold_single=1.0,
    threshold_acc=1.0,
    interpret=None,
) -> SamplingVerifyOutput:
    """The Pallas (Mosaic GPU) kernel; ``interpret`` is ``None`` or ``InterpretGPUParams``."""
    b, _ = candidates.shape
    lanes = round_up(max_depth + 1, LANES)
    first_child, next_sibling = tree_links(parents)
    out_shapes = (jax.ShapeDtypeStruct((b, lanes), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32))
    call = mgpu_kernel(
        _sampling_kernel_body(max_depth, lanes), out_shapes, grid=(b,), grid_names=("b",), interpret=interpret
    )
    idx, length = call(
        child_probs.astype(jnp.float32),
        coins.astype(jnp.float32),
        first_child,
        next_sibling,
        _thresholds(threshold_single, threshold_acc),
    )
    return _finish(candidates, parents, idx[:, : max_depth + 1], length, max_depth)


def verify_sampling(
    candidates: Int[Array, "B T"],
    parents: Int[Array, "B T"],
    child_probs: Float[Array, "B T"],
    coins: Float[Array, "B T"],
    *,
    max_depth: int,
    threshold_single=1.0,
    threshold_acc=1.0,
    impl: Impl = "auto",
    interpret: bool | None = None,
) -> SamplingVerifyOutput:
    """Tree speculative sampling (the accept/reject walk; the bonus is ``sample_bonus``).

    Args:
      candidates: ``[B, T]`` token at each slot.
      parents: ``[B, T]`` parent slot (root -1, padding -2).
      child_probs: ``[B, T]`` f32 target probability (after temperature/top-k/top-p) of
        ``candidates[b, t]`` under the target distribution at ``parents[b, t]``.
      coins: ``[B, T]`` uniform(0, 1); the walk uses ``coins[b, slot being expanded]``.
      max_depth: static ``D``; at most ``D`` drafts are accepted.
      threshold_single, threshold_acc: SGLang's relaxations; 1.0 and 1.0 = exact.
      impl, interpret: as in ``verify_greedy``.

    Returns:
      ``SamplingVerifyOutput(accept_index [B, D+1], accept_length [B],
      accepted_tokens [B, D], last_slot [B], rejected [B, T])``.
    """
    use_kernel, interp = resolve_impl(impl, interpret)
    fn = verify_sampling_kernel if use_kernel else verify_sampling_reference
    kwargs = dict(interpret=interp) if use_kernel else {}
    return fn(
        candidates,
        parents,
        child_probs,
        coins,
        max_depth=max_depth,
        threshold_single=threshold_single,
        threshold_acc=threshold_acc,
        **kwargs,
    )


def rejected_token_mask(
    candidates: Int[Array, "B T"], rejected: Bool[Array, "B T"], vocab_size: int
) -> Bool[Array, "B V"]:
    """``[B, V]`` mask of the tokens of rejected slots (scatter in XLA)."""
    b, _ = candidates.shape
    rows = jnp.arange(b)[:, None]
    tokens = jnp.clip(candidates, 0, vocab_size - 1)  # padding tokens add 0 anyway
    counts = jnp.zeros((b, vocab_size), jnp.int32).at[rows, tokens].add(rejected.astype(jnp.int32))
    return counts > 0


def sample_bonus(
    target_probs_at_last: Float[Array, "B V"],
    rejected_tokens_mask: Bool[Array, "B V"],
    uniform: Float[Array, " B"],
) -> Int[Array, " B"]:
    """Draw the bonus token from the residual by inverse CDF (reproducible given ``uniform``).

    With a deterministic draft the residual ``relu(p - removed)`` is ``p`` with the
    rejected tokens zeroed. Like SGLang, the sample is the first token whose cumulative
    residual exceeds ``uniform * total``; if rounding leaves none, the last token with
    positive residual. An all-zero residual (impossible when exact) falls back to ``p``.
    """
    p = target_probs_at_last.astype(jnp.float32)
    residual = jnp.where(rejected_tokens_mask, 0.0, p)
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p)
    cdf = jnp.cumsum(residual, axis=-1)
    u = uniform.astype(jnp.float32)[:, None] * cdf[:, -1:]
    idx = jnp.sum(cdf <= u, axis=-1).astype(jnp.int32)  # first index with cdf > u
    v = p.shape[-1]
    last_valid = v - 1 - _first_true((residual > 0)[:, ::-1])
    last_valid = jnp.where(last_valid > v - 1, v - 1, last_valid)  # no positive entry at all
    return jnp.where(idx < v, idx, last_valid).astype(jnp.int32)


def child_target_probs(
    candidates: Int[Array, "B T"], parents: Int[Array, "B T"], target_probs: Float[Array, "B T V"]
) -> Float[Array, "B T"]:
    """``p_target(candidates[b, t] | parent slot)`` per slot; 0 for the root and padding."""
    t = candidates.shape[1]
    v = target_probs.shape[-1]
    at_parent = jnp.take_along_axis(target_probs, jnp.clip(parents, 0, t - 1)[:, :, None], axis=1)
    p = jnp.take_along_axis(at_parent, jnp.clip(candidates, 0, v - 1)[:, :, None], axis=2)[:, :, 0]
    return jnp.where(parents >= 0, p, 0.0).astype(jnp.float32)


def tree_speculative_sample(
    candidates: Int[Array, "B T"],
    parents: Int[Array, "B T"],
    target_probs: Float[Array, "B T V"],
    coins: Float[Array, "B T"],
    bonus_uniform: Float[Array, " B"],
    *,
    max_depth: int,
    threshold_single=1.0,
    threshold_acc=1.0,
    impl: Impl = "auto",
    interpret: bool | None = None,
) -> SpecSampleOutput:
    """Verify a draft tree by sampling and draw the bonus token.

    Args:
      candidates, parents: the tree (see ``pallas_kernels.tree``).
      target_probs: ``[B, T, V]`` target distribution (after temperature/top-k/top-p)
        at every slot.
      coins: ``[B, T]`` uniforms for the accept walk; ``bonus_uniform``: ``[B]`` for the bonus.
      max_depth, threshold_single, threshold_acc, impl, interpret: as in ``verify_sampling``.

    Returns:
      ``SpecSampleOutput(accept_index [B, D+1], accept_length [B], out_tokens [B, D+1])``
      where ``out_tokens`` holds the accepted drafts followed by the bonus token.
    """
    v = target_probs.shape[-1]
    res = verify_sampling(
        candidates,
        parents,
        child_target_probs(candidates, parents, target_probs),
        coins,
        max_depth=max_depth,
        threshold_single=threshold_single,
        threshold_acc=threshold_acc,
        impl=impl,
        interpret=interpret,
    )
    p_last = jnp.take_along_axis(target_probs, res.last_slot[:, None, None], axis=1)[:, 0]
    bonus = sample_bonus(p_last, rejected_token_mask(candidates, res.rejected, v), bonus_uniform)
    tokens = jnp.concatenate([res.accepted_tokens, jnp.full_like(bonus[:, None], -1)], axis=1)
    pos = jnp.arange(max_depth + 1, dtype=jnp.int32)[None]
    out_tokens = jnp.where(pos == (res.accept_length - 1)[:, None], bonus[:, None], tokens)
    return SpecSampleOutput(res.accept_index, res.accept_length, out_tokens.astype(jnp.int32))
