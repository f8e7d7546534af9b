"""``eagle-jax doctor``: which Python, packages, source files and devices are in use, and
whether a model (and draft) checkpoint is complete, without loading any weights.

Knowing exactly which copy of the code runs is the point: the report names the file every
``eagle_jax`` and ``pallas_kernels`` module was imported from, whether the install is
editable and where its source lives, and the git commit of that source. Checkpoint checks
read only safetensors headers (never pickle), against the shapes of an abstract model.

Module-level imports are the standard library and ``eagle_jax.errors`` only, so ``eagle-jax --help`` stays fast when
the CLI registers this subcommand; jax, flax and the checkpoint code load on use.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import pkgutil
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from eagle_jax.environment import (  # noqa: F401  (the report's parts, re-exported)
    DISTRIBUTION, GIT_TIMEOUT_S, OPTIONAL_PACKAGES, REQUIRED_PACKAGES, git_info, install_info, package_info,
    packages_info, python_info,
)
from eagle_jax.errors import EagleJaxError

PROJECT_PACKAGES = ("eagle_jax", "pallas_kernels")
ENV_VARS = ("JAX_PLATFORMS", "XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR", "CUDA_VISIBLE_DEVICES", "EAGLE_JAX_MODEL",
            "EAGLE_JAX_EXECUTABLE_CACHE", "EAGLE_JAX_COMPILE_WORKERS", "EAGLE_JAX_CPU_MATMUL", "EAGLE_JAX_CPU_ATTENTION",
            "EAGLE_JAX_LAYERS")
# Any other variable with these prefixes can change what JAX or eagle-jax does, so show it too.
ENV_PREFIXES = ("JAX_", "XLA_", "EAGLE_JAX_")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MAX_PROBLEMS_SHOWN = 20


# ----------------------------------------------------------------------------- environment


def env_info() -> dict[str, str | None]:
    """The environment variables that steer JAX and eagle-jax (None when unset)."""
    env: dict[str, str | None] = {name: os.environ.get(name) for name in ENV_VARS}
    for name in sorted(os.environ):
        if name.startswith(ENV_PREFIXES):
            env.setdefault(name, os.environ[name])
    return env


def jax_info() -> dict[str, Any]:
    """Backend, devices and the dtype eagle-jax picks; ``error`` if the backend fails to start."""
    import jax
    import jax.numpy as jnp
    from jax.extend.backend import get_backend

    from eagle_jax.checkpoint.hf import default_dtype

    try:
        devices = jax.devices()
        backend = get_backend()
    except Exception as e:  # whatever JAX raises here is the finding
        # JAX_PLATFORMS=cuda without a visible GPU ends in a bare AssertionError: say why.
        detail = str(e) or f"no platform started (JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')!r})"
        return {"error": f"{type(e).__name__}: {detail}"}
    from eagle_jax.kernels import cpu_matmul
    from eagle_jax.errors import ConfigError

    try:
        _, matmul = cpu_matmul.status(jax.default_backend())
    except ConfigError as e:  # EAGLE_JAX_CPU_MATMUL=packed and no kernel: the finding
        matmul = f"error: {e}"
    lib = cpu_matmul.library_path()
    return {
        "backend": jax.default_backend(),
        "matrix_products": matmul + (f" ({lib})" if lib is not None else ""),
        "platform_version": backend.platform_version,
        "device_count": jax.device_count(),
        "devices": [{"id": d.id, "kind": d.device_kind, "platform": d.platform} for d in devices],
        "default_dtype": jnp.dtype(default_dtype()).name,
        "x64": bool(jax.config.jax_enable_x64),
    }


# ----------------------------------------------------------------------------- source code


def project_modules() -> list[dict[str, Any]]:
    """Every module of the project packages with the file it was imported from (or its import error)."""
    modules = []
    for package in PROJECT_PACKAGES:
        entry = _import_module(package)
        modules.append(entry)
        if entry["error"] is not None:
            continue
        path = sys.modules[package].__path__
        # walk_packages imports subpackages to recurse; their errors are recorded below.
        for info in pkgutil.walk_packages(path, prefix=package + ".", onerror=lambda name: None):
            modules.append(_import_module(info.name))
    return modules


def _import_module(name: str) -> dict[str, Any]:
    try:
        module = importlib.import_module(name)
    except Exception as e:  # any import failure is a finding to report, not a crash
        return {"name": name, "file": None, "error": f"{type(e).__name__}: {e}"}
    return {"name": name, "file": module.__file__, "error": None}


def check_modules(modules: list[dict[str, Any]]) -> dict[str, Any]:
    """Fail on modules that do not import, or that come from outside their package's directory."""
    check = _new_check("modules")
    roots = {m["name"]: Path(m["file"]).parent for m in modules if m["name"] in PROJECT_PACKAGES and m["file"]}
    for m in modules:
        if m["error"] is not None:
            _fail(check, f"{m['name']} does not import: {m['error']}", module=m["name"])
            continue
        root = roots.get(m["name"].split(".")[0])
        if root is not None and not Path(m["file"]).is_relative_to(root):
            _fail(
                check,
                f"{m['name']} is imported from {m['file']}, outside its package directory {root}",
                module=m["name"], expected=str(root), actual=m["file"],
            )
    check["info"]["count"] = len(modules)
    return check


# ----------------------------------------------------------------------------- checkpoints


def _new_check(name: str, path: Path | None = None) -> dict[str, Any]:
    return {"name": name, "status": "ok", "path": str(path) if path else None, "problems": [], "info": {}}


def _fail(check: dict[str, Any], message: str, **fields: Any) -> None:
    """Record a problem; ``fields`` (file, tensor, expected, actual, ...) are for --json readers."""
    check["status"] = "fail"
    check["problems"].append({"message": message, **fields})


def _skip(name: str, reason: str) -> dict[str, Any]:
    check = _new_check(name)
    check["status"] = "skipped"
    check["info"]["reason"] = reason
    return check


def expected_shapes(build: Callable[[], Any], names: dict[tuple, tuple[str, bool]]) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape in the file, from an abstract module (no weights allocated).

    ``names`` is a loader's NNX path -> (tensor name, transpose?) map; transposed tensors are
    stored PyTorch-style ``[out, in]``, the reverse of our kernels.
    """
    from flax import nnx

    from eagle_jax.models.target import checkpoint_shapes

    flat = dict(nnx.to_flat_state(nnx.state(nnx.eval_shape(build))))
    return checkpoint_shapes(names, {p: flat[p].shape for p in names})


def check_tensors(check: dict[str, Any], files: dict[str, Path], expected: dict[str, tuple[int, ...]]) -> None:
    """Compare the safetensors headers with ``expected``: every tensor present, every shape right."""
    from safetensors import SafetensorError, safe_open

    for name in sorted(n for n in expected if n not in files):
        _fail(
            check, f"tensor {name} is missing (expected shape {list(expected[name])})",
            tensor=name, expected=list(expected[name]), actual=None,
        )
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        if name in files:
            by_file.setdefault(files[name], []).append(name)
    dtypes: Counter[str] = Counter()
    for file, names in by_file.items():
        try:
            with safe_open(file, framework="numpy") as f:
                for name in names:
                    tensor = f.get_slice(name)  # header only: no data is read
                    shape = tuple(tensor.get_shape())
                    dtypes[tensor.get_dtype()] += 1
                    if shape != expected[name]:
                        _fail(
                            check, f"{file.name}: tensor {name} has shape {list(shape)}, expected {list(expected[name])}",
                            file=file.name, tensor=name, expected=list(expected[name]), actual=list(shape),
                        )
        except (SafetensorError, OSError) as e:
            _fail(check, f"{file} is not a readable safetensors file: {e}", file=file.name)
    unexpected = sorted(set(files) - set(expected))
    check["info"].update(
        tensors_expected=len(expected),
        tensors_in_files=len(files),
        unexpected_tensors=unexpected,
        dtypes=dict(dtypes),
        files=sorted({p.name for p in files.values()}),
    )


# Besides our own errors: a field of the wrong JSON type (a string for hidden_size) fails
# inside the parser with a bare TypeError/ValueError/KeyError, which the loader would hit too.
CONFIG_ERRORS = (EagleJaxError, TypeError, ValueError, KeyError)


def _config_message(e: Exception) -> str:
    """Our errors already name the file and field; a bare Python error needs the context."""
    return str(e) if isinstance(e, EagleJaxError) else f"config.json could not be parsed: {type(e).__name__}: {e}"


def _tensor_files(check: dict[str, Any], path: Path) -> dict[str, Path] | None:
    from eagle_jax.checkpoint.hf import safetensors_files

    try:
        return safetensors_files(path)
    except EagleJaxError as e:
        _fail(check, str(e), file="model.safetensors")
        return None


def check_model(path: Path) -> tuple[dict[str, Any], Any]:
    """Check a target model directory; returns the check and its ModelConfig (None if unreadable)."""
    from eagle_jax.models.config import read_config_json
    from eagle_jax.models.registry import family_for

    check = _new_check("model", path)
    try:
        raw = read_config_json(path, "checkpoint")
        family = family_for(raw, str(path / "config.json"))  # the implementation the loader would pick
        cfg = family.config_from_hf(raw)
    except CONFIG_ERRORS as e:
        _fail(check, _config_message(e), file="config.json")
        return check, None
    check["info"]["config"] = {
        "architecture": cfg.architecture,
        "implementation": family.name,
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "feature_layer_ids": list(cfg.feature_layer_ids),
    }
    quant = getattr(cfg, "quant", None)
    if quant is not None:
        check["info"]["config"]["quantization"] = {
            "format": "compressed-tensors pack-quantized INT4", "group_size": quant.group_size,
            "int4_moe_layers": list(cfg.int4_moe_layers),
        }
    files = _tensor_files(check, path)
    if files is not None:
        from eagle_jax.checkpoint.hf import packed_shape_records

        expected = expected_shapes(lambda: family.module(cfg), family.param_names(cfg))
        # A packed weight's shape record is a [2] tensor beside it (its values are checked at load).
        expected.update({n: (2,) for n in packed_shape_records(expected)})
        check_tensors(check, files, expected)
    check_tokenizer(check, path, cfg.vocab_size)
    return check, cfg


def check_tokenizer(check: dict[str, Any], path: Path, vocab_size: int) -> None:
    """tokenizer.json and tokenizer_config.json present and loadable, within the model's vocabulary."""
    from eagle_jax.checkpoint.tokenizer import Tokenizer

    missing = [name for name in TOKENIZER_FILES if not (path / name).is_file()]
    for name in missing:
        _fail(check, f"{name} not found in {path}", file=name)
    if missing:
        return
    try:
        tokenizer = Tokenizer.from_dir(path)
    except EagleJaxError as e:
        _fail(check, str(e), file="tokenizer.json")
        return
    check["info"]["tokenizer_vocab_size"] = tokenizer.vocab_size
    if tokenizer.vocab_size > vocab_size:
        _fail(
            check,
            f"tokenizer.json has {tokenizer.vocab_size} tokens but config.json vocab_size={vocab_size}: "
            "the model has no embedding for the ids above",
            file="tokenizer.json", expected=f"<= {vocab_size}", actual=tokenizer.vocab_size,
        )


def check_draft(path: Path, target_cfg: Any) -> tuple[dict[str, Any], Any]:
    """Check an EAGLE-3 draft directory; returns the check and its DraftConfig (None if unreadable)."""
    from eagle_jax.checkpoint.draft_io import D2T, T2D, describe_feature_layers, draft_name_map, read_draft_config
    from eagle_jax.models.draft import Eagle3Draft

    check = _new_check("draft", path)
    try:
        cfg = read_draft_config(path, target_cfg=target_cfg)
    except CONFIG_ERRORS as e:
        _fail(check, _config_message(e), file="config.json")
        return check, None
    check["info"]["config"] = {
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "aux_layer_ids": list(cfg.aux_layer_ids),
        "has_embed_tokens": cfg.has_embed_tokens,
    }
    # Which target streams the draft is fed, to compare with what it was trained on. With a
    # target, read_draft_config has already bounded the ids by N; without one, N (and so
    # the default) is unknown.
    check["info"]["feature_layers"] = (
        describe_feature_layers(cfg.aux_layer_ids, target_cfg.num_hidden_layers)
        if target_cfg is not None
        else f"entering target layers {', '.join(map(str, cfg.aux_layer_ids))} (no target to compare with)"
    )
    files = _tensor_files(check, path)
    if files is None:
        return check, cfg
    expected = expected_shapes(lambda: Eagle3Draft(cfg), draft_name_map(cfg))
    # The loader accepts a full-vocabulary draft without vocabulary maps (identity).
    if not (cfg.draft_vocab_size == cfg.vocab_size and D2T not in files and T2D not in files):
        expected.update({D2T: (cfg.draft_vocab_size,), T2D: (cfg.vocab_size,)})
    check_tensors(check, files, expected)
    return check, cfg


def check_compatibility(draft_cfg: Any, target_cfg: Any) -> dict[str, Any]:
    """Whether the draft can run on the target (``check_compatible``).

    The target is checked as a loader builds it for this draft: returning the draft's
    feature layers (the reason ``read_draft_config`` exists). Feature layers other than
    the target's defaults are noted, not failed; layers the target lacks fail.
    """
    from eagle_jax.models.draft import check_compatible

    check = _new_check("compatibility")
    defaults = tuple(target_cfg.feature_layer_ids)
    check["info"].update(draft_feature_layers=list(draft_cfg.aux_layer_ids), target_default_feature_layers=list(defaults))
    try:
        check_compatible(draft_cfg, target_cfg.replace(aux_layer_ids=draft_cfg.aux_layer_ids))
    except EagleJaxError as e:
        _fail(check, str(e))
    return check


# ----------------------------------------------------------------------------- report


def _resolve_model(model: Path | None) -> tuple[Path | None, str]:
    """The model directory to check and where it came from (--model or the CLI's default)."""
    from eagle_jax.defaults import default_model_dir

    if model is not None:
        return model, "--model"
    default = default_model_dir()
    return (default, "default") if default.is_dir() else (None, f"no --model, and the default {default} does not exist")


def collect_report(model: Path | None, draft: Path | None) -> dict[str, Any]:
    """Everything ``doctor`` shows, as JSON-ready data. ``report["ok"]`` is False when a check failed.

    ``model`` None means the CLI's default model directory, checked only if it exists.
    """
    modules = project_modules()
    install = install_info()
    install["git"] = git_info(install["imported_from"])
    jax_report = jax_info()
    checks = [check_modules(modules)]
    if "error" in jax_report:
        checks.append(_new_check("jax"))
        _fail(checks[-1], f"the JAX backend does not start: {jax_report['error']}")
    model_path, model_source = _resolve_model(model)
    target_cfg = draft_cfg = None
    if model_path is None:
        checks.append(_skip("model", model_source))
    else:
        model_check, target_cfg = check_model(model_path)
        model_check["info"]["source"] = model_source
        checks.append(model_check)
    if draft is None:
        checks.append(_skip("draft", "no --draft given"))
    else:
        draft_check, draft_cfg = check_draft(draft, target_cfg)
        checks.append(draft_check)
    if draft_cfg is not None:
        checks.append(
            check_compatibility(draft_cfg, target_cfg)
            if target_cfg is not None
            else _skip("compatibility", "no readable target model to check the draft against")
        )
    return {
        "ok": all(c["status"] != "fail" for c in checks),
        "python": python_info(),
        "eagle_jax": install,
        "packages": packages_info(),
        "jax": jax_report,
        "env": env_info(),
        "modules": modules,
        "checks": checks,
        "warnings": _warnings(install),
    }


def _warnings(install: dict[str, Any]) -> list[str]:
    """Findings that do not fail the doctor but explain surprises (another copy of the code)."""
    out = []
    if install["version"] is None:
        out.append(f"eagle-jax is not installed; it runs from {install['imported_from']} via sys.path")
    elif install["source"] != install["imported_from"]:
        out.append(
            f"eagle_jax is imported from {install['imported_from']}, but the installed "
            f"{'editable ' if install['editable'] else ''}copy is {install['source']}: another copy shadows the install"
        )
    if len({m["version"] for m in install["metadata"]}) > 1:
        copies = ", ".join(f"{m['path']} ({m['version']})" for m in install["metadata"])
        out.append(f"eagle-jax metadata copies disagree on the version; importlib.metadata reads the first: {copies}")
    return out


def _section(title: str, rows: list[tuple[str, Any]]) -> list[str]:
    width = max((len(k) for k, _ in rows), default=0)
    return [title] + [f"  {k.ljust(width)}  {v}" for k, v in rows] + [""]


def _git_text(git: dict[str, Any]) -> str:
    if "error" in git:
        return f"none ({git['error']})"
    state = f"dirty, {git['changed_files']} changed files" if git["dirty"] else "clean"
    return f"{git['commit']} ({state}) in {git['root']}"


def _jax_rows(info: dict[str, Any]) -> list[tuple[str, Any]]:
    if "error" in info:
        return [("error", info["error"])]
    devices = ", ".join(f"{d['platform']}:{d['id']} {d['kind']}" for d in info["devices"])
    return [
        ("backend", f"{info['backend']} ({info['platform_version']})"),
        ("devices", f"{info['device_count']}: {devices}"),
        ("matrix products", info["matrix_products"]),
        ("default dtype", info["default_dtype"]),
        ("x64", info["x64"]),
    ]


def _check_lines(check: dict[str, Any]) -> list[str]:
    tag = {"ok": "[ok]  ", "fail": "[FAIL]", "skipped": "[skip]"}[check["status"]]
    info = check["info"]
    detail = check["path"] or ""
    if check["status"] == "skipped":
        detail = info["reason"]
    elif check["name"] == "modules":
        detail = f"{info['count']} modules"
    elif check["name"] == "compatibility":
        detail = f"draft feature layers {info['draft_feature_layers']} (target default {info['target_default_feature_layers']})"
    head = f"  {tag} {check['name']:<14} "
    indent = " " * len(head)
    lines = [head + detail]
    if "feature_layers" in info:
        lines.append(f"{indent}features: {info['feature_layers']}")
    if "tensors_expected" in info:
        extra = f", {len(info['unexpected_tensors'])} unexpected" if info["unexpected_tensors"] else ""
        dtypes = ", ".join(f"{k} x{v}" for k, v in info["dtypes"].items())
        lines.append(f"{indent}{info['tensors_expected']} tensors expected{extra}; dtypes: {dtypes or '-'}")
    problems = check["problems"]
    lines += [f"{indent}- {p['message']}" for p in problems[:MAX_PROBLEMS_SHOWN]]
    if len(problems) > MAX_PROBLEMS_SHOWN:
        lines.append(f"{indent}... and {len(problems) - MAX_PROBLEMS_SHOWN} more (see --json)")
    return lines


def format_report(report: dict[str, Any]) -> str:
    """The report as plain text (no colour or box drawing, so it reads the same piped into a file)."""
    py, ej = report["python"], report["eagle_jax"]
    lines = ["eagle-jax doctor", ""]
    if report["warnings"]:
        lines += ["WARNINGS"] + [f"  ! {w}" for w in report["warnings"]] + [""]
    venv = "virtualenv" if py["virtualenv"] else "no virtualenv"
    lines += _section("Python", [
        ("version", f"{py['version']} ({py['implementation']})"),
        ("executable", py["executable"]),
        ("prefix", f"{py['prefix']} ({venv}; base {py['base_prefix']})"),
        ("platform", py["platform"]),
        ("sys.path", " : ".join(py["sys_path"])),
    ])
    lines += _section("eagle-jax", [
        ("version", ej["version"] or "not installed"),
        ("editable", ej["editable"]),
        ("source", ej["source"]),
        ("imported from", ej["imported_from"]),
        ("git", _git_text(ej["git"])),
        ("metadata", " ; ".join(f"{m['path']} ({m['installer'] or 'no installer'})" for m in ej["metadata"])),
    ])
    lines += _section("Packages", [
        (name, f"{p['version'] or 'not installed':<12} {p['location'] or ''}".rstrip())
        for name, p in report["packages"].items()
    ])
    lines += _section("JAX", _jax_rows(report["jax"]))
    lines += _section("Environment", [(k, "(unset)" if v is None else v) for k, v in report["env"].items()])
    lines += _section("Modules", [(m["name"], m["file"] or f"IMPORT ERROR: {m['error']}") for m in report["modules"]])
    lines.append("Checks")
    for check in report["checks"]:
        lines += _check_lines(check)
    failed = [c["name"] for c in report["checks"] if c["status"] == "fail"]
    lines += ["", f"Result: {'FAILED (' + ', '.join(failed) + ')' if failed else 'all checks passed'}"]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line


def cmd_doctor(args: argparse.Namespace) -> int:
    """Print the report; 0 when every check passes, 1 when one fails."""
    report = collect_report(args.model, args.draft)
    predict = getattr(args, "predict", None)
    if predict is not None:
        report["predicted_shapes"] = predict_shapes(report, args, predict)
    try:
        text = json.dumps(report, indent=2) if args.json else format_report(report)
        if predict is not None and not args.json:
            text += "\n" + format_predictions(report["predicted_shapes"])
        print(text, flush=True)
    except BrokenPipeError:
        # The reader (`| head`) stopped early, which is not a failure. Point stdout at
        # /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if report["ok"] else 1


def predict_shapes(report: dict[str, Any], args: argparse.Namespace, buckets_text: str) -> dict[str, Any]:
    """The auto policy's calibration on this machine: per batch bucket, every option's
    step time, expected accept length (the draft's model card) and predicted tokens/s."""
    from eagle_jax.serving.engine import Engine, EngineConfig
    from eagle_jax.errors import InputError
    from eagle_jax.serving.policy import parse_shapes
    from eagle_jax.spec.config import SpeculativeConfig

    if args.draft is None:
        raise InputError("--predict needs --draft DIR (the draft whose shapes to time)")
    if not report["ok"]:
        raise InputError("--predict needs checkpoints that pass the checks above (see the failed check)")
    try:
        buckets = tuple(sorted({int(b) for b in buckets_text.split(",") if b.strip()}))
    except ValueError:
        raise InputError(f"--predict {buckets_text!r}: batch buckets are comma-separated integers, e.g. 1,4,16") from None
    if not buckets or buckets[0] < 1:
        raise InputError(f"--predict {buckets_text!r}: give at least one batch bucket >= 1")
    model_dir, _ = _resolve_model(args.model)
    config = EngineConfig(
        max_batch=buckets[-1], batch_buckets=buckets, max_seq_len=256, prompt_buckets=(64,),
        speculative=SpeculativeConfig(), spec_policy="auto", sampled_steps=False,
        spec_shapes=parse_shapes(args.shapes) if args.shapes else None,
    )
    engine = Engine(str(model_dir), str(args.draft), config, progress=sys.stderr.isatty())
    policy = engine.policy
    return {
        "note": "step times on an empty cache at start-up; accept lengths from the draft's model card "
                "(the engine corrects both as it runs)",
        "prior": policy.prior_source,
        "buckets": {str(b): r for b, r in policy.report().items()},
    }


def format_predictions(pred: dict[str, Any]) -> str:
    lines = [f"Predicted best shape per batch bucket (auto policy; {pred['note']}; prior: {pred['prior']})"]
    for b, r in pred["buckets"].items():
        tps = r["predicted_tokens_per_second"]
        plain = tps["plain"]
        others = sorted(((v, k) for k, v in tps.items() if k != "plain"), reverse=True)[:3]
        lines.append(f"  batch {b}: {r['chosen']} (plain {plain:.1f} tok/s; "
                     + ", ".join(f"{k} {v:.1f} (x{v / plain:.2f}, accept {r['expected_accept_length'][k]:.2f}, "
                                 f"step {r['step_ms'][k]:.1f} ms vs {r['step_ms']['plain']:.1f})" for v, k in others) + ")")
    return "\n".join(lines)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``doctor`` on the CLI's subparsers (its handler is ``args.func``)."""
    p = subparsers.add_parser(
        "doctor",
        help="show which files, versions and devices are in use; check checkpoints",
        description=(
            "Report the Python, package versions, JAX devices, environment, and the file every "
            "eagle_jax / pallas_kernels module is imported from (with the install's source and git "
            "commit); then check a model (and draft) directory: config, every tensor's presence and "
            "shape (headers only, no weights loaded), tokenizer files, and draft/target compatibility. "
            "Exit status: 0 all checks pass, 1 a check failed."
        ),
    )
    p.add_argument(
        "--model", type=Path, default=None, metavar="DIR",
        help="target model directory (default: $EAGLE_JAX_MODEL or checkpoints/<default>, checked if it exists)",
    )
    p.add_argument("--draft", type=Path, default=None, metavar="DIR", help="EAGLE-3 draft directory to check (against --model)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--predict", nargs="?", const="1,4", default=None, metavar="BUCKETS",
        help="with --draft: load the model and draft, compile plain and every auto candidate shape for these batch "
             "buckets (comma-separated, default 1,4), time them on this machine and print the shape the auto policy "
             "predicts fastest per bucket (takes minutes: compiling and timing)",
    )
    p.add_argument("--shapes", default=None, metavar="LIST", help="with --predict: the candidates (default: auto's)")
    p.set_defaults(func=cmd_doctor)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``doctor`` on its own (``python -m eagle_jax.doctor [--model DIR] ...``)."""
    parser = argparse.ArgumentParser(prog="eagle-jax")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["doctor", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
