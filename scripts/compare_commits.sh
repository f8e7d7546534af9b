#!/usr/bin/env bash
# Performance of the working tree against an earlier commit, on this machine, interleaved:
#   scripts/compare_commits.sh OLD_COMMIT [ROUNDS] [OUT_DIR]
# Unpacks OLD_COMMIT (git archive, the repository is not touched), then runs, ROUNDS times
# and alternating new/old: scripts/bench_spec.py at batch 1 (plain step, chain S=3, tree
# 3/4/8; medians of 15 steps), then scripts/bench_engine.py at batch 1/4/16 with the
# released draft (tree 3/4/8, threshold 1; medians of 3 runs) once each. Every JSON keeps
# its command and environment; OUT_DIR/summary.txt has the figures side by side.
set -euo pipefail
old=${1:?usage: scripts/compare_commits.sh OLD_COMMIT [ROUNDS] [OUT_DIR]}
rounds=${2:-2}
root=$(cd "$(dirname "$0")/.." && pwd)
out=${3:-$root/results/compare-$(git -C "$root" rev-parse --short "$old")}
out=$(realpath -m "$out")  # the old tree runs from another directory: an absolute path for both
py=$root/.venv/bin/python
model=$root/checkpoints/smollm2-135m-instruct
draft=$root/checkpoints/smollm2-135m-instruct-eagle3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git -C "$root" archive "$old" | tar -x -C "$tmp"
mkdir -p "$out"
run() {  # run WHICH SCRIPT ARGS...: the new tree, or the old one with its own package first on the path
  local which=$1; shift
  if [ "$which" = new ]; then (cd "$root" && PYTHONPATH= "$py" "$@"); else (cd "$tmp" && PYTHONPATH="$tmp" "$py" "$@"); fi
}
for r in $(seq 1 "$rounds"); do
  for which in new old; do
    echo "== bench_spec $which round $r"
    run $which scripts/bench_spec.py --model "$model" --batches 1 --configs 1 3 --repeats 15 --new-tokens 48 \
      --draft-vocab 8192 --out "$out/spec_${which}_$r.json" | grep -E "plain decode step|chain S=3 |tree S=3 "
  done
done
for which in new old; do
  echo "== bench_engine $which"
  run $which scripts/bench_engine.py --model "$model" --draft "$draft" --steps 3 --topk 4 --draft-tokens 8 \
    --threshold 1 --batches 1 4 16 --new-tokens 32 --repeats 3 --out "$out/engine_$which.json" | tail -4
done
# The old scripts record the paths they were given: keep results free of machine paths.
sed -i "s#\"$root/#\"#g" "$out"/*.json
"$py" - "$out" "$rounds" <<'PY' | tee "$out/summary.txt"
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
med = statistics.median
def spec(which):
    """{name: [ms per round]} for the plain step and each speculative config at batch 1."""
    got = {}
    for r in range(1, rounds + 1):
        for row in json.load(open(f"{out}/spec_{which}_{r}.json"))["results"]:
            if row.get("batch") != 1 or "config" not in row:
                continue
            got.setdefault("plain step", {})[r] = row["plain_step_ms"]
            got.setdefault(row["config"], {})[r] = row["spec_step_ms"]
    return {k: list(v.values()) for k, v in got.items()}
new, old = spec("new"), spec("old")
print(f"bench_spec, batch 1, step ms (each a median of 15 steps; {rounds} interleaved rounds):")
for k in new:
    n, o = med(new[k]), med(old[k])
    print(f"  {k:18s} new {n:7.2f} {[round(x, 1) for x in new[k]]}  old {o:7.2f} {[round(x, 1) for x in old[k]]}  new/old {n / o:.3f}")
print("bench_engine tok/s (median of 3 runs; modes interleaved within each script):")
e = {w: {r["batch"]: r for r in json.load(open(f"{out}/engine_{w}.json"))["rows"]} for w in ("new", "old")}
for b in sorted(e["new"]):
    for m in ("on", "off", "cutoff"):
        n, o = e["new"][b][m]["tokens_per_s"], e["old"][b][m]["tokens_per_s"]
        print(f"  batch {b:3d} {m:7s} new {n:7.1f}  old {o:7.1f}  new/old {n / o:.3f}  "
              f"(runs new {[round(x, 1) for x in e['new'][b][m]['tokens_per_s_runs']]}, old {[round(x, 1) for x in e['old'][b][m]['tokens_per_s_runs']]})")
PY
echo "results in $out"
