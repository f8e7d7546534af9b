#!/usr/bin/env python
"""Engine throughput with speculation always on, always off, and with the batch-size cutoff.

On SmolLM2 (float32) at batch sizes 1, 4, 16 and 64 (that many requests arriving at
once, greedy, --new-tokens each; held-out chat prompts), for one draft: tokens/s per mode, the cutoff's loss
against the better of on and off, and the host share of the step time at batch 1.
"Off" keeps the draft in sync (the plain step with a 1-token draft extend), which is
what the cutoff runs above its threshold. Saves results/bench_engine.json
(results/bench_engine_phases.json with --time-phases; --out overrides).

    python scripts/bench_engine.py --draft DIR [--threshold N] [--new-tokens 32] [--time-phases]

Without --draft it uses a random draft (accept length ~1): speculation then never pays,
and the table shows only the cost of the machinery.

--time-phases builds the engines with ``EngineConfig.time_phases``: each speculative step
runs as its draft and verify graphs, each waited for, and a second table gives draft and
verify ms per speculative step per batch size. The syncs cost the host/device overlap, so
the tokens/s of such a run are not the fused step's.
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

from eagle_jax.checkpoint.draft_io import load_draft, random_draft
from eagle_jax.checkpoint.hf import load_model
from eagle_jax.defaults import default_model_dir
from eagle_jax.environment import fingerprint
from eagle_jax.experiments.harness import timed_generate
from eagle_jax.serving.engine import Engine, EngineConfig
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.spec.steps import SpeculativeConfig
from eagle_jax.checkpoint.tokenizer import Tokenizer
from eagle_jax.train.synthetic_prompts import synthetic_prompts

REPO = Path(__file__).resolve().parents[1]


def repo_path(path: Path) -> str:
    """``path`` relative to the repository when inside it, else its last component, so
    results/ files hold no machine's absolute paths."""
    resolved = Path(path).resolve()
    return resolved.relative_to(REPO).as_posix() if resolved.is_relative_to(REPO) else resolved.name


def run(engine: Engine, prompts, sp, repeats: int) -> dict:
    """Median tokens/s over ``repeats`` runs of the prompts (after one warm-up request)."""
    engine.generate(prompts[:1], sp)  # warm the host path
    m = engine.metrics
    rates, hosts, drafts, verifies = [], [], [], []
    for _ in range(repeats):
        before = (m.wall_s, m.host_s, m.spec_steps, m.draft_s, m.verify_s)
        out, rate = timed_generate(engine, prompts, sp)
        rates.append(rate)
        hosts.append((m.host_s - before[1]) / max(m.wall_s - before[0], 1e-9))
        n_spec = m.spec_steps - before[2]
        if m.phase_timing and n_spec:  # time_phases: per speculative step of this run
            drafts.append(1000 * (m.draft_s - before[3]) / n_spec)
            verifies.append(1000 * (m.verify_s - before[4]) / n_spec)
    accepts = [a for c in out for a in c.accept_lengths]
    return {
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_runs": rates,
        "host_fraction": statistics.median(hosts),
        "spec_steps_last_run": m.spec_steps - before[2],
        "mean_accept_length": sum(accepts) / len(accepts) if accepts else None,
        "draft_ms_per_step": statistics.median(drafts) if drafts else None,
        "verify_ms_per_step": statistics.median(verifies) if verifies else None,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--draft", type=Path, default=None)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--topk", type=int, default=1, help="draft branching (1 = chain)")
    ap.add_argument("--draft-tokens", type=int, default=None, help="tokens verified per step (chain: steps + 1)")
    ap.add_argument("--threshold", type=int, default=4, help="spec_disable_batch_threshold of the cutoff engine")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--time-phases", action="store_true",
                    help="time draft and verify apart (EngineConfig.time_phases; slower than the fused step)")
    ap.add_argument("--out", type=Path, default=None,
                    help="default results/bench_engine.json, or results/bench_engine_phases.json with --time-phases")
    args = ap.parse_args()
    if args.out is None:
        args.out = Path("results/bench_engine_phases.json" if args.time_phases else "results/bench_engine.json")
    model_dir = args.model or default_model_dir()
    tok = Tokenizer.from_dir(model_dir)
    target = load_model(model_dir, dtype="float32")
    draft = load_draft(args.draft, target=target) if args.draft else random_draft(target.config, seed=0, draft_vocab_size=8192)
    # Held-out chat prompts: the built-in "eval" split, whose topics no training data used.
    questions = synthetic_prompts(max(args.batches), split="eval", seed=2)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions]
    top = max(args.batches)
    base = dict(max_batch=top, max_seq_len=128, batch_buckets=tuple(sorted(set(args.batches))), prompt_buckets=(64, 128),
                time_phases=args.time_phases)
    spec = SpeculativeConfig(num_steps=args.steps, topk=args.topk, num_draft_tokens=args.draft_tokens)
    modes = {
        "on": EngineConfig(speculative=spec, **base),
        "off": EngineConfig(speculative=spec, spec_disable_batch_threshold=0, **base),
        "cutoff": EngineConfig(speculative=spec, spec_disable_batch_threshold=args.threshold, **base),
    }
    sp = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cores; SmolLM2 float32; "
          f"draft {args.draft or 'random (8192 vocab)'}; {spec.shape}; cutoff threshold {args.threshold}"
          + ("; time_phases on (draft and verify synced apart: tok/s below are not the fused step's)" if args.time_phases else ""))
    table = {}
    engines = {}
    for name, cfg in modes.items():
        t = time.perf_counter()
        engines[name] = Engine(target, draft, cfg, tok, progress=False)
        print(f"{name}: built in {time.perf_counter() - t:.0f} s")
    # Modes interleaved per batch size, so slow drifts of the machine hit them alike.
    for b in args.batches:
        for name, engine in engines.items():
            table.setdefault(b, {})[name] = run(engine, [prompts[i % len(prompts)] for i in range(b)], sp, args.repeats)
    print(f"\n{'batch':>6}{'on tok/s':>10}{'off tok/s':>11}{'cutoff':>9}{'cutoff vs best':>16}{'host % on/off':>15}")
    rows = []
    for b in args.batches:
        r = table[b]
        best = max(r["on"]["tokens_per_s"], r["off"]["tokens_per_s"])
        loss = 1 - r["cutoff"]["tokens_per_s"] / best
        host = f"{100 * r['on']['host_fraction']:.1f}/{100 * r['off']['host_fraction']:.1f}"
        print(f"{b:>6}{r['on']['tokens_per_s']:>10.1f}{r['off']['tokens_per_s']:>11.1f}{r['cutoff']['tokens_per_s']:>9.1f}{-100 * loss:>15.1f}%{host:>15}")
        rows.append({"batch": b, **{k: v for k, v in r.items()}, "cutoff_loss_vs_best": loss})
    if args.time_phases:
        print(f"\nms per speculative step\n{'batch':>6}{'on draft':>10}{'on verify':>11}{'draft %':>9}{'cutoff draft':>14}{'cutoff verify':>15}")
        def ms(x):
            return "-" if x is None else f"{x:.2f}"

        for b in args.batches:
            on, cut = table[b]["on"], table[b]["cutoff"]
            share = "-" if on["draft_ms_per_step"] is None else f"{100 * on['draft_ms_per_step'] / (on['draft_ms_per_step'] + on['verify_ms_per_step']):.1f}"
            print(f"{b:>6}{ms(on['draft_ms_per_step']):>10}{ms(on['verify_ms_per_step']):>11}{share:>9}"
                  f"{ms(cut['draft_ms_per_step']):>14}{ms(cut['verify_ms_per_step']):>15}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": "python scripts/bench_engine.py " + " ".join(sys.argv[1:]),
                                    "environment": fingerprint("float32"), "draft": repo_path(args.draft) if args.draft else "random", "threshold": args.threshold, "steps": args.steps, "topk": spec.topk, "draft_tokens": spec.num_draft_tokens,
                                    "new_tokens": args.new_tokens, "time_phases": args.time_phases, "rows": rows}, indent=2))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
