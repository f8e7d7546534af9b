"""``eagle-jax ablate CONFIG.toml``: one command per research question, a grid over
speculative, sampling, policy and engine fields, resumable, with provenance.

A config names fixed values at its top level and the grid under ``[grid]`` (each a
non-empty list); every field may be either::

    name = "chains"
    model = "checkpoints/smollm2-135m-instruct"       # default: the default model
    draft = "checkpoints/smollm2-135m-instruct-eagle3"
    suite = "mt_bench"                                 # built-in suite or a .jsonl prompt file
    max_prompts = 8
    max_new_tokens = 64
    repeats = 3
    [grid]
    steps = [1, 2, 3, 4, 5]
    temperature = [0.0, 0.7]

Fields (``FIELDS``): the draft shape as ``shape`` ("plain", "chain S=3", "tree S=3 k=4
T=8") or as ``steps``/``topk``/``draft_tokens``; ``policy`` (fixed, threshold, auto);
``threshold`` (the batch cutoff, with policy threshold); ``temperature``,
``top_p``, ``top_k``, ``sampling_verify`` (coupled, rejection); ``batch_size``; ``draft``;
``suite``; ``max_prompts``, ``max_new_tokens``, ``repeats``, ``seed``, ``dtype``, ``model``;
``draft_sync`` (eager, deferred; unset: the engine's default, ``EngineConfig.draft_sync``).
An unknown field, a bad value or an empty list is a ``ConfigError`` naming the field,
raised before anything runs (every point is resolved first).

Each point runs plain decoding and its speculative setting on the same prompts at its
batch size (continuous batching, ``max_batch = batch_size``), interleaved ``repeats``
times after a warm-up; tokens/s are medians with min and max; mean accept length and
acceptance by depth come from the first pass. Greedy points must reproduce plain
decoding token for token (checked: a difference stops the sweep). Sampled points under
coupled verification report how many prompts did and where the others part: they agree
except where a draw falls within float32 rounding of a boundary of the distribution,
where the verify forward and the plain one may pick either neighbour.

Output, in ``--out`` (default ``results/ablations/NAME``): ``points.jsonl``, one line per
finished point with the point's fields, its figures and an environment fingerprint
(versions, git commit and dirty flag, devices, CPU, dtype, seeds, the config's SHA-256);
``summary.md`` and ``summary.png``. A rerun of the same config resumes: points already
in ``points.jsonl`` are skipped (a torn last line from a kill is dropped and its point
rerun), so no point is lost and none runs twice. A ``points.jsonl`` written by another
config is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import os
import statistics
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from eagle_jax.errors import ConfigError, EagleJaxError, InputError
from eagle_jax.experiments import harness
from eagle_jax.experiments.harness import FIELDS, Point, acceptance, context_sizes, first_difference, resolve, spread
from eagle_jax.spec.config import parse_shape

MAX_DEPTH_LINES = 10  # acceptance-by-depth lines drawn one per point up to this many
WARMUP_TOKENS = 4


TOP_ONLY = ("name",)  # top-level keys that are not point fields


@dataclasses.dataclass(frozen=True)
class Sweep:
    name: str
    fixed: dict[str, Any]
    grid: dict[str, list[Any]]
    points: tuple[Point, ...]
    sha256: str


def load_config(path: str | Path) -> Sweep:
    """Parse and check a sweep config; every point resolved, or a ``ConfigError``."""
    path = Path(path)
    raw_bytes = path.read_bytes() if path.is_file() else None
    if raw_bytes is None:
        raise ConfigError(f"ablation config {path} not found")
    try:
        raw = tomllib.loads(raw_bytes.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    return parse_config(raw, str(path), hashlib.sha256(raw_bytes).hexdigest())


def parse_config(raw: dict[str, Any], where: str = "config", sha256: str = "") -> Sweep:
    grid = raw.get("grid", {})
    if not isinstance(grid, dict):
        raise ConfigError(f"{where}: [grid] must be a table of field = [values]")
    fixed = {k: v for k, v in raw.items() if k != "grid" and k not in TOP_ONLY}
    for k in list(fixed) + list(grid):
        if k not in FIELDS:
            raise ConfigError(f"{where}: unknown field {k!r}; known: {', '.join(FIELDS)}")
    both = sorted(set(fixed) & set(grid))
    if both:
        raise ConfigError(f"{where}: field(s) {both} are both fixed and in [grid]")
    for k, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{where}: grid.{k} must be a non-empty list of values")
        if len({json.dumps(v) for v in values}) != len(values):
            raise ConfigError(f"{where}: grid.{k} repeats a value: {values}")
    # Every value on its own first (the field is named), then the points they combine into.
    for k, v in fixed.items():
        FIELDS[k][0](k, v)
    for k, values in grid.items():
        for v in values:
            FIELDS[k][0](k, v)
    name = raw.get("name", Path(where).stem)
    if not isinstance(name, str) or not name or "/" in name:
        raise ConfigError(f"{where}: name={name!r} must be a non-empty string without '/'")
    points = []
    keys = list(grid)
    for combo in itertools.product(*(grid[k] for k in keys)) if keys else [()]:
        values = {k: v for k, v in fixed.items()}
        values.update(dict(zip(keys, combo)))
        points.append(resolve(values))
    return Sweep(name=name, fixed=fixed, grid=grid, points=tuple(points), sha256=sha256)


# ----------------------------------------------------------------------------- results file


def read_done(path: Path, sha256: str) -> dict[str, dict]:
    """The finished points of ``path`` by key; a torn last line (a kill mid-write) is cut off."""
    if not path.is_file():
        return {}
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with path.open("r+b") as f:
            f.truncate(end)
    done = {}
    for n, line in enumerate(data[:end].decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: not a JSON line ({e}); move the file away to start over") from e
        if rec.get("config_sha256") != sha256:
            raise InputError(
                f"{path}:{n} was written by another config (SHA-256 {str(rec.get('config_sha256'))[:12]}..., this one "
                f"{sha256[:12]}...); use another --out or move the file away"
            )
        done[rec["key"]] = rec
    return done


def append_line(path: Path, rec: dict) -> None:
    """One point's line, written whole and flushed to disk before the next point starts."""
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


# ----------------------------------------------------------------------------- running


class Runner(harness.Runner):
    """The shared runner (models, suites and engines loaded once each), and a point's run."""

    def run(self, point: Point) -> dict[str, Any]:
        from eagle_jax.defaults import default_model_dir
        from eagle_jax.serving.policy import policy_shapes
        from eagle_jax.spec.sampling import SamplingParams
        from eagle_jax.checkpoint.tokenizer import Tokenizer

        v = point.values
        model_dir = v.get("model") or str(default_model_dir())
        target, draft = self.models(model_dir, v.get("draft"), v["dtype"])
        tokenizer = Tokenizer.from_dir(model_dir)
        suite, prompts = self.prompts(v["suite"], v["max_prompts"], tokenizer)
        max_seq_len, buckets = context_sizes(max(map(len, prompts)), v["max_new_tokens"], target.config.max_position_embeddings)
        params = [SamplingParams(temperature=v["temperature"], top_p=v["top_p"], top_k=v["top_k"], seed=v["seed"] + i,
                                 max_new_tokens=v["max_new_tokens"]) for i in range(len(prompts))]
        plain = self.engine(target, draft, tokenizer, point, max_seq_len, buckets, speculative=False)
        spec = self.engine(target, draft, tokenizer, point, max_seq_len, buckets, True) if point.speculative else None
        warm = [dataclasses.replace(params[0], max_new_tokens=WARMUP_TOKENS)]
        for e in (plain, spec):
            if e is not None:
                e.generate(prompts[:1], warm)
        runs = {"plain": [], "speculative": []}
        accepts, plain_out, spec_out = [], None, None
        for rep in range(v["repeats"]):
            for name, e in (("plain", plain), ("speculative", spec)):
                if e is None:
                    continue
                out, tps = harness.timed_generate(e, prompts, params)
                runs[name].append(tps)
                if rep == 0:
                    if name == "plain":
                        plain_out = out
                    else:
                        spec_out = out
                        accepts = [a for c in out for a in c.accept_lengths]
        res: dict[str, Any] = {"suite": suite.name, "prompts": len(prompts),
                               "generated_tokens": sum(len(c.token_ids) for c in plain_out),
                               "plain": spread(runs["plain"])}
        if spec is not None:
            depth = max(s.num_steps for s in policy_shapes(spec.policy))
            res["speculative"] = spread(runs["speculative"])
            res["speedup"] = res["speculative"]["median"] / res["plain"]["median"]
            res.update(acceptance(accepts, depth))
            bad = [i for i, (p, s) in enumerate(zip(plain_out, spec_out)) if p.token_ids != s.token_ids]
            if v["temperature"] == 0:
                if bad:
                    raise RuntimeError(
                        f"point {point.key}: greedy speculative output differs from plain decoding on prompt(s) {bad}")
                res["identical_to_plain"] = True
            elif v["sampling_verify"] == "coupled":
                # Coupled verification draws each position's token with plain decoding's
                # uniform, so the texts agree, except where that uniform falls within
                # float32 rounding of a boundary of the cumulative distribution: the verify
                # forward (several tokens) and the plain one (one) round differently, and
                # there either token is a correct draw. Seen once in 4,600 tokens (SmolLM2,
                # T=1.0: the uniform 2.2e-7 above the boundary in a float64 reference).
                # Reported, with where the texts part, not failed; greedy points fail.
                res["identical_to_plain"] = not bad
                res["prompts_identical_to_plain"] = len(prompts) - len(bad)
                res["divergences"] = [
                    {"prompt": i, "token_index": first_difference(plain_out[i].token_ids, spec_out[i].token_ids)}
                    for i in bad]
                if bad:
                    self.log(f"point {point.key}: coupled-sampled output parts from plain decoding at "
                             + ", ".join(f"prompt {d['prompt']} token {d['token_index']}" for d in res["divergences"])
                             + " (a draw within float rounding of a distribution boundary; see ablate.Runner.run)")
            else:
                res["identical_to_plain"] = None  # rejection sampling: the same distribution, other draws
            summary = spec.metrics.summary()
            res["steps_by_bucket"] = summary["steps_by_bucket"]
            res["policy"] = spec.policy.describe()
        return res


def progress_line(res: dict) -> str:
    """A point's result in one line. A policy point whose policy ran plain throughout
    (the threshold above its cutoff, auto where nothing pays) has no accept length."""
    s = res.get("speculative", res["plain"])
    if "speedup" not in res:
        return f"{s['median']:.1f} tok/s (plain)"
    acc = res.get("mean_accept_length")
    ran_ = f", ran {ran(res)}" if res.get("steps_by_bucket") else ""
    return (f"{s['median']:.1f} tok/s, accept {'-' if acc is None else f'{acc:.2f}'}, "
            f"speedup {res['speedup']:.2f}x{ran_}")


def fingerprint(sweep: Sweep, dtype: str) -> dict[str, Any]:
    from eagle_jax.environment import fingerprint as environment

    env = environment(dtype)
    env["seeds"] = {"prompt_i": "seed + i", "note": "temperature 0 draws no random numbers"}
    return env


def run_sweep(sweep: Sweep, out: Path, log=print, runner: Runner | None = None) -> list[dict]:
    """Every point not yet in ``out/points.jsonl``, appended as it finishes; then the summary."""
    out.mkdir(parents=True, exist_ok=True)
    lines = out / "points.jsonl"
    done = read_done(lines, sweep.sha256)
    todo = [p for p in sweep.points if p.key not in done]
    from eagle_jax.environment import boot_id

    others = {_machine(r) for r in done.values()} - {boot_id() or "unrecorded"}
    if others and todo:
        log(f"ablation {sweep.name}: {len(done)} points in {lines} were taken on another machine or boot; "
            "their tokens/s will not compare with the new points' (the summary marks each point's machine)")
    log(f"ablation {sweep.name}: {len(sweep.points)} points, {len(sweep.points) - len(todo)} already in {lines}, "
        f"{len(todo)} to run")
    runner = runner or Runner(log)
    env = None
    for i, p in enumerate(todo, 1):
        t0 = time.perf_counter()
        res = runner.run(p)
        env = env or fingerprint(sweep, p.values["dtype"])
        rec = {"key": p.key, "point": p.values, "result": res, "config_sha256": sweep.sha256,
               "seconds": time.perf_counter() - t0, "finished_at": harness.timestamp(),
               "fingerprint": env}
        append_line(lines, rec)
        done[p.key] = rec
        log(f"[{i}/{len(todo)}] {_label(p.values, sweep)}: {progress_line(res)}")
    records = [done[p.key] for p in sweep.points]
    (out / "summary.md").write_text(markdown(sweep, records))
    save_plots(sweep, records, out / "summary.png")
    log(f"wrote {out / 'summary.md'} and {out / 'summary.png'}")
    return records


# ----------------------------------------------------------------------------- reports


def _label(values: dict, sweep: Sweep) -> str:
    return ", ".join(f"{k}={values.get(k)}" for k in sweep.grid) or "the point"


def ran(res: dict) -> str:
    """What a policy ran: its steps per (bucket: shape), most first, as 'chain S=1 83, plain 12'."""
    steps = res.get("steps_by_bucket") or {}
    merged: dict = {}
    for k, n in steps.items():
        shape = k.split(": ", 1)[-1]
        merged[shape] = merged.get(shape, 0) + n
    return ", ".join(f"{k} {n}" for k, n in sorted(merged.items(), key=lambda kv: -kv[1]))


def markdown(sweep: Sweep, records: list[dict]) -> str:
    fields = list(sweep.grid)
    policies = any(r["point"].get("policy") in ("auto", "threshold") for r in records)
    head = fields + ["accept length", "spec tok/s (min-max)", "plain tok/s (min-max)", "speedup"]
    if policies:
        head.append("ran (steps)")
    coupled = any("prompts_identical_to_plain" in r["result"] for r in records)
    if coupled:
        head.append("same text as plain")
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        res = r["result"]
        cells = [str(r["point"].get(k)) for k in fields]
        s, p = res.get("speculative"), res["plain"]
        cells += [f"{res['mean_accept_length']:.3f}" if res.get("mean_accept_length") is not None else "-",
                  f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})" if s else "-",
                  f"{p['median']:.1f} ({p['min']:.1f}-{p['max']:.1f})",
                  f"{res['speedup']:.2f}x" if "speedup" in res else "-"]
        if policies:
            cells.append(ran(res) or "-")
        if coupled:
            n = res.get("prompts_identical_to_plain")
            cells.append(f"{n}/{res['prompts']}" if n is not None else
                         ("all" if res.get("identical_to_plain") else "- (other draws)" if "speedup" in res else "-"))
        rows.append("| " + " | ".join(cells) + " |")
    fixed = ", ".join(f"{k}={v}" for k, v in sweep.fixed.items())
    env = records[0]["fingerprint"] if records else {}
    machines = list(dict.fromkeys(_machine(r) for r in records))
    if len(machines) > 1:
        # A sweep resumed on another machine (or boot): its speedups are each measured
        # within one point, but compare across rows only within one machine.
        head.append("machine")
        rows[0] = "| " + " | ".join(head) + " |"
        rows[1] = "|" + "---|" * len(head)
        for i, r in enumerate(records):
            rows[2 + i] = rows[2 + i] + f" m{machines.index(_machine(r)) + 1} |"
    return (f"# Ablation: {sweep.name}\n\nFixed: {fixed or '(none)'}. Config SHA-256 {sweep.sha256[:16]}; "
            f"git {env.get('git', {}).get('commit', '?')}; {env.get('cpu', '?')}; tokens/s are medians over "
            f"interleaved passes.\n\n"
            + (f"Points from {len(machines)} machines or boots (column machine; boot ids "
               + ", ".join(f"m{i + 1} {m[:8]}" for i, m in enumerate(machines))
               + "): accept lengths compare across them, tokens/s and speedups only within one.\n\n"
               if len(machines) > 1 else "")
            + "\n".join(rows) + "\n")


def _machine(record: dict) -> str:
    return record.get("fingerprint", {}).get("boot_id") or "unrecorded"


def speedup_series(records: list[dict], name) -> dict[str, dict[int, float]]:
    """{name(record): {batch size: speedup over the plain run inside that point}} for the
    speculative points of a sweep with batch_size in its grid."""
    out: dict[str, dict[int, float]] = {}
    for r in records:
        if "speedup" in r["result"]:
            out.setdefault(name(r), {})[r["point"]["batch_size"]] = r["result"]["speedup"]
    return out


def save_plots(sweep: Sweep, records: list[dict], path: Path, only: tuple[str, ...] | None = None) -> None:
    """Accept length against steps (per topk), tokens/s against batch size (per setting,
    plain included) and the speedup over plain against batch size, acceptance by depth per
    point: the panels the grid has data for (``only``: those of "accept", "batch",
    "speedup", "depth" named)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = [r for r in records if "speedup" in r["result"]]
    panels = []
    if spec:
        panels.append("accept")
    if "batch_size" in sweep.grid:
        panels.append("batch")
        if spec:
            panels.append("speedup")
    if spec:
        panels.append("depth")
    if only is not None:
        panels = [x for x in panels if x in only]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5.2 * max(1, len(panels)), 4), squeeze=False)
    others = [k for k in sweep.grid if k not in ("steps", "shape", "batch_size")]

    def group(r, drop=()):
        return ", ".join(f"{k}={r['point'].get(k)}" for k in others if k not in drop) or "all"

    def setting(r):
        pt = r["point"]
        # auto names no shape (it picks among its own candidates)
        shape = pt.get("shape") or (f"steps={pt['steps']}" if pt.get("steps") else "")
        return f"{pt['policy']} {shape}".strip() + f" ({group(r, ('policy',))})"

    def batch_axis(ax):
        ax.set_xscale("log", base=2)
        bs = sorted({r["point"]["batch_size"] for r in records})
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.set_xlabel("batch size")

    for ax, panel in zip(axes[0], panels):
        if panel == "accept":
            series: dict = {}
            for r in spec:
                if r["result"].get("mean_accept_length") is None:  # a policy that ran plain throughout
                    continue
                x = _steps(r)
                series.setdefault(group(r) + f", topk={_topk(r)}", []).append((x, r["result"]["mean_accept_length"]))
            for name, pts in series.items():
                pts.sort()
                ax.plot([a for a, _ in pts], [b for _, b in pts], "o-", label=name)
            ax.set_xlabel("draft steps S")
            ax.set_ylabel("mean accept length")
        elif panel == "batch":
            series, plain = {}, {}
            for r in records:
                res, b = r["result"], r["point"]["batch_size"]
                # Plain is measured beside every point: its line is the median of those runs.
                plain.setdefault(f"plain ({group(r, ('policy',))})", {}).setdefault(b, []).append(res["plain"]["median"])
                if "speedup" in res:
                    series.setdefault(setting(r), {})[b] = res["speculative"]["median"]
            for name, pts in plain.items():
                xs = sorted(pts)
                ax.plot(xs, [statistics.median(pts[x]) for x in xs], "k--", label=name)
            for name, pts in series.items():
                xs = sorted(pts)
                ax.plot(xs, [pts[x] for x in xs], "o-", label=name)
            for r in records:  # the policies' choices: what ran most at each point
                res = r["result"]
                if r["point"].get("policy") in ("auto", "threshold") and "speedup" in res and ran(res):
                    ax.annotate(ran(res).split(",")[0].rsplit(" ", 1)[0], (r["point"]["batch_size"], res["speculative"]["median"]),
                                textcoords="offset points", xytext=(4, 4), fontsize=6)
            batch_axis(ax)
            ax.set_ylabel("tokens/s (median)")
        elif panel == "speedup":
            # Over the plain run inside the same point: the figure to compare across points
            # taken hours apart, when the machine's own speed drifts by a few percent.
            series = speedup_series(spec, setting)
            ax.axhline(1.0, color="k", ls="--", lw=1, label="plain (same point)")
            for name, pts in series.items():
                xs = sorted(pts)
                ax.plot(xs, [pts[x] for x in xs], "o-", label=name)
            batch_axis(ax)
            ax.set_ylabel("speedup over plain (median tok/s ratio)")
        else:
            # One line per point while the legend stays readable; past that, one colour per
            # group (the grid's other fields) and a line style per shape kind.
            many = len(spec) > MAX_DEPTH_LINES
            colours: dict = {}
            for r in spec:
                rates = r["result"].get("acceptance_rate_by_depth") or []
                if many:
                    g = group(r)
                    first = g not in colours
                    c = colours.setdefault(g, f"C{len(colours) % 10}")
                    ax.plot(range(1, len(rates) + 1), rates, "-" if _topk(r) == 1 else "--", color=c, alpha=0.7,
                            marker=".", label=g if first else None)
                else:
                    ax.plot(range(1, len(rates) + 1), rates, "o-", label=_label(r["point"], sweep))
            if many:
                ax.set_title("solid: chains, dashed: trees", fontsize=7)
            ax.set_xlabel("draft depth")
            ax.set_ylabel("share of steps accepting depth d")
            ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        # Below the axes: a legend inside would cover the lines of a large sweep.
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    legend_rows = max((len(ax.get_legend_handles_labels()[1]) + 1) // 2 for ax in axes[0])
    fig.set_size_inches(fig.get_size_inches()[0], 4 + 0.14 * legend_rows)
    fig.suptitle(f"eagle-jax ablate: {sweep.name}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _steps(r) -> int:
    p = r["point"]
    if p.get("shape") and p["shape"] != "plain":
        return parse_shape(p["shape"]).num_steps
    return p.get("steps", 0)


def _topk(r) -> int:
    p = r["point"]
    if p.get("shape") and p["shape"] != "plain":
        return parse_shape(p["shape"]).topk
    return p.get("topk", 1)


# ----------------------------------------------------------------------------- CLI


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "ablate", help="run a grid of speculative/sampling/policy/engine settings from a TOML config (resumable)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("config", help="the sweep's TOML file (see scripts/ablations/)")
    p.add_argument("--out", help="output directory (default: results/ablations/NAME)")
    p.add_argument("--check", action="store_true", help="check the config and list its points; run nothing")
    p.set_defaults(func=cmd_ablate)
    return p


def cmd_ablate(args: argparse.Namespace) -> int:
    try:
        sweep = load_config(args.config)
        if args.check:
            for p in sweep.points:
                print(_label(p.values, sweep), "->", "plain" if p.speculative is None else p.speculative.shape)
            print(f"{len(sweep.points)} points")
            return 0
        out = Path(args.out) if args.out else Path("results") / "ablations" / sweep.name
        run_sweep(sweep, out, log=lambda m: print(m, file=sys.stderr, flush=True))
    except EagleJaxError as e:
        print(f"eagle-jax ablate: error: {e}", file=sys.stderr)
        return 2
    return 0
