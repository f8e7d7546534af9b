#!/usr/bin/env python
"""Where a compiled step's time goes, on this machine: ``jax.profiler`` over N steps.

Builds a step table for SmolLM2 (float32) and one step (plain, or a speculative shape with
a random draft), runs it under the profiler and prints the step's wall time, the time per
step of each kind of XLA thunk (FFI calls, fusions, ...) summed over the executor threads,
and the slowest single ops (median per step). Threads overlap, so the sums can exceed the
wall time; FFI calls are the packed CPU matmul and attention kernels.

    python scripts/profile_step.py [--shape plain | "chain S=3" | "tree S=3 k=4 T=8"] [--batch 1]
        [--steps 20] [--trace-dir DIR]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import re
import statistics
import tempfile
import time

import jax
import numpy as np

from eagle_jax.checkpoint.draft_io import random_draft
from eagle_jax.checkpoint.hf import load_model
from eagle_jax.defaults import default_model_dir
from eagle_jax.serving.policy import parse_shapes
from eagle_jax.runtime.step_table import StepTable
from eagle_jax.spec.sampling import SamplingParams

PROMPT_LEN, CACHE_LEN = 64, 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="plain")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--trace-dir", default=None, help="keep the trace here (default: a temporary directory)")
    args = ap.parse_args()
    target = load_model(default_model_dir(), dtype="float32")
    shape = None if args.shape == "plain" else parse_shapes(args.shape)[0]
    draft = None if shape is None else random_draft(target.config, seed=0, draft_vocab_size=8192)
    b = args.batch
    t = StepTable(target, draft, shapes=() if shape is None else (shape,), batch_buckets=(b,),
                  prompt_buckets=(PROMPT_LEN,), max_seq_len=CACHE_LEN, prefill_token_budget=b * PROMPT_LEN,
                  plain=shape is None, sampled=False, cache_align=1)
    t.build()
    print(f"matrix products: {t.plan.matmul_path}; verify attention: {t.verify_attention_path()}")
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, target.config.vocab_size, (b, PROMPT_LEN)).astype(np.int32)
    lengths = np.full(b, PROMPT_LEN // 2, np.int32)
    samp = t.sampling([SamplingParams()] * b, b)
    rows, _ = t.prefill(t.device_put_rows(tokens), t.device_put_rows(lengths), samp)
    state = t.insert(t.zeros(b), rows, t.device_put_rows(np.arange(b, dtype=np.int32)))
    seq0 = np.asarray(state.seq_lens)
    held = {"state": state}

    def run(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):  # the same context every step: lengths reset each time
            st = dataclasses.replace(held["state"], seq_lens=t.device_put_rows(seq0.copy()))
            held["state"], out, _, _ = t.step(st, samp, shape, greedy=True)
        out.block_until_ready()
        return (time.perf_counter() - t0) / n

    run(5)
    walls = [run(args.steps) for _ in range(3)]
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="eagle-jax-profile-")
    jax.profiler.start_trace(trace_dir)
    run(args.steps)
    jax.profiler.stop_trace()
    (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[-1:]
    data = jax.profiler.ProfileData.from_file(path)
    kinds, count, per_op = collections.Counter(), collections.Counter(), collections.defaultdict(list)
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):  # XLA's executor and intra-op threads
                continue
            for ev in line.events:
                if ev.name.startswith(("ThunkExecutor", "end: ")):
                    continue
                kind = re.sub(r"\.\d+$", "", ev.name)
                kinds[kind] += ev.duration_ns
                count[kind] += 1
                per_op[ev.name].append(ev.duration_ns)
    n = args.steps
    print(f"{args.shape} at batch {b}: {statistics.median(walls) * 1e3:.2f} ms per step "
          f"(median of {len(walls)} x {n} steps); trace in {trace_dir}")
    print(f"{'ms/step':>9} {'ops/step':>9}  kind")
    for kind, ns in kinds.most_common(12):
        print(f"{ns / 1e6 / n:9.3f} {count[kind] / n:9.1f}  {kind}")
    print("slowest ops (median us per call):")
    for name, ds in sorted(per_op.items(), key=lambda kv: -statistics.median(kv[1]))[:8]:
        print(f"  {statistics.median(ds) / 1e3:9.1f}  {name}")


if __name__ == "__main__":
    main()
