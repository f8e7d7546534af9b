#!/usr/bin/env python
"""Print the results tables from the shipped ablations' points files, or write them, with
the command, machine and date of every table, to docs/results.md.

    python scripts/readme_results.py [--dir results/ablations] [--batch-plot PNG] [--write docs/results.md]

eagle_table: mean accept length and speedup per shape (rows) and suite (columns);
temperature: accept length and speedup per (temperature, verification, shape), with how
many prompts matched plain decoding for coupled points; the batch sweeps: tokens/s per
batch size and setting, with what the policies ran. Only points present are shown, so a
sweep still running prints what it has.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line of a sweep being written
            pass
    return out


def in_config_order(recs: list[dict], name: str, field: str) -> list:
    """The values of ``field`` among ``recs``, in the order of the shipped config's grid
    (a point rerun later is appended to the points file, not put back in its place);
    values the config does not list follow in the order they appear."""
    seen = list(dict.fromkeys(r["point"][field] for r in recs))
    config = Path(__file__).resolve().parent / "ablations" / f"{name}.toml"
    if not config.is_file():
        return seen
    import tomllib

    order = [v for v in tomllib.loads(config.read_text()).get("grid", {}).get(field, []) if v in seen]
    return order + [v for v in seen if v not in order]


def eagle_table(recs: list[dict]) -> str:
    suites = in_config_order(recs, "eagle_table", "suite")
    shapes = in_config_order(recs, "eagle_table", "shape")
    cell = {(r["point"]["shape"], r["point"]["suite"]): r["result"] for r in recs}
    rows = ["| shape | " + " | ".join(suites) + " |", "|---|" + "---:|" * len(suites)]
    for s in shapes:
        cells = []
        for su in suites:
            res = cell.get((s, su))
            cells.append(f"{res['mean_accept_length']:.2f} ({res['speedup']:.2f}x)" if res else "-")
        rows.append(f"| {s} | " + " | ".join(cells) + " |")
    plain = sorted(r["result"]["plain"]["median"] for r in recs)
    return ("\n".join(rows) + f"\n\nPlain decoding in the same runs: {plain[0]:.1f} to {plain[-1]:.1f} tok/s "
            f"(medians per point).\n")


def temperature(recs: list[dict]) -> str:
    rows = ["| temperature | verification | shape | accept length | speedup | same text as plain | taken |",
            "|---:|---|---|---:|---:|---|---|"]
    for r in recs:
        p, res = r["point"], r["result"]
        same = (f"{res['prompts_identical_to_plain']}/{res['prompts']}" if "prompts_identical_to_plain" in res
                else "all" if res.get("identical_to_plain") else "- (other draws)")
        rows.append(f"| {p['temperature']} | {p['sampling_verify']} | {p['shape']} | {res['mean_accept_length']:.2f} | "
                    f"{res['speedup']:.2f}x | {same} | {r['finished_at'][:10]} |")
    return "\n".join(rows) + "\n"


def batch(recs_by_name: dict[str, list[dict]]) -> str:
    rows = ["| batch | setting | tok/s | plain tok/s (same run) | speedup | ran (steps) |", "|---:|---|---:|---:|---:|---|"]
    from eagle_jax.experiments.ablate import ran

    for name, recs in recs_by_name.items():
        for r in recs:
            p, res = r["point"], r["result"]
            setting = p["policy"] + " " + (p.get("shape") or "") if p["policy"] != "fixed" else p.get("shape", "plain")
            s = res.get("speculative", res["plain"])
            rows.append(f"| {p['batch_size']} | {setting.strip()} | {s['median']:.1f} | {res['plain']['median']:.1f} | "
                        f"{res.get('speedup', 1.0):.2f}x | {ran(res) or '-'} |")
    return "\n".join(rows) + "\n"


def machine(fp: dict) -> str:
    """The machine of a run, from its fingerprint: CPU (cores, vector ISA), backend, dtype."""
    flags = fp.get("cpu_flags", [])
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    cores = fp.get("cpus_usable", fp.get("cpu_count", "?"))
    return (f"{fp.get('cpu', '?')} ({cores} cores{', ' + isa if isa else ''}), {fp.get('jax_backend', '?')} backend, "
            f"{fp.get('dtype', '?')}")


def software(fp: dict) -> str:
    pk, git = fp.get("packages", {}), fp.get("git", {})
    return f"jax {pk.get('jax', '?')}, eagle-jax {(git.get('commit') or '?')[:7]}" + (" (uncommitted changes)" if git.get("dirty") else "")


def provenance(recs: list[dict], command: str) -> str:
    """The command, the machine(s), the software and the dates behind a table."""
    fps = [r.get("fingerprint", {}) for r in recs]
    days = sorted({str(r["finished_at"])[:10] for r in recs if r.get("finished_at")})
    when = days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}" if days else "?"
    return (f"Command: `{command}`. Machine: {'; '.join(dict.fromkeys(map(machine, fps)))}. "
            f"Software: {'; '.join(dict.fromkeys(map(software, fps)))}. Taken: {when}.\n")


HEADER = """# Results

Generated by `python scripts/readme_results.py --write docs/results.md` from the committed
files under `results/`; do not edit by hand (tests/test_readme_results.py checks it is up
to date). Every table names the command that produced it, the machine and the date.
Unless a table says otherwise: the target is SmolLM2-135M-Instruct
(`checkpoints/smollm2-135m-instruct`, `make model`), the draft the released one
(`checkpoints/smollm2-135m-instruct-eagle3`), decoding greedy, and each point runs plain
decoding and its setting interleaved on the same prompts (medians over the passes after a
warm-up), so a speedup is measured within its point. Every greedy speculative output was
token-identical to plain decoding (the commands check it and stop otherwise). How to read
and rerun them: [measuring.md](measuring.md).

## CPU
"""


def document(root: Path) -> str:
    """docs/results.md: every committed table with its provenance."""
    from eagle_jax.experiments.bench import markdown

    out = [HEADER]
    abl = root / "ablations"
    recs = load(abl / "eagle_table" / "points.jsonl")
    if recs:
        out.append("### The EAGLE papers' table\n\nMean accept length (speedup over plain) per draft shape and suite, "
                   "batch 1.\n\n" + provenance(recs, "eagle-jax ablate scripts/ablations/eagle_table.toml")
                   + "\n" + eagle_table(recs))
    recs = load(abl / "temperature" / "points.jsonl")
    if recs:
        out.append("### Temperature and verification\n\nMT-bench, batch 1, prompt i seeded with i; \"same text\" "
                   "counts the prompts whose sampled output equals plain decoding's (coupled verification draws what "
                   "plain decoding draws).\n\n" + provenance(recs, "eagle-jax ablate scripts/ablations/temperature.toml")
                   + "\n" + temperature(recs))
    for name, what in (("batch_sweep", "fixed shapes"), ("batch_sweep_threshold", "the threshold policy"),
                       ("batch_sweep_auto", "the auto policy")):
        recs = load(abl / name / "points.jsonl")
        if recs:
            out.append(f"### Batch size: {what}\n\nTokens/s against batch size; \"ran\" says which steps a policy "
                       "chose.\n\n" + provenance(recs, f"eagle-jax ablate scripts/ablations/{name}.toml")
                       + "\n" + batch({name: recs}))
    recs = load(abl / "draft_sync" / "points.jsonl")
    if recs:
        rows = ["| draft sync | tok/s | plain tok/s (same run) | speedup |", "|---|---:|---:|---:|"]
        for r in recs:
            res = r["result"]
            rows.append(f"| {r['point']['draft_sync']} | {res['speculative']['median']:.1f} | "
                        f"{res['plain']['median']:.1f} | {res['speedup']:.2f}x |")
        out.append("### What the draft costs where speculation is off\n\nThe threshold policy running plain "
                   "throughout (batch 16, above its cutoff of 1), the draft synced eagerly or deferred, against the "
                   "plain engine without a draft.\n\n" + provenance(recs, "eagle-jax ablate scripts/ablations/draft_sync.toml")
                   + "\n" + "\n".join(rows) + "\n")
    bench = root / "bench" / "bench.json"
    if bench.is_file():
        report = json.loads(bench.read_text())
        out.append("### Side by side: transformers, plain, fixed shapes and auto\n\n"
                   + provenance([report], report["command"]) + "\n"
                   + markdown(report).strip().removeprefix(f"`{report['command']}`").strip() + "\n")
    gpu = sorted(p for p in (root / "gpu").glob("*") if p.is_dir() and (p / "env.json").is_file())
    if gpu:
        out.append(gpu_section(root / "gpu", gpu))
    return "\n".join(out)


def gpu_section(gpu_root: Path, runs: list[Path]) -> str:
    """The device check's committed runs (results/gpu/<run>/): their commands, machine and
    findings from results/gpu/README.md, and the tables scripts/device/check.py renders."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("device_check", Path(__file__).resolve().parent / "device" / "check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    readme = (gpu_root / "README.md").read_text()
    intro, _, findings = readme.partition("## Findings")
    import re

    # The day each run was taken: env.json's "date" (runs from before it was recorded: the
    # README's).
    days = sorted({json.loads((r / "env.json").read_text()).get("items", {}).get("date", "") for r in runs} - {""})
    days = days or sorted(set(re.findall(r"\d{4}-\d{2}-\d{2}", readme.partition("## Findings")[0])))
    when = days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}" if days else "?"
    body = intro.split("\n", 1)[1].strip()  # the README's own title dropped
    return ("## GPU\n\n### The device check on one NVIDIA H200\n\n"
            f"Command: `scripts/device/check.sh` (runs and their exact command lines below). Taken: {when}.\n\n"
            + body + "\n\nFindings:\n\n" + findings.strip() + "\n\n" + check.report(runs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("results") / "ablations")
    ap.add_argument("--batch-plot", type=Path, default=None,
                    help="also draw the batch sweeps together in one PNG (results/ablations/batch_sweeps.png)")
    ap.add_argument("--write", type=Path, default=None, metavar="MD",
                    help="write the results document (docs/results.md) from the results/ above --dir")
    args = ap.parse_args()
    if args.write is not None:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(document(args.dir.parent))
        print(f"wrote {args.write}")
        return
    recs = load(args.dir / "eagle_table" / "points.jsonl")
    if recs:
        print("## eagle_table\n\n" + eagle_table(recs))
    recs = load(args.dir / "temperature" / "points.jsonl")
    if recs:
        print("## temperature\n\n" + temperature(recs))
    sweeps = {n: load(args.dir / n / "points.jsonl") for n in ("batch_sweep", "batch_sweep_threshold", "batch_sweep_auto")}
    sweeps = {n: r for n, r in sweeps.items() if r}
    if sweeps:
        print("## batch sweeps\n\n" + batch(sweeps))
        if args.batch_plot is not None:
            batch_plot(sweeps, args.batch_plot)
            print(f"\nwrote {args.batch_plot}")


def batch_plot(recs_by_name: dict[str, list[dict]], path: Path) -> None:
    """The three batch sweeps in one plot (plain, each fixed shape, the threshold policy,
    auto): tokens/s against batch size, and the speedup over the plain run inside each
    point; drawn by ``eagle-jax ablate``'s own plotting."""
    from eagle_jax.experiments.ablate import Sweep, save_plots

    recs = [r for rs in recs_by_name.values() for r in rs]
    sizes = sorted({r["point"]["batch_size"] for r in recs})
    grid = {"batch_size": sizes, "policy": sorted({r["point"]["policy"] for r in recs})}
    # The batch and speedup panels: the accept and depth panels belong to each sweep's own plot.
    save_plots(Sweep(name="the batch sweeps", fixed={}, grid=grid, points=(), sha256=""), recs, path,
               only=("batch", "speedup"))


if __name__ == "__main__":
    main()
