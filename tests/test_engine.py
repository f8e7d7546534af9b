"""The engine: continuous batching with the speculation cutoff, start-up that is whole or
absent, zero compiles after warm-up, reproducible sampling, metrics and bad input."""

import dataclasses
import gc
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle_jax.checkpoint.draft_io import random_draft
from eagle_jax.checkpoint.hf import load_model
from eagle_jax.models.config import ModelConfig
from eagle_jax.serving.engine import Engine, EngineConfig, EngineMetrics, NonFiniteError, compile_count
from eagle_jax.errors import CheckpointError, ConfigError, InputError
from eagle_jax.serving.generate import Buckets, Generator
from eagle_jax.spec.oracle import OracleProposer
from eagle_jax.runtime.step_table import CompileAfterBuildError
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.spec.steps import SpeculativeConfig
from hf_factories import make_hf_model, write_word_tokenizer

SPEC = SpeculativeConfig(num_steps=3)
CUTOFF = EngineConfig(
    max_batch=4, max_seq_len=128, prompt_buckets=(16, 128), speculative=SPEC,
    spec_disable_batch_threshold=2, spec_hysteresis_steps=2,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine_target")
    make_hf_model("llama3", seed=4).save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, 211)
    return path


@pytest.fixture(scope="module")
def target(model_dir):
    return load_model(model_dir)


@pytest.fixture(scope="module")
def draft(target):
    return random_draft(target.config, seed=2, draft_vocab_size=128)


@pytest.fixture(scope="module", params=["random", "noisy-oracle"])
def engine(request, target, draft, reference):
    """The cutoff engine, with the random draft (accept length about 1) and with a noisy
    oracle (multi-token accepts, so accepted drafts cross slot inserts and resizes)."""
    if request.param == "random":
        return Engine(target, draft, CUTOFF, progress=False)
    oracle = OracleProposer(row_width=CUTOFF.max_seq_len + SPEC.num_draft_tokens, noise=0.3, vocab_size=target.config.vocab_size)
    # Each request's row: its prompt and the target's greedy continuation (the reference).
    return Engine(target, draft, CUTOFF, proposer=oracle, proposer_rows=lambda rid, prompt: _oracle_row(prompt), progress=False)


def _add(engine, i, n, **kw):
    """Queue PROMPTS[i] for n greedy tokens."""
    return engine.add_request(PROMPTS[i], _greedy(n), **kw)


def _oracle_row(prompt):
    i = PROMPTS.index(list(prompt))
    return PROMPTS[i] + _REFERENCE[i].token_ids


_REFERENCE: list = []


PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18], [3, 4], [20, 21, 22], [30], [40, 41, 42, 43]]
LENGTHS = [60, 12, 35, 44, 6, 70, 25]


@pytest.fixture(scope="module")
def reference(target):
    gen = Generator(target, buckets=Buckets(batch=(1, 8), prompt=(16,), cache=(128,)))
    out = gen.generate(PROMPTS, [SamplingParams(max_new_tokens=max(LENGTHS), ignore_eos=True)] * len(PROMPTS))
    _REFERENCE[:] = out  # full-length continuations: the oracle's rows
    return [dataclasses.replace(c, token_ids=c.token_ids[:n]) for c, n in zip(out, LENGTHS)]


def _greedy(n):
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def test_cutoff_run_is_token_identical_and_compiles_nothing(engine, reference):
    """Requests arrive mid-run; the live batch crosses the threshold both ways; every
    bucket and both modes run; outputs equal plain greedy; no compile after warm-up."""
    before = compile_count()
    spec_before = engine.metrics.spec_steps
    ids = [_add(engine, i, LENGTHS[i]) for i in range(2)]
    for _ in range(6):
        engine.step()
    ids += [_add(engine, i, LENGTHS[i]) for i in range(2, 7)]
    engine.run_until_done()
    done = {c.id: c for c in engine.pop_finished()}
    for i, rid in enumerate(ids):
        assert done[rid].token_ids == reference[i].token_ids, i
        assert done[rid].finish_reason == "length"
    s = engine.metrics.summary()
    assert s["spec_steps"] > 0 and s["plain_steps"] > 0
    assert s["mode_switches"] >= 2  # off when the batch grew past 2, on again after it shrank
    # Nothing compiled in the process while the engine ran (observation), and the step
    # table refuses any graph it did not build (the guard itself).
    assert compile_count() - before == 0
    assert sum(s["accept_length_histogram"].values()) > 0
    assert len(s["acceptance_rate_by_depth"]) == SPEC.num_steps
    assert engine.metrics.spec_steps > spec_before
    accepts = [a for rid in ids for a in done[rid].accept_lengths]
    if engine.table.proposer.row_width:  # the noisy oracle really accepted several tokens per step
        assert np.mean(accepts) > 1.5
    else:
        assert np.mean(accepts) < 1.3


def test_a_first_token_is_delivered_before_the_step_behind_it_is_waited_for(engine, reference, monkeypatch):
    """A request's first token comes from its last prefill chunk; the decode step launched
    after that chunk (the request already in it) must not hold it back: when the host
    waits for that step's tokens, the first token is already the request's, and
    timestamped no later than the step's results."""
    x = engine.executor
    seen = []
    real_read = x.read

    def read(f):
        seen.append([(r.id, len(r.progress.tokens)) for r in f.rows if r is not None])
        result = real_read(f)
        for r in f.rows:
            if r is not None and r.metrics.first_token is not None:
                assert r.metrics.first_token <= result.ready_at
        return result

    monkeypatch.setattr(x, "read", read)
    rid = _add(engine, 2, 6)
    engine.run_until_done()
    (done,) = [c for c in engine.pop_finished() if c.id == rid]
    assert done.token_ids == reference[2].token_ids[:6]
    # The first read of a step the request decodes in: it holds its first token already.
    first_read = next(rows for rows in seen if any(i == rid for i, _ in rows))
    assert dict(first_read)[rid] == 1


def test_one_row_prefills_zero_the_last_state_in_place(engine, reference, monkeypatch):
    """A request prefilled alone gets the previous one-row prefill state back, zeroed in
    place (``StepTable.rezero``: no new buffers, whose pages cost most of a fresh
    state's time), not a newly allocated one; a short prompt after longer ones still
    decodes exactly as alone, and a rezeroed state is all zeros."""
    x, t = engine.executor, engine.table
    calls = {"zeros": 0, "rezero": 0}
    for name in calls:
        real = getattr(t, name)

        def spy(*a, name=name, real=real):
            if name == "rezero" or a == (1,):
                calls[name] += 1
            return real(*a)

        monkeypatch.setattr(t, name, spy)
    for i in (0, 5, 1, 3):  # 60, 70, 12 and 44 tokens: shorter prompts after longer ones
        rid = _add(engine, i, LENGTHS[i])
        engine.run_until_done()
        (done,) = [c for c in engine.pop_finished() if c.id == rid]
        assert done.token_ids == reference[i].token_ids, i
    assert calls["rezero"] + calls["zeros"] == 4 and calls["rezero"] >= 3, calls
    # Two requests prefilled together (a two-row state of its own) leave the spare alone.
    before = dict(calls)
    pair = [_add(engine, 1, 3), _add(engine, 3, 3)]
    engine.run_until_done()
    alone = _add(engine, 4, LENGTHS[4])
    engine.run_until_done()
    done = {c.id: c for c in engine.pop_finished()}
    assert [done[r].token_ids for r in pair] == [reference[1].token_ids[:3], reference[3].token_ids[:3]]
    assert done[alone].token_ids == reference[4].token_ids
    assert calls == {"zeros": before["zeros"], "rezero": before["rezero"] + 1}, calls
    spare, x._spare = x._spare, None  # donated below
    assert spare is not None and any(bool(jnp.any(a != 0)) for a in jax.tree.leaves(spare))
    fresh = t.zeros(1)
    cleared = t.rezero(spare)
    assert jax.tree.structure(cleared) == jax.tree.structure(fresh)
    for a, b in zip(jax.tree.leaves(cleared), jax.tree.leaves(fresh)):
        assert a.shape == b.shape and a.dtype == b.dtype and not bool(jnp.any(a != 0))


def test_step_table_refuses_graphs_it_did_not_build(engine):
    t = engine.table
    with pytest.raises(CompileAfterBuildError, match="not compiled at start-up"):
        t._get(("step", 3, SPEC, True))  # a batch of 3: no such bucket
    with pytest.raises(CompileAfterBuildError, match="not compiled at start-up"):
        t.step(t.zeros(1), t.sampling([], 1), SpeculativeConfig(num_steps=2), True)  # an unknown shape
    width = t.proposer.row_width  # the oracle engine's steps also take the proposer's rows
    rows = t.device_put_rows(np.zeros((1, width), np.int32)) if width else None
    with pytest.raises(TypeError):  # a built graph given other shapes refuses instead of recompiling
        t._get(("step", 1, SPEC, True))(t.params, t.zeros(2), t.sampling([], 1), rows)


def test_queued_requests_are_never_dropped(engine, reference):
    out = engine.generate(PROMPTS, [_greedy(n) for n in LENGTHS])  # 7 requests, 4 slots
    assert [c.token_ids for c in out] == [r.token_ids for r in reference]


def test_sampling_is_reproducible_alone_or_batched(engine):
    # With the oracle engine, the proposals are greedy reference tokens; coupled
    # verification keeps the sampled output the target's either way.
    sp = SamplingParams(temperature=0.8, top_k=40, seed=77, max_new_tokens=30, ignore_eos=True)
    alone = engine.generate([PROMPTS[0]], [sp])[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=50, ignore_eos=True) for s in range(5)]
    # Five requests: the batch goes past the cutoff, so this run mixes plain and speculative steps.
    batched = engine.generate([PROMPTS[1], PROMPTS[0]] + PROMPTS[2:6], [others[0], sp] + others[1:])[1].token_ids
    assert alone == batched
    assert engine.generate([PROMPTS[0]], [SamplingParams(temperature=0.8, top_k=40, seed=78, max_new_tokens=30, ignore_eos=True)])[0].token_ids != alone


def test_cancel_frees_the_slot_and_spares_the_others(engine, reference):
    ids = [_add(engine, i, LENGTHS[i]) for i in range(3)]
    for _ in range(4):
        engine.step()
    engine.cancel(ids[0])
    late = _add(engine, 3, LENGTHS[3])
    engine.run_until_done()
    done = {c.id: c for c in engine.pop_finished()}
    assert done[ids[0]].finish_reason == "cancelled"
    assert done[ids[0]].token_ids == reference[0].token_ids[: len(done[ids[0]].token_ids)]
    assert len(done[ids[0]].token_ids) < LENGTHS[0]
    for i, rid in ((1, ids[1]), (2, ids[2]), (3, late)):
        assert done[rid].token_ids == reference[i].token_ids


def test_stream_yields_the_completion_text(model_dir, target, draft):
    from eagle_jax.checkpoint.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    eng = Engine(target, draft, EngineConfig(max_batch=1, max_seq_len=64, prompt_buckets=(64,), speculative=SPEC), tokenizer=tok, progress=False)
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    deltas = list(eng.stream("w5 w6 w7", sp))
    [c] = eng.generate(["w5 w6 w7"], sp)
    assert len(deltas) > 1
    assert "".join(deltas) == c.text and c.text.startswith("w")


def test_detect_nan_names_request_and_step(tmp_path, draft):
    path = tmp_path / "nan"
    make_hf_model("llama3", seed=4).save_pretrained(path, safe_serialization=True)
    bad = load_model(path)
    state = nnx.state(bad, nnx.Param)
    w = np.asarray(state["norm"]["weight"][...]).copy()
    w[0] = np.nan
    state["norm"]["weight"].set_value(w)
    nnx.update(bad, state)
    eng = Engine(bad, draft, EngineConfig(max_batch=1, max_seq_len=32, prompt_buckets=(32,), speculative=SPEC, detect_nan=True), progress=False)
    eng.add_request([5, 6, 7], _greedy(5), request_id="req-7")
    with pytest.raises(NonFiniteError, match=r"step \d+ produced non-finite logits for request 'req-7'"):
        eng.run_until_done()


def test_failed_compile_raises_the_original_error_and_leaves_no_engine(monkeypatch, target, draft):
    import eagle_jax.runtime.step_table as runtime_mod

    def broken(*args, **kwargs):
        raise RuntimeError("injected compile failure")

    monkeypatch.setattr(runtime_mod, "speculative_step_impl", broken)
    gc.collect()
    before = sum(isinstance(o, Engine) for o in gc.get_objects())
    with pytest.raises(RuntimeError, match="injected compile failure") as info:
        Engine(target, draft, EngineConfig(max_batch=2, max_seq_len=32, prompt_buckets=(32,), speculative=SPEC), progress=False)
    assert any("while compiling the speculative step batch 1 chain S=3" in n for n in info.value.__notes__)
    del info
    gc.collect()
    assert sum(isinstance(o, Engine) for o in gc.get_objects()) == before


def test_start_up_logs_what_is_on(target, draft, caplog):
    with caplog.at_level(logging.INFO, logger="eagle_jax.serving.engine"):
        Engine(target, draft, EngineConfig(max_batch=2, max_seq_len=32, prompt_buckets=(32,), speculative=SPEC, spec_disable_batch_threshold=1), progress=False)
    [line] = [r.getMessage() for r in caplog.records if "engine ready" in r.getMessage()]
    for part in ("chain S=3", "off above padded batch 1", "batch buckets (1, 2)", "prompt buckets (32,)", "dtype float32", "graphs compiled",
                 "draft sync deferred (plain steps and prefill store the draft's inputs", "draft_sync=auto"):
        assert part in line


# ----------------------------------------------------------------------------- phase timing

# Speculation at every batch bucket (no cutoff), so every phase graph runs.
TIMED = EngineConfig(max_batch=2, max_seq_len=128, prompt_buckets=(16, 128), speculative=SPEC, time_phases=True)


@pytest.fixture(scope="module")
def timed_engine(target, draft):
    return Engine(target, draft, TIMED, progress=False)


def test_time_phases_is_token_identical_times_both_phases_and_compiles_nothing(timed_engine, reference):
    """Draft and verify as separate timed graphs: the same greedy tokens as the fused
    step, both phases timed, no compile while the batch goes through every bucket."""
    eng, m = timed_engine, timed_engine.metrics
    assert "time_phases on" in repr(eng)
    before, draft_before, verify_before = compile_count(), m.draft_s, m.verify_s
    buckets = set()
    ids = [eng.add_request(PROMPTS[1], _greedy(LENGTHS[1]))]
    for _ in range(3):  # batch 1, then 2 (one request queued), then 1 again
        eng.step()
        buckets.add(len(eng.scheduler.slots))
    ids += [eng.add_request(PROMPTS[i], _greedy(LENGTHS[i])) for i in (4, 6)]
    while eng.has_unfinished():
        eng.step()
        buckets.add(len(eng.scheduler.slots))
    done = {c.id: c for c in eng.pop_finished()}
    timed_out = [done[rid].token_ids for rid in ids]
    assert buckets == set(TIMED.batch_buckets)
    assert compile_count() - before == 0
    draft_s, verify_s = m.draft_s - draft_before, m.verify_s - verify_before
    assert draft_s > 0 and verify_s > 0
    s = m.summary()
    assert s["phase_timing"].startswith("on") and s["plain_steps"] == 0
    assert 0 < s["draft_share"] < 1 and s["draft_ms_per_step"] > 0 and s["verify_ms_per_step"] > 0
    assert timed_out == [reference[i].token_ids for i in (1, 4, 6)]  # the fused step is checked against it above
    off = EngineMetrics().summary()
    assert off["draft_s"] is None and off["verify_s"] is None and off["draft_share"] is None
    assert "time_phases=True" in off["phase_timing"]


def test_time_phases_attributes_time_to_the_right_phase(timed_engine, monkeypatch):
    """A known delay in the draft phase shows up in draft_s and not in verify_s (the split
    is measured, not apportioned)."""
    eng, m = timed_engine, timed_engine.metrics
    real = eng.table.draft_phase
    delay = 0.15

    def slow_draft(*args, **kwargs):
        out = real(*args, **kwargs)
        jax.block_until_ready(out)
        time.sleep(delay)
        return out

    monkeypatch.setattr(eng.table, "draft_phase", slow_draft)
    steps0, d0, v0 = m.spec_steps, m.draft_s, m.verify_s
    eng.generate([PROMPTS[0]], [_greedy(8)])
    n = m.spec_steps - steps0
    assert n > 0
    assert (m.draft_s - d0) / n >= delay
    assert (m.verify_s - v0) / n < delay


# ----------------------------------------------------------------------------- bad input


def test_unknown_checkpoint_path(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Engine(str(tmp_path / "nope"), None, EngineConfig(), progress=False)


def test_draft_that_does_not_fit(target):
    other = ModelConfig.from_hf_dict({**target.config.to_hf_dict(), "vocab_size": 300})
    with pytest.raises(ConfigError, match="vocab"):
        Engine(target, random_draft(other, seed=0), EngineConfig(max_batch=1, max_seq_len=32, speculative=SPEC), progress=False)


def test_speculation_without_draft_is_rejected(target):
    with pytest.raises(ConfigError, match="no draft"):
        Engine(target, None, EngineConfig(max_batch=1, max_seq_len=32, speculative=SPEC), progress=False)
    with pytest.raises(ConfigError, match="spec_policy='fixed' speculates"):
        Engine(target, None, EngineConfig(max_batch=1, max_seq_len=32, spec_policy="fixed"), progress=False)


def test_default_config_decodes_plainly_without_a_draft(model_dir, target):
    """``EngineConfig()``'s policy is auto: without a draft that is plain decoding, from a
    directory as from a loaded target, greedy-equal to the Generator."""
    from eagle_jax.serving.engine import default_policy
    from eagle_jax.serving.policy import FixedPolicy, PlainPolicy

    eng = Engine(str(model_dir), None, EngineConfig(max_batch=1, max_seq_len=32, prompt_buckets=(16,)), progress=False)
    assert isinstance(eng.policy, PlainPolicy) and eng.config.spec_policy == "auto"
    [c] = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    [want] = Generator(target, buckets=Buckets(batch=(1,), prompt=(16,), cache=(32,)), max_seq_len=32).generate(
        [[5, 6, 7]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert c.token_ids == want.token_ids
    # The fixed policy is chosen by the same field, with the default shape.
    assert EngineConfig(spec_policy="fixed").speculative.shape == "tree S=3 k=4 T=8"
    assert EngineConfig(speculative=SPEC).spec_policy == "fixed"
    assert isinstance(default_policy(EngineConfig(spec_policy="fixed")), FixedPolicy)


def test_bfloat16_on_a_cpu_streams_bfloat16_panels_and_stays_lossless(model_dir):
    """``dtype="bfloat16"`` from a directory on a CPU with the packed kernel: the models
    load in float32 and their products stream bfloat16 panels (the start-up line says
    so); speculative output equals plain output under the same weights."""
    from eagle_jax.kernels import cpu_matmul

    if not cpu_matmul.status("cpu")[0]:
        pytest.fail(f"the packed CPU kernel is unavailable here: {cpu_matmul.status('cpu')[1]}")
    base = dict(max_batch=2, max_seq_len=64, prompt_buckets=(16,), dtype="bfloat16", sampled_steps=False)
    plain = Engine(str(model_dir), None, EngineConfig(spec_policy="plain", **base), progress=False)
    assert plain.table.plan.packed_dtype == "bfloat16" and plain.target.dtype == jnp.float32
    assert "as bfloat16 (float32 arithmetic" in plain.description
    prompts = [[5, 6, 7], list(range(3, 30))]
    want = [c.token_ids for c in plain.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))]
    fp32 = Engine(str(model_dir), None, EngineConfig(spec_policy="plain", **{**base, "dtype": "float32"}), progress=False)
    assert fp32.table.plan.packed_dtype == "float32" and "as bfloat16" not in fp32.description
    spec = Engine(str(model_dir), random_draft(plain.target.config, seed=2), EngineConfig(speculative=SPEC, **base), progress=False)
    got = [c.token_ids for c in spec.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))]
    assert got == want and spec.metrics.spec_steps > 0


def test_the_serving_api_is_importable_from_the_package():
    import eagle_jax
    from eagle_jax import Engine as E, EngineConfig as C, SamplingParams as S

    assert (E, C, S) == (Engine, EngineConfig, SamplingParams)
    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        eagle_jax.Engin


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_batch=0), "max_batch"),
        (dict(draft_sync="lazy"), "draft_sync"),
        (dict(max_seq_len=1), "max_seq_len"),
        (dict(max_batch=4, batch_buckets=(1, 2)), "batch_buckets"),
        (dict(batch_buckets=(2, 1, 8)), "batch_buckets"),
        (dict(max_seq_len=64, prompt_buckets=(16, 128)), "prompt_buckets"),  # past max_seq_len
        (dict(spec_disable_batch_threshold=-1), "spec_disable_batch_threshold"),
        (dict(spec_policy="fixed", spec_disable_batch_threshold=2), "spec_disable_batch_threshold"),
        (dict(spec_policy="threshold"), "spec_disable_batch_threshold"),
        (dict(spec_policy="sometimes"), "spec_policy"),
        (dict(long_prompt="drop"), "long_prompt"),
        (dict(dtype="int8"), "dtype"),
        (dict(kernel_impl="cuda"), "kernel_impl"),
        (dict(time_phases="yes"), "time_phases"),
        (dict(spec_policy="plain", time_phases=True), "time_phases"),
        (dict(prefill_token_budget=0), "prefill_token_budget"),
        (dict(sampled_steps="no"), "sampled_steps"),
    ],
)
def test_invalid_engine_config(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**kwargs)


def test_prompt_errors(engine):
    with pytest.raises(InputError, match=r"prompt \d+ is empty"):
        engine.add_request([], _greedy(4))
    with pytest.raises(InputError, match="the prompt has 200 tokens; max_seq_len=128"):
        engine.add_request(list(range(3, 203)), _greedy(4))
    with pytest.raises(InputError, match="outside the vocabulary"):
        engine.add_request([5, 5000], _greedy(4))
    with pytest.raises(InputError, match="SamplingParams"):
        engine.add_request([5], {"temperature": 1.0})
    with pytest.raises(InputError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(InputError, match="no request"):
        engine.cancel("missing")


def test_long_prompt_truncation_is_said(target, draft, caplog):
    eng = Engine(target, draft, EngineConfig(max_batch=1, max_seq_len=32, prompt_buckets=(32,), speculative=SPEC, long_prompt="truncate"), progress=False)
    with caplog.at_level(logging.WARNING, logger="eagle_jax.serving.engine"):
        [c] = eng.generate([list(range(3, 63))], [_greedy(8)])
    assert c.truncated_prompt and c.prompt_token_ids == list(range(39, 63))
    assert len(c.token_ids) == 8
    assert any("truncated" in r.getMessage() for r in caplog.records)
