"""Every command on a tiny random checkpoint of every registered target family (Llama,
Mistral, Qwen2, Qwen3, DeepSeek-V3, Kimi-K2.5), as a user runs them (``eagle-jax ...``,
in-process to keep the suite cheap): the commands read the target through the registry,
never one family's config class. Greedy ``generate`` gives transformers' tokens.

``generate`` and ``doctor`` run on every family. The commands that cost tens of seconds
a family (``generate --draft``, ``bench``, ``eval-draft``, ``draft-data``,
``train-draft``) run on one checkpoint per implementation in the registry (Qwen3 for the
Llama decoder, whose most varied variant it is; Kimi-K2.5 for DeepSeek-V3, which adds
its text_config and tensor prefix), which keeps ``make test`` in its CI budget; the
Llama checkpoint's runs of them are in tests/cli/test_train_cli.py, test_bench.py and
test_eval_draft.py. ``EAGLE_JAX_ALL_FAMILIES=1`` runs them on every family.
"""

import json
import os

import numpy as np
import pytest
import torch

from eagle_jax import cli
from eagle_jax.checkpoint.draft_io import random_draft, save_draft
from eagle_jax.models.registry import read_target_config, supported_architectures
from hf_factories import FAMILIES, write_family_checkpoint

# One checkpoint per target implementation (see the module doc), or every family.
FULL = tuple(FAMILIES) if os.environ.get("EAGLE_JAX_ALL_FAMILIES") == "1" else ("qwen3", "kimi_k25")
PROMPT = "w5 w9 w13 w40"
NEW = 6


def test_every_registered_architecture_has_a_family_here():
    assert sorted(FAMILIES.values()) == sorted(supported_architectures())


_MADE = {}


def _family(name, tmp_path_factory):
    """(name, transformers model, target dir, draft dir, prompt suite), made once."""
    if name not in _MADE:
        root = tmp_path_factory.mktemp(name)
        target = root / "target"
        target.mkdir()
        hf = write_family_checkpoint(name, target, seed=1)
        draft = root / "draft"
        save_draft(random_draft(read_target_config(target), seed=0, draft_vocab_size=64), draft)
        suite = root / "suite.jsonl"
        suite.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate([PROMPT, "w7 w8 w100"])))
        _MADE[name] = (name, hf, target, draft, suite)
    return _MADE[name]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    return _family(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=FULL)
def full_family(request, tmp_path_factory):
    """One family per implementation (see the module doc)."""
    return _family(request.param, tmp_path_factory)


def _generate(target, out, *extra):
    assert cli.main(["generate", "--model", str(target), "--prompt", PROMPT, "--max-new-tokens", str(NEW),
                     "--output", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_generate_gives_transformers_greedy_tokens_and_speculation_keeps_them(family, tmp_path):
    name, hf, target, draft, _ = family
    plain = _generate(target, tmp_path / "plain.jsonl", "--no-speculation")
    with torch.no_grad():
        ref = hf.generate(torch.tensor([plain["prompt_token_ids"]]), max_new_tokens=NEW, do_sample=False,
                          pad_token_id=0)[0, len(plain["prompt_token_ids"]):].tolist()
    # The transformers reference stops at EOS too (our EOS is the model's).
    assert plain["token_ids"] == ref[:len(plain["token_ids"])] and len(plain["token_ids"]) >= 1, name
    if name not in FULL:
        return
    spec = _generate(target, tmp_path / "spec.jsonl", "--draft", str(draft), "--steps", "2", "--topk", "1")
    assert spec["token_ids"] == plain["token_ids"] and spec["accept_lengths"], name


def test_doctor_passes_model_and_draft(family, capsys):
    name, _, target, draft, _ = family
    assert cli.main(["doctor", "--model", str(target), "--draft", str(draft), "--json"]) == 0, name
    report = json.loads(capsys.readouterr().out)
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["model"]["info"]["config"]["architecture"] in FAMILIES.values() and checks["draft"]["status"] == "ok"


def test_bench_and_eval_draft_run(full_family, tmp_path):
    name, _, target, draft, suite = full_family
    out = tmp_path / "bench"
    assert cli.main(["bench", "--model", str(target), "--suite", str(suite), "--transformers", "off",
                     "--max-new-tokens", "4", "--repeats", "1", "--out", str(out)]) == 0, name
    rows = json.loads((out / "bench.json").read_text())["batches"][0]["rows"]
    assert [r["system"] for r in rows] == ["eagle-jax plain"]
    report = tmp_path / "eval.json"
    assert cli.main(["eval-draft", "--model", str(target), "--draft", str(draft), "--suite", str(suite), "--shapes", "1",
                     "--max-new-tokens", "4", "--out", str(report)]) == 0, name
    row = json.loads(report.read_text())["suites"][str(suite)]["shapes"]["chain S=1"]
    assert row["identical_to_plain"]


@pytest.mark.slow
def test_draft_data_then_train_draft(full_family, tmp_path, capsys):
    """Training data, then a (Llama-layer) draft trained on it: an MLA target trains one too."""
    name, _, target, _, _ = full_family
    prompts = tmp_path / "prompts.jsonl"
    rng = np.random.default_rng(0)
    prompts.write_text("".join(json.dumps({"id": i, "prompt": " ".join(f"w{t}" for t in rng.integers(3, 90, 4))}) + "\n"
                               for i in range(3)))
    data = tmp_path / "data"
    assert cli.main(["draft-data", "--model", str(target), "--out", str(data), "--prompt-file", str(prompts),
                     "--eval-prompts", "0", "--max-new-tokens", "4", "--max-seq-len", "16", "--batch-size", "4"]) == 0, name
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["splits"]["train"]["conversations"] == 3
    capsys.readouterr()
    out = tmp_path / "draft"
    rc = cli.main(["train-draft", "--model", str(target), "--data", str(data), "--out", str(out), "--draft-vocab", "32",
                   "--ttt-length", "1", "--epochs", "1", "--batch-size", "2", "--warmup-steps", "0"])
    assert rc == 0, (name, capsys.readouterr().err)
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 32


def test_what_a_family_cannot_do_is_one_error_line(tmp_path, capsys):
    """DeepSeek-V3 / Kimi targets load from Hugging Face directories only: `import-gguf`
    refuses a DeepSeek GGUF (llama.cpp's ``deepseek2``) in one error line, exit status 2."""
    import gguf

    path = tmp_path / "ds.gguf"
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    capsys.readouterr()
    assert cli.main(["import-gguf", str(path), str(tmp_path / "out")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and "GGUF architecture 'deepseek2' is not supported; supported: llama" in line, line
    assert not (tmp_path / "out").exists()
