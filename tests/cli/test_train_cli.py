"""`eagle-jax draft-data` and `eagle-jax train-draft`, run as a user runs them, on a tiny
target: data, then a draft that `generate --draft` uses with output equal to plain."""

import json

import numpy as np
import pytest
import torch

from hf_factories import make_hf_model, write_word_tokenizer
from test_cli import run


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    hf = make_hf_model("llama3", seed=3)
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)
    path = tmp_path_factory.mktemp("tiny_target")
    hf.save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, hf.config.vocab_size)
    return path


@pytest.fixture(scope="module")
def draft_data_run(tiny_dir, tmp_path_factory):
    """(data directory, stderr) of one `draft-data` run."""
    rng = np.random.default_rng(0)
    prompts = tmp_path_factory.mktemp("p") / "prompts.jsonl"
    prompts.write_text("".join(
        json.dumps({"id": i, "prompt": " ".join(f"w{t}" for t in rng.integers(3, 200, 5))}) + "\n" for i in range(24)
    ))
    out = tmp_path_factory.mktemp("data")
    r = run("draft-data", "--model", tiny_dir, "--out", out, "--prompt-file", prompts, "--eval-prompts", "4",
            "--max-new-tokens", "24", "--max-seq-len", "48", "--batch-size", "8", "--progress-every", "0.01")
    assert r.returncode == 0, r.stderr
    return out, r.stderr


@pytest.fixture(scope="module")
def data_dir(draft_data_run):
    return draft_data_run[0]


def test_draft_data_writes_conversations_features_and_manifest(draft_data_run):
    data_dir, err = draft_data_run
    manifest = json.loads((data_dir / "manifest.json").read_text())
    assert manifest["splits"]["train"]["conversations"] == 20
    assert manifest["splits"]["eval"]["conversations"] == 4
    assert len((data_dir / "conversations.jsonl").read_text().splitlines()) == 20
    tokens = np.load(data_dir / "train" / "tokens.npy")
    # Padded to the longest sequence, not to --max-seq-len.
    lengths = np.load(data_dir / "train" / "lengths.npy")
    assert tokens.shape == (20, lengths.max()) and lengths.max() <= 48
    assert np.load(data_dir / "train" / "features.npy").shape == (20, lengths.max(), 3 * 64)
    # stderr is not a terminal here: plain progress lines with counts, rate and ETA.
    assert "answers: 24/24 prompts," in err and "tok/s" in err and "ETA 0:00:00" in err
    assert "train features: 20/20 sequences" in err


@pytest.mark.slow  # the fast suite stays under 20 min on 2 cores
def test_train_draft_then_generate_with_it(tiny_dir, data_dir, tmp_path):
    out = tmp_path / "draft"
    r = run("train-draft", "--model", tiny_dir, "--data", data_dir, "--out", out, "--draft-vocab", "150",
            "--ttt-length", "2", "--epochs", "3", "--batch-size", "8", "--lr", "3e-3", "--warmup-steps", "1")
    assert r.returncode == 0, r.stderr
    assert "eval at step" in r.stderr
    summary = json.loads((out / "training.json").read_text())
    assert summary["train_config"]["ttt_length"] == 2 and summary["final_eval"]["acc"]
    # Outside the working directory, only directory names are recorded, never a machine's paths.
    assert (summary["target"], summary["data"], summary["data_manifest"]["model"]) == (tiny_dir.name, data_dir.name, tiny_dir.name)
    log = [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]
    assert {rec["event"] for rec in log} >= {"vocab", "train", "eval"}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 150 and cfg["architectures"] == ["LlamaForCausalLMEagle3"]

    outs = {}
    for mode in ("plain", "spec"):
        f = tmp_path / f"{mode}.jsonl"
        extra = ["--no-speculation"] if mode == "plain" else ["--draft", out, "--steps", "2"]
        r = run("generate", "--model", tiny_dir, "--prompt", "w5 w9 w13", "--max-new-tokens", "12", "--output", f, *extra)
        assert r.returncode == 0, r.stderr
        outs[mode] = json.loads(f.read_text())
    assert outs["spec"]["token_ids"] == outs["plain"]["token_ids"]
    assert outs["spec"]["accept_lengths"]

    # Continue training it: the vocabulary is kept, a snapshot is written per epoch.
    more = tmp_path / "more"
    r = run("train-draft", "--model", tiny_dir, "--data", data_dir, "--out", more, "--init-draft", out, "--draft-vocab", "100",
            "--ttt-length", "2", "--epochs", "1", "--batch-size", "8", "--save-epochs", "--save-dtype", "float16")
    assert r.returncode == 0, r.stderr
    assert json.loads((more / "config.json").read_text())["draft_vocab_size"] == 150
    assert json.loads((more / "epoch-1" / "config.json").read_text())["torch_dtype"] == "float16"
    assert json.loads((more / "training.json").read_text())["init_draft"] == out.name

    # Existing output directory, and data made for another target, are refused.
    r = run("train-draft", "--model", tiny_dir, "--data", data_dir, "--out", out)
    assert r.returncode == 2 and "--overwrite" in r.stderr
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text((tiny_dir / "config.json").read_text().replace('"rms_norm_eps"', '"x": 1, "rms_norm_eps"'))
    r = run("train-draft", "--model", other, "--data", data_dir, "--out", tmp_path / "d2")
    assert r.returncode == 2 and "was made with the target" in r.stderr


def test_train_draft_without_data(tiny_dir, tmp_path):
    r = run("train-draft", "--model", tiny_dir, "--data", tmp_path, "--out", tmp_path / "d")
    assert r.returncode == 2 and "no manifest.json" in r.stderr


def _train_losses(out):
    """{step: loss} of the run's training log."""
    return {step: rec["loss"] for step, rec in _records(out, "train").items()}


def _records(out, event):
    """{step: record} of the run's training log, for one kind of record."""
    log = [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]
    steps = [rec["step"] for rec in log if rec["event"] == event]
    assert len(steps) == len(set(steps)), f"a step's {event} record was logged twice"
    return {rec["step"]: rec for rec in log if rec["event"] == event}


def _learning_curve(out):
    """{step: (response tokens seen, held-out acceptance by depth)} of the run's evaluations."""
    return {step: (rec["response_tokens_seen"], rec["acc"]) for step, rec in _records(out, "eval").items()}


@pytest.mark.slow  # the fast suite stays under 20 min on 2 cores
def test_killed_training_resumes_with_the_losses_of_an_uninterrupted_run(tiny_dir, data_dir, tmp_path):
    """SIGKILL mid-run, then --resume: every step's loss equals the uninterrupted run's
    (same batches in the same order, nothing repeated or skipped); a corrupted newest
    checkpoint is reported and the one before it used; SIGTERM saves and stops."""
    import os
    import signal
    import subprocess
    import sys
    import time

    settings = ["--model", tiny_dir, "--data", data_dir, "--draft-vocab", "150", "--ttt-length", "2", "--epochs", "40",
                "--batch-size", "4", "--lr", "3e-3", "--warmup-steps", "1", "--log-every", "1", "--checkpoint-every", "7",
                "--eval-every", "3"]
    ref = tmp_path / "ref"
    r = run("train-draft", *settings, "--out", ref)
    assert r.returncode == 0, r.stderr
    want = _train_losses(ref)
    total = max(want)
    assert total == 200 and sorted(want) == list(range(1, total + 1))
    # The learning curve: an evaluation every 3 steps and at every epoch's end (5 steps),
    # each with the response tokens trained on so far; 40 epochs see every one 40 times.
    curve = _learning_curve(ref)
    assert sorted(curve) == sorted({s for s in range(1, total + 1) if s % 3 == 0 or s % 5 == 0})
    response = int((np.load(data_dir / "train" / "lengths.npy") - np.load(data_dir / "train" / "prompt_lengths.npy")).sum())
    assert curve[5][0] == response and curve[total][0] == 40 * response
    seen = [curve[s][0] for s in sorted(curve)]
    assert all(a < b for a, b in zip(seen, seen[1:]))
    assert {s: r["response_tokens_seen"] for s, r in _records(ref, "train").items()}[total] == 40 * response
    summary = json.loads((ref / "training.json").read_text())
    assert summary["train_response_tokens"] == response
    assert [(p["step"], p["tokens"], p["acc"]) for p in summary["learning_curve"]] == [(s, *curve[s]) for s in sorted(curve)]
    png = (ref / "learning_curve.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    # Drawn again from the log alone (as while a run trains).
    from eagle_jax.train.curve import main as curve_main

    assert curve_main([str(ref), "--out", str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").read_bytes().startswith(b"\x89PNG")

    def start(out):
        cmd = [sys.executable, "-m", "eagle_jax.cli", "train-draft", *map(str, settings), "--out", str(out)]
        return subprocess.Popen(cmd, env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)

    def wait_for_step(proc, out, step):
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            log = out / "training_log.jsonl"
            if log.is_file() and log.read_text().count('"event": "train"') >= step:
                return
            time.sleep(0.005)
        raise AssertionError(f"training ended or stalled before step {step}: {proc.stderr.read()[-2000:]}")

    # SIGKILL: no chance to save; the periodic checkpoints (every 7 steps) remain.
    out = tmp_path / "killed"
    proc = start(out)
    wait_for_step(proc, out, 30)
    proc.kill()
    proc.wait(timeout=30)
    assert not (out / "training.json").exists(), "the run finished before it was killed"
    steps = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert len(steps) >= 2 and all(s % 7 == 0 or s % 5 == 0 for s in steps)  # every 7 steps, and at epoch ends (5 steps)
    # Corrupt the newest checkpoint's parameters: resuming says so and uses the one before.
    newest = out / "checkpoints" / str(steps[-1])
    for f in (newest / "params").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    r = run("train-draft", "--resume", out)
    assert r.returncode == 0, r.stderr
    assert f"checkpoint of step {steps[-1]}" in r.stderr and "cannot be read" in r.stderr
    assert f"resumed at step {steps[-2]}" in r.stderr
    assert _train_losses(out) == want
    assert _learning_curve(out) == curve  # the tokens seen are recounted, the evaluations redone alike
    assert (out / "model.safetensors").is_file() and json.loads((out / "training.json").read_text())["final_eval"]

    # SIGTERM: the step in flight finishes, its state is saved, exit status 130.
    out = tmp_path / "terminated"
    proc = start(out)
    wait_for_step(proc, out, 20)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, err
    assert "continue with `eagle-jax train-draft --resume" in err
    r = run("train-draft", "--resume", out)
    assert r.returncode == 0, r.stderr
    assert _train_losses(out) == want
    assert _learning_curve(out) == curve

    # --resume with other flags, or of a directory that is not a run, is refused.
    r = run("train-draft", "--resume", out, "--data", data_dir)
    assert r.returncode == 2 and "drop --data" in r.stderr
    r = run("train-draft", "--resume", tmp_path)
    assert r.returncode == 2 and "no run.json" in r.stderr
