"""The DeepSeek-V3 / Kimi-K2 target: logit parity with transformers' DeepseekV3 on tiny
random checkpoints, both MLA forms and every MoE formulation against one another,
greedy generation against transformers' ``generate``, lossless speculation, bad configs."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from eagle_jax.checkpoint.draft_io import random_draft
from eagle_jax.checkpoint.hf import load_model
from eagle_jax.models.config import read_config_json
from eagle_jax.models.deepseek import DeepseekV3Config, DeepseekV3Model, experts_forward, mla_form, route
from eagle_jax.errors import ConfigError
from eagle_jax.serving.generate import Buckets, Generator, SpeculativeGenerator
from eagle_jax.models.llama import PrefixMask, causal_mask
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.spec.steps import SpeculativeConfig
from eagle_jax.models.target import init_from_spec
from hf_factories import DEEPSEEK, make_deepseek_model

TOL = 1e-4


@pytest.fixture(scope="module", params=list(DEEPSEEK))
def ds_checkpoint(request, tmp_path_factory):
    model = make_deepseek_model(request.param)
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out, safe_serialization=True)
    return request.param, model, out


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.from_numpy(ids).long()).logits.float().numpy()


def _load(path, **kw):
    """Our model from ``path`` with the formulations forced (``mla_form``, ``moe_impl``)."""
    if not kw:
        return load_model(path, dtype="float32")
    from flax import nnx

    base = load_model(path, dtype="float32")
    forced = DeepseekV3Model(base.config, **kw)
    nnx.update(forced, nnx.state(base))
    return forced


def _prefill(model, ids, max_len):
    b, t = ids.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cache = init_from_spec(model.cache_spec(b, max_len))
    h, _, cache = model(jnp.asarray(ids), pos, cache, pos, causal_mask(pos, max_len))
    return np.asarray(model.logits(h)), cache


def test_prefill_logits_match_transformers(ds_checkpoint):
    kind, hf, path = ds_checkpoint
    ids = np.random.default_rng(1).integers(0, hf.config.vocab_size, (2, 17))
    ref = _hf_logits(hf, ids)
    for kw in ({}, {"mla_form": "naive", "moe_impl": "dense"}, {"mla_form": "absorbed", "moe_impl": "gather"},
               {"moe_impl": "ragged"}):
        logits, _ = _prefill(_load(path, **kw), ids, 32)
        assert np.abs(logits - ref).max() <= TOL, (kind, kw)


def test_decode_token_by_token_matches_transformers(ds_checkpoint):
    """Prefill 4 tokens, then one at a time through the latent cache (decode shapes pick
    the absorbed form and the gather MoE), under a PrefixMask as the step math passes it."""
    kind, hf, path = ds_checkpoint
    ids = np.random.default_rng(2).integers(0, hf.config.vocab_size, (2, 12))
    ref = _hf_logits(hf, ids)
    ours = _load(path)
    max_len = 16
    assert mla_form(ours.config, 1, max_len) == "absorbed" and mla_form(ours.config, 12, 12) == "naive"
    _, cache = _prefill(ours, ids[:, :4], max_len)
    for t in range(4, ids.shape[1]):
        pos = jnp.full((2, 1), t, jnp.int32)
        mask = PrefixMask.causal(jnp.full((2,), t, jnp.int32), 1)
        h, _, cache = ours(jnp.asarray(ids[:, t:t + 1]), pos, cache, pos, mask)
        step = np.asarray(ours.logits(h))[:, 0]
        assert np.abs(step - ref[:, t]).max() <= TOL, (kind, t)


def test_features_are_layer_inputs(ds_checkpoint):
    kind, hf, path = ds_checkpoint
    ours = _load(path)
    ids = np.random.default_rng(3).integers(0, hf.config.vocab_size, (1, 9))
    pos = jnp.arange(9, dtype=jnp.int32)[None]
    cache = init_from_spec(ours.cache_spec(1, 16))
    _, feats, _ = ours(jnp.asarray(ids), pos, cache, pos, causal_mask(pos, 16), return_features=True)
    with torch.no_grad():
        hs = hf(torch.from_numpy(ids).long(), output_hidden_states=True).hidden_states
    want = np.concatenate([hs[i].numpy() for i in ours.config.feature_layer_ids], axis=-1)
    assert np.abs(np.asarray(feats) - want).max() <= TOL, kind


def test_router_matches_transformers(ds_checkpoint):
    """Expert choice and weights of every MoE layer's router on real hidden states."""
    kind, hf, path = ds_checkpoint
    ours = _load(path)
    cfg = ours.config
    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    for i in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        with torch.no_grad():
            _, w_ref, idx_ref = hf.model.layers[i].mlp.gate(x)
        mlp = ours.layers[i].mlp
        w, idx = route(jnp.asarray(x.numpy()), mlp.gate_weight[...], mlp.e_score_correction_bias[...], cfg)
        order, order_ref = np.argsort(np.asarray(idx), 1), np.argsort(idx_ref.numpy(), 1)
        np.testing.assert_array_equal(np.take_along_axis(np.asarray(idx), order, 1), np.take_along_axis(idx_ref.numpy(), order_ref, 1))
        np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, 1), np.take_along_axis(w_ref.numpy(), order_ref, 1), atol=1e-6)


def test_moe_formulations_agree_with_the_loop():
    """Every formulation against a per-token loop over the chosen experts, with repeated
    experts across tokens and token counts on both sides of the auto switches (blocked:
    runs shorter and longer than a block, experts left unused)."""
    rng = np.random.default_rng(0)
    e, h, i, k = 6, 8, 5, 2
    gate, up = rng.normal(size=(e, h, i)).astype(np.float32), rng.normal(size=(e, h, i)).astype(np.float32)
    down = rng.normal(size=(e, i, h)).astype(np.float32)
    for n in (1, 2, 7, 40):
        x = rng.normal(size=(n, h)).astype(np.float32)
        idx = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)
        w = rng.random((n, k)).astype(np.float32)
        silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
        want = np.stack([sum(w[t, j] * ((silu(x[t] @ gate[idx[t, j]]) * (x[t] @ up[idx[t, j]])) @ down[idx[t, j]])
                             for j in range(k)) for t in range(n)])
        for impl in ("gather", "blocked", "dense", "ragged"):
            got = experts_forward(jnp.asarray(x), jnp.asarray(w), jnp.asarray(idx), jnp.asarray(gate), jnp.asarray(up),
                                  jnp.asarray(down), impl=impl)
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=impl)


SMALL = Buckets(batch=(1, 4), prompt=(8, 16), cache=(64,))


def _hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_matches_transformers_generate(ds_checkpoint):
    kind, hf, path = ds_checkpoint
    gen = Generator(load_model(path), buckets=SMALL, max_seq_len=64)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, hf.config.vocab_size, n).tolist() for n in (5, 11, 3)]
    ours = gen.generate(prompts, SamplingParams(max_new_tokens=20))
    for p, c in zip(prompts, ours):
        assert c.token_ids == _hf_greedy(hf, p, 20), kind


CHAIN3, TREE336 = SpeculativeConfig(num_steps=3), SpeculativeConfig(num_steps=3, topk=3, num_draft_tokens=6)
SLOW = pytest.mark.slow  # ~20-50 s each: the fast suite keeps the variant that covers the most (q_lora, YaRN, groups)


@pytest.mark.parametrize("ds_checkpoint, spec", [
    ("ds_qlora_yarn_groups", CHAIN3), ("ds_qlora_yarn_groups", TREE336),
    pytest.param("ds_plain", CHAIN3, marks=SLOW), pytest.param("ds_plain", TREE336, marks=SLOW),
], ids=["ds_qlora_yarn_groups-chain3", "ds_qlora_yarn_groups-tree3-3-6", "ds_plain-chain3", "ds_plain-tree3-3-6"],
    indirect=["ds_checkpoint"])
def test_greedy_speculation_is_token_identical(ds_checkpoint, spec):
    """Chains and trees at batch 1 and 4, with a random draft (accepts about 1 token) and
    a noisy oracle (accepts several, so multi-token commits of the latent cache run)."""
    kind, hf, path = ds_checkpoint
    target = load_model(path)
    draft = random_draft(target.config, seed=1, draft_vocab_size=64)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, target.config.vocab_size, n).tolist() for n in (6, 3, 9, 4)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = Generator(target, buckets=SMALL, max_seq_len=64).generate(prompts, params)
    spec_gen = SpeculativeGenerator(target, draft, spec, buckets=SMALL, max_seq_len=64)
    for batch in (prompts[:1], prompts):
        out = spec_gen.generate(batch, params)
        assert [c.token_ids for c in out] == [c.token_ids for c in plain[:len(batch)]], (kind, len(batch))
    oracle = [p + c.token_ids for p, c in zip(prompts, plain)]
    out = spec_gen.generate(prompts, params, oracle=oracle, oracle_noise=0.3)
    assert [c.token_ids for c in out] == [c.token_ids for c in plain], kind
    assert np.mean([a for c in out for a in c.accept_lengths]) > 1.5


def _config(path):
    return read_config_json(path, "checkpoint")


@pytest.mark.parametrize("field,value", [("topk_method", "group_limited_greedy"), ("scoring_func", "softmax"),
                                         ("moe_layer_freq", 2), ("num_key_value_heads", 2), ("n_group", 3)])
def test_unsupported_config_is_named(ds_checkpoint, field, value):
    _, _, path = ds_checkpoint
    d = {**_config(path), field: value}
    with pytest.raises(ConfigError, match=field):
        DeepseekV3Config.from_hf_dict(d)


def test_kimi_text_config_is_read(ds_checkpoint):
    """A Kimi-K2.5-style directory: the text model's fields under text_config."""
    _, _, path = ds_checkpoint
    inner = {**_config(path), "model_type": "kimi_k2"}
    outer = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": inner}
    kimi = DeepseekV3Config.from_hf_dict(outer)
    assert kimi == DeepseekV3Config.from_hf_dict(_config(path)).replace(weight_prefix="language_model.")
    with pytest.raises(ConfigError, match="text_config"):
        DeepseekV3Config.from_hf_dict({**outer, "text_config": {**inner, "model_type": "qwen2"}})


def test_yarn_softmax_scale_and_frequencies_match_transformers():
    """YaRN's inverse frequencies, its cos/sin factor and the softmax scale (mscale^2)."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    from eagle_jax.models.deepseek import yarn_inv_freq
    from hf_factories import DS_TINY

    for rope in ({"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                 {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 0.707,
                  "mscale_all_dim": 0.5}):
        hf = transformers.DeepseekV3Config(**DS_TINY, q_lora_rank=None, n_group=1, topk_group=1, rope_parameters={"rope_theta": 5e4, **rope})
        inv_ref, attn_ref = ROPE_INIT_FUNCTIONS["yarn"](hf)
        ours = DeepseekV3Config.from_hf_dict(hf.to_dict())
        inv, attn = yarn_inv_freq(ours.qk_rope_head_dim, ours.rope_theta, ours.rope)
        np.testing.assert_allclose(inv, inv_ref.numpy(), rtol=1e-6)
        assert attn == pytest.approx(attn_ref)
        assert ours.softmax_scale == pytest.approx(yarn_apply_mscale(hf.rope_parameters, ours.qk_head_dim ** -0.5))


def _kimi_mla(target_cfg):
    """A draft MLA layer shaped unlike the target's (other ranks, no q_lora, YaRN)."""
    from eagle_jax.models.deepseek import MLAConfig, YarnRope

    return MLAConfig(hidden_size=target_cfg.hidden_size, num_attention_heads=2, kv_lora_rank=12, q_lora_rank=None,
                     qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=10, rope_theta=50000.0,
                     rope=YarnRope(factor=4.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=1.0))


@pytest.mark.parametrize("ds_checkpoint, fmt", [
    ("ds_qlora_yarn_groups", "mla"), pytest.param("ds_qlora_yarn_groups", "llama-full-vocab", marks=SLOW),
    pytest.param("ds_plain", "mla", marks=SLOW), pytest.param("ds_plain", "llama-full-vocab", marks=SLOW),
], ids=lambda v: v, indirect=["ds_checkpoint"])
def test_kimi_draft_formats_load_and_speculate_losslessly(ds_checkpoint, fmt, tmp_path):
    """Both released Kimi-K2.5 draft formats: ``Eagle3DeepseekV2ForCausalLM`` (one MLA
    layer) and ``LlamaForCausalLMEagle3`` with the full vocabulary (no draft_vocab_size,
    d2t or t2d in the files). Written, read back (outputs equal), then chains and trees
    at batch 1 and 4 are token-identical to plain decoding."""
    from eagle_jax.checkpoint.draft_io import load_draft, save_draft

    kind, _, path = ds_checkpoint
    target = load_model(path)
    if fmt == "mla":
        draft = random_draft(target.config, seed=3, draft_vocab_size=64, mla=_kimi_mla(target.config))
    else:
        draft = random_draft(target.config, seed=3, draft_vocab_size=target.config.vocab_size)
    save_draft(draft, tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    if fmt == "mla":
        assert d["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and "kv_b_proj" in str(_tensor_names(tmp_path))
    else:
        from safetensors.numpy import load_file, save_file

        del d["draft_vocab_size"]  # as the released Kimi Llama-format draft has it
        (tmp_path / "config.json").write_text(json.dumps(d))
        tensors = {k: v for k, v in load_file(tmp_path / "model.safetensors").items() if k not in ("d2t", "t2d")}
        save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = load_draft(tmp_path, target=target)
    assert loaded.config == draft.config
    toks = jnp.asarray([[5, 6, 7]])
    pos = jnp.arange(3)[None]
    hidden = jax.random.normal(jax.random.key(0), (1, 3, target.config.hidden_size))
    outs = []
    for m in (draft, loaded):
        cache = init_from_spec(m.cache_spec(1, 8, jnp.float32))
        h, _ = m(toks, hidden, pos, cache, pos, causal_mask(pos, 8))
        outs.append(np.asarray(m.logits(h)))
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6)

    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, target.config.vocab_size, n).tolist() for n in (6, 3, 9, 4)]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    plain = Generator(target, buckets=SMALL, max_seq_len=64).generate(prompts, params)
    oracle = [p + c.token_ids for p, c in zip(prompts, plain)]
    for spec in (SpeculativeConfig(num_steps=2), SpeculativeConfig(num_steps=3, topk=2, num_draft_tokens=5)):
        gen = SpeculativeGenerator(target, loaded, spec, buckets=SMALL, max_seq_len=64)
        for batch in (prompts[:1], prompts):
            assert [c.token_ids for c in gen.generate(batch, params)] == [c.token_ids for c in plain[:len(batch)]]
        out = gen.generate(prompts, params, oracle=oracle, oracle_noise=0.3)
        assert [c.token_ids for c in out] == [c.token_ids for c in plain], (kind, fmt, spec)


def _tensor_names(path):
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "np") as f:
        return list(f.keys())


def test_a_draft_that_does_not_fit_is_named(ds_checkpoint, tmp_path):
    from eagle_jax.checkpoint.draft_io import load_draft, save_draft
    from eagle_jax.errors import CheckpointError

    _, _, path = ds_checkpoint
    target = load_model(path)
    save_draft(random_draft(target.config, seed=1, draft_vocab_size=64), tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**d, "target_hidden_size": 32}))
    with pytest.raises((ConfigError, CheckpointError), match="target_hidden_size=32"):
        load_draft(tmp_path, target=target)
    n = target.config.num_hidden_layers
    (tmp_path / "config.json").write_text(json.dumps({**d, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, n]}}))
    with pytest.raises(ConfigError, match="eagle_aux_hidden_state_layer_ids"):
        load_draft(tmp_path, target=target)
