"""A target bound with its layers stacked (``LlamaModel.stacked``: one layer body in a
loop over stacked parameters and caches, what a CPU step table binds) computes what the
unrolled layers compute, bit for bit: logits, features and the cache, on every mask
the steps use, with XLA's kernels and with the CPU kernels; and an engine over it
generates the unrolled engine's tokens, greedy and sampled."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle_jax.checkpoint.draft_io import random_draft
from eagle_jax.kernels import cpu_matmul
from eagle_jax.kernels.plan import XLA_PLAN
from eagle_jax.models.config import ModelConfig
from eagle_jax.models.llama import (BoundModules, KVCache, LayerStack, LlamaModel, PrefixMask, StackedKVCache,
                                    causal_mask)
from eagle_jax.models.target import init_from_spec
from eagle_jax.runtime.plan import resolve_plan
from eagle_jax.serving.engine import Engine, EngineConfig
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.spec.steps import SpeculativeConfig

CFG = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                  tie_word_embeddings=False, aux_layer_ids=(2, 0, 2, 4))  # repeated, unordered, and the output
S = 100


@pytest.fixture(scope="module")
def target():
    return LlamaModel(CFG, rngs=nnx.Rngs(3))


def _masks(b, t, prefix):
    rng = np.random.default_rng(t)
    tree = jnp.asarray(rng.random((b, t, t)) < 0.5) | jnp.eye(t, dtype=bool)[None]
    pos = prefix[:, None] + jnp.arange(t)[None]
    return {
        "causal": PrefixMask.causal(prefix, t),
        "tree": PrefixMask(prefix, jnp.tril(tree)),
        "dense": causal_mask(pos, S),
    }


def _run(model, pack: bool, tokens, prefix, mask, plan):
    bound = BoundModules(model, pack=pack)
    b, t = tokens.shape
    pos = prefix[:, None] + jnp.arange(t)[None]
    rng = np.random.default_rng(9)
    # A cache with something in every slot, so the prefix the forward attends over matters.
    cache = init_from_spec(model.cache_spec(b, S))
    cache = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape, dtype=np.float32)), cache)
    if isinstance(cache, StackedKVCache):  # the same numbers as the unrolled run's
        base = [jnp.asarray(np.random.default_rng(9 + i).standard_normal((b, S, CFG.num_key_value_heads, CFG.head_dim),
                                                                          dtype=np.float32)) for i in range(2 * CFG.num_hidden_layers)]
        cache = StackedKVCache(k=jnp.stack(base[0::2], axis=1), v=jnp.stack(base[1::2], axis=1))
    else:
        base = [jnp.asarray(np.random.default_rng(9 + i).standard_normal((b, S, CFG.num_key_value_heads, CFG.head_dim),
                                                                          dtype=np.float32)) for i in range(2 * CFG.num_hidden_layers)]
        cache = KVCache(k=base[0::2], v=base[1::2])

    @jax.jit
    def f(params, cache):
        (m,) = bound.modules(params)
        h, feats, c = m(tokens, pos, cache, pos, mask, return_features=True, plan=plan)
        return m.logits(h), feats, c

    logits, feats, c = f(bound.params, cache)
    k = c.k if isinstance(c, StackedKVCache) else jnp.stack(c.k, axis=1)
    v = c.v if isinstance(c, StackedKVCache) else jnp.stack(c.v, axis=1)
    return [np.asarray(a) for a in (logits, feats, k, v)]


@pytest.mark.parametrize("kernels", ["xla", "cpu"])
@pytest.mark.parametrize("mask_kind", ["causal", "tree", "dense"])
@pytest.mark.parametrize("t", [1, 5, 64])
def test_stacked_forward_equals_unrolled_bit_for_bit(target, kernels, mask_kind, t):
    if kernels == "cpu" and not cpu_matmul.status("cpu")[0]:
        pytest.fail("the CPU kernel library does not build here; this test needs it")
    b = 2
    # t = 64: a prefill chunk's width (the CPU kernel's tiled path), one row with no prefix.
    prefix = jnp.asarray([3, 7] if t < 64 else [0, 20], jnp.int32)
    tokens = jnp.asarray(np.random.default_rng(t).integers(0, CFG.vocab_size, (b, t)), jnp.int32)
    mask = _masks(b, t, prefix)[mask_kind]
    plan, pack = (XLA_PLAN, False) if kernels == "xla" else (resolve_plan(backend="cpu"), True)
    want = _run(target, pack, tokens, prefix, mask, plan)
    got = _run(target.stacked("float32" if pack else None), pack, tokens, prefix, mask, plan)
    for name, g, w in zip(("logits", "features", "k cache", "v cache"), got, want):
        np.testing.assert_array_equal(g, w, err_msg=name)


def test_the_stacked_copy_is_made_once_and_follows_the_parameters(target):
    a = target.stacked("float32")
    assert isinstance(a.layers, LayerStack) and a.layers.num_layers == CFG.num_hidden_layers
    assert target.stacked("float32") is a and a.stacked("float32") is a
    assert target.stacked(None) is not a  # another pack dtype, another copy
    # Packed: the kernels as [L, P, K, nb] panels, counted for the start-up line.
    if cpu_matmul.status("cpu")[0]:
        assert a.layers.packed == 7 * CFG.num_hidden_layers
        assert a.layers.stacked.mlp.up_proj.kernel[...].ndim == 4
        assert BoundModules(a, pack=True).packed == 7 * CFG.num_hidden_layers + 1  # and the head
    assert isinstance(a.cache_spec(2, 8), StackedKVCache) and a.cache_spec(2, 8).k.shape == (2, 4, 8, 2, 32)
    # New layer arrays (a training step, a reload): a new stacked copy, with the new values.
    other = LlamaModel(CFG, rngs=nnx.Rngs(4))
    copy = LlamaModel(CFG, rngs=nnx.Rngs(3))
    b = copy.stacked(None)
    nnx.update(copy.layers, nnx.state(other.layers))
    c = copy.stacked(None)
    assert c is not b
    np.testing.assert_array_equal(np.asarray(c.layers.stacked.mlp.up_proj.kernel[...][1]),
                                  np.asarray(other.layers[1].mlp.up_proj.kernel[...]))


PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]]


def test_an_engine_over_stacked_layers_generates_the_unrolled_tokens(target, monkeypatch, caplog):
    """Tree speculation at batch 1 and 4 (the auto policy's steps), greedy and sampled:
    the same tokens with the layers stacked (a CPU's default) as unrolled."""
    draft = random_draft(CFG, seed=2, draft_vocab_size=128)
    cfg = EngineConfig(max_batch=4, max_seq_len=64, prompt_buckets=(16,), speculative=SpeculativeConfig(num_steps=2),
                       spec_disable_batch_threshold=3)
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=5, max_new_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=20, seed=6, max_new_tokens=16, ignore_eos=True)]
    out = {}
    for layers in ("unrolled", "stacked"):
        monkeypatch.setenv("EAGLE_JAX_LAYERS", layers)
        engine = Engine(target, draft, cfg, progress=False)
        assert engine.table.plan.layers == layers
        assert f"target layers {layers}" in engine.description
        out[layers] = [[c.token_ids for c in engine.generate(PROMPTS[:n], params[:n])] for n in (1, 3)]
        assert engine.metrics.spec_steps > 0
    assert out["stacked"] == out["unrolled"]


def test_feature_extraction_runs_the_inference_binding(target):
    """Draft training's features come from the engine's binding (packed, stacked on a
    CPU; no gradient is needed) by default: the same argmax as XLA's unrolled forward and
    features equal within float32 rounding, at real and padded widths."""
    from eagle_jax.train import data

    rng = np.random.default_rng(5)
    tokens = rng.integers(0, CFG.vocab_size, (6, 96)).astype(np.int32)
    lengths = np.asarray([96, 70, 64, 33, 9, 80])
    got = {k: list(data._batches(data._forward_fn(target, k), tokens, lengths, range(6), 4)) for k in ("inference", "xla")}
    for (ia, ha, fa, aa), (ib, hb, fb, ab) in zip(got["inference"], got["xla"]):
        assert list(ia) == list(ib)
        real = np.arange(ha.shape[1])[None] < lengths[ia][:, None]
        np.testing.assert_array_equal(aa[real], ab[real])
        np.testing.assert_allclose(fa[real], fb[real], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(ha[real], hb[real], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="kernels="):
        data._forward_fn(target, "fast")
