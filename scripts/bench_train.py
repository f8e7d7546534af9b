#!/usr/bin/env python
"""Draft-training step cost on this machine: the TTT attention (structured diagonal vs
the dense ``[L, ttt_length * L]`` mask) and the draft vocabulary size (4096 / 8192 /
16384), on the real target's shapes (SmolLM2: hidden 576, features 3 x 576).

A third option: unrolling only from the anchors whose predictions reach the response
(``DraftTrainer(select_queries=True)``, the default; the prompt is --prompt-fraction of
each sequence). Each configuration gets its own compiled ``DraftTrainer``; the timed steps then run
round-robin (one step of each configuration per round, --rounds rounds), so a slow
spell of the machine touches every configuration alike, and the median is kept. Inputs
are random features and tokens of the target's widths (what a step costs does not
depend on their values). With --conversations (a ``draft-data`` conversations.jsonl),
the vocabulary's coverage is measured too: ids chosen by frequency on the first 80% of
the conversations, coverage of the response tokens of the other 20%.

    python scripts/bench_train.py [--batch-size 4] [--width 384] [--ttt-length 7] \\
        [--vocabs 4096 8192 16384] [--conversations DATA/conversations.jsonl]

With --data DATA (a finished ``draft-data`` directory) it measures the real data instead
(saved to results/bench_train_data.json unless --out):

- padding: how many of the positions the trainer's length-sorted batches compute are
  real tokens, over one epoch's batch order (what packing sequences could save);
- the feature source: reading a batch from the memory-mapped float16 files against
  recomputing it with the target's forward pass (SpecForge's online mode), per batch;
- a training step on real batches per vocabulary size (--vocabs), and each vocabulary's
  coverage of the response tokens (chosen on the training split, measured on eval/).

Real batches: --samples batches drawn from one epoch's order (seeded); every timed
operation runs once per batch per round, round-robin, and the median is kept.
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

from eagle_jax.checkpoint.hf import load_model
from eagle_jax.defaults import default_model_dir
from eagle_jax.environment import fingerprint
from eagle_jax.train import ttt


def trainer_for(target, vocab: int, attention: str, select: bool, args):
    cfg = ttt.TrainConfig(draft_vocab_size=vocab, ttt_length=args.ttt_length, batch_size=args.batch_size)
    ids = np.sort(np.random.default_rng(0).choice(target.config.vocab_size, vocab, replace=False))
    draft = ttt.init_draft(target, ids, cfg)
    return ttt.DraftTrainer(draft, target, cfg, total_steps=1000, attention=attention, select_queries=select)


def batch_for(target, vocab: int, args, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    b, n, h = args.batch_size, args.width, target.config.hidden_size
    f = len(target.config.feature_layer_ids) * h
    return {
        "tokens": rng.integers(0, target.config.vocab_size, (b, n)).astype(np.int32),
        "lengths": np.full(b, n, np.int32), "prompt_lengths": np.full(b, int(args.prompt_fraction * n), np.int32),
        "features": rng.standard_normal((b, n, f)).astype(np.float16),
        "target_hidden": rng.standard_normal((b, n, h)).astype(np.float16),
        "target_argmax": rng.integers(0, vocab, (b, n)).astype(np.int32),
    }


def coverage(path: Path, vocabs, vocab_size: int) -> dict:
    convs = []
    with open(path) as fh:
        for line in fh:
            try:
                convs.append(json.loads(line)["response_ids"])
            except (json.JSONDecodeError, KeyError):
                continue  # a line torn by a running draft-data
    cut = int(0.8 * len(convs))
    fit = np.bincount(np.concatenate([np.asarray(c, np.int64) for c in convs[:cut]]), minlength=vocab_size)
    held = np.concatenate([np.asarray(c, np.int64) for c in convs[cut:]])
    order = np.lexsort((np.arange(vocab_size), -fit))
    out = {"conversations": len(convs), "fit_tokens": int(fit.sum()), "heldout_tokens": int(held.size)}
    for v in vocabs:
        member = np.zeros(vocab_size, bool)
        member[order[:v]] = True
        out[str(v)] = {"fit": float(fit[member].sum() / fit.sum()), "heldout": float(member[held].mean())}
    return out


def bench_data(target, args) -> dict:
    """The --data measurements (see the module docstring)."""
    from eagle_jax.train.data import FeatureSet, _forward_fn

    data = FeatureSet.load(args.data / "train", mmap=True)
    lengths, plens = np.asarray(data.lengths), np.asarray(data.prompt_lengths)
    bs, width_max = args.batch_size, data.tokens.shape[1]
    batches = list(ttt._length_batches(lengths, bs, np.random.default_rng(0), 64, width_max))
    real = int(lengths.sum())
    response = int((lengths - plens).sum())
    step0 = sum(bs * w for _, w in batches)
    rows = 0
    for idx, w in batches:  # the query rows DraftTrainer.query_rows picks (steps 1..)
        need = ttt.query_rows_needed(lengths[idx], plens[idx], args.ttt_length)
        rows += bs * min(w, max(64, -(-need // 64) * 64))
    padding = {
        "sequences": len(data), "batches_per_epoch": len(batches), "batch_size": bs, "longest": int(width_max),
        "real_tokens": real, "response_tokens": response,
        "step0_positions": step0, "step0_real_fraction": round(real / step0, 4),
        "query_rows": rows, "query_rows_response_fraction": round(response / rows, 4),
        "widths": {str(w): sum(1 for _, x in batches if x == w) for w in sorted({w for _, w in batches})},
    }
    print(f"padding: {len(batches)} batches of {bs}; step 0 computes {step0:,} positions for {real:,} real tokens "
          f"({100 * real / step0:.1f}% real); steps 1.. compute {rows:,} query rows for {response:,} response tokens "
          f"({100 * response / rows:.1f}%)", flush=True)

    pick = np.random.default_rng(1).choice(len(batches), min(args.samples, len(batches)), replace=False)
    sample = [batches[i] for i in sorted(pick)]
    forward = _forward_fn(target)
    trainers = {}
    for v in args.vocabs:
        cfg = ttt.TrainConfig(draft_vocab_size=v, ttt_length=args.ttt_length, batch_size=bs)
        ids = ttt.select_draft_vocab(data, v, target.config.vocab_size)
        trainers[v] = ttt.DraftTrainer(ttt.init_draft(target, ids, cfg), target, cfg, total_steps=1000)
    # Compile every (operation, width) once before timing.
    t = time.perf_counter()
    for idx, w in sample:
        b = ttt._batch_arrays(data, idx, w, bs)
        jax.block_until_ready(forward(b["tokens"]))
        for tr in trainers.values():
            jax.block_until_ready(tr.step(b)["loss"])
    print(f"compiled and warmed {len(sample)} batches in {time.perf_counter() - t:.0f} s "
          f"(widths {sorted({w for _, w in sample})})", flush=True)
    times = {"read": [], "online_forward": [], **{f"step_vocab_{v}": [] for v in args.vocabs}}
    for r in range(args.rounds):
        for idx, w in sample:
            t = time.perf_counter()
            b = ttt._batch_arrays(data, idx, w, bs)
            times["read"].append(time.perf_counter() - t)
            t = time.perf_counter()
            jax.block_until_ready(forward(b["tokens"]))
            times["online_forward"].append(time.perf_counter() - t)
            for v, tr in trainers.items():
                t = time.perf_counter()
                jax.block_until_ready(tr.step(b)["loss"])
                times[f"step_vocab_{v}"].append(time.perf_counter() - t)
        print(f"round {r + 1} done", flush=True)
    # Per batch: the median over rounds, then the mean over the sampled batches (an
    # epoch's cost is a sum over batches of different widths).
    n = len(sample)
    per = {k: float(np.mean([statistics.median(ts[j::n]) for j in range(n)])) for k, ts in times.items()}
    cov = {}
    if (args.data / "eval").is_dir():
        held = FeatureSet.load(args.data / "eval", mmap=True)
        for v in args.vocabs:
            cov[str(v)] = round(ttt.vocab_coverage(held, ttt.select_draft_vocab(data, v, target.config.vocab_size),
                                                   target.config.vocab_size), 4)
    out = {"data": args.data.name, "padding": padding, "sampled_batches": [[int(len(i)), int(w)] for i, w in sample],
           "mean_s_per_batch": {k: round(x, 4) for k, x in per.items()}, "eval_coverage": cov}
    for k, x in per.items():
        print(f"{k}: {x:.3f} s per batch (mean over the sampled batches of the per-batch median)")
    for v in args.vocabs:
        step = per[f"step_vocab_{v}"]
        print(f"vocab {v}: step {step:.2f} s, epoch ~{step * len(batches) / 3600:.2f} h; online features would add "
              f"{per['online_forward']:.2f} s ({100 * per['online_forward'] / step:.0f}%), the memory map costs "
              f"{per['read']:.3f} s; coverage of held-out response tokens {cov.get(str(v))}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--width", type=int, default=384, help="padded sequence length of a batch")
    ap.add_argument("--ttt-length", type=int, default=7)
    ap.add_argument("--vocabs", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-fraction", type=float, default=0.375,
                    help="prompt share of each sequence (default 0.375: 86 of 231 tokens, the mean of the first "
                         "real-prompt answers)")
    ap.add_argument("--conversations", type=Path, default=None)
    ap.add_argument("--data", type=Path, default=None, help="a finished draft-data directory: measure the real data")
    ap.add_argument("--samples", type=int, default=4, help="with --data: real batches timed (default 4)")
    ap.add_argument("--out", type=Path, default=None,
                    help="default results/bench_train.json, or results/bench_train_data.json with --data")
    args = ap.parse_args()
    target = load_model(args.model or default_model_dir())
    if args.data is not None:
        result = {"command": "python scripts/bench_train.py " + " ".join(sys.argv[1:]), "environment": fingerprint(jnp.dtype(target.dtype).name),
                  "batch_size": args.batch_size, "ttt_length": args.ttt_length, "rounds": args.rounds,
                  **bench_data(target, args)}
        out = args.out or Path("results/bench_train_data.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
        return 0
    args.out = args.out or Path("results/bench_train.json")
    configs = [("dense", 8192, False), ("diagonal", 8192, False)] + [("diagonal", v, True) for v in args.vocabs]
    trainers, batches, compile_s = {}, {}, {}
    for att, v, sel in configs:
        key = f"{att} attention, vocab {v}" + (", response anchors only" if sel else "")
        t = time.perf_counter()
        trainers[key] = trainer_for(target, v, att, sel, args)
        batches[key] = batch_for(target, v, args, seed=v)
        jax.block_until_ready(trainers[key].step(batches[key])["loss"])  # compile + one warm step
        compile_s[key] = time.perf_counter() - t
        print(f"{key}: compiled and warmed in {compile_s[key]:.1f} s", flush=True)
    times = {k: [] for k in trainers}
    for r in range(args.rounds):
        for key, tr in trainers.items():
            t = time.perf_counter()
            jax.block_until_ready(tr.step(batches[key])["loss"])
            times[key].append(time.perf_counter() - t)
        print(f"round {r + 1}: " + ", ".join(f"{k} {times[k][-1]:.2f} s" for k in times), flush=True)
    tokens = args.batch_size * args.width
    base = statistics.median(times["dense attention, vocab 8192"])
    rows = {}
    for key, ts in times.items():
        med = statistics.median(ts)
        rows[key] = {"step_s": round(med, 4), "step_s_runs": [round(x, 4) for x in ts],
                     "positions_per_s": round(tokens / med, 1), "vs_dense_8192": round(med / base, 3),
                     "compile_and_first_step_s": round(compile_s[key], 1)}
        print(f"{key}: {med:.3f} s/step, {tokens / med:.0f} positions/s, {med / base:.2f}x the dense 8192 step")
    result = {"command": "python scripts/bench_train.py " + " ".join(sys.argv[1:]), "environment": fingerprint(jnp.dtype(target.dtype).name),
              "batch_size": args.batch_size, "width": args.width, "ttt_length": args.ttt_length, "rounds": args.rounds,
              "rows": rows}
    if args.conversations is not None:
        result["coverage"] = coverage(args.conversations, args.vocabs, target.config.vocab_size)
        for v in args.vocabs:
            c = result["coverage"][str(v)]
            print(f"vocab {v}: covers {100 * c['fit']:.2f}% of the response tokens it was chosen on, "
                  f"{100 * c['heldout']:.2f}% of held-out ones")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
