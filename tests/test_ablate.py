"""`eagle-jax ablate`: config checking (before anything runs), a tiny sweep end to end
(JSON lines with fingerprints, a table, a PNG), resuming after a SIGKILL without losing or
repeating a point, and exact reproduction of greedy accept lengths on a rerun."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from eagle_jax.experiments import ablate

from eagle_jax import cli
from eagle_jax.errors import ConfigError, InputError
from hf_factories import write_tiny_eval_models


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_eval_models(tmp_path_factory.mktemp("ablate"))


def _config(tiny, grid: str, extra: str = "") -> str:
    return (f'name = "tiny"\nmodel = "{tiny["target"]}"\ndraft = "{tiny["draft"]}"\nsuite = "{tiny["suite"]}"\n'
            f"max_new_tokens = 12\nrepeats = 1\n{extra}\n[grid]\n{grid}\n")


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("text, message", [
    ('[grid]\nstep = [1, 2]', r"unknown field 'step'; known: shape, steps"),
    ('temprature = 0.5', r"unknown field 'temprature'"),
    ('[grid]\nsteps = []', r"grid.steps must be a non-empty list"),
    ('[grid]\nsteps = 3', r"grid.steps must be a non-empty list"),
    ('[grid]\nsteps = [1, 0]', r"steps=0 must be an integer >= 1"),
    ('draft = "d"\n[grid]\ntemperature = [0.0, -1.0]\nsteps = [2]', r"temperature=-1.0 must be a number in \[0.0, inf\)"),
    ('draft = "d"\n[grid]\nshape = ["chain S=2", "tree S=3 k=1 T=3"]', r"tree needs k >= 2"),
    ('draft = "d"\n[grid]\npolicy = ["fixed", "greedy"]\nsteps = [2]', r"policy='greedy'; valid: fixed, threshold, auto"),
    ('draft = "d"\npolicy = "threshold"\n[grid]\nsteps = [2]', r"policy='threshold' needs threshold"),
    ('[grid]\nsteps = [2]', r"a speculative point needs draft"),
    ('draft = "d"\nsteps = 2\n[grid]\nsteps = [3]', r"both fixed and in \[grid\]"),
    ('draft = "d"\n[grid]\nsteps = [2, 2]', r"grid.steps repeats a value"),
    ('draft = "d"\ntopk = 4\n[grid]\nsteps = [2]', r"topk=4 needs draft_tokens"),
    ('draft = "d"\npolicy = "auto"\n[grid]\nsteps = [2]', r"policy='auto' picks among its own candidate shapes"),
    ('[grid\nsteps = [1]', r"not valid TOML"),
    ('draft = "d"\n[grid]\nsteps = [2]\ndraft_sync = ["lazy"]', r"draft_sync='lazy'; valid: eager, deferred"),
])
def test_bad_config_is_named_before_anything_runs(tmp_path, text, message):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=message):
        ablate.load_config(f)


def test_an_unset_draft_sync_keeps_the_point_keys_of_earlier_sweeps(tmp_path):
    """Fields added later with no default leave the keys of points that do not set them as
    they were, so committed points files still resume."""
    f = tmp_path / "k.toml"
    f.write_text('draft = "d"\n[grid]\nsteps = [2]\n')
    [p] = ablate.load_config(f).points
    assert "draft_sync" not in json.loads(p.key)
    f.write_text('draft = "d"\ndraft_sync = "eager"\n[grid]\nsteps = [2]\n')
    [q] = ablate.load_config(f).points
    assert json.loads(q.key)["draft_sync"] == "eager" and q.key != p.key


def test_grid_points_are_the_product_with_fixed_values(tmp_path):
    f = tmp_path / "g.toml"
    f.write_text('draft = "d"\nmax_new_tokens = 5\n[grid]\nsteps = [1, 3]\ntemperature = [0.0, 0.7]\nbatch_size = [1, 4]\n')
    sweep = ablate.load_config(f)
    assert len(sweep.points) == 8 and len({p.key for p in sweep.points}) == 8
    p = sweep.points[-1]
    assert p.values["steps"] == 3 and p.values["temperature"] == 0.7 and p.values["batch_size"] == 4
    assert p.values["max_new_tokens"] == 5 and p.values["policy"] == "fixed" and p.speculative.shape == "chain S=3"
    assert sweep.name == "g" and len(sweep.sha256) == 64
    rc = cli.main(["ablate", str(f), "--check"])
    assert rc == 0


# ----------------------------------------------------------------------------- running


def test_tiny_sweep_writes_lines_table_and_plot_and_reproduces(tiny, tmp_path):
    f = tmp_path / "sweep.toml"
    f.write_text(_config(tiny, 'shape = ["plain", "chain S=1", "chain S=2", "tree S=2 k=2 T=4"]\nbatch_size = [1, 2]'))
    out = tmp_path / "out"
    assert cli.main(["ablate", str(f), "--out", str(out)]) == 0
    lines = [json.loads(x) for x in (out / "points.jsonl").read_text().splitlines()]
    assert len(lines) == 8
    for rec in lines:
        env = rec["fingerprint"]
        assert env["packages"]["jax"] and env["cpu"] and env["devices"] and env["dtype"] == "float32"
        assert env["boot_id"] and isinstance(env["cpu_flags"], list)  # which machine, which vector units
        assert "commit" in env["git"] or "error" in env["git"]
        assert rec["config_sha256"] == ablate.load_config(f).sha256
        res = rec["result"]
        assert res["plain"]["median"] > 0 and res["prompts"] == 2
        if rec["point"]["shape"] == "plain":
            assert "speculative" not in res
        else:
            assert res["identical_to_plain"] is True
            assert 1 <= res["mean_accept_length"] <= 3 and len(res["acceptance_rate_by_depth"]) == ablate._steps(rec)
    chain2 = [r for r in lines if r["point"]["shape"] == "chain S=2"]
    assert chain2[0]["result"]["acceptance_rate_by_depth"][0] > 0  # the tiny pair accepts some drafts
    table = (out / "summary.md").read_text()
    assert "| shape | batch_size | accept length |" in table and table.count("chain S=2") == 2
    png = (out / "summary.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    # A rerun elsewhere reproduces every greedy accept length exactly.
    again = tmp_path / "again"
    assert cli.main(["ablate", str(f), "--out", str(again)]) == 0
    second = {r["key"]: r["result"] for r in map(json.loads, (again / "points.jsonl").read_text().splitlines())}
    for rec in lines:
        for k in ("mean_accept_length", "acceptance_rate_by_depth", "accept_length_histogram"):
            assert second[rec["key"]].get(k) == rec["result"].get(k), (rec["key"], k)

    # The same directory: nothing to run; another config's file is refused.
    assert cli.main(["ablate", str(f), "--out", str(out)]) == 0
    assert len((out / "points.jsonl").read_text().splitlines()) == 8
    other = tmp_path / "other.toml"
    other.write_text(_config(tiny, 'shape = ["chain S=3"]'))
    with pytest.raises(InputError, match="written by another config"):
        ablate.run_sweep(ablate.load_config(other), out)


@pytest.mark.slow
def test_sampled_points_are_seeded_and_coupled_ones_equal_plain(tiny, tmp_path):
    f = tmp_path / "t.toml"
    f.write_text(_config(tiny, 'temperature = [0.8]\nsampling_verify = ["coupled", "rejection"]\nsteps = [2]'))
    recs = ablate.run_sweep(ablate.load_config(f), tmp_path / "o1", log=lambda m: None)
    again = ablate.run_sweep(ablate.load_config(f), tmp_path / "o2", log=lambda m: None)
    for a, b in zip(recs, again):
        assert a["result"]["accept_length_histogram"] == b["result"]["accept_length_histogram"]
    coupled, rejection = recs
    assert coupled["result"]["identical_to_plain"] is True and rejection["result"]["identical_to_plain"] is None
    assert coupled["result"]["prompts_identical_to_plain"] == 2 and coupled["result"]["divergences"] == []


@pytest.mark.slow
def test_a_killed_sweep_resumes_without_losing_or_repeating_points(tiny, tmp_path):
    f = tmp_path / "k.toml"
    f.write_text(_config(tiny, 'steps = [1, 2, 3]\nbatch_size = [1, 2]'))
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", "import sys; from eagle_jax.cli import main; sys.exit(main(sys.argv[1:]))",
           "ablate", str(f), "--out", str(out)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    lines = out / "points.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not lines.is_file() or len(lines.read_text().splitlines()) < 2):
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = lines.read_text().splitlines()
    assert 2 <= len(before) < 6, "the kill was meant to land mid-sweep"
    with lines.open("a") as fh:  # as if the kill had torn a line in half
        fh.write('{"key": "half a li')
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    after = lines.read_text().splitlines()
    assert after[: len(before)] == before  # finished points were not rerun
    keys = [json.loads(x)["key"] for x in after]
    assert len(keys) == 6 and len(set(keys)) == 6
    assert {k for k in keys} == {p.key for p in ablate.load_config(f).points}
    assert f"{len(before)} already in" in r.stderr


def test_policy_points_say_what_ran(tmp_path):
    """A threshold or auto point's table row and plot name what the policy ran, per shape
    summed over buckets, most first."""
    f = tmp_path / "p.toml"
    f.write_text('name = "p"\ndraft = "d"\npolicy = "threshold"\nthreshold = 1\nshape = "chain S=2"\n[grid]\nbatch_size = [1, 4]\n')
    sweep = ablate.load_config(f)

    def rec(b, steps, tps):
        spread = {"median": tps, "min": tps, "max": tps, "runs": [tps]}
        return {"point": sweep.points[[1, 4].index(b)].values, "fingerprint": {},
                "result": {"plain": spread, "speculative": spread, "speedup": 1.0, "mean_accept_length": 1.5,
                           "acceptance_rate_by_depth": [0.4, 0.1], "steps_by_bucket": steps}}

    recs = [rec(1, {"1: chain S=2": 30}, 40.0), rec(4, {"4: plain": 25, "4: chain S=2": 1, "1: chain S=2": 9}, 90.0)]
    table = ablate.markdown(sweep, recs)
    assert "| ran (steps) |" in table
    assert "| chain S=2 30 |" in table and "| plain 25, chain S=2 10 |" in table
    ablate.save_plots(sweep, recs, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000
    recs[1]["result"]["speedup"] = 0.95
    assert ablate.speedup_series(recs, lambda r: r["point"]["policy"]) == {"threshold": {1: 1.0, 4: 0.95}}
    # Above its cutoff the policy ran plain throughout: no accept length, still a line,
    # a table row and a plot (a sweep once stopped here on formatting None).
    off = rec(4, {"4: plain": 40}, 88.0)
    off["result"].update(mean_accept_length=None, acceptance_rate_by_depth=[])
    assert ablate.progress_line(off["result"]) == "88.0 tok/s, accept -, speedup 1.00x, ran plain 40"
    assert "| plain 40 |" in ablate.markdown(sweep, [recs[0], off])
    ablate.save_plots(sweep, [recs[0], off], tmp_path / "off.png")
    assert (tmp_path / "off.png").stat().st_size > 10_000


@pytest.mark.slow  # ~22 s
def test_a_sweep_over_suites_builds_engines_for_each_suites_lengths(tiny, tmp_path):
    """Engines are reused only for the same cache and prompt buckets: a longer suite after
    a short one once met the short suite's plain engine ('max_seq_len=... leaves no room')."""
    long = tmp_path / "long.jsonl"
    long.write_text('{"id": "l1", "prompt": "' + " ".join(f"w{i % 90 + 3}" for i in range(40)) + '"}\n')
    f = tmp_path / "s.toml"
    f.write_text(f'name = "s"\nmodel = "{tiny["target"]}"\ndraft = "{tiny["draft"]}"\nmax_new_tokens = 4\nrepeats = 1\n'
                 f'shape = "chain S=1"\n[grid]\nsuite = ["{tiny["suite"]}", "{long}"]\n')
    recs = ablate.run_sweep(ablate.load_config(f), tmp_path / "o", log=lambda m: None)
    assert [r["result"]["prompts"] for r in recs] == [2, 1]
    assert all(r["result"]["identical_to_plain"] is True for r in recs)


def test_a_summary_marks_points_from_other_machines(tmp_path):
    f = tmp_path / "m.toml"
    f.write_text('name = "m"\ndraft = "d"\n[grid]\nsteps = [1, 2]\n')
    sweep = ablate.load_config(f)
    spread = {"median": 10.0, "min": 10.0, "max": 10.0, "runs": [10.0]}
    recs = [{"point": p.values, "fingerprint": {"boot_id": boot},
             "result": {"plain": spread, "speculative": spread, "speedup": 1.0, "mean_accept_length": 1.2}}
            for p, boot in zip(sweep.points, ("aaaaaaaa-1", "bbbbbbbb-2"))]
    table = ablate.markdown(sweep, recs)
    assert "Points from 2 machines or boots" in table and "m1 aaaaaaaa, m2 bbbbbbbb" in table
    assert "| machine |" in table and table.rstrip().endswith("| m2 |")
    one = ablate.markdown(sweep, [recs[0], dict(recs[1], fingerprint={"boot_id": "aaaaaaaa-1"})])
    assert "machine" not in one
