#!/usr/bin/env python
"""Print the README's "Results" tables from the shipped ablations' points files.

    python scripts/readme_results.py [--dir results/ablations] [--batch-plot PNG]

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
    from eagle_jax.ablate import ran

    for name, recs in recs_by_name.items():
        for r in recs:
            p, res = r["point"], r["result"]
            setting = p["policy"] + " " + (p.get("shape") or "") if p["policy"] != "fixed" else p.get("shape", "plain")
            s = res.get("speculative", res["plain"])
            rows.append(f"| {p['batch_size']} | {setting.strip()} | {s['median']:.1f} | {res['plain']['median']:.1f} | "
                        f"{res.get('speedup', 1.0):.2f}x | {ran(res) or '-'} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("results") / "ablations")
    ap.add_argument("--batch-plot", type=Path, default=None,
                    help="also draw the batch sweeps together in one PNG (results/ablations/batch_sweeps.png)")
    args = ap.parse_args()
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
    from eagle_jax.ablate import Sweep, save_plots

    recs = [r for rs in recs_by_name.values() for r in rs]
    sizes = sorted({r["point"]["batch_size"] for r in recs})
    grid = {"batch_size": sizes, "policy": sorted({r["point"]["policy"] for r in recs})}
    # The batch and speedup panels: the accept and depth panels belong to each sweep's own plot.
    save_plots(Sweep(name="the batch sweeps", fixed={}, grid=grid, points=(), sha256=""), recs, path,
               only=("batch", "speedup"))


if __name__ == "__main__":
    main()
