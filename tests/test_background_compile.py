"""Background compile (``EngineConfig.background_compile``): the engine serves plain steps,
greedy-identical to the target, while its speculative graphs compile in another thread;
then the policy calibrates on the engine's thread and speculation starts, still
identical; a compile error is raised from ``step()``; the server's idle loop starts
speculation without waiting for a request, and ``/metrics`` shows what is pending.

The background compile is held at a gate (``StepTable.build_later`` waits on an event
the test sets), so "before" and "after" are states the test chooses, not races."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import pytest

from eagle_jax.checkpoint.draft_io import random_draft
from eagle_jax.checkpoint.hf import load_model
from eagle_jax.errors import ConfigError
from eagle_jax.runtime.step_table import CompileAfterBuildError, StepTable
from eagle_jax.serving.engine import Engine, EngineConfig
from eagle_jax.serving.generate import Buckets, Generator
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.spec.steps import SpeculativeConfig
from hf_factories import make_hf_model

SPEC = SpeculativeConfig(num_steps=2)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
N_NEW = 24
# Speculation at every batch bucket once ready (threshold = max_batch): every step after
# readiness is speculative, so "plain before, speculative after" is exact.
THRESHOLD = EngineConfig(max_batch=2, max_seq_len=64, prompt_buckets=(16,), speculative=SPEC,
                         spec_disable_batch_threshold=2, background_compile=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("bg_target")
    make_hf_model("llama3", seed=4).save_pretrained(path, safe_serialization=True)
    return load_model(path)


@pytest.fixture(scope="module")
def draft(target):
    return random_draft(target.config, seed=2, draft_vocab_size=128)


@pytest.fixture(scope="module")
def reference(target):
    gen = Generator(target, buckets=Buckets(batch=(1, 4), prompt=(16,), cache=(64,)))
    return [c.token_ids for c in gen.generate(PROMPTS, [_greedy()] * len(PROMPTS))]


def _greedy():
    return SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)


@pytest.fixture
def gate(monkeypatch):
    """Hold every background compile until the test sets the event."""
    event = threading.Event()
    original = StepTable.build_later

    def held(self, stop=None):
        assert event.wait(120), "the test never opened the gate"
        return original(self, stop)

    monkeypatch.setattr(StepTable, "build_later", held)
    return event


def test_plain_until_ready_then_speculative_all_greedy_identical(target, draft, reference, gate, caplog):
    caplog.set_level(logging.INFO, logger="eagle_jax.serving.engine")
    engine = Engine(target, draft, THRESHOLD, progress=False)
    assert "speculative graphs compiling in the background" in caplog.text
    pending = engine.table.speculative_pending
    assert not engine.speculation_ready and pending == 2 * 2 * 1  # buckets (1, 2) x greedy/sampled x one shape
    with pytest.raises(CompileAfterBuildError, match="still compiling in the background"):
        engine.table.compiled(("step", 2, SPEC, True))

    before = engine.generate(PROMPTS, _greedy())
    assert [c.token_ids for c in before] == reference
    m = engine.metrics
    assert m.spec_steps == 0 and m.plain_steps > 0
    assert not engine.speculation_ready  # the gate still holds it

    gate.set()
    assert engine.wait_for_speculation(timeout=300)
    assert engine.speculation_ready and engine.table.speculative_pending == 0
    assert "speculation ready" in caplog.text
    plain_steps = m.plain_steps
    after = engine.generate(PROMPTS, _greedy())
    assert [c.token_ids for c in after] == reference
    assert m.spec_steps > 0 and m.plain_steps == plain_steps  # threshold 2 = max_batch: speculates at every bucket
    assert all(c.metrics.spec_steps > 0 for c in after)
    assert m.summary()["process_compiles_since_ready"] == 0


def test_requests_that_straddle_readiness_stay_identical(target, draft, reference, gate):
    """Requests started on plain steps (the draft deferred: its inputs stored) go on
    speculatively once ready: the first speculative step catches the draft up."""
    engine = Engine(target, draft, THRESHOLD, progress=False)
    assert engine.table.draft_sync.mode == "deferred"
    ids = [engine.add_request(p, _greedy()) for p in PROMPTS]
    for _ in range(6):
        engine.step()
    gate.set()
    assert engine.wait_for_speculation(timeout=300)
    engine.run_until_done()
    done = {c.id: c for c in engine.pop_finished()}
    assert [done[i].token_ids for i in ids] == reference
    straddled = [done[i].metrics for i in ids[:2]]  # the two seated first
    assert all(m.plain_steps >= 5 and m.spec_steps > 0 for m in straddled), straddled


def test_auto_calibrates_once_ready(target, draft, reference, gate):
    config = dataclasses.replace(THRESHOLD, spec_policy="auto", spec_disable_batch_threshold=None, speculative=None,
                                 spec_shapes=(SPEC,), spec_calibration_s=0.5, calibration_cache=False)
    engine = Engine(target, draft, config, progress=False)
    assert engine.policy.calibration is None  # nothing timed until the speculative graphs exist
    out = engine.generate(PROMPTS[:1], _greedy())  # plain, and the uncalibrated policy is never asked
    assert out[0].token_ids == reference[0] and engine.metrics.spec_steps == 0
    gate.set()
    assert engine.wait_for_speculation(timeout=300)
    cal = engine.policy.calibration
    assert cal is not None and {(1, SPEC), (2, SPEC), (1, None), (2, None)} <= set(cal.seconds)
    assert [c.token_ids for c in engine.generate(PROMPTS, _greedy())] == reference


def test_a_failed_background_compile_is_raised_from_every_step(target, draft, monkeypatch):
    def boom(self, stop=None):
        raise RuntimeError("no speculative graph for you")

    monkeypatch.setattr(StepTable, "build_later", boom)
    engine = Engine(target, draft, THRESHOLD, progress=False)
    engine._background.done.wait(60)
    engine.add_request(PROMPTS[0], _greedy())
    for _ in range(2):  # not once and then forgotten
        with pytest.raises(RuntimeError, match="no speculative graph for you") as info:
            engine.step()
        assert any("background compile" in n for n in info.value.__notes__)
    assert not engine.speculation_ready


def test_a_failed_background_calibration_is_raised_from_step(target, draft, monkeypatch):
    from eagle_jax.serving.policy import AutoPolicy

    def broken(self, time_step, buckets, **_):
        raise RuntimeError("the calibration broke")

    monkeypatch.setattr(AutoPolicy, "calibrate", broken)
    config = dataclasses.replace(THRESHOLD, spec_policy="auto", spec_disable_batch_threshold=None, speculative=None,
                                 spec_shapes=(SPEC,), calibration_cache=False)
    engine = Engine(target, draft, config, progress=False)
    engine.add_request(PROMPTS[0], _greedy())
    with pytest.raises(RuntimeError, match="the calibration broke"):
        engine.wait_for_speculation(timeout=300)
    with pytest.raises(RuntimeError, match="the calibration broke"):
        engine.step()


def test_a_calibration_the_exit_cuts_off_is_resumed_by_the_next_start(tmp_path, monkeypatch, gate, caplog):
    """A short run ends while the background thread calibrates: the exit hook's stop is
    seen after the bucket in progress, whose timings are saved to the calibration cache
    as part of a record; the next start-up of the same command times only the buckets
    left, then keeps the whole record, which the one after reads without timing."""
    from eagle_jax.checkpoint.draft_io import save_draft
    from eagle_jax.serving.calibration import cache_dir

    monkeypatch.setenv("EAGLE_JAX_CALIBRATION_DIR", str(tmp_path / "calibration"))
    tdir, ddir = tmp_path / "target", tmp_path / "draft"
    make_hf_model("llama3", seed=4).save_pretrained(tdir, safe_serialization=True)
    from hf_factories import write_word_tokenizer

    write_word_tokenizer(tdir, 211)
    save_draft(random_draft(load_model(tdir).config, seed=2, draft_vocab_size=128), ddir)
    config = dataclasses.replace(THRESHOLD, spec_policy="auto", spec_disable_batch_threshold=None, speculative=None,
                                 spec_shapes=(SPEC,), spec_calibration_s=0.5)
    timed, box = [], {}
    real = StepTable.time_step

    def time_step(self, b, shape, **kw):
        timed.append(b)
        if b == 2 and "engine" in box:  # the process exits while bucket 1 is being timed
            box["engine"]._background.stop.set()
        return real(self, b, shape, **kw)

    monkeypatch.setattr(StepTable, "time_step", time_step)
    box["engine"] = first = Engine(str(tdir), str(ddir), config, progress=False)
    gate.set()
    assert first._background.done.wait(300)
    assert isinstance(first._background.error, ConfigError) and "[1] it measured are kept" in str(first._background.error)
    assert not first.speculation_ready
    [path] = cache_dir().glob("*.json")
    import json

    record = json.loads(path.read_text())["record"]
    assert record["partial"] is True and record["buckets"] == [1]
    del box["engine"]

    timed.clear()
    caplog.set_level(logging.INFO, logger="eagle_jax.serving.engine")
    second = Engine(str(tdir), str(ddir), config, progress=False)
    assert second.wait_for_speculation(timeout=300)
    assert timed and set(timed) == {2}, timed  # bucket 1 was not timed again
    assert "1 buckets resumed" in caplog.text
    record = json.loads(path.read_text())["record"]
    assert record["partial"] is False and record["buckets"] == [1, 2]
    assert second.policy.calibration.seconds[(1, SPEC)] == pytest.approx(first.policy._record_rows(record, [1])[1][SPEC])

    timed.clear()
    caplog.clear()
    third = Engine(str(tdir), str(ddir), config, progress=False)
    assert third.wait_for_speculation(timeout=300)
    assert timed == [] and "read from the cache" in caplog.text
    out = third.generate(PROMPTS, _greedy())
    assert [c.token_ids for c in out] == [c.token_ids for c in second.generate(PROMPTS, _greedy())]


EXIT_SCRIPT = """
import sys
from eagle_jax.checkpoint.draft_io import random_draft
from eagle_jax.checkpoint.hf import load_model
from eagle_jax.serving.engine import Engine, EngineConfig
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.spec.steps import SpeculativeConfig
target = load_model(sys.argv[1])
draft = random_draft(target.config, seed=2, draft_vocab_size=128)
config = EngineConfig(max_batch=2, max_seq_len=64, prompt_buckets=(16,), speculative=SpeculativeConfig(num_steps=2),
                      spec_disable_batch_threshold=2, background_compile=True)
engine = Engine(target, draft, config, progress=False)
out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2, ignore_eos=True))
print("pending at exit:", engine.table.speculative_pending, "tokens:", out[0].token_ids, flush=True)
"""


def test_a_process_that_ends_mid_compile_exits_cleanly(tmp_path):
    """A short run ends while the speculative graphs still compile: the exit hook stops the
    thread between graphs and waits for the one in progress (a daemon thread left inside
    XLA crashed the interpreter at exit with SIGSEGV in a short `generate`)."""
    import subprocess
    import sys

    path = tmp_path / "target"
    make_hf_model("llama3", seed=4).save_pretrained(path, safe_serialization=True)
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    p = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "pending at exit:" in p.stdout


def test_background_compile_needs_a_policy_that_runs_plain(target, draft):
    with pytest.raises(ConfigError, match="never runs plain"):
        EngineConfig(speculative=SPEC, spec_policy="fixed", background_compile=True)
    with pytest.raises(ConfigError, match="background_compile"):
        EngineConfig(background_compile="yes")


def test_without_a_draft_there_is_nothing_to_wait_for(target, reference):
    engine = Engine(target, None, dataclasses.replace(THRESHOLD, spec_policy="auto", speculative=None,
                                                      spec_disable_batch_threshold=None), progress=False)
    assert engine.speculation_ready and engine.table.speculative_pending == 0
    assert [c.token_ids for c in engine.generate(PROMPTS, _greedy())] == reference


def test_the_server_loop_starts_speculation_while_idle(target, draft, gate):
    from eagle_jax.server.metrics import ServerMetrics
    from eagle_jax.server.worker import EngineThread

    engine = Engine(target, draft, THRESHOLD, progress=False)
    metrics = ServerMetrics(THRESHOLD.max_batch, SPEC.num_steps + 1)
    worker = EngineThread(engine, metrics)
    worker.start()
    try:
        time.sleep(0.3)  # a few idle turns of the loop
        assert not worker.speculation_ready
        assert metrics.registry.get_sample_value("eagle_jax_speculative_graphs_pending") == 4
        gate.set()
        deadline = time.monotonic() + 300
        while not worker.speculation_ready:  # no request: the idle loop polls
            assert worker.error is None, worker.error
            assert time.monotonic() < deadline, "speculation never became ready while the server was idle"
            time.sleep(0.05)
        time.sleep(0.2)
        assert metrics.registry.get_sample_value("eagle_jax_speculative_graphs_pending") == 0
    finally:
        assert worker.stop(30)
    assert worker.error is None
