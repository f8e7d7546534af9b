"""The prefix-attention CPU kernel (eagle_jax/kernels/cpu_attention.cc through the XLA FFI).

It must agree with XLA's blocked loop (``prefix_attention(impl="xla")``) on every mask
the steps use, give a query the same bits whatever else shares the call (other queries,
other rows), and be what an inference step table's model runs -- and only that."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.kernels import cpu_matmul
from eagle_jax.errors import ConfigError
from eagle_jax.models.llama import PrefixMask, prefix_attention


def _arrays(rng, b, t, kv, g, d, s):
    def mk(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32))

    return mk(b, t, kv * g, d), mk(b, t, kv, d), mk(b, t, kv, d), mk(b, s, kv, d), mk(b, s, kv, d)


@pytest.mark.parametrize(
    "b,t,kv,g,d,s",
    [
        (1, 1, 3, 3, 64, 50),     # batch-1 decode
        (64, 1, 3, 3, 64, 386),   # a full decode batch
        (2, 4, 3, 3, 64, 1100),   # a verify over prefixes of up to four 256-slot blocks
        (3, 4, 3, 3, 64, 300),    # a chain verify
        (2, 8, 2, 4, 128, 200),   # head dim 128 (Llama 3)
        (5, 16, 1, 4, 16, 70),    # T * G = 64, the kernel's largest; head dim 16
        (2, 3, 2, 1, 32, 9),      # one head per kv head; prefixes shorter than a vector
        # The tiled path (prefill chunks): tiles of 64 queries, a last partial tile, and
        # prefixes that end inside a 64-slot chunk, on a long cache.
        (1, 128, 3, 3, 64, 1200),  # SmolLM2's 128-token chunk
        (2, 64, 2, 4, 128, 300),   # head dim 128; 256 queries a head
        (3, 64, 1, 3, 32, 211),    # 192 queries a head; head dim 32 (register blocks of 1 and 4 vectors)
        (2, 96, 1, 1, 16, 150),    # one query head: 96 queries, one full tile and a partial one
    ],
)
def test_matches_the_xla_loop(b, t, kv, g, d, s):
    rng = np.random.default_rng(b * 1000 + t)
    q, kn, vn, kc, vc = _arrays(rng, b, t, kv, g, d, s)
    prefix = rng.integers(0, s - t + 1, b).astype(np.int32)
    prefix[0] = 0  # no prefix: the new tokens alone
    prefix[-1] = s - t  # the whole cache below the new tokens
    # A tree's ancestor mask (any subset, every query sees itself).
    block = jnp.asarray(rng.random((b, t, t)) < 0.5) | jnp.eye(t, dtype=bool)[None]
    mask = PrefixMask(jnp.asarray(prefix), block)
    scale = 1 / np.sqrt(d)
    # The plan routes only the decode path's widths here (a wide tree's verify keeps XLA's
    # loop); the kernel computes the wider ones right all the same (its tiled path).
    assert cpu_matmul.prefix_attention_supported(t, g, d, jnp.float32) == (t * g <= cpu_matmul.ATTENTION_MAX_QUERIES)
    want = jax.jit(lambda *a: prefix_attention(*a, scale, impl="xla"))(q, kn, vn, kc, vc, mask)
    got = jax.jit(lambda *a: prefix_attention(*a, scale, impl="cpu"))(q, kn, vn, kc, vc, mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(
    "b,t,kv,g,d,s",
    [
        (1, 128, 3, 3, 64, 1200),  # SmolLM2's 128-token chunk over a long prefix
        (3, 64, 1, 1, 16, 100),    # 64 queries a head: one tile (the causal kernel is always tiled)
        (2, 96, 2, 3, 32, 200),    # 288 queries a head: tiles that straddle two query heads
        (2, 64, 2, 4, 128, 300),   # head dim 128
    ],
)
def test_a_prefill_chunks_whole_attention_matches_the_xla_loop(b, t, kv, g, d, s):
    """``PrefixMask.causal`` forwards of a prefill chunk's width on the kernel attend over
    the prefix and the chunk's own keys (already written to the cache) in one call;
    prefixes of 0, inside a 128-slot block and up to the cache end."""
    from eagle_jax.models.llama import write_rows

    rng = np.random.default_rng(b * 7 + t)
    q, kn, vn, kc, vc = _arrays(rng, b, t, kv, g, d, s)
    prefix = rng.integers(0, s - t + 1, b).astype(np.int32)
    prefix[0] = 0
    prefix[-1] = s - t
    slots = jnp.asarray(prefix)[:, None] + jnp.arange(t)[None]
    kc, vc = write_rows(kc, slots, kn), write_rows(vc, slots, vn)
    mask = PrefixMask.causal(jnp.asarray(prefix), t)
    scale = 1 / np.sqrt(d)
    got_fn = jax.jit(lambda *a: prefix_attention(*a, scale, impl="cpu"))
    text = got_fn.lower(q, kn, vn, kc, vc, mask).as_text()
    assert cpu_matmul.PREFILL_ATTENTION_TARGET in text and cpu_matmul.ATTENTION_TARGET + '"' not in text
    want = jax.jit(lambda *a: prefix_attention(*a, scale, impl="xla"))(q, kn, vn, kc, vc, mask)
    np.testing.assert_allclose(np.asarray(got_fn(q, kn, vn, kc, vc, mask)), np.asarray(want), rtol=1e-5, atol=2e-6)


def test_a_prefill_chunk_past_the_cache_end_attends_over_what_was_written():
    """A chunk's padding positions past the cache are dropped, never written: the kernel
    clamps each query's slots to the cache, and every position inside it is exact."""
    from eagle_jax.models.llama import write_rows

    rng = np.random.default_rng(5)
    b, t, kv, g, d, s = 1, 64, 2, 2, 32, 150
    q, kn, vn, kc, vc = _arrays(rng, b, t, kv, g, d, s)
    prefix = np.array([s - t + 20], np.int32)  # the last 20 positions fall past the cache
    slots = jnp.asarray(prefix)[:, None] + jnp.arange(t)[None]
    kc, vc = write_rows(kc, slots, kn), write_rows(vc, slots, vn)
    scale = 1 / np.sqrt(d)
    got = np.asarray(jax.jit(lambda *a: prefix_attention(*a, scale, impl="cpu"))(
        q, kn, vn, kc, vc, PrefixMask.causal(jnp.asarray(prefix), t)))
    assert np.all(np.isfinite(got))
    want = np.asarray(jax.jit(lambda *a: prefix_attention(*a, scale, impl="xla"))(
        q, kn, vn, kc, vc, PrefixMask.causal(jnp.asarray(prefix), t)))
    inside = t - 20
    np.testing.assert_allclose(got[:, :inside], want[:, :inside], rtol=1e-5, atol=2e-6)


def test_state_of_a_row_without_prefix():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 1, 1, 2, 16), dtype=np.float32))
    kc = jnp.asarray(rng.standard_normal((2, 8, 1, 16), dtype=np.float32))
    m, l, acc = cpu_matmul.prefix_attention_state(q, kc, kc, jnp.asarray([0, 8], jnp.int32))
    assert m.shape == l.shape == (2, 1, 2, 1) and acc.shape == (2, 1, 2, 1, 16)
    assert np.all(np.isneginf(np.asarray(m[0]))) and np.all(np.asarray(l[0]) == 0) and np.all(np.asarray(acc[0]) == 0)
    # Row 1 sees all 8 slots: the state is the softmax's, computed here in float64.
    qs, ks = np.asarray(q[1, 0, 0], np.float64), np.asarray(kc[1, :, 0], np.float64)
    sc = qs @ ks.T  # [G, S]
    np.testing.assert_allclose(np.asarray(m[1, 0, :, 0]), sc.max(-1), rtol=1e-6)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(l[1, 0, :, 0]), p.sum(-1), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(acc[1, 0, :, 0]), p @ ks, rtol=1e-5, atol=1e-5)


def test_a_query_gets_the_same_bits_whatever_shares_the_call():
    """A plain step's query (alone, T=1) and the same query inside a verify call (T=8, a
    batch of 7) get identical prefix states: greedy speculation relies on it. The
    prefixes cross the decode path's 256-slot blocks (one block, a block and a slot,
    four blocks), whose partial states merge the same whatever shares the call."""
    rng = np.random.default_rng(1)
    b, t, kv, g, d, s = 7, 8, 3, 3, 64, 1000
    q = jnp.asarray(rng.standard_normal((b, t, kv, g, d), dtype=np.float32))
    kc = jnp.asarray(rng.standard_normal((b, s, kv, d), dtype=np.float32))
    vc = jnp.asarray(rng.standard_normal((b, s, kv, d), dtype=np.float32))
    lens = jnp.asarray([0, 77, 150, 256, 257, 300, 1000], jnp.int32)
    f = jax.jit(cpu_matmul.prefix_attention_state)
    m, l, acc = (np.asarray(x) for x in f(q, kc, vc, lens))
    for row in (1, 3, 4, 6):
        for tq in (0, 5):
            m1, l1, a1 = (np.asarray(x) for x in f(q[row:row + 1, tq:tq + 1], kc[row:row + 1], vc[row:row + 1], lens[row:row + 1]))
            np.testing.assert_array_equal(m1[0, :, :, 0], m[row, :, :, tq])
            np.testing.assert_array_equal(l1[0, :, :, 0], l[row, :, :, tq])
            np.testing.assert_array_equal(a1[0, :, :, 0], acc[row, :, :, tq])


def test_a_decode_query_gets_the_same_bits_whether_its_heads_share_a_unit():
    """With rows enough for the threads (a batch of 64 here, for up to 32 threads), a
    decode-path unit takes all of a row's kv heads, reading each slot's keys and values
    for them together; a lone row runs a unit a head. A query's bits are the same either
    way, across the 256-slot blocks, for plain (T=1) and verify (T=8) widths."""
    rng = np.random.default_rng(2)
    s, kv, g, d = 600, 3, 3, 64
    for t in (1, 8):
        b = 64
        q = jnp.asarray(rng.standard_normal((b, t, kv, g, d), dtype=np.float32))
        kc = jnp.asarray(rng.standard_normal((b, s, kv, d), dtype=np.float32))
        vc = jnp.asarray(rng.standard_normal((b, s, kv, d), dtype=np.float32))
        lens = jnp.asarray(rng.integers(0, s + 1, b), jnp.int32).at[:4].set(jnp.asarray([1, 256, 257, 600]))
        f = jax.jit(cpu_matmul.prefix_attention_state)
        m, l, acc = (np.asarray(x) for x in f(q, kc, vc, lens))
        for row in (0, 1, 2, 3, 40):
            m1, l1, a1 = (np.asarray(x) for x in f(q[row:row + 1], kc[row:row + 1], vc[row:row + 1], lens[row:row + 1]))
            np.testing.assert_array_equal(m1[0], m[row])
            np.testing.assert_array_equal(l1[0], l[row])
            np.testing.assert_array_equal(a1[0], acc[row])


def test_a_prefill_query_gets_the_same_bits_whatever_shares_its_tile():
    """On the tiled path a query's state depends on its own vector and its row's prefix,
    not on the queries beside it in a register block or tile, nor on other rows: the
    same chunk's query in a batch of 3 and alone (its row only) agree bit for bit, and
    so do the kernel's own outputs for one row whatever the other rows' prefixes."""
    rng = np.random.default_rng(3)
    b, t, kv, g, d, s = 3, 64, 3, 3, 64, 400
    q = jnp.asarray(rng.standard_normal((b, t, kv, g, d), dtype=np.float32))
    kc = jnp.asarray(rng.standard_normal((b, s, kv, d), dtype=np.float32))
    vc = jnp.asarray(rng.standard_normal((b, s, kv, d), dtype=np.float32))
    f = jax.jit(cpu_matmul.prefix_attention_state)
    full = [np.asarray(x) for x in f(q, kc, vc, jnp.asarray([10, 333, 77], jnp.int32))]
    other = [np.asarray(x) for x in f(q, kc, vc, jnp.asarray([0, 333, 400], jnp.int32))]
    alone = [np.asarray(x) for x in f(q[1:2], kc[1:2], vc[1:2], jnp.asarray([333], jnp.int32))]
    for a, o, one in zip(full, other, alone):
        np.testing.assert_array_equal(a[1], o[1])
        np.testing.assert_array_equal(a[1], one[0])
    # And the state is the softmax's (float64 here), query (kv head 2, g 1, t 63).
    qs = np.asarray(q[1, 63, 2, 1], np.float64)
    ks, vs = np.asarray(kc[1, :333, 2], np.float64), np.asarray(vc[1, :333, 2], np.float64)
    sc = ks @ qs
    p = np.exp(sc - sc.max())
    m, l, acc = (x[1, 2, 1, 63] for x in full)
    np.testing.assert_allclose(m, sc.max(), rtol=1e-5)
    np.testing.assert_allclose(l, p.sum(), rtol=1e-5)
    np.testing.assert_allclose(acc, p @ vs, rtol=1e-4, atol=1e-4)


def test_supported_and_env(monkeypatch):
    assert not cpu_matmul.prefix_attention_supported(1, 3, 64, jnp.bfloat16)
    assert not cpu_matmul.prefix_attention_supported(22, 3, 64, jnp.float32)  # 66 queries per head
    assert not cpu_matmul.prefix_attention_supported(64, 3, 64, jnp.float32)  # a wide tree's verify
    assert cpu_matmul.prefix_attention_supported(64, 3, 64, jnp.float32, causal=True)  # a prefill chunk
    assert not cpu_matmul.prefix_attention_supported(63, 3, 64, jnp.float32, causal=True)  # narrower than a chunk
    assert not cpu_matmul.prefix_attention_supported(1, 3, 72, jnp.float32)
    assert "prefix-attention kernel" in cpu_matmul.status("cpu")[1]
    monkeypatch.setenv("EAGLE_JAX_CPU_ATTENTION", "xla")
    assert not cpu_matmul.prefix_attention_supported(1, 3, 64, jnp.float32)
    assert "prefix attention in XLA" in cpu_matmul.status("cpu")[1]
    monkeypatch.setenv("EAGLE_JAX_CPU_ATTENTION", "fast")
    with pytest.raises(ConfigError, match="must be one of"):
        cpu_matmul.prefix_attention_supported(1, 3, 64, jnp.float32)


@pytest.mark.parametrize("env", ["auto", "xla"])
def test_inference_binding_runs_the_kernel_and_only_it(monkeypatch, env):
    """Packed (step-table) modules run with the plan the step table resolves on a CPU
    attend through the kernel -- its custom call is in the compiled graph -- with the
    unpacked modules' logits; unpacked modules under XLA_PLAN (training, feature
    extraction: no gradient through the FFI call) and EAGLE_JAX_CPU_ATTENTION=xla keep
    XLA's loop."""
    from eagle_jax.checkpoint.draft_io import random_draft
    from eagle_jax.models.config import ModelConfig
    from eagle_jax.kernels.plan import XLA_PLAN
    from eagle_jax.models.llama import BoundModules, KVCache, LlamaModel
    from eagle_jax.runtime.plan import resolve_plan

    monkeypatch.setenv("EAGLE_JAX_CPU_ATTENTION", env)
    cfg = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      tie_word_embeddings=True)
    target = LlamaModel(cfg)
    draft = random_draft(cfg, seed=0, draft_vocab_size=128)
    rng = np.random.default_rng(2)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    new = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 3)), jnp.int32)
    plens = jnp.asarray([12, 5], jnp.int32)

    plan = resolve_plan(backend="cpu")
    assert plan.matmul == "packed" and plan.prefix_attention == ("cpu" if env == "auto" else "xla")

    def run(bound, params, plan):
        t, _ = bound.modules(params)
        cache = KVCache.zeros(cfg, 2, 32)
        pos0 = jnp.broadcast_to(jnp.arange(12), (2, 12))
        _, _, cache = t(prompt, pos0, cache, pos0, PrefixMask.causal(jnp.zeros(2, jnp.int32), 12), plan=plan)
        pos = plens[:, None] + jnp.arange(3)[None]
        h, _, _ = t(new, pos, cache, pos, PrefixMask.causal(plens, 3), plan=plan)
        return t.logits(h)

    runs = {"plain": (BoundModules(target, draft), XLA_PLAN), "packed": (BoundModules(target, draft, pack=True), plan)}
    hlo = {name: jax.jit(lambda p, b=b, pl=pl: run(b, p, pl)).lower(b.params).as_text() for name, (b, pl) in runs.items()}
    assert cpu_matmul.ATTENTION_TARGET not in hlo["plain"]
    assert (cpu_matmul.ATTENTION_TARGET in hlo["packed"]) == (env == "auto")
    (plain, _), (packed, _) = runs["plain"], runs["packed"]
    want = np.asarray(jax.jit(lambda p: run(plain, p, XLA_PLAN))(plain.params))
    got = np.asarray(jax.jit(lambda p: run(packed, p, plan))(packed.params))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("causal,t", [(False, 1), (False, 4), (True, 64)])
def test_a_layer_of_a_stacked_cache_gives_that_layers_bits(causal, t):
    """The kernel reads layer i of a stacked cache ``[B, L, S, KV, D]`` in place
    (``LayerOf(cache, i, axis=1)``, the stacked target's loop body): the same bits as
    over the layer's own ``[B, S, KV, D]`` cache, on the decode and the prefill path."""
    rng = np.random.default_rng(t)
    b, s, n_layers, kv, g, d = 2, 150, 3, 2, 3, 64
    k = jnp.asarray(rng.standard_normal((b, n_layers, s, kv, d), dtype=np.float32))
    v = jnp.asarray(rng.standard_normal((b, n_layers, s, kv, d), dtype=np.float32))
    q = jnp.asarray(rng.standard_normal((b, t, kv, g, d), dtype=np.float32))
    lens = jnp.asarray([17, s - t], jnp.int32)
    f = jax.jit(lambda q, k, v, i: cpu_matmul.prefix_attention_state(
        q, cpu_matmul.LayerOf(k, i, 1), cpu_matmul.LayerOf(v, i, 1), lens, causal=causal))
    for i in range(n_layers):
        want = cpu_matmul.prefix_attention_state(q, k[:, i], v[:, i], lens, causal=causal)
        got = f(q, k, v, jnp.int32(i))
        for a, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(w))
    with pytest.raises(ValueError, match="both be LayerOf"):
        cpu_matmul.prefix_attention_state(q, cpu_matmul.LayerOf(k, jnp.int32(0), 1), v[:, 0], lens)
