"""Speculative decoding is lossless: greedy output token-identical to plain greedy, sampled
output distributed as the target's, across chain and tree configs and acceptance regimes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats

from eagle_jax.checkpoint.draft_io import random_draft
from eagle_jax.checkpoint.hf import load_model
from eagle_jax.models.config import ModelConfig
from eagle_jax.errors import ConfigError
from eagle_jax.serving.generate import Buckets, Generator, SpeculativeGenerator
from eagle_jax.models.llama import causal_mask
from eagle_jax.spec.sampling import SamplingParams, target_probs
from eagle_jax.spec.steps import SpeculativeConfig
from hf_factories import make_hf_model

BUCKETS = Buckets(batch=(1, 4, 8), prompt=(16,), cache=(160,))
CHAINS = [SpeculativeConfig(num_steps=s) for s in (1, 3, 5)]
TREES = [
    SpeculativeConfig(num_steps=3, topk=4, num_draft_tokens=8),
    SpeculativeConfig(num_steps=5, topk=4, num_draft_tokens=16),
    SpeculativeConfig(num_steps=6, topk=10, num_draft_tokens=60),
]


def _cfg_id(c):
    return f"S{c.num_steps}k{c.topk}T{c.num_draft_tokens}"


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    hf = make_hf_model("llama3", seed=11)
    with torch.no_grad():  # a peakier head makes greedy continuations less repetitive
        hf.lm_head.weight.mul_(8.0)
    path = tmp_path_factory.mktemp("spec_target")
    hf.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir)


@pytest.fixture(scope="module")
def draft(target):
    return random_draft(target.config, seed=5, draft_vocab_size=128)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(3, 200, n).tolist() for n in (5, 13, 2, 9, 16, 1, 7, 11)]


@pytest.fixture(scope="module")
def reference(target, prompts):
    """Plain greedy continuations (128 tokens; the oracle's source)."""
    gen = Generator(target, buckets=BUCKETS)
    return gen.generate(prompts, SamplingParams(max_new_tokens=128, ignore_eos=True))


def _check_lossless(target, draft, cfg, prompts, reference, regime):
    gen = SpeculativeGenerator(target, draft, cfg, buckets=BUCKETS)
    oracle = [p + r.token_ids for p, r in zip(prompts, reference)] if regime != "random" else None
    noise = 0.3 if regime == "noisy" else 0.0
    # A stop id taken from the middle of prompt 0's reference, so stops land mid-draft;
    # max_new_tokens values that are no multiple of the accept length.
    stop = reference[0].token_ids[21]
    for batch in (1, 3, 8):
        idx = list(range(batch))
        params = [
            SamplingParams(max_new_tokens=128 if i % 2 == 0 else 37 + i, stop_token_ids=(stop,) if i == 0 else (), ignore_eos=True)
            for i in idx
        ]
        out = gen.generate([prompts[i] for i in idx], params, oracle=None if oracle is None else [oracle[i] for i in idx], oracle_noise=noise)
        for i, o in zip(idx, out):
            ref = reference[i].token_ids[: params[i].max_new_tokens]
            if i == 0:
                ref = ref[: ref.index(stop) + 1]
            assert o.token_ids == ref, (_cfg_id(cfg), regime, batch, i)
            assert o.finish_reason == ("stop" if i == 0 else "length")
            assert all(1 <= a <= cfg.max_accept for a in o.accept_lengths)
    return out


@pytest.mark.parametrize("cfg", CHAINS, ids=_cfg_id)
@pytest.mark.parametrize("regime", ["random", "oracle", "noisy"])
def test_chain_greedy_lossless(target, draft, prompts, reference, cfg, regime):
    out = _check_lossless(target, draft, cfg, prompts, reference, regime)
    mean = np.mean([a for o in out for a in o.accept_lengths])
    if regime == "oracle":  # everything accepted (up to the last, truncated step)
        assert mean > cfg.max_accept - 0.25
    if regime == "random":
        assert mean < 1.2


@pytest.mark.slow
@pytest.mark.parametrize("cfg", TREES, ids=_cfg_id)
@pytest.mark.parametrize("regime", ["random", "oracle", "noisy"])
def test_tree_greedy_lossless(target, draft, prompts, reference, cfg, regime):
    out = _check_lossless(target, draft, cfg, prompts, reference, regime)
    if regime == "oracle":
        assert np.mean([a for o in out for a in o.accept_lengths]) > 1.5


def test_tree_greedy_lossless_fast(target, draft, prompts, reference):
    """The smallest tree, every regime, batch 1/3/8 (the full grid is marked slow)."""
    for regime in ("random", "oracle", "noisy"):
        _check_lossless(target, draft, TREES[0], prompts, reference, regime)


def test_plain_mode_keeps_output(target, draft, prompts, reference):
    gen = SpeculativeGenerator(target, draft, None, buckets=BUCKETS)
    out = gen.generate(prompts[:3], SamplingParams(max_new_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in out] == [r.token_ids[:40] for r in reference[:3]]
    assert all(o.accept_lengths == [] for o in out)  # accept lengths count speculative steps only


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_steps=0), "num_steps"),
        (dict(topk=0), "topk"),
        (dict(num_steps=3, num_draft_tokens=5), "num_draft_tokens"),
        (dict(num_steps=3, topk=4), "num_draft_tokens"),
        (dict(num_steps=2, topk=2, num_draft_tokens=8), "num_draft_tokens"),
        (dict(threshold_acc=0.0, sampling_verify="rejection"), "threshold_acc"),
        (dict(threshold_single=1.5, sampling_verify="rejection"), "threshold_single"),
        (dict(threshold_acc=0.5), "sampling_verify='rejection'"),
        (dict(sampling_verify="typical"), "sampling_verify"),
    ],
)
def test_invalid_speculative_config(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        SpeculativeConfig(**kwargs)


# ----------------------------------------------------------------------------- sampling


SMALL_V = 8


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A target with an 8-token vocabulary and peaky distributions, and a draft that
    disagrees with it (so rejections happen)."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=SMALL_V, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(20.0)
        hf.model.embed_tokens.weight.mul_(5.0)
    path = tmp_path_factory.mktemp("small_vocab")
    hf.save_pretrained(path, safe_serialization=True)
    target = load_model(path)
    draft = random_draft(target.config, seed=1, draft_vocab_size=SMALL_V)
    from flax import nnx

    state = nnx.state(draft, nnx.Param)
    state["lm_head"].set_value(state["lm_head"][...] * 400.0)
    nnx.update(draft, state)
    return target, draft


def _exact_pair_probs(target, prompt, sp):
    """P(x2, x3 | prompt, x1) for every x1: the target's own distribution, computed directly."""
    v = SMALL_V
    n = len(prompt)
    seqs = np.array([prompt + [a, b] for a in range(v) for b in range(v)], np.int32)  # [v*v, n+2]
    pos = np.broadcast_to(np.arange(n + 2), seqs.shape)
    from eagle_jax.models.target import init_from_spec

    cache = init_from_spec(target.cache_spec(len(seqs), 32))
    import jax.numpy as jnp

    h, _, _ = target(jnp.asarray(seqs), jnp.asarray(pos), cache, jnp.asarray(pos), causal_mask(jnp.asarray(pos), 32))
    logits = target.logits(h)  # [v*v, n+2, V]
    rows = len(seqs)
    tp = lambda lg: np.asarray(target_probs(lg, jnp.full((rows,), sp.temperature), jnp.full((rows,), sp.top_k, jnp.int32), jnp.full((rows,), sp.top_p)))  # noqa: E731
    p1 = tp(logits[:, n - 1])[0]  # P(x1)
    p2 = tp(logits[:, n])  # row (a, b): P(x2 | x1=a)
    p3 = tp(logits[:, n + 1])  # row (a, b): P(x3 | x1=a, x2=b)
    joint = np.zeros((v, v, v))
    for a in range(v):
        for b in range(v):
            joint[a, b] = p1[a] * p2[a * v + b, b] * p3[a * v + b]
    return joint  # [x1, x2, x3]


def _spec_samples(target, draft, cfg, sp_base, n_rows):
    """First three sampled tokens of ``n_rows`` seeds (token 1 from prefill, 2-3 speculated)."""
    buckets = Buckets(batch=(n_rows,), prompt=(8,), cache=(32,))
    gen = SpeculativeGenerator(target, draft, cfg, buckets=buckets)
    prompt = [1, 5, 2, 7]
    params = [SamplingParams(temperature=sp_base.temperature, top_k=sp_base.top_k, top_p=sp_base.top_p, seed=s, max_new_tokens=3, ignore_eos=True) for s in range(n_rows)]
    out = gen.generate([prompt] * n_rows, params)
    return prompt, np.array([o.token_ids[:3] for o in out])


def _chi2_pvalue(samples, joint):
    """Chi-square of the (x1, x2, x3) counts against the exact joint, pooling rare cells."""
    v = SMALL_V
    counts = np.zeros(v**3)
    np.add.at(counts, samples[:, 0] * v * v + samples[:, 1] * v + samples[:, 2], 1)
    expected = joint.reshape(-1) * len(samples)
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue


@pytest.mark.parametrize(
    "cfg",
    [
        SpeculativeConfig(num_steps=2),
        SpeculativeConfig(num_steps=2, topk=3, num_draft_tokens=6),
        SpeculativeConfig(num_steps=2, sampling_verify="rejection"),
        SpeculativeConfig(num_steps=2, topk=3, num_draft_tokens=6, sampling_verify="rejection"),
    ],
    ids=lambda c: f"{_cfg_id(c)}-{c.sampling_verify}",
)
@pytest.mark.parametrize("sp", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=5, top_p=0.9)], ids=["t1", "t0.8k5p0.9"])
def test_sampling_matches_target_distribution(small_vocab, cfg, sp):
    target, draft = small_vocab
    prompt, samples = _spec_samples(target, draft, cfg, sp, 4096)
    joint = _exact_pair_probs(target, prompt, sp)
    p = _chi2_pvalue(samples, joint)
    assert p > 1e-3, p


@pytest.fixture(scope="module")
def small_vocab_deepseek(tmp_path_factory):
    """A DeepSeek-V3 target (MLA, MoE) with an 8-token vocabulary and peaky distributions,
    and a Kimi-format MLA draft (``Eagle3DeepseekV2ForCausalLM``) that disagrees with it."""
    import transformers
    from flax import nnx

    from eagle_jax.models.deepseek import MLAConfig

    cfg = transformers.DeepseekV3Config(
        vocab_size=SMALL_V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8, q_lora_rank=12, qk_nope_head_dim=4,
        qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(20.0)
        hf.model.embed_tokens.weight.mul_(5.0)
    path = tmp_path_factory.mktemp("small_vocab_ds")
    hf.save_pretrained(path, safe_serialization=True)
    target = load_model(path)
    mla = MLAConfig(hidden_size=32, num_attention_heads=2, kv_lora_rank=6, q_lora_rank=None, qk_nope_head_dim=4,
                    qk_rope_head_dim=4, v_head_dim=4, rope_theta=10000.0)
    draft = random_draft(target.config, seed=1, draft_vocab_size=SMALL_V, mla=mla)
    state = nnx.state(draft, nnx.Param)
    state["lm_head"].set_value(state["lm_head"][...] * 400.0)
    nnx.update(draft, state)
    return target, draft


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [SpeculativeConfig(num_steps=2),
                                 SpeculativeConfig(num_steps=2, topk=3, num_draft_tokens=6, sampling_verify="rejection")],
                         ids=lambda c: f"{_cfg_id(c)}-{c.sampling_verify}")
def test_deepseek_sampling_matches_target_distribution(small_vocab_deepseek, cfg):
    """The same chi-square test on the DeepSeek family with a Kimi MLA draft."""
    target, draft = small_vocab_deepseek
    sp = SamplingParams(temperature=1.0)
    prompt, samples = _spec_samples(target, draft, cfg, sp, 4096)
    joint = _exact_pair_probs(target, prompt, sp)
    assert joint.max() < 0.9  # peaky, not degenerate: the test has something to measure
    assert _chi2_pvalue(samples, joint) > 1e-3


def test_biased_thresholds_fail_the_same_test(small_vocab):
    """threshold_acc < 1 relaxes acceptance (SGLang): the chi-square test must catch it."""
    target, draft = small_vocab
    sp = SamplingParams(temperature=1.0)
    cfg = SpeculativeConfig(
        num_steps=2, topk=3, num_draft_tokens=6, threshold_acc=0.2, threshold_single=0.2, sampling_verify="rejection"
    )
    prompt, samples = _spec_samples(target, draft, cfg, sp, 4096)
    assert _chi2_pvalue(samples, _exact_pair_probs(target, prompt, sp)) < 1e-6


def test_coupled_sampling_equals_plain_sampling(target, draft, prompts):
    """With coupled verification a seeded request samples the same tokens with or without
    speculation, at any batch size and in any batch company."""
    sp = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_new_tokens=40, ignore_eos=True) for i in range(8)]
    plain = Generator(target, buckets=BUCKETS).generate(prompts, sp)
    # The oracle proposes the plain run's own samples (20% made wrong), so most drafts
    # are accepted: the accepted path, not just bonus tokens, must reproduce them.
    oracle = [p + c.token_ids for p, c in zip(prompts, plain)]
    for cfg in (CHAINS[2], TREES[0]):
        gen = SpeculativeGenerator(target, draft, cfg, buckets=BUCKETS)
        together = gen.generate(prompts, sp, oracle=oracle, oracle_noise=0.2)
        alone = gen.generate(prompts[3:4], sp[3:4])
        assert [c.token_ids for c in together] == [c.token_ids for c in plain]
        assert alone[0].token_ids == plain[3].token_ids
        assert np.mean([a for c in together for a in c.accept_lengths]) > 1.5
    # Different seeds do give different samples (the check above is not vacuous).
    assert len({tuple(c.token_ids) for c in plain}) == len(plain)


def test_tree_attention_path_matches_dense_mask(target, draft, prompts):
    """The verify forward through pallas_kernels.tree_attention (its jnp reference here;
    the kernel on GPUs) gives the dense-mask XLA path's logits, features and cache."""
    import jax.numpy as jnp

    from eagle_jax.kernels.plan import XLA_PLAN
    from eagle_jax.spec.sampling import SamplingArrays
    from eagle_jax.spec.steps import draft_tree, new_state, prefill_impl, verify_tree

    cfg = TREES[1]
    b = 3
    toks = np.zeros((b, 16), np.int32)
    for i in range(b):
        toks[i, : len(prompts[i])] = prompts[i]
    lengths = jnp.asarray([len(p) for p in prompts[:b]], jnp.int32)
    state, _ = prefill_impl(
        target, draft, new_state(target, draft, cfg, b, 64), jnp.asarray(toks), lengths,
        SamplingArrays.build([SamplingParams()] * b, b), greedy_only=True,
    )
    tree, _ = draft_tree(draft, state.draft_cache, state, cfg)
    assert len(set(np.asarray(tree.depths).ravel().tolist())) > 2  # a real tree, several depths
    dense = verify_tree(target, state.target_cache, state.seq_lens, tree)
    kernel = verify_tree(target, state.target_cache, state.seq_lens, tree,
                         plan=dataclasses.replace(XLA_PLAN, tree_attention="reference"))
    for a, k in zip(jax.tree.leaves(dense), jax.tree.leaves(kernel)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(k), atol=2e-5)


def test_speculative_generate_function_and_eos_mid_draft(target_dir, target, draft, prompts, reference):
    """The experiment-level function; the target's own EOS (not a stop id) ends a request
    in the middle of an accepted draft."""
    from eagle_jax.serving.generate import speculative_generate

    eos = reference[2].token_ids[17]
    with_eos = load_model(target_dir, config=ModelConfig.from_dir(target_dir).replace(eos_token_ids=(eos,)))
    oracle = [p + r.token_ids for p, r in zip(prompts, reference)]
    gen = SpeculativeGenerator(with_eos, draft, CHAINS[2], buckets=BUCKETS)
    out = gen.generate(prompts[2:3], SamplingParams(max_new_tokens=100), oracle=oracle[2:3])
    ref = reference[2].token_ids
    assert out[0].token_ids == ref[: ref.index(eos) + 1] and out[0].finish_reason == "stop"
    assert out[0].mean_accept_length > 3  # the EOS landed inside a fully accepted draft
    res = speculative_generate(target, draft, prompts[:2], CHAINS[1], SamplingParams(max_new_tokens=30, ignore_eos=True), buckets=BUCKETS)
    assert [r.token_ids for r in res] == [r.token_ids[:30] for r in reference[:2]]
    assert all(len(r.accept_lengths) >= 1 for r in res)


@pytest.fixture(scope="module")
def smollm2_plain(smollm2_dir):
    """SmolLM2, its tokenizer, three chat prompts and their plain greedy continuations
    (48 tokens), shared by the speculative shapes below: the reference is computed once."""
    from eagle_jax.checkpoint.tokenizer import Tokenizer

    tgt = load_model(smollm2_dir)
    tok = Tokenizer.from_dir(smollm2_dir)
    chats = ["What is the capital of France?", "Write a haiku about rain.", "List three prime numbers."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}])) for c in chats]
    buckets = Buckets(batch=(1, 4), prompt=(64,), cache=(128,))
    sp = SamplingParams(max_new_tokens=48)
    return tgt, tok, prompts, buckets, sp, Generator(tgt, tok, buckets=buckets).generate(prompts, sp)


@pytest.mark.slow
@pytest.mark.smollm2
@pytest.mark.parametrize("cfg", [CHAINS[2], TREES[0], TREES[1]], ids=_cfg_id)
def test_smollm2_greedy_lossless(smollm2_plain, cfg):
    """The real model: random draft (almost nothing accepted) and the oracle with noise."""
    tgt, tok, prompts, buckets, sp, ref = smollm2_plain
    drf = random_draft(tgt.config, seed=0, draft_vocab_size=4096)
    gen = SpeculativeGenerator(tgt, drf, cfg, tok, buckets=buckets)
    for oracle, noise in ((None, 0.0), ([p + r.token_ids for p, r in zip(prompts, ref)], 0.3)):
        out = gen.generate(prompts, sp, oracle=oracle, oracle_noise=noise)
        assert [o.token_ids for o in out] == [r.token_ids for r in ref]
        assert [o.text for o in out] == [r.text for r in ref]


def test_deferred_draft_sync_catches_up_to_what_eager_sync_leaves(target, draft, prompts):
    """Prefill and plain steps of a deferred state store the draft's inputs; the catch-up
    (small tiles here, so rows and positions take several rounds) leaves the draft cache,
    ``draft_hidden`` and the next speculative step what eager syncing leaves."""
    from eagle_jax.spec.sampling import SamplingArrays
    from eagle_jax.spec.steps import (
        DraftSync, catch_up_draft, plain_step_impl, prefill_impl, speculative_step_impl, state_spec,
    )
    from eagle_jax.models.target import init_from_spec

    cfg, max_len, p = SpeculativeConfig(num_steps=3), 48, 16
    rows = [prompts[i] for i in (1, 2, 4)]  # 13, 2 and 16 tokens: rows differ in what is pending
    tokens = np.zeros((3, p), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    lengths = jnp.asarray([len(r) for r in rows], jnp.int32)
    samp = SamplingArrays.build([SamplingParams()] * 3, 3)
    sync = DraftSync("deferred", rows=2, width=3)
    states = {}
    for mode in ("eager", "deferred"):
        st = init_from_spec(state_spec(target, draft, [cfg], 3, max_len, deferred=mode == "deferred"))
        st, _ = prefill_impl(target, draft, st, jnp.asarray(tokens), lengths, samp, greedy_only=True)
        for _ in range(4):
            st, *_ = plain_step_impl(target, draft, st, samp, greedy_only=True, max_seq_len=max_len)
        states[mode] = st
    eager, deferred = states["eager"], states["deferred"]
    assert not eager.deferred and eager.pending_hidden is None
    np.testing.assert_array_equal(deferred.draft_len, 0)  # nothing of the draft ran yet
    np.testing.assert_array_equal(deferred.seq_lens, eager.seq_lens)
    caught = catch_up_draft(draft, deferred, sync)
    seq = np.asarray(eager.seq_lens)
    np.testing.assert_array_equal(caught.draft_len, seq)
    np.testing.assert_allclose(caught.draft_hidden, eager.draft_hidden, atol=2e-5, rtol=1e-4)
    for a, b in zip(jax.tree.leaves(caught.draft_cache), jax.tree.leaves(eager.draft_cache)):
        for r in range(3):  # the committed prefix; slots above it are scratch
            np.testing.assert_allclose(np.asarray(a)[r, : seq[r]], np.asarray(b)[r, : seq[r]], atol=2e-5, rtol=1e-4)
    # An in-sync deferred state is left as it is (no round runs).
    again = catch_up_draft(draft, caught, sync)
    np.testing.assert_array_equal(again.draft_hidden, caught.draft_hidden)
    # The speculative step catches up by itself and then matches the eager one.
    outs = [speculative_step_impl(target, draft, s, samp, cfg=cfg, greedy_only=True, max_seq_len=max_len, sync=sync)
            for s in (eager, deferred)]
    (se, te, ae, _), (sd, td, ad, _) = outs
    np.testing.assert_array_equal(td, te)
    np.testing.assert_array_equal(ad, ae)
    np.testing.assert_array_equal(sd.draft_len, sd.seq_lens)
    np.testing.assert_allclose(sd.draft_hidden, se.draft_hidden, atol=2e-5, rtol=1e-4)


def test_plain_step_through_the_tree_attention_kernel_matches_the_prefix_path():
    """On GPUs the plain step attends through the tree-attention kernel with a one-slot
    tree (the plan's tree_attention); here the kernel runs in Mosaic GPU's interpreter and
    must give what the PrefixMask path gives: the same tokens, the same KV written."""
    from flax import nnx

    from eagle_jax.kernels.plan import XLA_PLAN
    from eagle_jax.models.config import ModelConfig
    from eagle_jax.models.llama import LlamaModel
    from eagle_jax.spec.sampling import SamplingArrays
    from eagle_jax.spec.steps import plain_step_impl, prefill_impl, state_spec
    from eagle_jax.models.target import init_from_spec

    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256)
    target = LlamaModel(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 128, (2, 16)), jnp.int32)
    lengths = jnp.asarray([16, 9], jnp.int32)
    samp = SamplingArrays.build([SamplingParams()] * 2, 2)
    spec = state_spec(target, None, [], 2, 128, cache_align=64)  # the kernel's 64-slot blocks
    start, _ = prefill_impl(target, None, init_from_spec(spec), tokens, lengths, samp, greedy_only=True)
    runs = {}
    for impl in (None, "kernel"):
        st, out = start, []
        for _ in range(3):
            st, tok, acc, _ = plain_step_impl(target, None, st, samp, greedy_only=True, max_seq_len=128,
                                              plan=dataclasses.replace(XLA_PLAN, tree_attention=impl))
            out.append(np.asarray(tok))
            np.testing.assert_array_equal(acc, 1)
        runs[impl] = (st, np.concatenate(out, 1))
    (ref, ref_tokens), (got, got_tokens) = runs[None], runs["kernel"]
    np.testing.assert_array_equal(got_tokens, ref_tokens)
    np.testing.assert_array_equal(got.seq_lens, ref.seq_lens)
    for a, b in zip(jax.tree.leaves(got.target_cache), jax.tree.leaves(ref.target_cache)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=3e-2)
