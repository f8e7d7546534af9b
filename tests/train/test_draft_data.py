"""`draft-data` on real-style prompt files: multi-turn records (token layout, loss mask),
bad and unusable records, resuming a killed run (in process and by SIGKILL), refusing to
resume with other inputs, and the streamed, resumable feature files."""

import json
import os
from pathlib import Path
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from eagle_jax.checkpoint.draft_io import random_draft
from eagle_jax.checkpoint.hf import load_model
from eagle_jax.cli import build_parser
from eagle_jax.errors import InputError
from eagle_jax.train import data as data_mod
from eagle_jax.train.commands import _context_for
from eagle_jax.train.data import (
    Conversation,
    FeatureSet,
    answer_params,
    extract_features,
    read_answered,
    read_conversations,
    write_features,
)
from eagle_jax.train.ttt import ttt_loss
from hf_factories import make_hf_model, write_word_tokenizer

# Word i is token i. The template marks roles with their own words (w6 system, w3 user,
# w4 assistant, w5 end of turn), so a test can write the expected ids by hand.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}w6{% elif m['role'] == 'user' %}w3{% else %}w4{% endif %}"
    " {{ m['content'] }} w5 {% endfor %}{% if add_generation_prompt %}w4{% endif %}"
)
MULTI_TURN = {"id": "mt-1", "messages": [
    {"role": "user", "content": "w10 w11"},
    {"role": "assistant", "content": "w20 w21 w22"},
    {"role": "user", "content": "w30"},
]}
# The template over all three turns plus the generation prompt, written out by hand.
MULTI_TURN_IDS = [3, 10, 11, 5, 4, 20, 21, 22, 5, 3, 30, 5, 4]
# Prompts of up to 128 tokens are answered in a context of 128 + 16, longer ones in one
# of 160 (two engines); prompts may have 160 - 16 = 144 tokens.
SETTINGS = ["--max-new-tokens", "16", "--max-seq-len", "160", "--batch-size", "2", "--sampled-fraction", "0.5"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    hf = make_hf_model("llama3", seed=3)
    with torch.no_grad():  # a peaky head: answers that do not hinge on rounding
        hf.lm_head.weight.mul_(8.0)
    path = tmp_path_factory.mktemp("tiny_chat_target")
    hf.save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, hf.config.vocab_size)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": CHAT_TEMPLATE}))
    return path


def _words(rng, lo=3, hi=9):
    return " ".join(f"w{t}" for t in rng.integers(10, 200, int(rng.integers(lo, hi))))


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory):
    """A training file (single-turn, one multi-turn, one long prompt, four unusable
    records) and a held-out file."""
    rng = np.random.default_rng(0)
    recs = [{"id": f"s-{i}", "messages": [{"role": "user", "content": _words(rng)}]} for i in range(40)]
    recs.insert(5, MULTI_TURN)
    recs.insert(9, {"id": "bad-last", "messages": [{"role": "user", "content": "w10"}, {"role": "assistant", "content": "w20"}]})
    recs.insert(12, {"id": "bad-role", "messages": [{"role": "tool", "content": "w10"}, {"role": "user", "content": "w11"}]})
    recs.insert(15, {"id": "bad-empty", "messages": [{"role": "user", "content": "  "}]})
    # 142 + 3 template tokens: over the 144 tokens a prompt may have; 133 + 3 fit.
    recs.insert(20, {"id": "too-long", "messages": [{"role": "user", "content": " ".join(["w12"] * 142)}]})
    recs.insert(25, {"id": "long", "messages": [{"role": "user", "content": _words(rng, 133, 134)}]})
    held = [{"id": f"h-{i}", "messages": [{"role": "user", "content": _words(rng)}]} for i in range(3)]
    d = tmp_path_factory.mktemp("prompts")
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (d / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held))
    return d / "train.jsonl", d / "held.jsonl"


def draft_data(*argv):
    args = build_parser().parse_args(["draft-data", *map(str, argv)])
    return args.func(args)


def _argv(tiny_dir, prompt_files, out, *extra):
    train, held = prompt_files
    return ["--model", tiny_dir, "--out", out, "--prompt-file", train, "--eval-prompt-file", held, *SETTINGS, *extra]


@pytest.fixture(scope="module")
def reference(tiny_dir, prompt_files, tmp_path_factory):
    """An uninterrupted run."""
    out = tmp_path_factory.mktemp("reference")
    assert draft_data(*_argv(tiny_dir, prompt_files, out)) == 0
    return out


def test_multi_turn_layout_and_loss_mask(tiny_dir, reference):
    convs = read_conversations(reference / "conversations.jsonl")
    ids = [c.id for c in convs]
    # Usable records only, in file order; each answered once.
    assert ids[:6] == ["s-0", "s-1", "s-2", "s-3", "s-4", "mt-1"] and len(ids) == len(set(ids)) == 42
    assert len(convs[ids.index("long")].prompt_ids) == 136
    row = ids.index("mt-1")
    conv = convs[row]
    assert conv.prompt_ids == MULTI_TURN_IDS and conv.response_ids

    fs = FeatureSet.load(reference / "train")
    mask = fs.loss_mask()
    n_prompt, n = len(MULTI_TURN_IDS), len(MULTI_TURN_IDS) + len(conv.response_ids)
    assert fs.prompt_lengths[row] == n_prompt and fs.lengths[row] == n
    assert fs.tokens[row, :n].tolist() == MULTI_TURN_IDS + conv.response_ids
    # True exactly on the new answer: the first user turn, the original assistant reply
    # (positions 4..8) and the generation prompt are context.
    assert np.flatnonzero(mask[row]).tolist() == list(range(n_prompt, n))
    assert fs.tokens[row][mask[row]].tolist() == conv.response_ids
    assert not mask[row, 4:9].any()
    for i, c in enumerate(convs):
        assert fs.tokens[i][mask[i]].tolist() == c.response_ids

    # The trainer's loss counts the same positions: with every token in the draft
    # vocabulary, step 0 predicts each masked position once (labels start at position 2,
    # and every prompt here is longer than that).
    target = load_model(tiny_dir)
    draft = random_draft(target.config, seed=1, draft_vocab_size=target.config.vocab_size)
    batch = {k: jnp.asarray(np.asarray(getattr(fs, k))) for k in ("tokens", "lengths", "prompt_lengths", "features", "target_hidden", "target_argmax")}
    head = jnp.zeros((target.config.hidden_size, target.config.vocab_size))
    _, aux = ttt_loss(draft, head, batch, ttt_length=1, step_decay=1.0)
    assert int(aux["count"][0]) == int(mask.sum())


def test_unusable_records_are_counted(reference):
    manifest = json.loads((reference / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert manifest["skipped"]["train"] == {
        "last turn not from the user": 1, "unknown role": 1, "empty content": 1, "prompt over 144 tokens": 1,
    }
    assert manifest["splits"]["train"]["conversations"] == 42 and manifest["splits"]["eval"]["conversations"] == 3
    assert [c.id for c in read_conversations(reference / "eval_conversations.jsonl")] == ["h-0", "h-1", "h-2"]
    assert manifest["prompt_files"] == {"train": "train.jsonl", "eval": "held.jsonl"}
    assert not os.path.isabs(manifest["model"])


def test_context_groups():
    # Most chat prompts are short: they get an engine whose cache fits them, not the longest.
    assert [_context_for(n, 256, 1024) for n in (5, 128, 129, 256, 300, 768)] == [384, 384, 512, 512, 768, 1024]
    assert _context_for(10, 16, 48) == 48


def test_sampled_answers_follow_the_id():
    a = answer_params("x-1", seed=0, sampled_fraction=0.5, temperature=0.7, max_new_tokens=8)
    assert a == answer_params("x-1", seed=0, sampled_fraction=0.5, temperature=0.7, max_new_tokens=8)
    kinds = [answer_params(f"x-{i}", seed=0, sampled_fraction=0.5, temperature=0.7, max_new_tokens=8) for i in range(200)]
    assert 60 < sum(not k.greedy for k in kinds) < 140
    assert len({k.seed for k in kinds if not k.greedy}) == sum(not k.greedy for k in kinds)
    assert all(k.greedy for k in (answer_params(f"x-{i}", seed=0, sampled_fraction=0.0, temperature=0.7, max_new_tokens=8) for i in range(50)))


class _Killed(Exception):
    pass


def test_resume_after_interruption_equals_uninterrupted(tiny_dir, prompt_files, reference, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    real_add = data_mod.ConversationWriter.add
    calls = []

    def dying_add(self, conv):
        if len(calls) == 7:
            raise _Killed()
        calls.append(conv.id)
        real_add(self, conv)

    monkeypatch.setattr(data_mod.ConversationWriter, "add", dying_add)
    with pytest.raises(_Killed):
        draft_data(*_argv(tiny_dir, prompt_files, out))
    monkeypatch.undo()
    path = out / "conversations.jsonl"
    assert len(path.read_text().splitlines()) == 7
    assert json.loads((out / "manifest.json").read_text())["status"] == "in progress"
    # A kill in the middle of the next write leaves a torn line.
    whole = json.dumps({"prompt_ids": [3, 4], "response_ids": [5, 6], "id": "s-39"})
    with open(path, "a") as f:
        f.write(whole[:20])

    train = build_parser().parse_args(["train-draft", "--model", str(tiny_dir), "--data", str(out), "--out", str(tmp_path / "d")])
    with pytest.raises(InputError, match="unfinished `draft-data` output"):
        train.func(train)

    capsys.readouterr()
    assert draft_data(*_argv(tiny_dir, prompt_files, out)) == 0
    err = capsys.readouterr().err
    assert "torn by an interrupted run" in err and "7 of 42 prompts already answered" in err
    assert "37 prompts in a context of 144 tokens" in err and "1 prompts in a context of 160 tokens" in err, err
    # Same ids, same tokens, in the same order, nothing twice.
    assert path.read_bytes() == (reference / "conversations.jsonl").read_bytes()
    assert (out / "eval_conversations.jsonl").read_bytes() == (reference / "eval_conversations.jsonl").read_bytes()
    a, b = FeatureSet.load(out / "train"), FeatureSet.load(reference / "train")
    for name in data_mod.FEATURE_FILES:
        np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)), err_msg=name)


@pytest.mark.slow  # the fast suite stays under 20 min on 2 cores
def test_sigkilled_run_resumes(tiny_dir, prompt_files, reference, tmp_path):
    """A real kill: the process is SIGKILLed once it has written some answers (while it
    answers the rest, or while it computes features: both must resume)."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "eagle_jax.cli", "draft-data", *map(str, _argv(tiny_dir, prompt_files, out))]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    path = out / "conversations.jsonl"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if path.is_file() and path.read_text().count("\n") >= 3:
                break
            time.sleep(0.01)
        assert proc.poll() is None, f"draft-data ended before it could be killed: {proc.stderr.read()[-2000:]}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "already answered" in r.stderr
    assert path.read_bytes() == (reference / "conversations.jsonl").read_bytes()
    a, b = FeatureSet.load(out / "train"), FeatureSet.load(reference / "train")
    for name in data_mod.FEATURE_FILES:
        np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)), err_msg=name)


def test_growing_train_prompts_keeps_answers_and_equals_a_full_run(tiny_dir, prompt_files, reference, tmp_path, capsys):
    """--train-prompts N answers the first N; a larger N later asks only for the new
    prompts and ends equal to a run over all of them; a smaller N is refused."""
    out = tmp_path / "out"
    assert draft_data(*_argv(tiny_dir, prompt_files, out, "--train-prompts", "10")) == 0
    first = (out / "conversations.jsonl").read_text().splitlines()
    ref = (reference / "conversations.jsonl").read_text().splitlines()
    assert first == ref[:10]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["train_prompts"] == 10 and manifest["splits"]["train"]["conversations"] == 10
    capsys.readouterr()
    assert draft_data(*_argv(tiny_dir, prompt_files, out, "--train-prompts", "1000")) == 0
    assert "10 of 42 prompts already answered" in capsys.readouterr().err
    assert (out / "conversations.jsonl").read_bytes() == (reference / "conversations.jsonl").read_bytes()
    a, b = FeatureSet.load(out / "train"), FeatureSet.load(reference / "train")
    for name in data_mod.FEATURE_FILES:
        np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)), err_msg=name)
    with pytest.raises(InputError, match=r"not in this run's train prompts.*larger --train-prompts than 5"):
        draft_data(*_argv(tiny_dir, prompt_files, out, "--train-prompts", "5"))
    with pytest.raises(InputError, match="--train-prompts needs --prompt-file"):
        draft_data("--model", tiny_dir, "--out", tmp_path / "syn", "--synthetic", "4", "--train-prompts", "2", *SETTINGS)


def test_skip_train_prompts_takes_the_next_ones(tiny_dir, prompt_files, reference, tmp_path):
    """--skip-train-prompts K --train-prompts N answers exactly the full run's prompts
    K..K+N-1 (what a continued draft trains on); the same --out with another K is refused."""
    out = tmp_path / "out"
    assert draft_data(*_argv(tiny_dir, prompt_files, out, "--skip-train-prompts", "10", "--train-prompts", "8")) == 0
    ref = (reference / "conversations.jsonl").read_text().splitlines()
    assert (out / "conversations.jsonl").read_text().splitlines() == ref[10:18]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["prompts"]["train"]["skipped_first"] == 10
    with pytest.raises(InputError, match="skipped_first"):
        draft_data(*_argv(tiny_dir, prompt_files, out, "--skip-train-prompts", "9", "--train-prompts", "8"))
    with pytest.raises(InputError, match="--skip-train-prompts 42 leaves none of the 42"):
        draft_data(*_argv(tiny_dir, prompt_files, tmp_path / "o2", "--skip-train-prompts", "42"))
    with pytest.raises(InputError, match="--skip-train-prompts needs --prompt-file"):
        draft_data("--model", tiny_dir, "--out", tmp_path / "syn", "--synthetic", "4", "--skip-train-prompts", "2", *SETTINGS)


def test_bad_lines_are_named(tiny_dir, tmp_path):
    def attempt(text, held=None):
        f = tmp_path / "p.jsonl"
        f.write_text(text)
        extra = []
        if held is not None:
            (tmp_path / "h.jsonl").write_text(held)
            extra = ["--eval-prompt-file", tmp_path / "h.jsonl"]
        return draft_data("--model", tiny_dir, "--out", tmp_path / "out", "--prompt-file", f, *extra, *SETTINGS)

    good = json.dumps({"id": "a", "messages": [{"role": "user", "content": "w10"}]}) + "\n"
    with pytest.raises(InputError, match=r"p\.jsonl:3: not valid JSON"):
        attempt(good + "\n" + '{"id": "b", "messages": [\n')
    with pytest.raises(InputError, match=r"p\.jsonl:2: messages\[0\] must be an object with string 'role' and 'content'"):
        attempt(good + json.dumps({"id": "b", "messages": [{"role": "user", "content": 5}]}) + "\n")
    with pytest.raises(InputError, match=r"p\.jsonl:3: id 'a' repeats the id of line 1"):
        attempt(good + good.replace('"a"', '"b"') + good)
    with pytest.raises(InputError, match=r"h\.jsonl:1: id 'a' is also in .*p\.jsonl:1"):
        attempt(good, held=good)
    assert not (tmp_path / "out").exists()


def test_resume_with_other_settings_is_refused(tiny_dir, prompt_files, reference, tmp_path):
    before = (reference / "manifest.json").read_text()
    with pytest.raises(InputError, match=r"other inputs or settings.*seed: 0 there, 1 now.*delete"):
        draft_data(*_argv(tiny_dir, prompt_files, reference, "--seed", "1"))
    other = tmp_path / "other.jsonl"
    other.write_text(prompt_files[0].read_text().replace("w10", "w13", 1))
    with pytest.raises(InputError, match=r"other inputs or settings.*prompts"):
        draft_data(*_argv(tiny_dir, (other, prompt_files[1]), reference))
    assert (reference / "manifest.json").read_text() == before
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "notes.txt").write_text("x")
    with pytest.raises(InputError, match="no manifest.json"):
        draft_data(*_argv(tiny_dir, prompt_files, tmp_path / "stuff"))


def test_write_features_resumes_at_the_first_unfinished_shard(tiny_dir, tmp_path):
    target = load_model(tiny_dir)
    rng = np.random.default_rng(5)
    convs = [Conversation(rng.integers(3, 200, int(rng.integers(2, 12))).tolist(), rng.integers(3, 200, int(rng.integers(1, 30))).tolist())
             for _ in range(22)]
    kw = dict(batch_size=4, shard_size=5)
    whole = write_features(target, convs, tmp_path / "whole", **kw)

    progress = []

    def dying(done, total, ntok):
        progress.append(done)
        if len(progress) == 2:
            raise _Killed()

    with pytest.raises(_Killed):
        write_features(target, convs, tmp_path / "f", on_progress=dying, **kw)
    with pytest.raises(InputError, match=r"unfinished \(2 of 5 shards"):
        FeatureSet.load(tmp_path / "f")
    # Its finished shards alone: the first 10 sequences, equal to the finished run's.
    part = FeatureSet.load(tmp_path / "f", finished_shards=True)
    assert len(part) == 10
    for name in data_mod.FEATURE_FILES:
        np.testing.assert_array_equal(np.asarray(getattr(part, name)), np.asarray(getattr(whole, name))[:10], err_msg=name)
    del part
    progress.clear()
    fs = write_features(target, convs, tmp_path / "f", on_progress=lambda d, t, n: progress.append(d), **kw)
    assert progress == [15, 20, 22]  # shards 1 and 2 were not computed again
    assert isinstance(fs.features, np.memmap)
    for name in data_mod.FEATURE_FILES:
        np.testing.assert_array_equal(np.asarray(getattr(fs, name)), np.asarray(getattr(whole, name)), err_msg=name)

    # The same as the in-memory path at every real position; padding is never written.
    mem = extract_features(target, convs, max_len=fs.tokens.shape[1], batch_size=4)
    real = np.arange(fs.tokens.shape[1])[None, :] < np.asarray(fs.lengths)[:, None]
    np.testing.assert_array_equal(np.asarray(fs.tokens), mem.tokens)
    np.testing.assert_array_equal(np.asarray(fs.target_argmax)[real], mem.target_argmax[real])
    np.testing.assert_allclose(np.asarray(fs.features, np.float32)[real], mem.features[real].astype(np.float32), rtol=1e-2, atol=1e-2)
    assert not np.asarray(fs.features)[~real].any() and not np.asarray(fs.target_hidden)[~real].any()

    # Other conversations into the same directory: started over, not mixed.
    progress.clear()
    fs2 = write_features(target, convs[:7], tmp_path / "f", on_progress=lambda d, t, n: progress.append(d), **kw)
    assert progress == [5, 7] and len(fs2) == 7


def test_read_answered_drops_only_a_torn_last_line(tmp_path):
    path = tmp_path / "c.jsonl"
    line = Conversation([1, 2], [3], id="a").to_json() + "\n"
    path.write_text(line + line.replace('"a"', '"b"') + '{"prompt_ids": [1')
    got, torn = read_answered(path, vocab_size=10)
    assert torn and sorted(k[1] for k in got) == ["a", "b"]
    assert path.read_text() == line + line.replace('"a"', '"b"')
    path.write_text('{"prompt_ids": [1\n' + line)
    with pytest.raises(InputError, match=r"c\.jsonl:1: not a conversation record"):
        read_answered(path)
    path.write_text(line + line)
    with pytest.raises(InputError, match=r"c\.jsonl:2: id 'a' answered twice"):
        read_answered(path)
    path.write_text(Conversation([1], [2]).to_json() + "\n")
    with pytest.raises(InputError, match=r"c\.jsonl:1: record has no id"):
        read_answered(path)


# ----------------------------------------------------------------------------- committed answers (--answers)

SHARD_TOKENS = 80  # a few answers per shard: the tiny run writes several


def _answers_argv(tiny_dir, train, held, answers, *extra):
    return ["--model", tiny_dir, "--answers", answers, "--prompt-file", train, "--eval-prompt-file", held,
            *SETTINGS, "--shard-tokens", str(SHARD_TOKENS), *extra]


@pytest.fixture(scope="module")
def gz_prompts(prompt_files, tmp_path_factory):
    """The training prompts gzipped, as the repository keeps its large prompt file."""
    import gzip

    d = tmp_path_factory.mktemp("gz")
    (d / "train.jsonl.gz").write_bytes(gzip.compress(prompt_files[0].read_bytes(), mtime=0))
    return d / "train.jsonl.gz", prompt_files[1]


@pytest.fixture(scope="module")
def answer_store(tiny_dir, gz_prompts, tmp_path_factory):
    """Answers only (no --out), kept as shards: what a session commits."""
    root = tmp_path_factory.mktemp("store") / "answers"
    assert draft_data(*_answers_argv(tiny_dir, *gz_prompts, root)) == 0
    return root


def _no_generation(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("an answer was regenerated")

    monkeypatch.setattr(data_mod, "regenerate", refuse)


def test_answer_shards_round_trip(tiny_dir, gz_prompts, prompt_files, reference, answer_store, tmp_path, monkeypatch, capsys):
    """The store a run leaves, copied like a commit and a clone would, gives a later run
    every answer without generating one, and the same data as a run that never stored."""
    import shutil

    from eagle_jax.serving.prompts import prompt_file_sha256

    train_store = answer_store / "train"
    m = json.loads((train_store / "manifest.json").read_text())
    assert m["prompt_file"] == "train.jsonl.gz" and m["prompt_file_sha256"] == prompt_file_sha256(prompt_files[0])
    assert m["settings"] == {"max_new_tokens": 16, "max_seq_len": 160, "sampled_fraction": 0.5, "temperature": 0.7, "seed": 0}
    assert len(m["shards"]) >= 3 and m["answers"] == 42 == sum(s["answers"] for s in m["shards"])
    assert m["response_tokens"] == sum(s["tokens"] for s in m["shards"])
    assert all(s["batch_size"] == 2 and len(s["sha256"]) == 64 for s in m["shards"])
    assert sorted(p.name for p in train_store.iterdir()) == sorted(["manifest.json", *(s["file"] for s in m["shards"])])
    with np.load(train_store / m["shards"][0]["file"]) as z:  # plain numpy reads a shard
        assert z["tokens"].dtype == np.uint16 and z["index"].dtype == np.uint32
    assert json.loads((answer_store / "held" / "manifest.json").read_text())["answers"] == 3  # held.jsonl

    clone = tmp_path / "clone"
    shutil.copytree(answer_store, clone)
    out = tmp_path / "out"
    _no_generation(monkeypatch)
    capsys.readouterr()
    assert draft_data(*_answers_argv(tiny_dir, *gz_prompts, clone, "--out", out)) == 0
    err = capsys.readouterr().err
    assert "train: resuming, 42 of 42 prompts already answered" in err and "eval: resuming, 3 of 3" in err
    assert (out / "conversations.jsonl").read_bytes() == (reference / "conversations.jsonl").read_bytes()
    assert (out / "eval_conversations.jsonl").read_bytes() == (reference / "eval_conversations.jsonl").read_bytes()
    a, b = FeatureSet.load(out / "train"), FeatureSet.load(reference / "train")
    for name in data_mod.FEATURE_FILES:
        np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)), err_msg=name)
    # Nothing written to the store: no answer was new.
    assert json.loads((clone / "train" / "manifest.json").read_text()) == m


def test_a_kill_while_a_shard_is_written_loses_that_shard_only(tiny_dir, gz_prompts, answer_store, tmp_path, monkeypatch, capsys):
    store = tmp_path / "answers"
    real = data_mod._write_npz_atomic
    calls = []

    def dying(path, arrays):
        calls.append(path.name)
        if len(calls) >= 3:  # cut off half-way through the third shard; the process dies there
            (path.parent / f".{path.name}.tmp").write_bytes(b"PK\x03\x04partial")
            raise _Killed()
        real(path, arrays)

    monkeypatch.setattr(data_mod, "_write_npz_atomic", dying)
    with pytest.raises(_Killed):
        draft_data(*_answers_argv(tiny_dir, *gz_prompts, store))
    monkeypatch.undo()
    m = json.loads((store / "train" / "manifest.json").read_text())
    assert [s["file"] for s in m["shards"]] == ["shard-00000.npz", "shard-00001.npz"]
    kept = m["answers"]
    capsys.readouterr()
    assert draft_data(*_answers_argv(tiny_dir, *gz_prompts, store)) == 0
    assert f"train: resuming, {kept} of 42 prompts already answered" in capsys.readouterr().err
    assert not list((store / "train").glob(".*.tmp"))
    # Every answer once, each the same as the uninterrupted store's.
    assert _store_answers(store / "train") == _store_answers(answer_store / "train")


def _store_answers(path):
    """index -> (response ids, finish, sampled) of every shard a store's manifest lists."""
    m = json.loads((path / "manifest.json").read_text())
    out = {}
    for s in m["shards"]:
        with np.load(path / s["file"]) as z:
            ends = np.cumsum(z["length"].astype(int))
            for j, i in enumerate(z["index"].tolist()):
                assert i not in out
                out[i] = (z["tokens"][ends[j] - z["length"][j]: ends[j]].tolist(), int(z["finish"][j]), int(z["sampled"][j]))
    return out


def test_a_changed_shard_is_refused_by_name(tiny_dir, gz_prompts, answer_store, tmp_path, monkeypatch):
    import shutil

    clone = tmp_path / "clone"
    shutil.copytree(answer_store, clone)
    shard = clone / "train" / "shard-00001.npz"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    _no_generation(monkeypatch)
    with pytest.raises(InputError, match=r"train/shard-00001\.npz: sha256 [0-9a-f]{64} does not match .* refusing"):
        draft_data(*_answers_argv(tiny_dir, *gz_prompts, clone))
    shard.unlink()
    with pytest.raises(InputError, match=r"train/shard-00001\.npz: shard listed in .* is missing"):
        draft_data(*_answers_argv(tiny_dir, *gz_prompts, clone))


def test_a_store_of_another_model_prompt_file_or_settings_is_refused(tiny_dir, gz_prompts, answer_store, tmp_path, monkeypatch):
    import gzip
    import shutil

    clone = tmp_path / "clone"
    shutil.copytree(answer_store, clone)
    _no_generation(monkeypatch)
    manifest = clone / "train" / "manifest.json"
    m = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**m, "model_sha256": "0" * 64}))
    with pytest.raises(InputError, match=r"train holds answers made with another model.*model_sha256: '0000"):
        draft_data(*_answers_argv(tiny_dir, *gz_prompts, clone))
    manifest.write_text(json.dumps(m))

    other = tmp_path / "other" / "train.jsonl.gz"  # the same name, other prompts
    other.parent.mkdir()
    other.write_bytes(gzip.compress(gzip.decompress(gz_prompts[0].read_bytes()).replace(b"w10", b"w13", 1)))
    with pytest.raises(InputError, match=r"another model, prompt file or settings.*prompt_file_sha256"):
        draft_data(*_answers_argv(tiny_dir, other, gz_prompts[1], clone))
    with pytest.raises(InputError, match=r"another model, prompt file or settings.*settings.*'seed': 0.*'seed': 1"):
        draft_data(*_answers_argv(tiny_dir, *gz_prompts, clone, "--seed", "1"))
    with pytest.raises(InputError, match="--answers .* needs --prompt-file"):
        draft_data("--model", tiny_dir, "--answers", clone, "--synthetic", "4", *SETTINGS)


@pytest.mark.slow  # a subprocess that imports jax and compiles: ~1 min on 2 cores
def test_sigterm_writes_the_shard_in_progress(tiny_dir, gz_prompts, answer_store, tmp_path):
    """A session's end (SIGTERM) keeps every finished answer: the buffered shard is
    written before the process exits, and the next run answers only the rest."""
    store = tmp_path / "answers"
    argv = [str(a) for a in _answers_argv(tiny_dir, *gz_prompts, store)]
    argv[argv.index("--shard-tokens") + 1] = "100000"  # nothing is written before the signal
    cmd = [sys.executable, "-m", "eagle_jax.cli", "draft-data", *argv, "--progress-every", "0.01"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = []
    try:
        for line in proc.stderr:
            err.append(line)
            if line.startswith("answers: ") and "/45 prompts" in line and int(line.split()[1].split("/")[0]) >= 3:
                proc.send_signal(signal.SIGTERM)
                break
        err.append(proc.stderr.read())
        assert proc.wait(timeout=120) == 130, "".join(err)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "interrupted: the answers finished so far are saved" in "".join(err)
    m = json.loads((store / "train" / "manifest.json").read_text())
    assert len(m["shards"]) == 1 and m["answers"] >= 3
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"train: resuming, {m['answers']} of 42 prompts already answered" in r.stderr
    assert _store_answers(store / "train") == _store_answers(answer_store / "train")


def test_growing_train_prompts_into_a_store(tiny_dir, gz_prompts, answer_store, tmp_path, capsys):
    """What scripts/draft_answers.sh does: growing prefixes of the prompt file into one
    store; each pass asks only for the new prompts, and a smaller one asks for nothing."""
    store = tmp_path / "answers"
    assert draft_data(*_answers_argv(tiny_dir, *gz_prompts, store, "--train-prompts", "10")) == 0
    assert json.loads((store / "train" / "manifest.json").read_text())["answers"] == 10
    capsys.readouterr()
    assert draft_data(*_answers_argv(tiny_dir, *gz_prompts, store, "--train-prompts", "1000")) == 0
    assert "train: resuming, 10 of 42 prompts already answered" in capsys.readouterr().err
    assert _store_answers(store / "train") == _store_answers(answer_store / "train")
    assert draft_data(*_answers_argv(tiny_dir, *gz_prompts, store, "--train-prompts", "5")) == 0
    assert "train: resuming, 5 of 5 prompts already answered" in capsys.readouterr().err


def test_answered_only_computes_features_for_the_stored_answers_and_generates_none(tiny_dir, gz_prompts, answer_store,
                                                                                  tmp_path, monkeypatch, capsys):
    """--answered-only (a device run whose answering was cut off): features for the
    selected prompts the store answers, none generated; the conversations are exactly
    the stored ones, in prompt order; it needs --answers and --out."""
    import shutil

    store = tmp_path / "answers"
    shutil.copytree(answer_store, store)
    m = json.loads((store / "train" / "manifest.json").read_text())
    # A store that holds only some prompts: keep its first shard (drop the rest from the manifest).
    first = m["shards"][0]
    m.update(shards=[first], answers=first["answers"], response_tokens=first["tokens"])
    for s in (store / "train").glob("shard-*.npz"):
        if s.name != first["file"]:
            s.unlink()
    (store / "train" / "manifest.json").write_text(json.dumps(m))
    _no_generation(monkeypatch)
    out = tmp_path / "out"
    capsys.readouterr()
    assert draft_data(*_answers_argv(tiny_dir, *gz_prompts, store, "--out", out, "--answered-only")) == 0
    err = capsys.readouterr().err
    assert f"train: --answered-only, {first['answers']} of 42 selected prompts answered" in err
    convs = [json.loads(line) for line in (out / "conversations.jsonl").read_text().splitlines()]
    assert len(convs) == first["answers"] == len(FeatureSet.load(out / "train"))
    assert json.loads((out / "manifest.json").read_text())["answered_only"] is True
    with pytest.raises(InputError, match="--answered-only .* needs --answers DIR and --out DATA"):
        draft_data(*_answers_argv(tiny_dir, *gz_prompts, store, "--answered-only"))


@pytest.mark.slow
def test_the_device_draft_pipeline_dry_run(tiny_dir, gz_prompts, answer_store, tmp_path):
    """scripts/device/draft_pipeline.sh at tiny scale on the CPU, as the device runs it (a
    subprocess, $OUT): the store copy lacks most answers; the call fills it, computes
    features, trains a draft, and returns pipeline.json, the new shards as a tar that
    untars into a store equal to one run whole, and the draft in parts that join into a
    loadable draft directory."""
    import shutil
    import subprocess
    import sys
    import tarfile

    repo = Path(__file__).resolve().parents[2]
    store = tmp_path / "answers"
    shutil.copytree(answer_store, store)
    m = json.loads((store / "train" / "manifest.json").read_text())
    first = m["shards"][0]  # keep the first shard only: the pipeline answers the rest
    m.update(shards=[first], answers=first["answers"], response_tokens=first["tokens"])
    for s in (store / "train").glob("shard-*.npz"):
        if s.name != first["file"]:
            s.unlink()
    (store / "train" / "manifest.json").write_text(json.dumps(m))
    out = tmp_path / "out"
    train, held = gz_prompts
    cmd = ["bash", str(repo / "scripts/device/draft_pipeline.sh"), "--dry-run", "--model", str(tiny_dir),
           "--answers", str(store), "--prompt-file", str(train), "--eval-prompt-file", str(held), "--eval-prompts", "3",
           "--settings", "--max-new-tokens 16 --max-seq-len 160 --sampled-fraction 0.5", "--answer-batch", "2",
           "--init-from", "", "--train-args", "--draft-vocab 150 --ttt-length 2 --epochs 2 --batch-size 8 --lr 3e-3 "
           "--warmup-steps 1 --eval-every 4",
           "--answer-s", "240", "--features-s", "240", "--train-s", "240", "--total-s", "900", "--work", str(tmp_path / "work")]
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, JAX_PLATFORMS="cpu")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    log = (out / "pipeline.log").read_text() if (out / "pipeline.log").exists() else ""
    assert r.returncode == 0, r.stderr[-3000:] + log[-3000:]
    rec = json.loads((out / "pipeline.json").read_text())
    assert rec["dry_run"] and set(rec["phases"]) == {"answers", "features", "train"}
    assert all(ph["exit"] == 0 and not ph["cut_off_at_limit"] for ph in rec["phases"].values())
    whole = json.loads((answer_store / "train" / "manifest.json").read_text())
    assert rec["answers_before"]["answers"] == first["answers"]
    assert rec["answers_after"]["answers"] == whole["answers"] == 42
    assert rec["answers_new"]["answers"] == 42 - first["answers"] > 0
    assert rec["held_out"]["last"]["acc"] and rec["held_out"]["last"]["step"] > 0
    # --epochs 2 ends the training, not its 240 s budget (the budget once lifted the cap).
    assert rec["held_out"]["last"]["epoch"] == 2.0
    # The new shards untar into a fresh copy of the store it started from: every answer there.
    with tarfile.open(out / "answers-new.tar") as tar:
        names = tar.getnames()
        assert "train/manifest.json" in names and first["file"] not in {Path(n).name for n in names}
    assert _store_answers(store / "train") == _store_answers(answer_store / "train")
    # The draft, joined from its parts.
    parts = sorted(out.glob("draft.tar.part-*"))
    assert parts and len(list(out.iterdir())) <= 8  # what a device call can return
    joined = tmp_path / "draft.tar"
    joined.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(joined) as tar:
        tar.extractall(tmp_path / "back", filter="data")
    cfg = json.loads((tmp_path / "back" / "draft" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 150 and cfg["architectures"] == ["LlamaForCausalLMEagle3"]
