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
