"""The eagle-jax command line, run as a user runs it (a subprocess)."""

import json
import os
import subprocess
import sys

import pytest


def run(*args, timeout=300):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "eagle_jax.cli", *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"], ["import-gguf", "--help"]])
def test_help(args):
    r = run(*args)
    assert r.returncode == 0
    assert "usage: eagle-jax" in r.stdout


def test_missing_model_dir(tmp_path):
    r = run("generate", "--model", tmp_path / "missing", "--prompt", "hi")
    assert r.returncode == 2
    assert "error: model directory" in r.stderr and "make model" in r.stderr


def test_bad_prompt_file_line_is_named(tmp_path, smollm2_dir):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "a", "prompt": "hello"}\n{"id": "b", "prompt": \n')
    r = run("generate", "--model", smollm2_dir, "--prompt-file", f)
    assert r.returncode == 2
    assert f"{f}:2: not valid JSON" in r.stderr


def test_invalid_sampling_value(smollm2_dir):
    r = run("generate", "--model", smollm2_dir, "--prompt", "hi", "--top-p", "1.5")
    assert r.returncode == 2
    assert "top_p=1.5" in r.stderr


def test_import_gguf_missing_file(tmp_path):
    r = run("import-gguf", tmp_path / "none.gguf", tmp_path / "out")
    assert r.returncode == 2
    assert "none.gguf" in r.stderr


@pytest.mark.slow
@pytest.mark.smollm2
def test_prompt_longer_than_context(smollm2_dir):
    r = run("generate", "--model", smollm2_dir, "--prompt", "word " * 40, "--max-seq-len", "16")
    assert r.returncode == 2
    assert "the context holds 16" in r.stderr


@pytest.mark.slow
@pytest.mark.smollm2
def test_generate_output_file(tmp_path, smollm2_dir):
    f = tmp_path / "p.jsonl"
    lines = [
        {"id": "plain", "prompt": "The capital of France is"},
        {"id": 7, "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    ]
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    out = tmp_path / "out.jsonl"
    r = run("generate", "--model", smollm2_dir, "--prompt-file", f, "--max-new-tokens", "12", "--output", out)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["id"] for x in rows] == ["plain", 7]
    for x in rows:
        assert set(x) == {"id", "prompt_token_ids", "token_ids", "text", "finish_reason", "tokens_per_second", "accept_lengths",
                          "mean_accept_length", "queue_s", "ttft_s", "decode_tokens_per_second"}
        assert 1 <= len(x["token_ids"]) <= 12 and x["finish_reason"] in ("stop", "length")
        assert x["tokens_per_second"] > 0
        assert 0 <= x["queue_s"] <= x["ttft_s"]
        # Counted from the first token, the decode rate is at least the from-arrival rate.
        assert x["decode_tokens_per_second"] is None or x["decode_tokens_per_second"] >= x["tokens_per_second"]
    assert "Paris" in rows[1]["text"]


@pytest.mark.slow
@pytest.mark.smollm2
def test_generate_streams_to_terminal(smollm2_dir):
    r = run("generate", "--model", smollm2_dir, "--chat", "--prompt", "What is the capital of France?", "--max-new-tokens", "16")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tok/s" in r.stderr


@pytest.mark.slow
@pytest.mark.smollm2
def test_generate_speculative_equals_plain(tmp_path, smollm2_dir):
    """--draft with a tree (cutoff above the batch): output equals --no-speculation's."""
    from eagle_jax.checkpoint.draft_io import random_draft, save_draft
    from eagle_jax.config import ModelConfig

    draft = tmp_path / "draft"
    save_draft(random_draft(ModelConfig.from_dir(smollm2_dir), seed=0, draft_vocab_size=4096), draft)
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"id": i, "prompt": p}) for i, p in enumerate(["The sky is", "One, two,", "def f(x):"])))
    outs = {}
    for name, extra in (("spec", ["--draft", draft, "--steps", "3", "--topk", "2", "--draft-tokens", "4", "--spec-disable-batch-threshold", "4"]),
                        ("plain", ["--draft", draft, "--no-speculation"])):
        out = tmp_path / f"{name}.jsonl"
        r = run("generate", "--model", smollm2_dir, "--prompt-file", f, "--max-new-tokens", "10", "--output", out, *extra)
        assert r.returncode == 0, r.stderr
        assert "engine ready" in r.stderr
        outs[name] = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["token_ids"] for x in outs["spec"]] == [x["token_ids"] for x in outs["plain"]]
    assert all(x["accept_lengths"] == [] for x in outs["plain"])
    assert any(x["accept_lengths"] for x in outs["spec"])


def test_doctor_runs(smollm2_dir):
    r = run("doctor", "--model", smollm2_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "eagle_jax.engine" in r.stdout and "editable" in r.stdout
