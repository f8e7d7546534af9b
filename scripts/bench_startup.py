"""Start-up as a user meets it (issue 32): ``eagle-jax generate`` run as a fresh process,
cold (empty JAX compilation cache and calibration cache) and then warm (the same caches
again), with the speculative steps compiled before serving (the default) and with
``--background-compile``.

    python scripts/bench_startup.py [--batch-size 16] [--prompts 24] [--max-new-tokens 64]
                                    [--modes blocking background] [--runs 2] [--out results/startup]

Each run gets the first ``--prompts`` held-out prompts of data/prompts/heldout-prompts.jsonl
and the CLI's defaults otherwise (auto with the released draft). Reported per run, from
the run's own log lines and output: process wall time; the engine's build (graphs, split
into trace / lower / compile, persistent-cache hits) and calibration (measured or read
from the cache); for --background-compile when speculation became ready; the requests'
time to first token (from ``add_request``, so after start-up) and the first token's time
since the process started; and whether the greedy outputs equal the first run's.
Each mode has its own cache directories (a temporary directory), so its cold run is cold.

Saves ``bench_startup.json`` under ``--out`` with the command and an environment fingerprint.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eagle_jax.environment import FINGERPRINT_ENV, fingerprint

REPO = Path(__file__).resolve().parents[1]
READY = re.compile(r"(\d+) graphs compiled in ([\d.]+) s(?: on (\d+) threads)?: trace ([\d.]+) s, lower ([\d.]+) s, "
                   r"compile or load ([\d.]+) s; (\d+) of (\d+) loaded untraced from the executable cache, (\d+) from "
                   r"JAX's persistent cache")
CALIBRATED = re.compile(r"calibrated \d+ steps .*? in ([\d.]+) s")
FROM_CACHE = re.compile(r"calibration cache|\.json; --recalibrate measures again")
# auto's per-bucket choice of shapes (AutoPolicy.fit_buckets): timed plain steps, or the cache.
FIT = re.compile(r"shapes per batch bucket by their least step cost \(.*?; ([\d.]+) s\).*?\((\d+) of (\d+) speculative "
                 r"steps left out\)")
FIT_CACHED = re.compile(r"shapes per batch bucket from the calibration cache: .*?\((\d+) of (\d+) speculative steps left out\)")
SPEC_READY = re.compile(r"speculation ready ([\d.]+) s after start-up: (\d+) graphs compiled in ([\d.]+) s")


def run_once(args, mode: str, cache: Path, prompt_file: Path, out_jsonl: Path) -> dict:
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache / "jax"), EAGLE_JAX_CALIBRATION_DIR=str(cache / "calibration"))
    cmd = [sys.executable, "-m", "eagle_jax.cli", "-vv", "generate", "--prompt-file", str(prompt_file), "--output", str(out_jsonl),
           "--batch-size", str(args.batch_size), "--max-new-tokens", str(args.max_new_tokens)]
    cmd.append("--background-compile" if mode == "background" else "--no-background-compile")
    t0 = time.perf_counter()
    # stderr read as it comes, to time when the engine said it was ready (start-up: model
    # load, compile, calibration; before the first request is admitted).
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)
    lines, engine_ready = [], None
    for line in p.stderr:
        lines.append(line)
        if engine_ready is None and "eagle-jax engine ready" in line:
            engine_ready = time.perf_counter() - t0
    p.wait()
    wall = time.perf_counter() - t0
    log = "".join(lines)
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        (args.log_dir / f"{out_jsonl.stem}.log").write_text(log)
    if p.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed ({p.returncode}):\n{log[-4000:]}")
    ready = list(READY.finditer(log))  # the engine-ready line first (a background report may follow)
    row: dict = {"wall_s": round(wall, 2), "engine_ready_s": round(engine_ready, 2) if engine_ready else None}
    if ready:
        g, total, workers, trace, lower, comp, loaded, n, hits = ready[0].groups()
        row["build"] = {"graphs": int(g), "seconds": float(total), "workers": int(workers or 1), "trace_s": float(trace),
                        "lower_s": float(lower), "compile_s": float(comp), "loaded_untraced": int(loaded),
                        "jax_cache_hits": int(hits)}
    cal = CALIBRATED.search(log)
    row["calibration"] = {"measured_s": float(cal.group(1))} if cal else {"from_cache": bool(FROM_CACHE.search(log))}
    fit, cached = FIT.search(log), FIT_CACHED.search(log)
    if fit:
        row["bucket_fit"] = {"measured_s": float(fit.group(1)), "left_out": int(fit.group(2)), "of": int(fit.group(3))}
    elif cached:
        row["bucket_fit"] = {"from_cache": True, "left_out": int(cached.group(1)), "of": int(cached.group(2))}
    spec = SPEC_READY.search(log)
    if spec:
        row["speculation_ready_after_s"] = float(spec.group(1))
        row["background_graphs"] = int(spec.group(2))
        row["background_compile_s"] = float(spec.group(3))
    rows = [json.loads(line) for line in out_jsonl.read_text().splitlines()]
    ttft = sorted(r["ttft_s"] for r in rows)
    row["ttft_s"] = {"min": round(ttft[0], 3), "median": round(ttft[len(ttft) // 2], 3), "max": round(ttft[-1], 3)}
    row["tokens"] = sum(len(r["token_ids"]) for r in rows)
    row["token_ids"] = [r["token_ids"] for r in rows]
    row["spec_steps"] = sum(len(r["accept_lengths"]) for r in rows)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--modes", nargs="+", choices=("blocking", "background"), default=["blocking", "background"])
    p.add_argument("--runs", type=int, default=2,
                   help="runs per mode: cold, then warm ones over the same caches (3: a second warm run, which "
                        "shows what a cut-off background calibration left to the next)")
    p.add_argument("--out", type=Path, default=REPO / "results" / "startup")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="also write each run's log (-vv: every graph's trace/lower/compile seconds) there, as "
                        "'<mode>-<cold|warm>.log' (logs name local paths: keep them out of results/)")
    args = p.parse_args()
    if args.runs < 1:
        p.error("--runs must be at least 1")
    records = (REPO / "data" / "prompts" / "heldout-prompts.jsonl").read_text().splitlines()[: args.prompts]
    work = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    prompt_file = work / "prompts.jsonl"
    prompt_file.write_text("\n".join(records) + "\n")
    # The variables that change what runs (EAGLE_JAX_LAYERS=unrolled for an A/B), as the command's prefix.
    env = [f"{k}={os.environ[k]}" for k in FINGERPRINT_ENV if k in os.environ]
    results = {"command": shlex.join([*env, "python", "scripts/bench_startup.py", *sys.argv[1:]]),
               "environment": fingerprint("float32"), "batch_size": args.batch_size, "prompts": len(records),
               "max_new_tokens": args.max_new_tokens, "runs": {}}
    reference = None
    for mode in args.modes:
        cache = work / f"cache-{mode}"
        for temp in (["cold", "warm"] + [f"warm {i}" for i in range(2, args.runs)])[: args.runs]:
            print(f"[{mode} {temp}] eagle-jax generate --batch-size {args.batch_size} ...", file=sys.stderr, flush=True)
            row = run_once(args, mode, cache, prompt_file, work / f"{mode}-{temp}.jsonl")
            ids = row.pop("token_ids")
            reference = reference or ids
            row["outputs_equal_first_run"] = ids == reference
            results["runs"][f"{mode} {temp}"] = row
            print(f"  {json.dumps(row)}", file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_startup.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    print("| run | engine ready s | wall s | graphs at start-up | build s (trace/lower/compile or load; loaded untraced, "
          "JAX cache hits) | calibration | speculation ready s | TTFT median s | spec steps | outputs equal |")
    print("|---|---:|---:|---:|---|---|---:|---:|---:|---|")
    for name, r in results["runs"].items():
        b = r.get("build", {})
        cal = r["calibration"]
        cal_text = f"{cal['measured_s']:.1f} s measured" if "measured_s" in cal else ("cached" if cal.get("from_cache") else "-")
        print(f"| {name} | {r['engine_ready_s']} | {r['wall_s']:.1f} | {b.get('graphs', '?')} | {b.get('seconds', 0):.1f} "
              f"({b.get('trace_s', 0):.1f}/{b.get('lower_s', 0):.1f}/{b.get('compile_s', 0):.1f}; "
              f"{b.get('loaded_untraced', 0)}, {b.get('jax_cache_hits', 0)}) | {cal_text} | "
              f"{r.get('speculation_ready_after_s', '-')} | {r['ttft_s']['median']:.2f} | {r['spec_steps']} | "
              f"{r['outputs_equal_first_run']} |")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
