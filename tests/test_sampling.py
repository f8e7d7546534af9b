"""``filter_logits`` (temperature, top-k, top-p) checked against an independent reference,
Hugging Face's ``TemperatureLogitsWarper`` / ``TopKLogitsWarper`` / ``TopPLogitsWarper``
applied in the order ``generate`` applies them, and against hand-computed cases.

Documented semantics (``eagle_jax.spec.sampling.filter_logits``):

* temperature first, then top-k, then top-p over the top-k survivors (renormalised);
* ``top_k == 0`` and ``top_p == 1`` mean "off" (``generate`` then adds no such warper);
* the kept set depends only on the values: a token tied with the last one kept is kept.
  For top-k this is what ``TopKLogitsWarper`` does (it removes ``scores < kth``). For
  top-p it differs: ``TopPLogitsWarper`` sorts and cuts at a position, so of tokens tied
  at the cut-off it keeps whichever its sort puts last; we keep them all. The tie tests
  below assert our behaviour and show where transformers' differs.
* at least one token always stays (transformers' ``min_tokens_to_keep=1``).
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from eagle_jax.spec.sampling import filter_logits, target_probs


def ours(logits, temperature, top_k, top_p) -> np.ndarray:
    """filter_logits on a batch whose rows may each have their own settings."""
    rows = len(logits)

    def per_row(v, dtype):
        return jnp.asarray(np.broadcast_to(np.asarray(v, dtype), (rows,)))

    out = filter_logits(
        jnp.asarray(logits, jnp.float32), per_row(temperature, np.float32), per_row(top_k, np.int32),
        per_row(top_p, np.float32),
    )
    return np.asarray(out)


def hf(logits_row, temperature, top_k, top_p) -> np.ndarray:
    """transformers' warpers on one row, as ``generate`` builds them (a warper only when
    its setting is not the neutral one)."""
    scores = torch.tensor(np.asarray(logits_row, np.float32))[None]
    ids = torch.zeros((1, 1), dtype=torch.long)
    if temperature > 0:
        scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return scores[0].numpy()


def kept(row) -> list[int]:
    return np.flatnonzero(np.isfinite(row)).tolist()


def assert_same_filter(got_row, want_row, what):
    assert kept(got_row) == kept(want_row), what
    finite = np.isfinite(want_row)
    np.testing.assert_allclose(got_row[finite], want_row[finite], rtol=1e-6, err_msg=str(what))


# ----------------------------------------------------------------------------------------
# against transformers on random logits
# ----------------------------------------------------------------------------------------

TOP_K = [0, 1, 2, 7, 50, 999, 1000, 5000]  # 0 = off; 1000 = the whole vocabulary; 5000 > V
TOP_P = [0.05, 0.3, 0.5, 0.8, 0.95, 0.999, 1.0]  # 1.0 = off
TEMPERATURES = [0.3, 1.0, 2.5]


@pytest.mark.parametrize("seed", range(3))
def test_matches_transformers_warpers_on_random_logits(seed):
    """Every (temperature, top-k, top-p) combination, as rows of one batch (so each row
    also sees the others' settings), against the warpers applied to that row alone."""
    rng = np.random.default_rng(seed)
    vocab = 1000
    combos = [(t, k, p) for t in TEMPERATURES for k in TOP_K for p in TOP_P]
    logits = (rng.standard_normal((len(combos), vocab)) * rng.uniform(0.5, 6.0, (len(combos), 1))).astype(np.float32)
    temp, top_k, top_p = (np.array(c) for c in zip(*combos))
    got = ours(logits, temp, top_k, top_p)
    sizes = set()
    for i, (t, k, p) in enumerate(combos):
        want = hf(logits[i], t, k, p)
        assert_same_filter(got[i], want, (seed, t, k, p))
        sizes.add(len(kept(want)))
    # The cases are not degenerate: from a single token to the whole vocabulary.
    assert 1 in sizes and vocab in sizes and len(sizes) > 20


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (40, 1.0), (40, 0.9), (3, 0.5)])
def test_matches_transformers_on_peaked_rows(top_k, top_p):
    """Peaked distributions (most of the mass on a few tokens), where the top-p cut-off
    falls within the first few tokens."""
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((16, 300)).astype(np.float32)
    logits[:, :5] += np.linspace(12, 4, 5, dtype=np.float32)
    got = ours(logits, 1.0, top_k, top_p)
    for i in range(len(logits)):
        assert_same_filter(got[i], hf(logits[i], 1.0, top_k, top_p), (i, top_k, top_p))


# ----------------------------------------------------------------------------------------
# hand-computed cases
# ----------------------------------------------------------------------------------------

PROBS = [0.5, 0.3, 0.15, 0.05]  # ranks 0..3; placed at shuffled indices below
ORDER = [2, 0, 3, 1]  # PROBS[r] sits at index ORDER[r]


def _shuffled_log_probs() -> np.ndarray:
    x = np.zeros(4, np.float32)
    x[ORDER] = np.log(PROBS)
    return x


@pytest.mark.parametrize(
    "top_p, n_kept",
    # mass before each rank: 0, 0.5, 0.8, 0.95; a token stays while that is < top_p
    [(0.01, 1), (0.4, 1), (0.6, 2), (0.79, 2), (0.9, 3), (0.99, 4), (1.0, 4)],
)
def test_top_p_by_hand(top_p, n_kept):
    got = ours(_shuffled_log_probs()[None], 1.0, 0, top_p)[0]
    assert kept(got) == sorted(ORDER[:n_kept])


@pytest.mark.parametrize("top_k, n_kept", [(1, 1), (2, 2), (3, 3), (4, 4), (9, 4), (0, 4)])
def test_top_k_by_hand(top_k, n_kept):
    got = ours(_shuffled_log_probs()[None], 1.0, top_k, 1.0)[0]
    assert kept(got) == sorted(ORDER[:n_kept])


def test_top_p_applies_to_the_top_k_survivors_renormalised():
    """top_k=2 leaves (0.5, 0.3) -> renormalised (0.625, 0.375): top_p=0.6 then keeps one
    token; on the unfiltered distribution top_p=0.6 keeps two (0.5 < 0.6)."""
    x = _shuffled_log_probs()[None]
    assert kept(ours(x, 1.0, 2, 0.6)[0]) == [ORDER[0]]
    assert kept(ours(x, 1.0, 0, 0.6)[0]) == sorted(ORDER[:2])
    assert kept(hf(x[0], 1.0, 2, 0.6)) == [ORDER[0]]


def test_temperature_comes_before_top_p():
    """logits (2, 1, 0): at T=1 probabilities (0.665, 0.245, 0.090), at T=4 (0.419, 0.326,
    0.254). top_p=0.6 keeps 1 token at T=1 (0.665 >= 0.6) and 2 at T=4 (0.419 < 0.6 <= 0.745)."""
    x = np.array([[2.0, 1.0, 0.0]], np.float32)
    assert kept(ours(x, 1.0, 0, 0.6)[0]) == [0]
    assert kept(ours(x, 4.0, 0, 0.6)[0]) == [0, 1]
    np.testing.assert_allclose(ours(x, 4.0, 0, 1.0)[0], [0.5, 0.25, 0.0])
    # The softmax of what is kept is the distribution sampled from.
    probs = np.asarray(target_probs(jnp.asarray(x), jnp.array([4.0]), jnp.array([0]), jnp.array([0.6])))[0]
    e = np.exp([0.5, 0.25])
    np.testing.assert_allclose(probs, [*(e / e.sum()), 0.0], rtol=1e-6)


def test_top_k_ties_keep_every_tied_token_like_transformers():
    """top_k=2 on (1, 3, 3, 3, 0): the 2nd largest value is 3 and three tokens hold it;
    all three stay (ours and transformers')."""
    x = np.array([[1.0, 3.0, 3.0, 3.0, 0.0]], np.float32)
    assert kept(ours(x, 1.0, 2, 1.0)[0]) == [1, 2, 3]
    assert kept(hf(x[0], 1.0, 2, 1.0)) == [1, 2, 3]
    # top_k=4 cuts between distinct values: exactly four tokens.
    assert kept(ours(x, 1.0, 4, 1.0)[0]) == [0, 1, 2, 3]


def test_top_p_ties_keep_every_tied_token_unlike_transformers():
    """Probabilities (0.5, 0.25, 0.25), top_p=0.6: the second token is needed (mass before
    it 0.5 < 0.6), the third ties with it, so we keep all three. transformers cuts at a
    sort position and keeps only one of the two tied tokens."""
    x = np.log(np.array([[0.5, 0.25, 0.25]], np.float32))
    assert kept(ours(x, 1.0, 0, 0.6)[0]) == [0, 1, 2]
    theirs = kept(hf(x[0], 1.0, 0, 0.6))
    assert len(theirs) == 2 and theirs[0] == 0 and theirs[1] in (1, 2)
    # Uniform over 4 with top_p=0.5: two tokens reach the mass, all four are tied.
    u = np.zeros((1, 4), np.float32)
    assert kept(ours(u, 1.0, 0, 0.5)[0]) == [0, 1, 2, 3]
    assert len(kept(hf(u[0], 1.0, 0, 0.5))) == 2


def test_at_least_one_token_stays():
    x = np.array([[0.0, 5.0, 1.0]], np.float32)
    assert kept(ours(x, 1.0, 0, 1e-6)[0]) == [1]
    assert kept(ours(x, 1.0, 1, 1e-6)[0]) == [1]
    assert kept(hf(x[0], 1.0, 0, 1e-6)) == [1]


def test_greedy_rows_are_not_scaled_and_keep_their_argmax():
    x = np.array([[0.5, 2.0, -1.0, 1.5]], np.float32)
    got = ours(x, 0.0, 0, 1.0)[0]
    np.testing.assert_array_equal(got, x[0])
    got = ours(x, 0.0, 2, 0.5)[0]
    assert np.argmax(got) == 1 and got[1] == 2.0


def test_unfiltered_row_is_untouched_whatever_the_other_rows_ask():
    """A row with top_k=0, top_p=1 keeps every token even when another row of the batch
    turns the filter on, including tokens whose probability is below float32's resolution
    of 1 (the cumulative mass reaches 1.0 before them). Before the fix, this row lost its
    four tail tokens when batched with a top-k row."""
    peaked = np.array([0.0, -20.0, -20.0, -20.0, -21.0], np.float32)
    other = np.array([0.0, 1.0, 2.0, 3.0, 4.0], np.float32)
    alone = ours(peaked[None], 1.0, 0, 1.0)[0]
    batched = ours(np.stack([peaked, other]), np.array([1.0, 1.0]), np.array([0, 2]), np.array([1.0, 0.7]))
    np.testing.assert_array_equal(alone, peaked)
    np.testing.assert_array_equal(batched[0], peaked)
    assert kept(batched[1]) == [4]  # 3 and 4 survive top-k; 4 holds 0.73 of their mass >= top_p=0.7
    # top_k only with top_p=1 on the peaked row: exactly the top-k cut, no top-p cut.
    only_k = ours(np.stack([peaked, other]), 1.0, np.array([3, 0]), np.array([1.0, 0.5]))[0]
    assert kept(only_k) == [0, 1, 2, 3]
    assert math.isclose(float(only_k[0]), 0.0)
