"""Tree speculative sampling: kernel == reference == SGLang's loop, and losslessness."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from pallas_kernels.testing import assert_lowers_to_mosaic_gpu, children, random_trees, sampling_walk
from pallas_kernels.verify_sampling import (
    rejected_token_mask,
    sample_bonus,
    tree_speculative_sample,
    verify_sampling,
)

B, T, D, VOCAB = 3, 16, 4, 6


@partial(jax.jit, static_argnames=("max_depth", "impl"))
def _run(candidates, parents, child_probs, coins, thresholds, *, max_depth, impl):
    return verify_sampling(
        candidates,
        parents,
        child_probs,
        coins,
        max_depth=max_depth,
        threshold_single=thresholds[0],
        threshold_acc=thresholds[1],
        impl=impl,
    )


def _random_child_probs(rng, parents):
    """Per-slot target probs: each node's children share at most total mass 1."""
    probs = np.zeros(parents.shape, np.float32)
    for b in range(parents.shape[0]):
        for t in range(parents.shape[1]):
            kids = children(parents[b], t)
            if kids:
                probs[b, kids] = rng.dirichlet(np.ones(len(kids) + 1))[:-1]
    return probs


def _expected(parents, candidates, probs, coins, max_depth, thr):
    idx = np.full((parents.shape[0], max_depth + 1), -1, np.int32)
    rejected = np.zeros(parents.shape, bool)
    for b in range(parents.shape[0]):
        path, rej = sampling_walk(parents[b], probs[b], coins[b], max_depth, *thr)
        idx[b, : len(path)] = path
        rejected[b, rej] = True
    length = (idx >= 0).sum(1)
    tokens = np.where(idx[:, 1:] >= 0, np.take_along_axis(candidates, np.maximum(idx[:, 1:], 0), 1), -1)
    last = idx[np.arange(len(idx)), length - 1]
    return idx, length, tokens, last, rejected


def _check(parents, candidates, probs, coins, max_depth, thr=(1.0, 1.0), impls=("reference", "kernel")):
    want = _expected(parents, candidates, probs, coins, max_depth, thr)
    args = [jnp.asarray(x) for x in (candidates, parents, probs, coins)] + [jnp.asarray(thr, jnp.float32)]
    for impl in impls:
        got = _run(*args, max_depth=max_depth, impl=impl)
        for name, g, w in zip(got._fields, got, want):
            np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"{impl}: {name}")


THRESHOLDS = st.sampled_from([(1.0, 1.0), (0.3, 1.0), (1.0, 0.5), (0.6, 0.8)])


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), thr=THRESHOLDS)
def test_kernel_matches_reference_and_walk_on_random_trees(seed, thr):
    rng = np.random.default_rng(seed)
    parents, candidates = random_trees(rng, B, T, D, VOCAB)
    probs = _random_child_probs(rng, parents)
    coins = rng.random(parents.shape, dtype=np.float32)
    _check(parents, candidates, probs, coins, D, thr)


def test_reference_matches_walk_on_many_trees():
    rng = np.random.default_rng(1)
    for thr in [(1.0, 1.0), (0.4, 0.7)]:
        for _ in range(10):
            parents, candidates = random_trees(rng, 8, T, D, VOCAB, pad_prob=0.2)
            probs = _random_child_probs(rng, parents)
            coins = rng.random(parents.shape, dtype=np.float32)
            _check(parents, candidates, probs, coins, D, thr, impls=("reference",))


# Root with children 1, 2 (probs .25, .5); slot 1 has children 3, 4 (.3, .3); slot 2 has
# child 5 (.125).
EDGE_PARENTS = np.array([[-1, 0, 0, 1, 1, 2, -2, -2]], np.int32)
EDGE_CANDS = np.array([[0, 1, 2, 3, 4, 5, 0, 0]], np.int32)
EDGE_PROBS = np.array([[0, 0.25, 0.5, 0.3, 0.3, 0.125, 0, 0]], np.float32)


@pytest.mark.parametrize(
    "root_coin, slot_coins, thr, want_path, want_rejected",
    [
        (0.25, (0.9, 0.9), (1.0, 1.0), [0, 1], [3, 4]),  # coin == running sum is accepted (<=)
        (0.7, (0.0, 0.1), (1.0, 1.0), [0, 2, 5], []),  # second child, then its only child
        (0.99, (0.0, 0.0), (1.0, 1.0), [0], [1, 2]),  # all rejected at the root
        (0.99, (0.0, 0.0), (0.5, 1.0), [0, 2, 5], []),  # threshold_single lets p=.5 through
        (0.99, (0.9, 0.9), (1.0, 0.5), [0, 2], [5]),  # threshold_acc: .75/.5 >= .99
    ],
)
def test_edge_cases(root_coin, slot_coins, thr, want_path, want_rejected):
    coins = np.zeros((1, 8), np.float32)
    coins[0, 0], coins[0, 1], coins[0, 2] = root_coin, *slot_coins
    _check(EDGE_PARENTS, EDGE_CANDS, EDGE_PROBS, coins, 3, thr)
    args = [jnp.asarray(x) for x in (EDGE_CANDS, EDGE_PARENTS, EDGE_PROBS, coins)]
    got = _run(*args, jnp.asarray(thr, jnp.float32), max_depth=3, impl="kernel")
    np.testing.assert_array_equal(got.accept_index[0, : len(want_path)], want_path)
    np.testing.assert_array_equal(np.flatnonzero(got.rejected[0]), want_rejected)


def test_depth_cap_leaves_nothing_rejected():
    coins = np.zeros((1, 8), np.float32)  # accept the first child every time
    got = _run(*[jnp.asarray(x) for x in (EDGE_CANDS, EDGE_PARENTS, EDGE_PROBS, coins)],
               jnp.asarray((1.0, 1.0)), max_depth=1, impl="kernel")
    np.testing.assert_array_equal(got.accept_index, [[0, 1]])
    assert not got.rejected.any()  # slot 1's children were never tried


def test_sample_bonus_inverse_cdf_and_rejection():
    p = jnp.array([[0.1, 0.2, 0.3, 0.4]] * 4)
    no_rej = jnp.zeros((4, 4), bool)
    u = jnp.array([0.0, 0.15, 0.35, 0.999])  # away from CDF steps: no rounding ties
    np.testing.assert_array_equal(sample_bonus(p, no_rej, u), [0, 1, 2, 3])
    rej = jnp.array([[True, False, False, False]] * 4)
    # Residual [0, .2, .3, .4]/.9: u=.5 -> .45 lies in (.2, .5] -> token 2.
    np.testing.assert_array_equal(sample_bonus(p, rej, jnp.array([0.0, 0.2, 0.5, 0.9])), [1, 1, 2, 3])
    # Everything rejected cannot happen when exact; fall back to p itself.
    np.testing.assert_array_equal(sample_bonus(p, jnp.ones((4, 4), bool), u), [0, 1, 2, 3])


def test_rejected_token_mask_scatters_tokens():
    cands = jnp.array([[0, 3, 1, 3, 9]])
    rej = jnp.array([[False, True, False, True, False]])
    np.testing.assert_array_equal(rejected_token_mask(cands, rej, 5), [[False, False, False, True, False]])


# ---- Losslessness -------------------------------------------------------------------
# Depth-2, branching-2 tree over a 5-token vocabulary. The "true" model: the first
# token ~ P0, the second ~ Q[first]. The tree's slot distributions are the model's
# conditionals at those prefixes. Speculative sampling plus (when only one token is
# emitted) one ordinary sampling step for the second token must give P0(x) Q[x](y).

V = 5
LL_PARENTS = np.array([-1, 0, 0, 1, 1, 2, 2], np.int32)
LL_CANDS = np.array([0, 1, 3, 2, 0, 4, 1], np.int32)  # drafts: 1, 3 at depth 1
N_SAMPLES = 40_000


def _lossless_model():
    rng = np.random.default_rng(123)
    p0 = np.array([0.1, 0.3, 0.15, 0.25, 0.2])
    q = rng.dirichlet(np.full(V, 3.0), size=V)  # q[x] = distribution after first token x
    r = rng.dirichlet(np.full(V, 3.0), size=len(LL_PARENTS))  # any valid depth-2 dists
    slot_probs = np.stack([p0, q[LL_CANDS[1]], q[LL_CANDS[2]], *r[3:]]).astype(np.float32)
    return p0, q, slot_probs


@partial(jax.jit, static_argnames=("threshold_single", "threshold_acc"))
def _sample_pairs(key, slot_probs, q, *, threshold_single, threshold_acc):
    """N_SAMPLES (first, second) token pairs from one speculative step (+ one plain step)."""
    k_coin, k_bonus, k_next = jax.random.split(key, 3)
    n, t = N_SAMPLES, len(LL_PARENTS)
    res = tree_speculative_sample(
        jnp.broadcast_to(LL_CANDS, (n, t)),
        jnp.broadcast_to(LL_PARENTS, (n, t)),
        jnp.broadcast_to(slot_probs, (n, t, V)),
        jax.random.uniform(k_coin, (n, t)),
        jax.random.uniform(k_bonus, (n,)),
        max_depth=2,
        threshold_single=threshold_single,
        threshold_acc=threshold_acc,
        impl="reference",
    )
    first = res.out_tokens[:, 0]
    plain_second = sample_bonus(q[first], jnp.zeros((n, V), bool), jax.random.uniform(k_next, (n,)))
    second = jnp.where(res.accept_length >= 2, res.out_tokens[:, 1], plain_second)
    return first, second, res.accept_length


def _p_values(threshold_single=1.0, threshold_acc=1.0):
    p0, q, slot_probs = _lossless_model()
    first, second, acc_len = _sample_pairs(
        jax.random.PRNGKey(0), jnp.asarray(slot_probs), jnp.asarray(q, jnp.float32),
        threshold_single=threshold_single, threshold_acc=threshold_acc,
    )
    first, second = np.asarray(first), np.asarray(second)
    obs_first = np.bincount(first, minlength=V)
    obs_pair = np.bincount(first * V + second, minlength=V * V)
    p_first = stats.chisquare(obs_first, p0 * N_SAMPLES).pvalue
    p_pair = stats.chisquare(obs_pair, (p0[:, None] * q).ravel() * N_SAMPLES).pvalue
    return p_first, p_pair, np.bincount(np.asarray(acc_len), minlength=4)


def test_exact_sampling_is_lossless():
    p_first, p_pair, lengths = _p_values()
    assert lengths[1:].min() > 1000, lengths  # rejection at the root, at depth 2, and full paths
    assert p_first > 1e-3 and p_pair > 1e-3, (p_first, p_pair)


@pytest.mark.parametrize("thresholds", [dict(threshold_acc=0.5), dict(threshold_single=0.2)])
def test_relaxed_thresholds_are_detected_as_biased(thresholds):
    p_first, p_pair, _ = _p_values(**thresholds)
    assert min(p_first, p_pair) < 1e-6, (p_first, p_pair)


def test_lowers_for_cuda_with_mosaic_gpu(mgpu_semantics):
    args = (jnp.zeros((B, T), jnp.int32), jnp.full((B, T), -2, jnp.int32),
            jnp.zeros((B, T), jnp.float32), jnp.zeros((B, T), jnp.float32))
    assert_lowers_to_mosaic_gpu(partial(verify_sampling, max_depth=D, impl="kernel", interpret=False), *args)
