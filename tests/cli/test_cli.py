"""The eagle-jax command line, run as a user runs it (a subprocess)."""

import json
import os
import re
import subprocess
import sys

import pytest

from eagle_jax.cli import build_parser
from eagle_jax.errors import InputError
from eagle_jax.spec.config import SpeculativeConfig


def run(*args, timeout=300):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "eagle_jax.cli", *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"], ["serve", "--help"], ["import-gguf", "--help"]])
def test_help(args):
    r = run(*args)
    assert r.returncode == 0
    assert "usage: eagle-jax" in r.stdout


def test_missing_model_dir(tmp_path):
    r = run("generate", "--model", tmp_path / "missing", "--prompt", "hi")
    assert r.returncode == 2
    assert "error: model directory" in r.stderr and "make model" in r.stderr


def test_verbosity_counts_and_vv_turns_on_eagle_jax_debug_lines(tmp_path):
    """-v logs at INFO, -vv adds eagle-jax's DEBUG lines (each graph's compile seconds);
    without either the start-up lines still show (INFO for eagle_jax)."""
    import logging

    from eagle_jax import cli

    assert [build_parser().parse_args([*v, "doctor"]).verbose for v in ([], ["-v"], ["-vv"])] == [0, 1, 2]
    logger = logging.getLogger("eagle_jax")
    try:
        for flags, level in (([], logging.INFO), (["-vv"], logging.DEBUG), (["-v"], logging.INFO)):
            assert cli.main([*flags, "generate", "--model", str(tmp_path / "missing"), "--prompt", "hi"]) == 2
            assert logger.level == level, flags
    finally:
        logger.setLevel(logging.INFO)


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
    from eagle_jax.models.config import ModelConfig

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
    assert "eagle_jax.serving.engine" in r.stdout


@pytest.mark.parametrize(
    "argv, want",
    [
        ([], "auto"),
        (["--spec-shapes", "chain S=1, tree S=3 k=4 T=8"], "auto"),
        (["--steps", "2", "--topk", "1"], "fixed"),
        (["--spec-disable-batch-threshold", "4"], "threshold"),
        (["--spec-policy", "fixed"], "fixed"),
        (["--spec-policy", "threshold", "--steps", "2", "--spec-disable-batch-threshold", "1"], "threshold"),
        (["--spec-policy", "auto", "--steps", "2"], "--steps set the fixed shape; with --spec-policy auto list candidates"),
        (["--spec-policy", "fixed", "--spec-shapes", "chain S=1"], "--spec-shapes are auto's candidates"),
        (["--spec-policy", "auto", "--spec-disable-batch-threshold", "2"], "goes with --spec-policy threshold, not auto"),
        (["--spec-policy", "threshold"], "needs --spec-disable-batch-threshold"),
        (["--spec-calibration-s", "0"], "--spec-calibration-s 0.0 must be > 0"),
    ],
)
def test_spec_policy_flags(argv, want):
    from eagle_jax.cli import _spec_policy

    args = build_parser().parse_args(["generate", "--prompt", "x", *argv])
    if want in ("auto", "fixed", "threshold"):
        assert _spec_policy(args) == want
    else:
        with pytest.raises(InputError, match=re.escape(want)):
            _spec_policy(args)


def _described(policy):
    from eagle_jax.serving.policy import policy_shapes

    return type(policy).__name__, policy.describe(), tuple(policy_shapes(policy)), policy.runs_plain


@pytest.mark.parametrize("argv, api", [
    ([], {}),
    (["--spec-shapes", "chain S=1, tree S=3 k=4 T=8"], dict(spec_shapes=("chain S=1", "tree S=3 k=4 T=8"))),
    (["--spec-policy", "auto", "--spec-calibration-s", "5"], dict(spec_policy="auto", spec_calibration_s=5.0)),
    (["--steps", "2", "--topk", "1"], dict(speculative=SpeculativeConfig(num_steps=2))),
    (["--spec-policy", "fixed"], dict(spec_policy="fixed")),
    (["--topk", "2"], dict(speculative=SpeculativeConfig(num_steps=3, topk=2, num_draft_tokens=8))),
    (["--spec-disable-batch-threshold", "4"], dict(spec_disable_batch_threshold=4)),
    (["--background-compile"], dict(background_compile=True)),
    (["--spec-policy", "threshold", "--steps", "2", "--spec-disable-batch-threshold", "1"],
     dict(speculative=SpeculativeConfig(num_steps=2, topk=4, num_draft_tokens=8), spec_disable_batch_threshold=1)),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_cli_and_api_build_the_same_policy(argv, api):
    """The generate flags and the same settings given to ``EngineConfig`` (its defaults
    for the flags not given) build the same policy and shapes, with a draft and without."""
    from eagle_jax.cli import engine_config
    from eagle_jax.serving.engine import EngineConfig, default_policy
    from eagle_jax.serving.policy import parse_shape

    args = build_parser().parse_args(["generate", "--prompt", "x", *argv])
    if "spec_shapes" in api:
        api = {**api, "spec_shapes": tuple(parse_shape(t) for t in api["spec_shapes"])}
    sizes = dict(batch=4, max_seq_len=64, longest=10)
    for draft in (True, False):
        cli_config = engine_config(args, draft=draft, **sizes)
        api_config = EngineConfig(max_batch=4, max_seq_len=64, batch_buckets=cli_config.batch_buckets,
                                  prompt_buckets=cli_config.prompt_buckets, sampled_steps=False,
                                  **(api if draft else {"spec_policy": "plain", "spec_calibration_s": api.get("spec_calibration_s", 20.0),
                                                  "background_compile": api.get("background_compile", False)}))
        assert cli_config == api_config, draft
        assert _described(default_policy(cli_config, has_draft=draft)) == _described(default_policy(api_config, has_draft=draft))
    # Without a draft the defaults decode plainly, with one they run auto.
    assert _described(default_policy(EngineConfig(), has_draft=False))[0] == "PlainPolicy"
    assert _described(default_policy(EngineConfig(), has_draft=True))[0] == "AutoPolicy"


def test_background_compile_with_a_fixed_shape_is_refused():
    from eagle_jax.cli import engine_config
    from eagle_jax.errors import ConfigError

    args = build_parser().parse_args(["generate", "--prompt", "x", "--steps", "2", "--background-compile"])
    with pytest.raises(ConfigError, match="never runs plain"):
        engine_config(args, draft=True, batch=4, max_seq_len=64, longest=10)


@pytest.mark.parametrize("argv, on", [
    ([], True), (["--spec-disable-batch-threshold", "4"], True), (["--no-background-compile"], False),
    (["--steps", "2", "--topk", "1"], False), (["--no-speculation"], False),
])
def test_serve_compiles_in_the_background_by_default_where_the_policy_serves_plain(argv, on):
    """serve (background_default=True, as serve_engine passes) starts answering with plain
    steps under auto and threshold unless --no-background-compile; a fixed shape or no
    speculation has nothing to compile later; generate keeps it off unless asked."""
    from eagle_jax.cli import engine_config

    sizes = dict(batch=4, max_seq_len=64, longest=10)
    serve = build_parser().parse_args(["serve", *argv])
    assert engine_config(serve, draft="--no-speculation" not in argv, background_default=True, sampled=True,
                         **sizes).background_compile is on
    generate = build_parser().parse_args(["generate", "--prompt", "x", *argv])
    assert engine_config(generate, draft="--no-speculation" not in argv, **sizes).background_compile is False


def test_unknown_spec_shape_is_a_start_up_error(tmp_path, capsys):
    from eagle_jax.cli import main

    model = tmp_path / "m"
    draft = tmp_path / "d"
    model.mkdir()
    draft.mkdir()
    rc = main(["generate", "--model", str(model), "--draft", str(draft), "--prompt", "x", "--spec-shapes", "chain S=2, chian S=3"])
    assert rc == 2
    assert "'chian S=3' is not 'chain S=<n>'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_tp_model(tmp_path_factory):
    """A tiny random Llama whose heads (4), KV heads (2), MLP width and vocabulary (256)
    split over model=2, with a word-level tokenizer."""
    import torch
    import transformers

    from hf_factories import TINY, write_word_tokenizer

    path = tmp_path_factory.mktemp("tiny_tp")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**TINY, "vocab_size": 256}, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, 256)
    return path


def _run_devices(n_devices, *args, timeout=300, env=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(n_devices), **(env or {}))
    return subprocess.run([sys.executable, "-m", "eagle_jax.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_generate_on_a_tensor_parallel_mesh_matches_one_device(tmp_path, tiny_tp_model):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(["w5 w6 w7", "w9 w3 w11 w40 w8"])))
    rows = {}
    for mesh in ("data=1,model=1", "data=1,model=2"):
        out = tmp_path / f"{mesh}.jsonl"
        r = _run_devices(2, "generate", "--model", tiny_tp_model, "--prompt-file", f, "--max-new-tokens", "8",
                         "--no-speculation", "--mesh", mesh, "--output", out)
        assert r.returncode == 0, r.stderr
        assert f"mesh {mesh} over" in r.stderr
        rows[mesh] = [json.loads(x)["token_ids"] for x in out.read_text().splitlines()]
    assert rows["data=1,model=2"] == rows["data=1,model=1"]
    assert all(len(t) == 8 for t in rows["data=1,model=1"])


def test_a_mesh_over_some_devices_loads_its_cached_executables(tmp_path, tiny_tp_model):
    """A mesh over one of two devices, run twice with a fresh cache: the second run loads
    every graph from the executable cache and decodes as the first. (Loaded for every
    device of the backend, its first call failed: "execute with 2 argument lists when
    local device count is 1".)"""
    import re

    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": 0, "prompt": "w5 w6 w7"}) + "\n")
    outs, loaded = [], []
    for i in range(2):
        out = tmp_path / f"{i}.jsonl"
        env = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jit"), "EAGLE_JAX_EXECUTABLE_CACHE": "on"}
        r = _run_devices(2, "generate", "--model", tiny_tp_model, "--prompt-file", f, "--max-new-tokens", "8",
                         "--no-speculation", "--mesh", "data=1,model=1", "--output", out, env=env)
        assert r.returncode == 0, r.stderr
        assert "mesh data=1,model=1 over ['cpu:0']" in r.stderr
        m = re.search(r"(\d+) of (\d+) loaded untraced from the executable cache", r.stderr)
        assert m, r.stderr
        loaded.append((int(m.group(1)), int(m.group(2))))
        outs.append([json.loads(x)["token_ids"] for x in out.read_text().splitlines()])
    assert loaded[0][0] == 0 and loaded[1][0] == loaded[1][1] > 0, loaded
    assert outs[1] == outs[0] and len(outs[0][0]) == 8


@pytest.mark.slow
def test_generate_across_two_processes_matches_one(tmp_path, tiny_tp_model):
    """``--coordinator/--num-processes/--process-id``: two processes of one CPU device
    each (gloo on loopback), one model=2 mesh over both; process 0 writes the output,
    process 1 writes nothing; the tokens are the single-process run's."""
    import socket

    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(["w5 w6 w7", "w9 w3 w11 w40 w8"])))
    one = tmp_path / "one.jsonl"
    r = _run_devices(1, "generate", "--model", tiny_tp_model, "--prompt-file", f, "--max-new-tokens", "8",
                     "--no-speculation", "--output", one)
    assert r.returncode == 0, r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "eagle_jax.cli", "generate", "--model", str(tiny_tp_model), "--prompt-file", str(f),
         "--max-new-tokens", "8", "--no-speculation", "--mesh", "data=1,model=2", "--output", str(tmp_path / f"{i}.jsonl"),
         "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    errs = []
    for q in procs:
        try:
            errs.append(q.communicate(timeout=300)[1])
        except subprocess.TimeoutExpired:
            for k in procs:
                k.kill()
            raise
        assert q.returncode == 0, errs[-1][-3000:]
    assert "(process 0 of 2; tokens read back replicated)" in errs[0]
    assert "(process 1 of 2; tokens read back replicated)" in errs[1]
    assert not (tmp_path / "1.jsonl").exists()
    got = [json.loads(x)["token_ids"] for x in (tmp_path / "0.jsonl").read_text().splitlines()]
    assert got == [json.loads(x)["token_ids"] for x in one.read_text().splitlines()]
    assert all(len(t) == 8 for t in got)


def test_generate_with_a_mesh_larger_than_the_machine_is_a_clear_error(tiny_tp_model):
    r = _run_devices(2, "generate", "--model", tiny_tp_model, "--prompt", "w5 w6", "--no-speculation",
                     "--mesh", "data=2,model=2")
    assert r.returncode == 2
    assert "error: mesh data=2,model=2 needs 4 devices; 2 are available" in r.stderr
    r = _run_devices(2, "generate", "--model", tiny_tp_model, "--prompt", "w5 w6", "--mesh", "model=two")
    assert r.returncode == 2 and "expected 'auto' or 'data=D,model=M'" in r.stderr


@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_on_three_model_shards_matches_one_device(tmp_path, smollm2_dir):
    """SmolLM2-135M: 9 heads, 3 KV heads, MLP 1536, vocabulary 49152, all split over model=3."""
    rows = {}
    for mesh in ("data=1,model=1", "data=1,model=3"):
        out = tmp_path / f"{mesh}.jsonl"
        r = _run_devices(3, "generate", "--model", smollm2_dir, "--prompt", "The capital of France is",
                         "--max-new-tokens", "12", "--no-speculation", "--mesh", mesh, "--output", out, timeout=900)
        assert r.returncode == 0, r.stderr
        rows[mesh] = json.loads(out.read_text())["token_ids"]
    assert "KV heads: 3 split over model" in r.stderr
    assert rows["data=1,model=3"] == rows["data=1,model=1"]
