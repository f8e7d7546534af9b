"""Which exact-MoE formulation is fastest here, by token count: ``gather``, ``blocked``,
``dense``, ``ragged`` (eagle_jax.models.deepseek.experts_forward), float32 and INT4-packed experts.

One compiled routed-expert product per (formulation, token count), the expert weights
passed as arguments (not folded into the graph), timed interleaved (every variant once
per round, ``--rounds`` rounds), medians reported. Shapes: Kimi-K2.5's expert count and
top-k with narrow matrices (``kimi-experts``), and fewer, wider experts (``wide``).
Token counts cover decode (1 per sequence), tree verification (4..16) and prefill.

    .venv/bin/python scripts/bench_moe.py                 # writes results/bench_moe.json
    .venv/bin/python scripts/bench_moe.py --quick         # a smoke run
    .venv/bin/python scripts/bench_moe.py --rescore results/bench_moe.json
        # the auto rule's pick and its regret recomputed from the saved medians (after a
        # change of moe_impl_for; the measurements are not touched)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.models.deepseek import experts_forward, moe_impl_for
from eagle_jax.environment import fingerprint
from eagle_jax.models.quant import Int4Weight

SHAPES = {
    # name: (experts, top-k, hidden, expert width)
    "kimi-experts": (384, 8, 256, 128),
    "wide": (64, 8, 1024, 256),
}
TOKENS = (1, 4, 8, 16, 64, 256)
IMPLS = ("gather", "blocked", "dense", "ragged")


def _pack(w: np.ndarray, group: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric INT4 packs of ``w`` [E, out, in] (layout: eagle_jax.models.quant)."""
    e, o, i = w.shape
    g = w.reshape(e, o, i // group, group)
    scale = np.maximum(np.abs(g).max(-1) / 7.0, 1e-8).astype(np.float32)
    q = np.clip(np.round(g / scale[..., None]), -8, 7).astype(np.int64).reshape(e, o, i) + 8
    words = q.reshape(e, o, i // 8, 8) << (np.arange(8) * 4)
    return words.sum(-1).astype(np.uint32).view(np.int32), scale


def _weights(shape, int4: bool, seed: int = 0):
    e, _, h, i = shape
    rng = np.random.default_rng(seed)
    mats = {"gate": (e, i, h), "up": (e, i, h), "down": (e, h, i)}  # [E, out, in]
    out = {}
    for name, s in mats.items():
        w = (rng.standard_normal(s) * 0.02).astype(np.float32)
        if int4:
            p, sc = _pack(w)
            out[name] = (jnp.asarray(p), jnp.asarray(sc))
        else:
            out[name] = jnp.asarray(np.ascontiguousarray(w.transpose(0, 2, 1)))  # [E, in, out]
    return out


def _fn(impl: str, int4: bool):
    def run(x, w, idx, weights):
        mats = [Int4Weight(*weights[n]) if int4 else weights[n] for n in ("gate", "up", "down")]
        return experts_forward(x, w, idx, *mats, impl=impl)
    return jax.jit(run)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="3 rounds, 2 token counts")
    ap.add_argument("--out", type=Path, default=Path("results/bench_moe.json"))
    ap.add_argument("--rescore", type=Path, help="recompute the rule columns of a saved run with today's moe_impl_for")
    args = ap.parse_args(argv)
    if args.rescore:
        return rescore(args.rescore)
    rounds, tokens = (3, (1, 16)) if args.quick else (args.rounds, TOKENS)
    rows = []
    for shape_name, shape in SHAPES.items():
        e, k, h, i = shape
        for int4 in (False, True):
            weights = _weights(shape, int4)
            for n in tokens:
                rng = np.random.default_rng(n)
                x = jnp.asarray(rng.standard_normal((n, h)).astype(np.float32))
                idx = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(n)]).astype(np.int32))
                w = jnp.asarray(rng.random((n, k)).astype(np.float32))
                fns = {impl: _fn(impl, int4) for impl in IMPLS}
                ref = None
                for impl, f in fns.items():  # compile, and check the three agree
                    y = np.asarray(f(x, w, idx, weights))
                    ref = y if ref is None else ref
                    np.testing.assert_allclose(y, ref, rtol=2e-4, atol=2e-5)
                times = {impl: [] for impl in IMPLS}
                for _ in range(rounds):
                    for impl, f in fns.items():
                        t0 = time.perf_counter()
                        f(x, w, idx, weights).block_until_ready()
                        times[impl].append((time.perf_counter() - t0) * 1e3)
                med = {impl: statistics.median(t) for impl, t in times.items()}
                best = min(med, key=med.get)
                rule = moe_impl_for(n, k, e, "cpu", int4=int4)
                row = {"shape": shape_name, "experts": e, "top_k": k, "hidden": h, "width": i, "int4": int4,
                       "tokens": n, "median_ms": med, "min_ms": {m: min(t) for m, t in times.items()},
                       "best": best, "rule": rule, "rule_vs_best": med[rule] / med[best]}
                rows.append(row)
                print(f"{shape_name:13s} {'int4' if int4 else 'f32 ':4s} N={n:4d}  "
                      + "  ".join(f"{m} {med[m]:8.3f}" for m in IMPLS)
                      + f"  best {best:6s} rule {rule:6s} ({row['rule_vs_best']:.2f}x)", flush=True)
    out = {"command": " ".join(["scripts/bench_moe.py", *(argv if argv is not None else sys.argv[1:])]),
           "environment": fingerprint("float32"), "rounds": rounds, "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


def rescore(path: Path) -> int:
    """The rule's pick and regret for every saved row, from its medians (no timing)."""
    import subprocess

    data = json.loads(path.read_text())
    worst = 1.0
    for row in data["results"]:
        rule = moe_impl_for(row["tokens"], row["top_k"], row["experts"], "cpu", int4=row["int4"])
        row["rule"], row["rule_vs_best"] = rule, row["median_ms"][rule] / row["median_ms"][row["best"]]
        worst = max(worst, row["rule_vs_best"])
        print(f"{row['shape']:13s} {'int4' if row['int4'] else 'f32 '} N={row['tokens']:4d}  best {row['best']:7s} "
              f"rule {rule:7s} ({row['rule_vs_best']:.2f}x)")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    data["rescored"] = {"by": f"scripts/bench_moe.py --rescore {path}", "rule_at_commit": commit,
                        "worst_rule_vs_best": worst}
    path.write_text(json.dumps(data, indent=2))
    print(f"worst rule/best: {worst:.2f}x; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
