"""Tree attention: Mosaic GPU kernel (interpreted) == jnp reference == a naive numpy loop."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.testing import assert_lowers_to_mosaic_gpu, random_trees
from pallas_kernels.tree import tree_ancestor_mask
from pallas_kernels.tree_attention import tree_attention, tree_attention_kernel

BF16_ATOL = 2e-2  # the kernel rounds probabilities to bf16 for P@V, and the output is bf16


def _inputs(seed, b, t, hq, hkv, d, s, dtype=jnp.bfloat16):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (b, t, hq, d)).astype(dtype)
    k = jax.random.normal(kk, (b, s, hkv, d)).astype(dtype)
    v = jax.random.normal(kv, (b, s, hkv, d)).astype(dtype)
    return q, k, v


def _naive(q, k, v, seq_lens, tree_mask, scale):
    """One query and head at a time, straight from the definition."""
    q, k, v = (np.asarray(x, np.float32) for x in (q, k, v))
    b, t, hq, _ = q.shape
    g = hq // k.shape[2]
    out = np.zeros(q.shape, np.float32)
    for bi in range(b):
        n = int(seq_lens[bi])
        for ti in range(t):
            keys = list(range(n)) + [n + j for j in range(t) if tree_mask[bi, ti, j]]
            if not keys:
                continue
            for h in range(hq):
                s = k[bi, keys, h // g] @ q[bi, ti, h] * scale
                p = np.exp(s - s.max())
                out[bi, ti, h] = (p / p.sum()) @ v[bi, keys, h // g]
    return out


@partial(jax.jit, static_argnames=("scale", "block_k", "impl"))
def _run(q, k, v, seq_lens, tree_mask, *, scale, block_k=64, impl):
    return tree_attention(q, k, v, seq_lens, tree_mask, scale=scale, block_k=block_k, impl=impl)


def _check(q, k, v, seq_lens, tree_mask, block_k=64):
    scale = q.shape[-1] ** -0.5
    args = (q, k, v, jnp.asarray(seq_lens, jnp.int32), jnp.asarray(tree_mask))
    ref = _run(*args, scale=scale, block_k=block_k, impl="reference")
    got = _run(*args, scale=scale, block_k=block_k, impl="kernel")
    assert got.shape == q.shape and got.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(ref, np.float32), _naive(*args, scale), atol=BF16_ATOL)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=BF16_ATOL)


def _tree_masks(rng, b, t, depth=4):
    parents, _ = random_trees(rng, b, t, depth, vocab=2)
    return np.asarray(tree_ancestor_mask(jnp.asarray(parents)))


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), arbitrary_mask=st.booleans())
def test_kernel_matches_reference_random_trees(seed, arbitrary_mask):
    b, t, hq, hkv, d, s = 2, 8, 4, 2, 64, 128  # two key blocks: exercises the online softmax
    rng = np.random.default_rng(seed)
    seq_lens = rng.integers(0, s - t + 1, b)
    mask = rng.random((b, t, t)) < 0.5 if arbitrary_mask else _tree_masks(rng, b, t)
    _check(*_inputs(seed, b, t, hq, hkv, d, s), seq_lens, mask)


@pytest.mark.parametrize(
    "b, t, hq, hkv, d, s, block_k, seq_lens",
    [
        (1, 16, 8, 1, 64, 128, 64, [50]),  # G=8: 128 query rows -> two row tiles
        (1, 40, 2, 2, 64, 128, 64, [70]),  # T > 32: two mask words; tree spans two blocks
        (2, 4, 2, 1, 64, 128, 64, [0, 124]),  # tree only; tree ends at the cache end
        (1, 8, 2, 1, 128, 256, 128, [130]),  # head dim 128, key block 128
    ],
)
def test_kernel_matches_reference_shapes(b, t, hq, hkv, d, s, block_k, seq_lens):
    rng = np.random.default_rng(t)
    _check(*_inputs(t, b, t, hq, hkv, d, s), np.array(seq_lens), _tree_masks(rng, b, t), block_k)


def test_query_that_sees_nothing_gets_zeros():
    q, k, v = _inputs(0, 1, 4, 2, 1, 64, 64)
    mask = np.eye(4, dtype=bool)[None]
    mask[0, 2] = False  # with seq_len 0, query 2 sees no key at all
    _check(q, k, v, np.array([0]), mask)
    out = _run(q, k, v, jnp.array([0]), jnp.asarray(mask), scale=0.125, impl="kernel")
    assert not np.asarray(out[0, 2], np.float32).any()


def test_no_races_in_the_double_buffered_pipeline():
    b, t, hq, hkv, d, s = 1, 4, 2, 1, 64, 192  # three key blocks: both slots get reused
    q, k, v = _inputs(3, b, t, hq, hkv, d, s)
    mask = jnp.asarray(_tree_masks(np.random.default_rng(0), b, t))
    args = (q, k, v, jnp.array([150], jnp.int32), mask)
    interp = plgpu.InterpretGPUParams(detect_races=True)
    got = jax.jit(partial(tree_attention_kernel, scale=0.125, interpret=interp))(*args)
    ref = tree_attention(*args, scale=0.125, impl="reference")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=BF16_ATOL)


def test_auto_on_cpu_and_unsupported_dtype():
    q, k, v = _inputs(0, 1, 4, 2, 1, 64, 64, dtype=jnp.float32)
    args = (q, k, v, jnp.array([10]), jnp.ones((1, 4, 4), bool))
    ref = tree_attention(*args, scale=0.125, impl="reference")
    np.testing.assert_array_equal(tree_attention(*args, scale=0.125), ref)  # auto = reference on CPU
    with pytest.raises(ValueError, match="bf16"):
        tree_attention(*args, scale=0.125, impl="kernel")


@pytest.mark.parametrize("d, block_k", [(64, 64), (128, 128)])
def test_lowers_for_cuda_with_mosaic_gpu(d, block_k, mgpu_semantics):
    q, k, v = _inputs(0, 2, 8, 4, 2, d, 256)
    args = (q, k, v, jnp.array([5, 100], jnp.int32), jnp.ones((2, 8, 8), bool))
    fn = partial(tree_attention, scale=d**-0.5, block_k=block_k, impl="kernel", interpret=False)
    assert_lowers_to_mosaic_gpu(fn, *args)
