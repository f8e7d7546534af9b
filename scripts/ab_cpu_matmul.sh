#!/bin/bash
# The packed-weight CPU matmul against XLA's dot, interleaved on this machine:
# ROUNDS rounds of `bench_spec.py --batches 1 --configs 1 3` (chain S=3, tree 3/4/8),
# EAGLE_JAX_CPU_MATMUL=xla then =auto in each round; per-run JSON and logs, and
# summary.json (medians over rounds, ratios, the command, an environment fingerprint).
#
#   scripts/ab_cpu_matmul.sh            # writes results/cpu-matmul-ab/
#   OUT=/tmp/ab ROUNDS=3 scripts/ab_cpu_matmul.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/cpu-matmul-ab}
ROUNDS=${ROUNDS:-2}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
for r in $(seq 1 "$ROUNDS"); do
  for m in xla auto; do
    echo "round $r: EAGLE_JAX_CPU_MATMUL=$m"
    EAGLE_JAX_CPU_MATMUL=$m $PY scripts/bench_spec.py --batches 1 --configs 1 3 --repeats 15 \
      --out "$OUT/spec-$m-$r.json" > "$OUT/spec-$m-$r.log" 2>&1
  done
done
OUT="$OUT" ROUNDS="$ROUNDS" $PY - <<'PYEOF'
import json, os, statistics
from pathlib import Path
from eagle_jax.environment import fingerprint
out, rounds = Path(os.environ["OUT"]), int(os.environ["ROUNDS"])
ms = {}
for m in ("xla", "auto"):
    for r in range(1, rounds + 1):
        runs = [x for x in json.loads((out / f"spec-{m}-{r}.json").read_text())["results"] if "config" in x]
        # Each config row repeats the run's one plain-step figure: take it once per run.
        ms.setdefault(m, {}).setdefault("plain", []).append(runs[0]["plain_step_ms"])
        for x in runs:
            ms[m].setdefault(x["config"], []).append(x["spec_step_ms"])
med = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in ms.items()}
rows = []
for k in med["xla"]:
    rows.append({"step": k, "xla_ms": round(med["xla"][k], 2), "packed_ms": round(med["auto"][k], 2),
                 "packed_over_xla": round(med["auto"][k] / med["xla"][k], 3),
                 "samples_ms": {m: [round(v, 2) for v in ms[m][k]] for m in ms}})
for m in ("xla", "auto"):
    for k in med[m]:
        if k != "plain":
            rows_k = next(r for r in rows if r["step"] == k)
            rows_k[f"break_even_{'packed' if m == 'auto' else 'xla'}"] = round(med[m][k] / med[m]["plain"], 3)
summary = {"command": f"OUT={out} ROUNDS={rounds} scripts/ab_cpu_matmul.sh", "environment": fingerprint("float32"), "rows": rows}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
for r in rows:
    print(r)
PYEOF
