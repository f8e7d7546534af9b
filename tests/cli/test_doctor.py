"""``eagle-jax doctor``: the report names the code, versions and devices in use, and its
checkpoint checks pass good directories and name what is wrong with bad ones."""

import argparse
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

from eagle_jax import doctor
from eagle_jax.checkpoint.draft_io import describe_feature_layers, random_draft, save_draft
from eagle_jax.models.config import ModelConfig
from eagle_jax.errors import InputError
from hf_factories import make_hf_model

REPO = Path(__file__).resolve().parents[2]
# A tensor every Llama checkpoint has; deleting it must fail the model check by name.
DROPPED = "model.layers.1.mlp.up_proj.weight"


def write_tokenizer(directory: Path) -> None:
    """A three-word tokenizer.json and a minimal tokenizer_config.json (ids < the model's 211)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"unk_token": "[UNK]"}))


def copy_model(src: Path, dst: Path, edit) -> Path:
    """``src`` with its tensors changed by ``edit(tensors)`` (config and tokenizer copied as is)."""
    dst.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model")
    make_hf_model("llama_tied").save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def draft_dir(model_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("draft")
    save_draft(random_draft(ModelConfig.from_dir(model_dir), seed=0), path)
    return path


@pytest.fixture(scope="module")
def foreign_draft_dir(model_dir, tmp_path_factory) -> Path:
    """A well-formed draft made for a target with a larger vocabulary."""
    path = tmp_path_factory.mktemp("foreign_draft")
    save_draft(random_draft(ModelConfig.from_dir(model_dir).replace(vocab_size=300), seed=0), path)
    return path


@pytest.fixture(scope="module")
def missing_tensor_dir(model_dir, tmp_path_factory) -> Path:
    return copy_model(model_dir, tmp_path_factory.mktemp("bad") / "model", lambda t: t.pop(DROPPED))


@pytest.fixture(scope="module")
def report(model_dir, draft_dir) -> dict:
    return doctor.collect_report(model_dir, draft_dir)


def run_doctor(*args, env=None) -> subprocess.CompletedProcess:
    """The doctor as a user runs it, in a fresh interpreter (cli.py registers it separately)."""
    code = "import sys; from eagle_jax.doctor import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=120, env=env
    )


def checks_by_name(report: dict) -> dict:
    return {c["name"]: c for c in report["checks"]}


def test_lists_every_project_module_with_its_file(report):
    expected = {}
    for package in doctor.PROJECT_PACKAGES:
        for file in (REPO / package).rglob("*.py"):
            parts = file.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            expected[name] = file
    listed = {m["name"]: m for m in report["modules"]}
    assert set(listed) == set(expected)
    for name, file in expected.items():
        assert listed[name]["error"] is None, listed[name]
        assert Path(listed[name]["file"]).resolve() == file


def test_install_names_where_the_code_comes_from(report):
    """The tests import this checkout; the report says so, with the installed copy's
    version, and warns exactly when the installed copy is another one (an editable
    install of another checkout, or a wheel, shadowed by this one on the path). How it
    was installed (editable or not) is the machine's business, not the test's
    (tests/test_packaging.py checks a wheel install)."""
    install = report["eagle_jax"]
    assert Path(install["imported_from"]) == REPO
    assert install["version"] == importlib.metadata.version("eagle-jax")
    git = install["git"]
    if "error" not in git:  # a machine without git is fine; a checkout has a commit
        assert re.fullmatch(r"[0-9a-f]{40}", git["commit"])
        assert isinstance(git["dirty"], bool)
    if Path(install["source"]) == REPO:
        assert report["warnings"] == []
    else:
        assert any("another copy shadows the install" in w for w in report["warnings"]), report["warnings"]


def _fake_distribution(site: Path, dist: str, version: str, module_files: list[str]) -> None:
    """An installed distribution as pip lays it out: a dist-info with METADATA, and its files."""
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    for rel in module_files:
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text("")


def test_package_info_reads_metadata_and_module_path(tmp_path, monkeypatch):
    """Versions come from the distribution's metadata (not the module), locations from the
    import system: a package by its directory, a single-file module by its file."""
    site = tmp_path / "site"
    _fake_distribution(site, "eagle-fake-pkg", "3.1.4", ["eagle_fake_pkg/__init__.py", "eagle_fake_pkg/sub.py"])
    _fake_distribution(site, "eagle-fake-single", "0.0.7", ["eagle_fake_single.py"])
    # A module without metadata (vendored copy) and metadata without its module.
    (site / "eagle_fake_bare.py").write_text("")
    _fake_distribution(site, "eagle-fake-ghost", "9.9", [])
    monkeypatch.syspath_prepend(str(site))
    assert doctor.package_info("eagle-fake-pkg", "eagle_fake_pkg") == {
        "version": "3.1.4", "location": str(site / "eagle_fake_pkg"),
    }
    assert doctor.package_info("eagle-fake-pkg", "eagle_fake_pkg.sub") == {
        "version": "3.1.4", "location": str(site / "eagle_fake_pkg" / "sub.py"),
    }
    assert doctor.package_info("eagle-fake-single", "eagle_fake_single") == {
        "version": "0.0.7", "location": str(site / "eagle_fake_single.py"),
    }
    assert doctor.package_info("eagle-fake-bare", "eagle_fake_bare") == {
        "version": None, "location": str(site / "eagle_fake_bare.py"),
    }
    assert doctor.package_info("eagle-fake-ghost", "eagle_fake_ghost") == {"version": "9.9", "location": None}
    # A submodule of a package that is not there: not found, not an exception.
    assert doctor.package_info("eagle-fake-none", "eagle_fake_none.child") == {"version": None, "location": None}


def test_report_lists_the_dependencies_that_are_imported(report):
    """The report's numbers for real dependencies agree with the modules themselves."""
    import jax
    import numpy

    for dist, module in (("jax", jax), ("numpy", numpy)):
        assert report["packages"][dist] == {"version": module.__version__, "location": str(Path(module.__file__).parent)}
    assert set(report["packages"]) == {d for d, _ in doctor.REQUIRED_PACKAGES + doctor.OPTIONAL_PACKAGES}


def test_python_section_names_the_interpreter_that_ran(model_dir, tmp_path):
    """Run the doctor from a virtual environment made here (a pyvenv.cfg beside a link to
    the base interpreter; the packages come in through PYTHONPATH), with VIRTUAL_ENV set to
    a marker: the report names that launcher and that prefix, not the test's own."""
    import sysconfig

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    base = Path(sys.executable).resolve()
    (venv / "pyvenv.cfg").write_text(f"home = {base.parent}\ninclude-system-site-packages = false\n")
    launcher = venv / "bin" / "python"
    launcher.symlink_to(base)
    code = "import sys; from eagle_jax.doctor import main; sys.exit(main(sys.argv[1:]))"
    pythonpath = os.pathsep.join([str(REPO), sysconfig.get_paths()["purelib"]])
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "VIRTUAL_ENV": "/marker/venv", "PYTHONPATH": pythonpath}
    r = subprocess.run(
        [str(launcher), "-c", code, "--model", str(model_dir), "--json"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert r.returncode in (0, 1) and r.stdout.startswith("{"), r.stdout + r.stderr  # the checks are not the subject
    py = json.loads(r.stdout)["python"]
    assert py["executable"] == str(launcher)
    assert py["prefix"] == str(venv) and py["base_prefix"] == sys.base_prefix
    assert py["virtualenv"] is True and py["VIRTUAL_ENV"] == "/marker/venv"
    assert py["version"] == ".".join(map(str, sys.version_info[:3]))


def test_environment_and_devices(report):
    assert set(doctor.ENV_VARS) <= set(report["env"])
    jax_report = report["jax"]
    assert jax_report["device_count"] == len(jax_report["devices"]) >= 1
    assert jax_report["default_dtype"] in ("float32", "bfloat16")
    # On this CPU the packed-weight kernel builds; the doctor names the library file.
    assert jax_report["matrix_products"].startswith("packed-weight CPU kernel"), jax_report["matrix_products"]
    assert ".so)" in jax_report["matrix_products"]


def test_good_model_and_draft_pass(report, model_dir, draft_dir):
    checks = checks_by_name(report)
    assert report["ok"], [c["problems"] for c in report["checks"]]
    assert {n: c["status"] for n, c in checks.items()} == {
        "modules": "ok", "model": "ok", "draft": "ok", "compatibility": "ok",
    }
    model = checks["model"]["info"]
    assert model["tensors_expected"] == 4 * 9 + 2  # per layer: 2 norms, 4 attention, 3 MLP
    assert model["unexpected_tensors"] == []
    assert checks["draft"]["info"]["config"]["has_embed_tokens"] is True
    # The draft was saved on the target's default layers, so its config.json has no ids.
    target_cfg = ModelConfig.from_dir(model_dir)
    features = describe_feature_layers(target_cfg.feature_layer_ids, target_cfg.num_hidden_layers)
    assert checks["draft"]["info"]["feature_layers"] == features and "(default [2, N//2, N-3]" in features
    text = doctor.format_report(report)
    assert f"features: {features}" in text
    assert "Result: all checks passed" in text
    assert str(model_dir) in text and str(draft_dir) in text
    assert str(REPO / "eagle_jax" / "doctor.py") in text


def test_missing_tensor_is_named_and_exits_1(missing_tensor_dir):
    r = run_doctor("--model", missing_tensor_dir)
    assert r.returncode == 1, r.stderr
    assert "[FAIL] model" in r.stdout
    assert f"tensor {DROPPED} is missing (expected shape [128, 64])" in r.stdout
    assert "Result: FAILED (model)" in r.stdout


def test_wrong_shape_names_file_tensor_expected_actual(model_dir, tmp_path):
    name = "model.layers.0.mlp.gate_proj.weight"  # [128, 64] stored, written transposed
    bad = copy_model(model_dir, tmp_path / "model", lambda t: t.update({name: t[name].T.copy()}))
    check, _ = doctor.check_model(bad)
    assert check["status"] == "fail"
    assert check["problems"] == [
        {
            "message": f"model.safetensors: tensor {name} has shape [64, 128], expected [128, 64]",
            "file": "model.safetensors", "tensor": name, "expected": [128, 64], "actual": [64, 128],
        }
    ]


def test_missing_tokenizer_fails(model_dir, tmp_path):
    bad = copy_model(model_dir, tmp_path / "model", lambda t: None)
    (bad / "tokenizer_config.json").unlink()
    check, _ = doctor.check_model(bad)
    assert check["status"] == "fail"
    assert [p["file"] for p in check["problems"]] == ["tokenizer_config.json"]


def test_draft_for_another_target_fails_compatibility(model_dir, foreign_draft_dir):
    target_cfg = ModelConfig.from_dir(model_dir)
    draft_check, draft_cfg = doctor.check_draft(foreign_draft_dir, target_cfg)
    assert draft_check["status"] == "ok"  # well-formed on its own
    check = doctor.check_compatibility(draft_cfg, target_cfg)
    assert check["status"] == "fail"
    assert "vocab_size=300" in check["problems"][0]["message"]


def test_json_output_parses(model_dir, draft_dir):
    r = run_doctor("--model", model_dir, "--draft", draft_dir, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] is True
    assert {c["name"] for c in out["checks"]} == {"modules", "model", "draft", "compatibility"}
    draft = next(c for c in out["checks"] if c["name"] == "draft")
    assert draft["info"]["feature_layers"].startswith("entering target layers 2, 2, 1 (default")


def test_backend_that_does_not_start_fails(tmp_path):
    r = run_doctor("--model", tmp_path / "none", env={"JAX_PLATFORMS": "nosuch"})
    assert r.returncode == 1
    assert "[FAIL] jax" in r.stdout and "the JAX backend does not start" in r.stdout and "nosuch" in r.stdout
    assert "checkpoint directory" in r.stdout  # the other checks still ran


def test_predict_times_the_candidates_and_names_the_best_per_bucket(model_dir, draft_dir, capsys):
    """--predict builds an auto engine for the buckets, so its figures are this machine's:
    every option has a positive step time, and the chosen one has the best prediction."""
    args = argparse.Namespace(model=model_dir, draft=draft_dir, json=False, predict="1,2", shapes="chain S=1, tree S=2 k=2 T=4")
    assert doctor.cmd_doctor(args) == 0
    out = capsys.readouterr().out
    assert "Predicted best shape per batch bucket" in out and "  batch 1: " in out and "  batch 2: " in out
    pred = doctor.predict_shapes(doctor.collect_report(model_dir, draft_dir), args, "2")
    r = pred["buckets"]["2"]
    assert set(r["step_ms"]) == {"plain", "chain S=1", "tree S=2 k=2 T=4"} and min(r["step_ms"].values()) > 0
    tps = r["predicted_tokens_per_second"]
    assert tps[r["chosen"]] == max(tps.values())
    with pytest.raises(InputError, match="--predict needs --draft"):
        doctor.predict_shapes(doctor.collect_report(model_dir, None), argparse.Namespace(model=model_dir, draft=None, shapes=None), "1")
    with pytest.raises(InputError, match="comma-separated integers"):
        doctor.predict_shapes(doctor.collect_report(model_dir, draft_dir), args, "1,x")


def test_git_info_names_the_changed_paths(tmp_path):
    """A dirty flag alone cannot tell changed code from a results file being written."""
    import subprocess

    from eagle_jax.doctor import git_info

    def git(*a):
        subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "code.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    clean = git_info(tmp_path)
    assert clean["dirty"] is False and clean["changed_paths"] == []
    (tmp_path / "code.py").write_text("x = 2\n")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "points.jsonl").write_text("{}\n")
    info = git_info(tmp_path)
    assert info["dirty"] is True and info["changed_files"] == 2
    assert sorted(info["changed_paths"]) == ["code.py", "results/"]
