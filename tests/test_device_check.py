"""The device check (scripts/device/check.sh): its CPU dry run, so the script a GPU loan
runs cannot rot between loans, and the driver's bookkeeping."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device" / "check.py"


def _check_module():
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_dry_run_runs_every_section(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "device" / "check.sh"), "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1200)
    log = (tmp_path / "check.log").read_text() if (tmp_path / "check.log").exists() else ""
    assert r.returncode == 0, r.stdout[-3000:] + log[-5000:]
    sections = {}
    for name, _ in _check_module().SECTIONS:
        d = json.loads((tmp_path / f"{name}.json").read_text())
        assert d["status"] == "done", (name, d.get("errors"), d.get("error"), log[-5000:])
        assert not d["skipped"], (name, d["skipped"])
        sections[name] = d["items"]

    env_items = sections["env"]
    assert env_items["versions"]["jax"] and env_items["device"]["backend"] == "cpu"
    assert env_items["copy_bandwidth"]["gb_per_s"] > 0 and env_items["bf16_matmul"]["tflop_per_s"] > 0

    kernels = sections["kernels"]
    pt = kernels.pop("pytest_tests_kernels")
    assert pt["passed"] >= 3 and pt["failures"] == 0 and pt["errors"] == 0, pt
    assert len(kernels) == 3  # one case of each kernel
    for case, res in kernels.items():
        assert res.get("ok", res.get("equal")) is True, (case, res)
        assert res["kernel_ms"] > 0 and res["reference_ms"] > 0

    (engine,) = sections["lossless"].values()
    assert engine["graphs"] > 0
    runs = engine["runs"]
    # fp32 (the dry run's dtype): every policy, greedy and sampled, at batch 1 and 8.
    assert len(runs) == 2 * 2 * 3, sorted(runs)
    for name, run in runs.items():
        assert run["identical"] == run["prompts"], (name, run)
    assert any((r["mean_accept_length"] or 0) > 1.2 for r in runs.values())  # the oracle made steps accept

    steps = sections["llama8b"]
    assert {k for k in steps} >= {"step b1 plain", "step b1 chain S=1", "step b2 tree 3/4/8"}
    for k, v in steps.items():
        assert v["pipelined_ms"] > 0 and v["sync_ms"] > 0 and v["gb_per_s"] > 0, (k, v)
    llama = json.loads((tmp_path / "llama8b.json").read_text())
    assert set(llama["break_even"]) == {"b1 chain S=1", "b1 tree 3/4/8", "b2 chain S=1", "b2 tree 3/4/8"}
    assert {v["choice"] for v in llama["auto_choices"].values()} <= {"plain", "chain S=1", "tree 3/4/8"}

    moe = sections["deepseek"]
    assert {"moe auto b2 plain", "moe auto b2 chain S=3", "moe gather b2 plain"} <= set(moe)

    text = (tmp_path / "summary.md").read_text()
    for name in sections:
        assert f"## {name}: done" in text


def test_a_section_without_time_is_recorded_not_run(tmp_path):
    mod = _check_module()
    assert mod.main(["--out", str(tmp_path), "--dry-run", "--sections", "env", "--total-s", "12"]) == 1
    d = json.loads((tmp_path / "env.json").read_text())
    assert d["status"].startswith("not run")


def test_attempt_records_an_error_and_goes_on(tmp_path, capsys):
    mod = _check_module()
    rec = mod.Record(tmp_path, "x", 60.0, dry=True)

    def boom():
        raise ValueError("no such kernel")

    assert rec.attempt("bad", boom) is None
    assert rec.attempt("good", lambda: {"ms": 1.0}) == {"ms": 1.0}
    assert rec.attempt("late", lambda: 1, need_s=1e9) is None
    d = json.loads((tmp_path / "x.json").read_text())
    assert d["items"]["bad"] == {"error": "ValueError: no such kernel"}
    assert d["errors"] == ["bad: ValueError: no such kernel"]
    assert d["items"]["good"] == {"ms": 1.0} and "late" not in d["items"]
    assert d["skipped"] and d["skipped"][0].startswith("late:")
    assert "Traceback" in capsys.readouterr().err  # printed, not swallowed


def test_summary_shows_errors_and_missing_sections(tmp_path):
    mod = _check_module()
    (tmp_path / "kernels.json").write_text(json.dumps({
        "section": "kernels", "status": "done with errors", "limit_s": 95, "elapsed_s": 3, "skipped": [],
        "errors": ["tree_attention b1: MosaicError: bad layout"],
        "items": {"pytest_tests_kernels": {"passed": 3, "failures": 1, "errors": 0, "skipped": 0, "seconds": 1,
                                           "native": True, "failed": ["t::x: boom"]},
                  "tree_attention b1": {"error": "MosaicError: bad layout"}}}))
    text = mod.summary(tmp_path)
    assert "## env: not run" in text
    assert "## kernels: done with errors" in text and "t::x: boom" in text
    assert "MosaicError: bad layout" in text


def test_auto_choices_follow_the_measured_costs():
    mod = _check_module()
    shapes = mod.spec_shapes()
    options = {"plain": None, "chain S=1": shapes["chain S=1"], "tree 3/4/8": shapes["tree 3/4/8"]}
    # A chain S=1 step as dear as plain always pays; a tree at 3x plain pays only for a good draft.
    times = {1: {"plain": {"pipelined_ms": 10.0}, "chain S=1": {"pipelined_ms": 10.0}, "tree 3/4/8": {"pipelined_ms": 30.0}}}
    got = mod.auto_choices(options, times)
    assert got["L=2 b1"]["choice"] == "chain S=1"
    assert got["L=2 b1"]["predicted_speedup"] == pytest.approx(1.5)  # 1 + p with p = 1/2
    assert got["L=4 b1"]["choice"] == "chain S=1"  # tree: 1 + .75 + .75^2 + .75^3 = 2.73 < 3x the time
    times[1]["tree 3/4/8"]["pipelined_ms"] = 12.0
    assert mod.auto_choices(options, times)["L=4 b1"]["choice"] == "tree 3/4/8"


def test_report_tables_every_run_and_recounts_moe_bytes(tmp_path):
    """The report docs/results.md shows: one row per item and run, MoE GB/s from the
    experts a step's tokens choose (one expert's INT4 bytes from the real widths)."""
    mod = _check_module()
    assert mod.int4_expert_bytes(7168, 2048) == 24_772_608  # 3 x (4-bit weights + a bf16 scale per 32)
    run = tmp_path / "h200-runX"
    run.mkdir()
    (run / "env.json").write_text(json.dumps({"status": "done", "items": {
        "device": {"kind": "NVIDIA H200", "compute_capability": "9.0"}, "versions": {"jax": "0.11.2", "flax": "0.12.12"},
        "copy_bandwidth": {"gb_per_s": 3850.4}, "bf16_matmul": {"tflop_per_s": 688.0}}}))
    (run / "llama8b.json").write_text(json.dumps({"status": "done", "items": {
        "step b1 plain": {"pipelined_ms": 16.443, "sync_ms": 15.0, "gb_per_s": 1889.7, "of_copy_ceiling": 0.26, "compile_s": 7.6}}}))
    weights = 25.32
    (run / "deepseek.json").write_text(json.dumps({"status": "done", "model": {
        "config": "Kimi-K2 slice: 1 dense + 2 MoE layers", "target_weight_gb": weights, "context": 2048}, "items": {
        "moe auto b1 plain": {"pipelined_ms": 3.301, "sync_ms": 3.9, "gb_per_s": 7672.0, "compile_s": 6.9}}}))
    text = mod.report([run])
    assert "| h200-runX | NVIDIA H200 | 9.0 | 0.11.2 | 0.12.12 | 3850.4 | 688.0 |" in text
    assert "| h200-runX | b1 plain | 16.44 | 15 | 1890 | 0.26 | 7.6 |" in text
    e = 24_772_608
    moved = weights * 1e9 - e * 384 * 2 + 8 * e * 2 + 2048 * 3 * 576 * 2
    assert f"| h200-runX | auto | 1 | plain | 3.3 | {moved / 3.301 / 1e6:.0f} | 6.9 |" in text
    assert "h200-runX/kernels" not in text  # a section that did not run is not reported as cut off
