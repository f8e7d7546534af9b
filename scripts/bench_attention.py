#!/usr/bin/env python
"""Decode and verify step cost with the prefix attention in XLA's blocked loop against
the CPU kernel (``cpu_attention.cc``), on SmolLM2 (float32) at the cache lengths the
engine really runs.

For each batch size and prefix-length profile, one step table per attention path is
built (``EAGLE_JAX_CPU_ATTENTION`` is read when a graph is traced), the rows are
prefilled to the profile's lengths, and the plain decode step is timed; with --verify,
so is a chain S=3 speculative step's verify forward under a random draft (4 tokens per
row). Rounds alternate between the two paths (one timed run of each per round, --rounds
rounds) and the median is kept, so a slow spell touches both alike.

Profiles (prefix lengths of the batch's rows, in a --cache slot cache): short (all 100),
mixed (uniform 60..340: draft-data's answers), long (all 300).

    python scripts/bench_attention.py [--batches 1 16 64] [--profiles short mixed long] [--rounds 5]

Saves results/bench_attention.json (--out) with the command and an environment fingerprint.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

from eagle_jax.checkpoint.hf import load_model
from eagle_jax.defaults import default_model_dir
from eagle_jax.environment import fingerprint
from eagle_jax.runtime.step_table import StepTable
from eagle_jax.spec.sampling import SamplingParams

PATHS = ("xla", "kernel")


def lengths_for(profile: str, b: int, rng) -> np.ndarray:
    if profile == "short":
        return np.full(b, 100, np.int32)
    if profile == "long":
        return np.full(b, 300, np.int32)
    if profile == "mixed":
        return rng.integers(60, 341, b).astype(np.int32)
    raise SystemExit(f"unknown profile {profile!r}")


def build(model, path: str, b: int, cache: int, draft, shape):
    os.environ["EAGLE_JAX_CPU_ATTENTION"] = "xla" if path == "xla" else "auto"
    shapes = () if shape is None else (shape,)
    table = StepTable(model, draft, shapes=shapes, batch_buckets=(b,), prompt_buckets=(cache - 8,), max_seq_len=cache,
                      prefill_token_budget=b * (cache - 8), plain=True, sampled=False)
    table.build()
    return table


def timed(table, state0, samp, shape, steps: int) -> float:
    state = jax.tree.map(lambda x: x.copy(), state0)  # the step donates its state
    jax.block_until_ready(state)
    t = time.perf_counter()
    for _ in range(steps):
        state, nxt, _, _ = table.step(state, samp, shape, greedy=True)
    jax.block_until_ready(nxt)
    return (time.perf_counter() - t) / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--profiles", nargs="+", default=["short", "mixed", "long"])
    ap.add_argument("--cache", type=int, default=392, help="cache slots (draft-data's 384-token context)")
    ap.add_argument("--steps", type=int, default=8, help="steps per timed run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--verify", action="store_true", help="also time a chain S=3 step (random draft)")
    ap.add_argument("--out", type=Path, default=Path("results/bench_attention.json"))
    args = ap.parse_args()
    model = load_model(args.model or default_model_dir())
    draft = shape = None
    if args.verify:
        from eagle_jax.checkpoint.draft_io import random_draft
        from eagle_jax.spec.config import SpeculativeConfig

        draft = random_draft(model.config, seed=0, draft_vocab_size=4096)
        shape = SpeculativeConfig(num_steps=3, topk=1, num_draft_tokens=4)
    rng = np.random.default_rng(0)
    rows = []
    for b in args.batches:
        tables = {p: build(model, p, b, args.cache, draft, shape) for p in PATHS}
        for profile in args.profiles:
            lens = lengths_for(profile, b, rng)
            tokens = rng.integers(100, model.config.vocab_size, (b, args.cache - 8)).astype(np.int32)
            states, samps = {}, {}
            for p, t in tables.items():
                samps[p] = t.sampling([SamplingParams()] * b, b)
                rs, _ = t.prefill(t.device_put_rows(tokens), t.device_put_rows(lens), samps[p])
                states[p] = t.insert(t.zeros(b), rs, t.device_put_rows(np.arange(b, dtype=np.int32)))
            modes = [("plain", None)] + ([("chain S=3", shape)] if shape is not None else [])
            times = {(p, m): [] for p in PATHS for m, _ in modes}
            for _ in range(args.rounds + 1):  # the first round warms up
                for m, sh in modes:
                    for p in PATHS:
                        times[(p, m)].append(timed(tables[p], states[p], samps[p], sh, args.steps))
            for m, _ in modes:
                med = {p: statistics.median(times[(p, m)][1:]) for p in PATHS}
                row = {"batch": b, "profile": profile, "mean_prefix": float(lens.mean()), "max_prefix": int(lens.max()),
                       "step": m, "xla_ms": 1000 * med["xla"], "kernel_ms": 1000 * med["kernel"],
                       "kernel_over_xla": med["kernel"] / med["xla"],
                       "runs_ms": {p: [round(1000 * x, 2) for x in times[(p, m)][1:]] for p in PATHS}}
                rows.append(row)
                print(f"batch {b:3d} {profile:6s} {m:9s}: XLA loop {row['xla_ms']:7.1f} ms, kernel {row['kernel_ms']:7.1f} ms "
                      f"({row['kernel_over_xla']:.2f}x)", flush=True)
        del tables
    result = {"command": "python scripts/bench_attention.py " + " ".join(sys.argv[1:]), "environment": fingerprint("float32"),
              "cache_slots": args.cache, "steps_per_run": args.steps, "rounds": args.rounds, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
