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

Saves results/bench_train.json (--out) with the command and an environment fingerprint.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_policy import fingerprint  # noqa: E402

from eagle_jax.checkpoint.hf import load_model  # noqa: E402
from eagle_jax.defaults import default_model_dir  # noqa: E402
from eagle_jax.train import ttt  # noqa: E402


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
    ap.add_argument("--out", type=Path, default=Path("results/bench_train.json"))
    args = ap.parse_args()
    target = load_model(args.model or default_model_dir())
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
    result = {"command": "python scripts/bench_train.py " + " ".join(sys.argv[1:]), "environment": fingerprint(),
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
