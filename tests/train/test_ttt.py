"""Draft training: the unrolled TTT forward is the drafting the engine does, the data
files round-trip and reject bad input, and training on a tiny target's own outputs
produces a draft that speculation accepts (with output still identical to greedy)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from eagle_jax.checkpoint.draft_io import load_draft, random_draft, save_draft
from eagle_jax.checkpoint.hf import load_model
from eagle_jax.errors import ConfigError, InputError
from eagle_jax.serving.generate import Buckets, Generator
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.serving.generate import speculative_generate
from eagle_jax.spec.steps import SpecState, SpeculativeConfig, _draft_extend, draft_tree, new_state
from eagle_jax.train.data import Conversation, FeatureSet, extract_features, read_conversations, write_conversations
from eagle_jax.train.ttt import (
    TrainConfig,
    expected_accept_length,
    select_draft_vocab,
    train_draft,
    ttt_forward,
    ttt_loss,
    ttt_mask,
    vocab_coverage,
)
from eagle_jax.models.llama import StepDiagonalMask, masked_attention, step_diagonal_attention
from hf_factories import make_hf_model


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    hf = make_hf_model("llama3", seed=3)
    with torch.no_grad():  # a peaky head: greedy continuations that are learnable, not uniform noise
        hf.lm_head.weight.mul_(8.0)
    path = tmp_path_factory.mktemp("ttt_target")
    hf.save_pretrained(path, safe_serialization=True)
    return load_model(path)


def test_ttt_mask_shape_and_blocks():
    m = ttt_mask(4, 3)
    assert m.shape == (3, 4, 12)
    assert (m[0, :, :4] == np.tril(np.ones((4, 4), bool))).all() and not m[0, :, 4:].any()
    # step 2, anchor 1: step-0 slots 0..1, then slot 1 of step 1 and slot 1 of step 2
    assert np.flatnonzero(m[2, 1]).tolist() == [0, 1, 5, 9]


@pytest.mark.parametrize("step", [0, 1, 3])
def test_step_diagonal_attention_is_the_dense_ttt_mask(step):
    """The structured attention is masked attention under ``ttt_mask``'s row for that
    step (values and gradients), with the cache's later blocks holding garbage that the
    mask hides; ``StepDiagonalMask.dense`` is ``ttt_mask``'s block."""
    b, n, t_len, hq, hkv, d = 2, 7, 4, 6, 2, 8
    rng = np.random.default_rng(step)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in ((b, n, hq, d), (b, t_len * n, hkv, d), (b, t_len * n, hkv, d)))
    mask = StepDiagonalMask(step=step, length=n)
    dense = mask.dense(t_len * n)[0]
    assert (dense == ttt_mask(n, t_len)[step]).all()

    def structured(q, k, v):
        return step_diagonal_attention(q, k, v, mask, 0.35)

    def reference(q, k, v):
        return masked_attention(q, k, v, jnp.broadcast_to(dense, (b, n, t_len * n)), 0.35)

    np.testing.assert_allclose(structured(q, k, v), reference(q, k, v), rtol=1e-5, atol=1e-6)
    w = jnp.asarray(rng.standard_normal((b, n, hq, d)), jnp.float32)
    g_s = jax.grad(lambda *a: (structured(*a) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    g_r = jax.grad(lambda *a: (reference(*a) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    for a, r in zip(g_s, g_r):
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-5)
    # Blocks past the step are never read: their gradient is exactly zero.
    assert not np.asarray(g_s[1][:, (step + 1) * n:]).any()


def test_ttt_loss_diagonal_equals_dense(target):
    """The training loss and its gradient are the same with the structured attention as
    with the dense ``[L, ttt_length * L]`` mask (the reference)."""
    from flax import nnx

    from eagle_jax.train.ttt import TRAINABLE

    draft = random_draft(target.config, seed=4, draft_vocab_size=97)
    rng = np.random.default_rng(1)
    b, n, vd = 2, 12, 97
    batch = {
        "tokens": jnp.asarray(rng.integers(0, target.config.vocab_size, (b, n)), jnp.int32),
        "lengths": jnp.asarray([12, 9], jnp.int32), "prompt_lengths": jnp.asarray([3, 2], jnp.int32),
        "features": jnp.asarray(rng.standard_normal((b, n, draft.config.fc_in_features)), jnp.float16),
        "target_hidden": jnp.asarray(rng.standard_normal((b, n, target.config.hidden_size)), jnp.float16),
        "target_argmax": jnp.asarray(rng.integers(0, vd, (b, n)), jnp.int32),
    }
    head = jnp.asarray(rng.standard_normal((target.config.hidden_size, vd)), jnp.float32)
    graph, params, frozen = nnx.split(draft, TRAINABLE, ...)

    def loss(params, attention):
        return ttt_loss(nnx.merge(graph, params, frozen), head, batch, ttt_length=4, step_decay=0.8, attention=attention)

    (l_d, aux_d), g_d = jax.value_and_grad(loss, has_aux=True)(params, "diagonal")
    (l_r, aux_r), g_r = jax.value_and_grad(loss, has_aux=True)(params, "dense")
    assert float(aux_d["count"].sum()) > 0
    np.testing.assert_allclose(l_d, l_r, rtol=1e-5)
    np.testing.assert_allclose(aux_d["loss"], aux_r["loss"], rtol=1e-5)
    for a, r in zip(jax.tree.leaves(g_d), jax.tree.leaves(g_r)):
        np.testing.assert_allclose(a, r, rtol=1e-3, atol=1e-6)
    with pytest.raises(ConfigError, match="diagonal"):
        loss(params, "sparse")


@pytest.mark.slow  # the fast suite stays under 20 min on 2 cores
def test_query_rows_keep_the_loss(target):
    """Unrolling only from the anchors near the response (``query_rows``) gives the loss,
    per-step losses, counts and gradients of unrolling from every position, for prompts
    of 1 token to most of the sequence; the per-anchor logits are the full forward's."""
    from flax import nnx

    from eagle_jax.train.ttt import TRAINABLE, DraftTrainer, query_anchors, query_rows_needed

    draft = random_draft(target.config, seed=5, draft_vocab_size=97)
    rng = np.random.default_rng(2)
    b, n, vd, steps = 4, 24, 97, 4
    lengths = np.array([24, 20, 9, 24], np.int32)
    plens = np.array([1, 14, 3, 19], np.int32)
    batch = {
        "tokens": jnp.asarray(rng.integers(0, target.config.vocab_size, (b, n)), jnp.int32),
        "lengths": jnp.asarray(lengths), "prompt_lengths": jnp.asarray(plens),
        "features": jnp.asarray(rng.standard_normal((b, n, draft.config.fc_in_features)), jnp.float16),
        "target_hidden": jnp.asarray(rng.standard_normal((b, n, target.config.hidden_size)), jnp.float16),
        # The target's argmax inside the draft vocabulary: every label in range counts.
        "target_argmax": draft.draft_to_target(jnp.asarray(rng.integers(0, vd, (b, n)), jnp.int32)),
    }
    head = jnp.asarray(rng.standard_normal((target.config.hidden_size, vd)), jnp.float32)
    graph, params, frozen = nnx.split(draft, TRAINABLE, ...)
    need = query_rows_needed(lengths, plens, steps)  # the 1-token prompt: anchors 0..21
    need_short = query_rows_needed(lengths[1:], plens[1:], steps)  # without it: 20 - 2 - 9
    assert (need, need_short) == (22, 9)

    def loss(params, rows, sub=slice(None)):
        bt = {k: v[sub] for k, v in batch.items()}
        return ttt_loss(nnx.merge(graph, params, frozen), head, bt, ttt_length=steps, step_decay=0.8, query_rows=rows)

    for sub, rows in ((slice(None), need), (slice(1, None), need_short)):
        (l_q, aux_q), g_q = jax.value_and_grad(loss, has_aux=True)(params, rows, sub)
        (l_f, aux_f), g_f = jax.value_and_grad(loss, has_aux=True)(params, None, sub)
        assert aux_q["count"].tolist() == aux_f["count"].tolist() and float(aux_f["count"][-1]) > 0
        np.testing.assert_allclose(l_q, l_f, rtol=1e-5)
        np.testing.assert_allclose(aux_q["loss"], aux_f["loss"], rtol=1e-5)
        for a, r in zip(jax.tree.leaves(g_q), jax.tree.leaves(g_f)):
            np.testing.assert_allclose(a, r, rtol=1e-3, atol=1e-6)
    # One row fewer than needed drops a labelled anchor: the count says so.
    _, aux_s = loss(params, need_short - 1, slice(1, None))
    _, aux_f = loss(params, None, slice(1, None))
    assert float(aux_s["count"].sum()) < float(aux_f["count"].sum())
    # The logits at the selected anchors are the full forward's at those positions.
    anchors, real = query_anchors(jnp.asarray(plens), n, 8, steps)
    sel = ttt_forward(draft, batch["tokens"], batch["features"], ttt_length=steps, anchors=anchors)
    full = ttt_forward(draft, batch["tokens"], batch["features"], ttt_length=steps)
    for t in range(steps):
        want = jnp.take_along_axis(full[t], anchors[:, :, None], axis=1)
        np.testing.assert_allclose(np.asarray(sel[t])[np.asarray(real)], np.asarray(want)[np.asarray(real)], rtol=1e-4, atol=1e-5)
    # The trainer asks for the rows the batch needs, rounded up, never past the width.
    cfg = TrainConfig(draft_vocab_size=vd, ttt_length=steps, batch_size=b)
    tr = DraftTrainer(random_draft(target.config, seed=5, draft_vocab_size=vd), target, cfg, 10, round_to=8)
    host = {k: np.asarray(v) for k, v in batch.items()}
    assert tr.query_rows(host) == n  # 22 needed, rounded up to 24
    assert tr.query_rows({k: v[1:] for k, v in host.items()}) == 8 * -(-need_short // 8)
    assert DraftTrainer(random_draft(target.config, seed=5, draft_vocab_size=vd), target, cfg, 10,
                        select_queries=False).query_rows(host) is None
    with pytest.raises(ConfigError, match="select_queries needs attention='diagonal'"):
        DraftTrainer(random_draft(target.config, seed=5, draft_vocab_size=vd), target, cfg, 10, attention="dense")


@pytest.mark.parametrize("anchor", [0, 3, 6])
def test_ttt_forward_is_chain_drafting(target, anchor):
    """Feed the TTT forward the tokens a chain draft proposes: at every step its logits
    reproduce draft_tree's choices and probabilities, i.e. training sees exactly the
    positions, hidden states and attention the engine's drafting uses."""
    draft = random_draft(target.config, seed=2, draft_vocab_size=97)
    steps = 4
    rng = np.random.default_rng(0)
    length = 12
    tokens = rng.integers(0, target.config.vocab_size, (1, length)).astype(np.int32)
    features = rng.normal(size=(1, length, draft.config.fc_in_features)).astype(np.float32)
    # The engine's state after committing tokens 0..anchor: the draft has run step 0 over
    # (f_0..f_anchor, x_1..x_{anchor+1}); the root is x_{anchor+1}.
    spec = SpeculativeConfig(num_steps=steps)
    state = new_state(target, draft, spec, 1, 32)
    n = anchor + 1
    h, dcache = _draft_extend(
        draft, state.draft_cache, jnp.asarray(tokens[:, 1:n + 1]), jnp.asarray(features[:, :n]),
        jnp.zeros((1,), jnp.int32), jnp.asarray([anchor]),
    )
    state = SpecState(state.target_cache, dcache, jnp.asarray([n]), jnp.asarray(tokens[:, n]), h)
    tree, _ = draft_tree(draft, dcache, state, spec)
    chain = np.asarray(tree.tokens[0])  # [root, d1, .., dS]
    assert chain[0] == tokens[0, n]
    # The sequence the TTT forward reads: committed tokens, then the drafted ones.
    seq = np.concatenate([tokens[0, :n + 1], chain[1:steps]])[None]
    seq = np.pad(seq, ((0, 0), (0, length + 4 - seq.shape[1])))
    feats = np.pad(features, ((0, 0), (0, 4), (0, 0)))
    logits = ttt_forward(draft, jnp.asarray(seq), jnp.asarray(feats), ttt_length=steps)
    for t in range(steps):
        p = np.asarray(jax.nn.softmax(logits[t][0, anchor]))
        assert int(draft.draft_to_target(jnp.argmax(p))) == chain[t + 1], f"step {t}"
    # draft_tree ranks a chain node by the product of its path's probabilities.
    d_scores = np.asarray(jax.nn.softmax(draft.logits(h[None]))).max()
    assert np.isclose(float(np.asarray(jax.nn.softmax(logits[0][0, anchor])).max()), d_scores, rtol=1e-5)


def _conversations(target, n, seed):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 200, int(rng.integers(3, 9))).tolist() for _ in range(n)]
    gen = Generator(target, buckets=Buckets(batch=(16,), prompt=(16,), cache=(64,)), max_seq_len=64)
    outs = gen.generate(prompts, SamplingParams(max_new_tokens=40))
    return [Conversation(p, o.token_ids) for p, o in zip(prompts, outs)], prompts


def test_conversations_round_trip_and_bad_lines(tmp_path):
    convs = [Conversation([1, 2], [3, 4, 5]), Conversation([7], [8], "length", 0.7)]
    path = tmp_path / "c.jsonl"
    write_conversations(path, convs)
    assert read_conversations(path, vocab_size=10) == convs
    with pytest.raises(InputError, match=r"c.jsonl:1: token id 8 outside|c.jsonl:2: token id"):
        read_conversations(path, vocab_size=8)
    path.write_text(json.dumps({"prompt_ids": [1]}) + "\n")
    with pytest.raises(InputError, match=r":1: not a conversation record"):
        read_conversations(path)
    path.write_text(json.dumps({"prompt_ids": [1], "response_ids": []}) + "\n")
    with pytest.raises(InputError, match=r":1: empty"):
        read_conversations(path)
    path.write_text("\n")
    with pytest.raises(InputError, match="no conversations"):
        read_conversations(path)


def test_train_config_validation():
    with pytest.raises(ConfigError, match="ttt_length=0"):
        TrainConfig(ttt_length=0)
    with pytest.raises(ConfigError, match="step_decay=1.5"):
        TrainConfig(step_decay=1.5)
    with pytest.raises(ConfigError, match="learning_rate=nan"):
        TrainConfig(learning_rate=float("nan"))


def test_select_draft_vocab_counts_response_tokens_only():
    tokens = np.array([[9, 9, 9, 1, 1, 2, 0, 0], [9, 3, 3, 3, 2, 1, 1, 0]], np.int32)
    fs = FeatureSet(
        tokens=tokens, lengths=np.array([6, 7]), prompt_lengths=np.array([3, 1]),
        features=np.zeros((2, 8, 3), np.float16), target_hidden=np.zeros((2, 8, 1), np.float16),
        target_argmax=np.zeros((2, 8), np.int32),
    )
    fs.check()
    # responses: [1, 1, 2] and [3, 3, 3, 2, 1, 1] -> 1 x4, 3 x3, 2 x2; 9 only in prompts
    assert select_draft_vocab(fs, 2, 10).tolist() == [1, 3]
    assert select_draft_vocab(fs, 4, 10).tolist() == [0, 1, 2, 3]  # unseen ids fill in id order
    assert vocab_coverage(fs, np.array([1, 3]), 10) == pytest.approx(7 / 9)
    bad = FeatureSet(**{**fs.__dict__, "prompt_lengths": np.array([6, 1])})
    with pytest.raises(InputError, match="prompt_length < length"):
        bad.check()


def test_expected_accept_length():
    assert expected_accept_length([1.0, 1.0, 1.0]) == 4.0
    assert expected_accept_length([0.5, 0.5]) == pytest.approx(1.75)


def test_training_makes_a_draft_that_speculation_accepts(target, tmp_path):
    """Train on the target's own greedy continuations; on held-out conversations (never
    trained on) the trained draft agrees with the target, its accept length on held-out
    prompts is well above a random draft's, and output stays identical."""
    convs, _ = _conversations(target, 64, seed=1)
    held_convs, _ = _conversations(target, 16, seed=2)
    trained_on = {tuple(c.prompt_ids) for c in convs}
    assert not any(tuple(c.prompt_ids) in trained_on for c in held_convs)
    held_data = extract_features(target, held_convs, max_len=64, batch_size=16)
    data = extract_features(target, convs, max_len=64, batch_size=16)
    data.save(tmp_path / "feats")
    data = FeatureSet.load(tmp_path / "feats")
    assert data.features.dtype == np.float16 and len(data) == 64
    # The stored argmax is the target's own greedy choice: the next response token.
    c = convs[0]
    p = len(c.prompt_ids)
    assert data.target_argmax[0, p - 1:p + len(c.response_ids) - 1].tolist() == c.response_ids
    cfg = TrainConfig(draft_vocab_size=160, ttt_length=3, batch_size=16, epochs=40, learning_rate=1e-2, warmup_steps=5)
    draft, history = train_draft(target, data, cfg, eval_data=held_data, log_every=4)
    evals = [h for h in history if h["event"] == "eval"]
    # Evaluated on the held-out conversations. The loss is bounded below by the target's
    # entropy; agreement with its argmax is the clear signal: a random draft agrees on
    # about 1/160 of positions, the trained one on ~0.4 at every TTT step (measured; on
    # its own training data it reaches > 0.5).
    assert evals[-1]["loss"][0] < evals[0]["loss"][0] - 0.3
    assert min(evals[-1]["acc"]) > 0.3, evals[-1]["acc"]
    save_draft(draft, tmp_path / "draft")
    assert (tmp_path / "draft" / "model.safetensors").stat().st_size > 0
    loaded = load_draft(tmp_path / "draft", target=target)

    _, held_out = _conversations(target, 8, seed=99)
    spec = SpeculativeConfig(num_steps=3)
    buckets = Buckets(batch=(8,), prompt=(16,), cache=(64,))
    sp = SamplingParams(max_new_tokens=40)
    plain = Generator(target, buckets=buckets, max_seq_len=64).generate(held_out, sp)
    trained = speculative_generate(target, loaded, held_out, spec, sp, buckets=buckets, max_seq_len=64)
    rand = speculative_generate(
        target, random_draft(target.config, seed=4, draft_vocab_size=160), held_out, spec, sp, buckets=buckets, max_seq_len=64,
    )
    assert [c.token_ids for c in trained] == [c.token_ids for c in plain]
    acc_trained = np.mean([a for c in trained for a in c.accept_lengths])
    acc_random = np.mean([a for c in rand for a in c.accept_lengths])
    assert acc_random < 1.3
    assert acc_trained > 1.35, (acc_trained, acc_random)


def test_learning_curve_points_and_bad_log_lines(tmp_path):
    from eagle_jax.train.curve import curve_points, read_log, save_learning_curve

    recs = [
        {"event": "eval", "step": 20, "epoch": 2.0, "response_tokens_seen": 200, "acc": [0.5, 0.3], "expected_accept_length": 1.65},
        {"event": "train", "step": 10, "epoch": 1.0, "response_tokens_seen": 100, "loss": 1.0},
        {"event": "eval", "step": 10, "epoch": 1.0, "response_tokens_seen": 100, "acc": [0.4, 0.2], "expected_accept_length": 1.48},
        {"event": "eval", "step": 5, "epoch": 0.5, "acc": [0.1, 0.0], "expected_accept_length": 1.1},  # an older log's record
    ]
    pts = curve_points(recs)
    assert [(p["step"], p["tokens"], p["acc"]) for p in pts] == [(10, 100, [0.4, 0.2]), (20, 200, [0.5, 0.3])]
    assert save_learning_curve(recs, tmp_path / "c.png", title="t", epoch_tokens=100) == 2
    assert (tmp_path / "c.png").read_bytes().startswith(b"\x89PNG")
    assert save_learning_curve(recs[1:2], tmp_path / "none.png", title="t") == 0 and not (tmp_path / "none.png").exists()
    log = tmp_path / "training_log.jsonl"
    log.write_text(json.dumps(recs[0]) + "\n{oops\n")
    with pytest.raises(InputError, match=r"training_log.jsonl:2: not JSON"):
        read_log(log)
    log.write_text("[1, 2]\n")
    with pytest.raises(InputError, match=r":1: not a training record"):
        read_log(log)


@pytest.fixture(scope="module")
def small_sets(target):
    """(train, held-out) feature sets of the tiny target's own greedy answers."""
    convs, _ = _conversations(target, 32, seed=5)
    held, _ = _conversations(target, 8, seed=6)
    return (extract_features(target, convs, max_len=64, batch_size=16),
            extract_features(target, held, max_len=64, batch_size=16))


def test_time_budget_ends_the_run_in_time_with_a_decayed_rate_and_a_checkpoint(target, small_sets, tmp_path):
    """Far more epochs than fit: the budget, not the epochs, ends the run; the training
    clock stays inside it, the learning rate has decayed to its floor by the last step
    (the plan followed the measured step time), and the final checkpoint holds that step."""
    import signal

    from eagle_jax.train.ttt import TrainCheckpoints

    data, held = small_sets
    cfg = TrainConfig(draft_vocab_size=160, ttt_length=2, batch_size=8, epochs=10_000, learning_rate=1e-2,
                      warmup_steps=2, min_learning_rate_ratio=0.1)
    budget = 25.0
    steps_seen = []

    def interrupt_once(step, out):  # a kill mid-run: the resumed run keeps the same budget
        steps_seen.append(step)
        if step == 3 and len(steps_seen) == 3:
            signal.raise_signal(signal.SIGINT)

    from eagle_jax.train.ttt import TrainingInterrupted

    with pytest.raises(TrainingInterrupted):
        train_draft(target, data, cfg, eval_data=held, log_every=1, checkpoint_dir=tmp_path / "ck",
                    checkpoint_every=0, time_budget_s=budget, on_step=interrupt_once)
    draft, history = train_draft(target, data, cfg, eval_data=held, log_every=1, checkpoint_dir=tmp_path / "ck",
                                 checkpoint_every=0, time_budget_s=budget, resume=True)
    trains = [h for h in history if h["event"] == "train"]
    evals = [h for h in history if h["event"] == "eval"]
    epoch_steps = -(-len(data) // cfg.batch_size)
    last = trains[-1]
    assert 4 <= last["step"] < cfg.epochs * epoch_steps
    assert max(h.get("elapsed_s", 0.0) for h in history) <= budget + 1.0, history[-1]
    # The step-0 evaluation (the curve's start) and the final one.
    assert evals[0]["response_tokens_seen"] == 0 and evals[-1]["step"] == last["step"]
    assert last["lr"] == pytest.approx(cfg.learning_rate * cfg.min_learning_rate_ratio, rel=0.05)
    # The rate went up, then down: a plan, not a constant.
    assert max(h["lr"] for h in trains) > 5 * last["lr"]
    ck = TrainCheckpoints(tmp_path / "ck")
    try:
        assert ck.steps()[0] == last["step"]
    finally:
        ck.close()
    with pytest.raises(ConfigError, match="must be a finite number > 0"):
        train_draft(target, data, cfg, time_budget_s=0)


def test_a_time_budget_never_runs_past_the_epochs(target, small_sets):
    """A budget with room for far more steps than ``cfg.epochs`` holds: the run ends at
    the epochs' last step (an upper bound the budget does not lift) with the rate decayed
    to its floor there, well inside the budget."""
    data, held = small_sets
    cfg = TrainConfig(draft_vocab_size=160, ttt_length=2, batch_size=8, epochs=2, learning_rate=1e-2,
                      warmup_steps=1, min_learning_rate_ratio=0.1)
    epoch_steps = -(-len(data) // cfg.batch_size)
    budget = 90.0  # about ten times what the two epochs take here
    _, history = train_draft(target, data, cfg, eval_data=held, log_every=1, time_budget_s=budget)
    trains = [h for h in history if h["event"] == "train"]
    assert [h["step"] for h in trains] == list(range(1, 2 * epoch_steps + 1))
    assert trains[-1]["lr"] == pytest.approx(cfg.learning_rate * cfg.min_learning_rate_ratio, rel=0.05)
    assert max(h.get("elapsed_s", 0.0) for h in history) < budget / 2


def test_new_vocab_keeps_the_layer_and_the_shared_head_columns(target, small_sets):
    from eagle_jax.train.ttt import revocab_draft

    data, _ = small_sets
    old = random_draft(target.config, seed=7, draft_vocab_size=160)
    target_head = np.asarray(target.lm_head[...], np.float32)
    old_ids = np.asarray(old.draft_to_target(jnp.arange(160)))
    # A head that is a linear map of the target's columns: the new ids' columns must come
    # out of the same map (fitted on the shared ids), not be the target's own.
    m = np.random.default_rng(1).standard_normal((target_head.shape[0],) * 2).astype(np.float32) / 8
    old.lm_head[...] = jnp.asarray(m @ target_head[:, old_ids])
    ids = select_draft_vocab(data, 96, target.config.vocab_size)
    new = revocab_draft(old, target, ids)
    assert new.config.draft_vocab_size == 96
    np.testing.assert_array_equal(np.asarray(new.fc.kernel[...]), np.asarray(old.fc.kernel[...]))
    for a, b in zip(jax.tree.leaves(nnx_state(new.midlayer)), jax.tree.leaves(nnx_state(old.midlayer))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(new.draft_to_target(jnp.arange(96))), ids)
    assert np.asarray(new.t2d[...]).sum() == 96 and np.asarray(new.t2d[...])[ids].all()
    old_ids = old_ids.tolist()
    head, old_head = np.asarray(new.lm_head[...]), np.asarray(old.lm_head[...])
    shared = 0
    for j, t in enumerate(ids.tolist()):
        if t in old_ids:
            np.testing.assert_array_equal(head[:, j], old_head[:, old_ids.index(t)])
            shared += 1
        else:
            np.testing.assert_allclose(head[:, j], m @ target_head[:, t], rtol=1e-3, atol=1e-4)
    assert target_head.shape[0] <= shared < 96  # the map was fitted; both kinds of column were checked
    # Training from it (the trainer donates its parameters) leaves the init draft whole.
    cfg = TrainConfig(draft_vocab_size=96, ttt_length=2, batch_size=8, epochs=0.5, warmup_steps=1)
    trained, _ = train_draft(target, data, cfg, init=old, new_vocab=True)
    assert trained.config.draft_vocab_size == 96 and np.isfinite(np.asarray(old.lm_head[...])).all()
    with pytest.raises(ConfigError, match="new_vocab=True needs an init draft"):
        train_draft(target, data, cfg, new_vocab=True)


def nnx_state(module):
    from flax import nnx

    return nnx.state(module)


def test_cumulative_training_adds_up_across_runs(tmp_path):
    from eagle_jax.train.commands import _cumulative

    run = {"steps": 10, "response_tokens_seen": 1000, "train_seconds": 5.0}
    assert _cumulative(None, run) == {"runs": 1, **run}
    # A draft recorded before runs were added up: its own run, from its final evaluation.
    (tmp_path / "training.json").write_text(json.dumps({
        "final_eval": {"step": 100, "epoch": 2.0}, "train_seconds": 50.0,
        "data_manifest": {"splits": {"train": {"response_tokens": 300}, "eval": {"response_tokens": 99}}},
    }))
    assert _cumulative(tmp_path, run) == {"runs": 2, "steps": 110, "response_tokens_seen": 1600, "train_seconds": 55.0}
    (tmp_path / "training.json").write_text(json.dumps({"cumulative": {"runs": 3, "steps": 7, "response_tokens_seen": 9,
                                                                      "train_seconds": 1.0}}))
    assert _cumulative(tmp_path, run) == {"runs": 4, "steps": 17, "response_tokens_seen": 1009, "train_seconds": 6.0}


def test_time_budget_flag_reads_durations():
    import argparse

    from eagle_jax.train.commands import _duration

    assert [_duration(t) for t in ("90m", "2h", "600s", "45", "1.5h")] == [5400, 7200, 600, 45, 5400]
    for bad in ("", "m", "-5m", "0", "soon", "infh"):
        with pytest.raises(argparse.ArgumentTypeError):
            _duration(bad)


def test_a_restored_checkpoint_lowers_to_the_graphs_the_fresh_state_did(tmp_path):
    """Orbax hands back arrays committed to their device; a committed input lowers to
    another graph (a sharding annotation on each argument), so a resumed run compiled its
    step again instead of loading it from the compilation cache. Restored state keeps the
    placement of its template, and the step lowers to the same text."""
    import optax

    from eagle_jax.train.ttt import TrainCheckpoints

    params = {"w": jnp.ones((4, 4)), "b": jnp.arange(4.0)}
    opt_state = optax.adam(1e-3).init(params)
    ck = TrainCheckpoints(tmp_path / "ck")
    try:
        ck.save(7, params, opt_state, {"step": 7})
        step, got_params, got_opt, meta = ck.restore(params, opt_state)
    finally:
        ck.close()
    assert step == 7 and meta["step"] == 7
    for fresh, back in zip(jax.tree.leaves((params, opt_state)), jax.tree.leaves((got_params, got_opt))):
        assert back.committed == fresh.committed and back.dtype == fresh.dtype
        np.testing.assert_array_equal(np.asarray(back), np.asarray(fresh))
    f = jax.jit(lambda p, s: (p["w"] @ p["b"], jax.tree.leaves(s)[0]))
    assert f.lower(got_params, got_opt).as_text() == f.lower(params, opt_state).as_text()
