"""`eagle-jax eval-draft`: the built-in suites, prompt-file errors, the figures, and the
check that speculative output equals plain decoding, end to end on a tiny target and draft."""

import argparse
import json

import pytest

from eagle_jax import cli

from eagle_jax.experiments import evaluate, harness
from eagle_jax.errors import InputError
from hf_factories import write_tiny_eval_models

# ----------------------------------------------------------------------------- suites


@pytest.mark.parametrize("name", harness.SUITES)
def test_builtin_suites_parse_every_line(name):
    path = harness.builtin_suite_path(name)
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    suite = harness.load_suite(name)
    # The EAGLE authors' files hold 80 questions each.
    assert len(suite.records) == len(lines) == 80
    assert all(r.messages is not None and r.messages[-1]["role"] == "user" for r in suite.records)
    assert (path.parent / "LICENSE").read_text().count("Apache License") >= 1
    assert "SafeAILab/EAGLE" in (path.parent / "NOTICE").read_text()


def test_held_out_suite_is_the_synthetic_eval_split_and_the_demo_questions():
    """The former scripts/bench_draft.py's prompts, as a built-in suite (not in the default run)."""
    from eagle_jax.train.synthetic_prompts import synthetic_prompts

    suite = harness.load_suite("held_out")
    assert suite.builtin and "held_out" not in harness.SUITES
    texts = [r.messages[-1]["content"] for r in suite.records]
    assert len(texts) == 20 and all(len(r.messages) == 1 for r in suite.records)
    assert texts[:16] == synthetic_prompts(1000, split="eval", seed=1)[:16]
    assert texts[16] == "Explain in two sentences why the sky is blue."  # make demo's first question
    assert "held_out" in (suite.path.parent / "NOTICE").read_text()


def test_max_prompts_spreads_over_mt_bench_categories():
    suite = harness.load_suite("mt_bench")
    picked = harness.select(suite, 10)
    assert len(picked.records) == 10
    categories = {json.loads(line)["category"] for line in suite.path.read_text().splitlines()}
    picked_ids = {r.id for r in picked.records}
    picked_categories = {
        json.loads(line)["category"] for line in suite.path.read_text().splitlines() if json.loads(line)["id"] in picked_ids
    }
    assert picked_categories == categories and len(categories) == 8
    assert harness.select(suite, 0) is suite


def test_unknown_suite_lists_the_valid_ones(capsys, tmp_path):
    rc = cli.main(["eval-draft", "--draft", str(tmp_path), "--suite", "mtbench"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "unknown suite 'mtbench'" in err and "mt_bench, humaneval, gsm8k, alpaca" in err


@pytest.mark.parametrize(
    "second_line, message",
    [
        ('{"id": "b", "messages": [{"role": "user"}]}', "messages[0] must be an object"),
        ('{"id": "b", "prompt": ', "not valid JSON"),
        ('{"id": "b", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}',
         "the model answers a 'user' turn"),
        ('{"id": "a", "prompt": "again"}', "id 'a' was already used at"),
    ],
)
def test_bad_prompt_file_line_is_named(tmp_path, second_line, message):
    f = tmp_path / "suite.jsonl"
    f.write_text('{"id": "a", "prompt": "w1 w2"}\n' + second_line + "\n")
    with pytest.raises(InputError, match="suite.jsonl:2: ") as e:
        harness.load_suite(str(f))
    assert message in str(e.value)


def test_shapes_parse_and_bad_ones_are_refused():
    assert evaluate.parse_shape("3/4/8") == (3, 4, 8)
    cfg = evaluate.shape_config((3, 4, 8))
    assert cfg.shape == "tree S=3 k=4 T=8" and evaluate.shape_arg(cfg) == "3/4/8"
    assert evaluate.shape_config((2,)).shape == "chain S=2"
    for bad in ("3/4", "x", "3/4/8/1", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="give S"):
            evaluate.parse_shape(bad)
    with pytest.raises(InputError, match="--shapes 3/4/99"):
        evaluate.shape_config((3, 4, 99))


def test_acceptance_by_depth_counts_accepted_drafts():
    # Accept length n = n-1 accepted drafts + the bonus token.
    fig = harness.acceptance([1, 2, 4, 3], num_steps=3)
    assert fig["mean_accept_length"] == 2.5
    assert fig["acceptance_rate_by_depth"] == [0.75, 0.5, 0.25]
    assert fig["accept_length_histogram"] == {"1": 1, "2": 1, "3": 1, "4": 1}
    assert harness.acceptance([], num_steps=2)["mean_accept_length"] is None
    assert harness.first_difference([1, 2, 3], [1, 5, 3]) == 1 and harness.first_difference([1, 2], [1, 2, 3]) == 2


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_eval_models(tmp_path_factory.mktemp("eval"))


def _run(tiny, out, *extra):
    return cli.main([
        "eval-draft", "--model", str(tiny["target"]), "--draft", str(tiny["draft"]), "--suite", str(tiny["suite"]),
        "--max-new-tokens", "10", "--out", str(out), *extra,
    ])


def test_eval_draft_end_to_end(tiny, capsys):
    out = tiny["root"] / "res" / "eval.json"
    assert _run(tiny, out, "--shapes", "2", "2/2/4", "--repeats", "2") == 0
    report = json.loads(out.read_text())
    assert report["command"].startswith("eagle-jax eval-draft --draft ")
    assert "--shapes 2 2/2/4" in report["command"] and "--repeats 2" in report["command"]
    env = report["environment"]
    assert env["packages"]["jax"] and env["devices"] and env["cpu"] and env["dtype"] == "float32"
    assert "commit" in env["git"] or "error" in env["git"]
    assert report["compiles_during_timing"] == 0
    entry = report["suites"][str(tiny["suite"])]
    assert entry["prompts"] == 2 and entry["prompt_ids"] == ["p1", "p2"]
    assert entry["plain"]["tokens_per_s"] > 0 and len(entry["plain"]["runs"]) == 2
    assert set(entry["shapes"]) == {"chain S=2", "tree S=2 k=2 T=4"}
    for row in entry["shapes"].values():
        depth = row["acceptance_rate_by_depth"]
        assert len(depth) == 2 and 1 > depth[0] >= depth[1] >= 0
        assert depth[0] > 0  # some drafts were accepted, so the equality check saw accepted tokens
        assert 1 < row["mean_accept_length"] < 3
        assert sum(row["accept_length_histogram"].values()) == row["steps"] > 0
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / entry["plain"]["tokens_per_s"])
        # Both passes compared both prompts with plain decoding.
        assert row["identical_to_plain"] and row["outputs_compared"] == 4
    # The engine's own count covers both passes of both shapes, plus the warm-ups.
    assert report["engine_totals"]["steps"] > 2 * sum(r["steps"] for r in entry["shapes"].values())
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Teacher-forced agreement on the plain outputs, by step (the deepest shape's 2 steps).
    tf = entry["teacher_forced"]
    assert len(tf["agreement_by_step"]) == 2 and all(0 <= a <= 1 for a in tf["agreement_by_step"])
    # Every response token is a label at each step (anchors reach back into the prompt,
    # as in training; the draft's vocabulary is the target's here): 10 per prompt.
    assert tf["positions"] == [2 * 10, 2 * 10]
    assert tf["agreement_by_step"][0] > 0  # the engine accepted drafts at depth 1, so some agree
    a1, a2 = tf["agreement_by_step"]
    assert tf["predicted_chain_accept_length"] == {"1": pytest.approx(1 + a1), "2": pytest.approx(1 + a1 + a1 * a2)}
    table = capsys.readouterr().out
    assert "| suite | shape | accept length |" in table and "tree S=2 k=2 T=4" in table
    assert "teacher-forced agreement by step" in table


def test_a_speculative_output_that_differs_from_plain_is_a_hard_error(tiny, monkeypatch):
    from eagle_jax.serving.engine import Engine

    real = Engine.generate

    def corrupt(self, prompts, params):
        out = real(self, prompts, params)
        if self.config.speculative is not None and len(prompts) > 1:  # the timed passes, not the warm-up
            out[1].token_ids[-1] = (out[1].token_ids[-1] + 1) % 211
        return out

    monkeypatch.setattr(Engine, "generate", corrupt)
    with pytest.raises(evaluate.OutputMismatchError, match=r"prompt 'p2' \(.*tiny.jsonl:3\), shape chain S=2"):
        _run(tiny, tiny["root"] / "bad.json", "--shapes", "2")
    assert not (tiny["root"] / "bad.json").exists()
