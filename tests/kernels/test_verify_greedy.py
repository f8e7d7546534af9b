"""Greedy tree verification: Mosaic GPU kernel (interpreted) == jnp reference == Python walk."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.testing import assert_lowers_to_mosaic_gpu, chain_parents, children, greedy_walk, random_trees
from pallas_kernels.verify_greedy import verify_greedy

B, T, D, VOCAB = 3, 16, 4, 6


@partial(jax.jit, static_argnames=("max_depth", "impl"))
def _run(candidates, parents, target_argmax, *, max_depth, impl):
    return verify_greedy(candidates, parents, target_argmax, max_depth=max_depth, impl=impl)


def _targets_that_often_match(rng, parents, candidates):
    """Target argmax = a random child's token most of the time, so paths get long."""
    targ = rng.integers(0, VOCAB, parents.shape).astype(np.int32)
    for b in range(parents.shape[0]):
        for t in range(parents.shape[1]):
            kids = children(parents[b], t)
            if kids and rng.random() < 0.8:
                targ[b, t] = candidates[b, rng.choice(kids)]
    return targ


def _expected(parents, candidates, targ, max_depth):
    """Outputs of the Python walk, padded like the functions' outputs."""
    idx = np.full((parents.shape[0], max_depth + 1), -1, np.int32)
    tok = np.full_like(idx, -1)
    for b in range(parents.shape[0]):
        path, tokens = greedy_walk(parents[b], candidates[b], targ[b], max_depth)
        idx[b, : len(path)] = path
        tok[b, : len(tokens)] = tokens
    return idx, (idx >= 0).sum(1), tok


def _check(parents, candidates, targ, max_depth, impls=("reference", "kernel")):
    want = _expected(parents, candidates, targ, max_depth)
    for impl in impls:
        got = _run(jnp.asarray(candidates), jnp.asarray(parents), jnp.asarray(targ), max_depth=max_depth, impl=impl)
        for name, g, w in zip(("accept_index", "accept_length", "out_tokens"), got, want):
            np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"{impl}: {name}")


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_kernel_matches_reference_and_walk_on_random_trees(seed):
    rng = np.random.default_rng(seed)
    parents, candidates = random_trees(rng, B, T, D, VOCAB)
    _check(parents, candidates, _targets_that_often_match(rng, parents, candidates), D)


def test_reference_matches_walk_on_many_trees():
    rng = np.random.default_rng(0)
    for _ in range(20):
        parents, candidates = random_trees(rng, 8, T, D, VOCAB, pad_prob=0.2)
        _check(parents, candidates, _targets_that_often_match(rng, parents, candidates), D, impls=("reference",))


def test_root_only_and_nothing_accepted():
    # Row 0: a tree with no drafts at all; row 1: drafts, none matching.
    parents = np.array([[-1, -2, -2, -2], [-1, 0, 0, 1]], np.int32)
    candidates = np.array([[7, 7, 7, 7], [7, 1, 2, 3]], np.int32)
    targ = np.array([[7, 0, 0, 0], [5, 3, 0, 0]], np.int32)
    _check(parents, candidates, targ, 3)
    got = _run(jnp.asarray(candidates), jnp.asarray(parents), jnp.asarray(targ), max_depth=3, impl="kernel")
    np.testing.assert_array_equal(got.accept_length, [1, 1])
    np.testing.assert_array_equal(got.out_tokens[:, 0], [7, 5])  # the bonus is the target's argmax


@pytest.mark.parametrize("max_depth", [3, 5])
def test_full_chain_accepted_and_depth_cap(max_depth):
    parents = np.stack([chain_parents(6)] * 2)
    candidates = np.array([[9, 1, 2, 3, 4, 5]] * 2, np.int32)
    targ = np.array([[1, 2, 3, 4, 5, 6]] * 2, np.int32)
    _check(parents, candidates, targ, max_depth)
    got = _run(jnp.asarray(candidates), jnp.asarray(parents), jnp.asarray(targ), max_depth=max_depth, impl="kernel")
    np.testing.assert_array_equal(got.accept_length, [max_depth + 1] * 2)
    # With the cap at 3 the bonus is target_argmax at slot 3, i.e. 4.
    np.testing.assert_array_equal(got.out_tokens[0], list(range(1, max_depth + 2)))


def test_padding_slots_are_never_accepted():
    # Slot 1 is padding with the right token; the real child (slot 2) has a wrong one.
    parents = np.array([[-1, -2, 0, -2]], np.int32)
    candidates = np.array([[0, 4, 3, 4]], np.int32)
    targ = np.array([[4, 4, 4, 4]], np.int32)
    _check(parents, candidates, targ, 2)


def test_ties_take_the_first_child_in_slot_order():
    # Slots 1 and 2 are both children of the root with token 4; only slot 2 has a child.
    parents = np.array([[-1, 0, 0, 2]], np.int32)
    candidates = np.array([[0, 4, 4, 8]], np.int32)
    targ = np.array([[4, 8, 8, 1]], np.int32)
    _check(parents, candidates, targ, 2)
    got = _run(jnp.asarray(candidates), jnp.asarray(parents), jnp.asarray(targ), max_depth=2, impl="kernel")
    np.testing.assert_array_equal(got.accept_index, [[0, 1, -1]])
    np.testing.assert_array_equal(got.out_tokens, [[4, 8, -1]])


def test_lowers_for_cuda_with_mosaic_gpu(mgpu_semantics):
    args = (jnp.zeros((B, T), jnp.int32), jnp.full((B, T), -2, jnp.int32), jnp.zeros((B, T), jnp.int32))
    assert_lowers_to_mosaic_gpu(partial(verify_greedy, max_depth=D, impl="kernel", interpret=False), *args)
