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
from pallas_kernels.tree_attention import select_tree_attention_path, tree_attention, tree_attention_kernel

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


def test_kernel_impl_rejects_unsupported_dtype():
    q, k, v = _inputs(0, 1, 4, 2, 1, 64, 64, dtype=jnp.float32)
    args = (q, k, v, jnp.array([10]), jnp.ones((1, 4, 4), bool))
    with pytest.raises(ValueError, match="bf16"):
        tree_attention(*args, scale=0.125, impl="kernel")


# The path selection, as a pure function: SmolLM2-135M's verify shapes (9 query heads, 3 kv
# heads, head dim 64) with batch 4, 8 tree tokens, bf16, on a Hopper GPU.
SMOL_Q, BF16 = (4, 8, 9, 64), jnp.bfloat16


def _smol_kv(s_len: int, hkv: int = 3, d: int = 64) -> tuple[int, ...]:
    return (4, s_len, hkv, d)


@pytest.mark.parametrize("s_len, block_k", [(64, 64), (320, 64), (2048, 64), (256, 128), (384, 128)])
def test_auto_takes_the_kernel_on_hopper_when_shapes_fit(s_len, block_k):
    path, reason = select_tree_attention_path(
        "auto", "gpu", SMOL_Q, _smol_kv(s_len), BF16, block_k=block_k, compute_capability="9.0"
    )
    assert (path, reason) == ("kernel", "GPU and shapes the kernel supports")
    # Unknown compute capability: a GPU is taken to be able to run it.
    assert select_tree_attention_path("auto", "gpu", SMOL_Q, _smol_kv(s_len), BF16, block_k=block_k)[0] == "kernel"


@pytest.mark.parametrize(
    "q_shape, kv_shape, dtype, kv_dtype, block_k, cc, reason",
    [
        # A prefix bucket plus the tree's slots (256 + 8): not a multiple of the key block.
        (SMOL_Q, _smol_kv(264), BF16, None, 64, "9.0", "cache length 264 must be a multiple of block_k=64"),
        (SMOL_Q, _smol_kv(320), BF16, None, 128, "9.0", "cache length 320 must be a multiple of block_k=128"),
        (SMOL_Q, _smol_kv(320), jnp.float32, None, 64, "9.0", "dtype float32: the WGMMA kernel takes bf16/f16"),
        (SMOL_Q, _smol_kv(320), BF16, jnp.float16, 64, "9.0", "must share a dtype"),
        ((4, 8, 9, 80), _smol_kv(320, d=80), BF16, None, 64, "9.0", "head dim 80 must be a multiple of 64"),
        ((4, 8, 6, 64), _smol_kv(320, hkv=4), BF16, None, 64, "9.0", "Hq=6 must be a multiple of Hkv=4"),
        (SMOL_Q, _smol_kv(320), BF16, None, 32, "9.0", "block_k=32 must be 64 or 128"),
        (SMOL_Q, _smol_kv(320), BF16, None, 64, "8.0", "compute capability 8.0: the kernel's WGMMA needs sm_90"),
        (SMOL_Q, _smol_kv(320), BF16, None, 64, "10.0", "compute capability 10.0"),
    ],
)
def test_auto_falls_back_on_gpu_and_says_why(q_shape, kv_shape, dtype, kv_dtype, block_k, cc, reason):
    path, why = select_tree_attention_path(
        "auto", "gpu", q_shape, kv_shape, dtype, kv_dtype, block_k=block_k, compute_capability=cc
    )
    assert path == "reference"
    assert reason in why, why


@pytest.mark.parametrize("backend", ["cpu", "tpu"])
def test_auto_off_gpu_is_the_reference_even_for_kernel_shapes(backend):
    path, why = select_tree_attention_path("auto", backend, SMOL_Q, _smol_kv(320), BF16)
    assert path == "reference" and f"backend {backend!r}" in why


def test_explicit_impls():
    assert select_tree_attention_path("reference", "gpu", SMOL_Q, _smol_kv(320), BF16)[0] == "reference"
    assert select_tree_attention_path("kernel", "gpu", SMOL_Q, _smol_kv(320), BF16)[0] == "kernel"
    path, why = select_tree_attention_path("kernel", "cpu", SMOL_Q, _smol_kv(320), BF16)
    assert path == "kernel" and "interpreter" in why
    # "kernel" does not fall back: unsupported shapes are an error, whatever the backend.
    with pytest.raises(ValueError, match="cache length 264"):
        select_tree_attention_path("kernel", "gpu", SMOL_Q, _smol_kv(264), BF16)
    with pytest.raises(ValueError, match="impl='fast'"):
        select_tree_attention_path("fast", "gpu", SMOL_Q, _smol_kv(320), BF16)


def test_tree_attention_runs_the_selected_path(monkeypatch):
    """tree_attention asks select_tree_attention_path with its backend, shapes and dtypes,
    and runs what it returns."""
    from pallas_kernels import tree_attention as ta

    q, k, v = _inputs(0, 1, 4, 2, 1, 64, 64)
    args = (q, k, v, jnp.array([10], jnp.int32), jnp.ones((1, 4, 4), bool))
    calls, forced = [], {}
    real = ta.select_tree_attention_path

    def spy(*a, **kw):
        calls.append((a, kw))
        return forced.get("path") or real(*a, **kw)

    monkeypatch.setattr(ta, "select_tree_attention_path", spy)
    ref = ta.tree_attention(*args, scale=0.125, impl="reference")
    auto = ta.tree_attention(*args, scale=0.125)  # on this CPU: the reference
    np.testing.assert_array_equal(auto, ref)
    assert calls[-1] == (
        ("auto", jax.default_backend(), q.shape, k.shape, q.dtype, k.dtype), {"block_k": 64, "compute_capability": ta._gpu_compute_capability()},
    )
    kernel_calls = []
    monkeypatch.setattr(ta, "tree_attention_kernel", lambda *a, **kw: kernel_calls.append(kw) or "kernel-output")
    forced["path"] = ("kernel", "forced by the test")
    assert ta.tree_attention(*args, scale=0.125) == "kernel-output"
    assert len(kernel_calls) == 1 and kernel_calls[0]["block_k"] == 64


@pytest.mark.parametrize("d, block_k", [(64, 64), (128, 128)])
def test_lowers_for_cuda_with_mosaic_gpu(d, block_k, mgpu_semantics):
    q, k, v = _inputs(0, 2, 8, 4, 2, d, 256)
    args = (q, k, v, jnp.array([5, 100], jnp.int32), jnp.ones((2, 8, 8), bool))
    fn = partial(tree_attention, scale=d**-0.5, block_k=block_k, impl="kernel", interpret=False)
    assert_lowers_to_mosaic_gpu(fn, *args)


def test_every_layer_calls_one_lowered_kernel(mgpu_semantics):
    """A verify forward calls the kernel once per layer: lowered for CUDA, the calls share
    one Mosaic GPU module (each inlined copy costs the lowering passes again; an 8B
    model's verify step compiled in 30-46 s on the H200 that way)."""
    q, k, v = _inputs(0, 1, 8, 4, 2, 64, 128)
    lens, mask = jnp.array([5], jnp.int32), jnp.ones((1, 8, 8), bool)

    def layers(q, k, v):
        for _ in range(4):
            q = tree_attention(q, k, v, lens, mask, scale=0.125, impl="kernel", interpret=False)
        return q

    text = jax.jit(layers).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
    assert text.count("call @") >= 4 + 1  # four calls of the kernel's function
