#!/usr/bin/env python
"""The draft replicated over ``model`` against split over it, on the devices at hand.

For each speculative shape and batch size: median seconds of the compiled speculative
step (greedy, ``StepTable.time_step``) and of its draft phase alone
(``time_phases``), with the draft replicated (the default) and with
``draft_sharding="model"``, the two tables timed in alternation. Prints a table and saves
``results/bench_draft_sharding.json`` (command, environment fingerprint, every sample).

    python scripts/bench_draft_sharding.py [--mesh auto] [--batches 1 8] [--rounds 5]
        [--model DIR] [--draft DIR | --random-draft [--draft-vocab N]] [--out PATH]

Meaningful on a machine with several real devices; simulated CPU devices
(``JAX_NUM_CPU_DEVICES``) share the same cores, so their ratio says little.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax

from eagle_jax.checkpoint.draft_io import load_draft, random_draft
from eagle_jax.checkpoint.hf import load_model
from eagle_jax.defaults import default_draft_dir, default_model_dir
from eagle_jax.environment import fingerprint
from eagle_jax.serving.policy import parse_shapes
from eagle_jax.runtime.step_table import StepTable
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.runtime.sharding import describe_mesh, make_mesh


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mesh", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--shapes", default="chain S=3, tree S=3 k=4 T=8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--draft", type=Path, default=None)
    ap.add_argument("--random-draft", action="store_true", help="a random draft of the target's shape")
    ap.add_argument("--draft-vocab", type=int, default=None, help="the random draft's vocabulary (default the target's)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path, default=Path("results/bench_draft_sharding.json"))
    args = ap.parse_args()
    mesh = make_mesh(args.mesh)
    shapes = parse_shapes(args.shapes)
    target = load_model(args.model or default_model_dir(), dtype=args.dtype, mesh=mesh)
    draft = (random_draft(target.config, seed=0, draft_vocab_size=args.draft_vocab) if args.random_draft
             else load_draft(args.draft or default_draft_dir(), target=target, dtype=args.dtype))
    tables = {}
    for how in ("replicated", "model"):
        for phases in (False, True):
            t = StepTable(target, draft, shapes=shapes, batch_buckets=tuple(sorted(set(args.batches))), prompt_buckets=(),
                          max_seq_len=args.max_seq_len, plain=False, sampled=False, time_phases=phases, mesh=mesh,
                          draft_sharding=how)
            t.build()
            tables[how, phases] = t
    samples: dict = {}
    for _ in range(args.rounds + 1):  # the first round warms up
        for b in args.batches:
            for shape in shapes:
                for (how, phases), t in tables.items():
                    if phases:  # the draft phase alone, on a fresh state like time_step's
                        state = jax.block_until_ready(t.zeros(b))
                        samp = jax.block_until_ready(t.sampling([SamplingParams()] * b, b))
                        t0 = time.perf_counter()
                        jax.block_until_ready(t.draft_phase(state, samp, shape))
                        s = time.perf_counter() - t0
                    else:
                        s = t.time_step(b, shape)
                    samples.setdefault(f"{b}|{shape.shape}|{how}|{'draft phase' if phases else 'step'}", []).append(s)
    rows = []
    print(f"mesh {describe_mesh(mesh)} over {jax.device_count()} {jax.devices()[0].platform} devices")
    print("| batch | shape | step replicated ms | step split ms | split/replicated | draft phase replicated ms | split ms |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for b in args.batches:
        for shape in shapes:
            med = {k: 1e3 * statistics.median(v[1:]) for k, v in samples.items() if k.startswith(f"{b}|{shape.shape}|")}
            g = lambda how, what: med[f"{b}|{shape.shape}|{how}|{what}"]  # noqa: E731
            row = {"batch": b, "shape": shape.shape, "step_ms": {h: g(h, "step") for h in ("replicated", "model")},
                   "draft_phase_ms": {h: g(h, "draft phase") for h in ("replicated", "model")}}
            row["split_over_replicated"] = row["step_ms"]["model"] / row["step_ms"]["replicated"]
            rows.append(row)
            print(f"| {b} | {shape.shape} | {row['step_ms']['replicated']:.2f} | {row['step_ms']['model']:.2f} | "
                  f"{row['split_over_replicated']:.2f} | {row['draft_phase_ms']['replicated']:.2f} | "
                  f"{row['draft_phase_ms']['model']:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "python scripts/bench_draft_sharding.py " + " ".join(sys.argv[1:]),
        "environment": fingerprint(args.dtype), "mesh": describe_mesh(mesh), "rounds": args.rounds,
        "rows": rows, "samples_s": samples,
    }, indent=1))
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
