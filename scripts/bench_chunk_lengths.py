"""What the prefill chunk lengths cost real chat prompts: padding and time to first token.

    python scripts/bench_chunk_lengths.py [--model DIR] [--prompts data/prompts/heldout-prompts.jsonl]
                                          [--steps 0 32 16] [--sample 40] [--repeats 3]

For each chunk step (0: powers of two only, 64 and 128 on a CPU, as before
``defaults.CPU_CHUNK_STEP``; 32: 64, 96, 128, the CPU default now; 16: 64, 80, 96, 112,
128), from ``runtime.plan.prompt_buckets_for`` at the default largest chunk:

- over every prompt of the file, rendered with the model's chat template as the CLI
  renders it: the padded share of the prefill's tokens (``scheduler.chunk_plan``) and
  the chunk graphs a batch-1 engine compiles;
- over ``--sample`` of them (evenly spaced, in the file's order), the time to first token
  of a batch-1 prefill through the step table's compiled chunk graphs (one table holds
  every length; each step's plan uses its own), every step once per prompt per round,
  ``--repeats`` rounds interleaved; per step the median over rounds of the summed TTFT,
  and the per-prompt ratio to step 0.

Saves ``results/prefill/chunk_lengths.json`` (``--out``) with the command and an
environment fingerprint.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np

from eagle_jax.checkpoint.hf import load_model
from eagle_jax.checkpoint.tokenizer import Tokenizer
from eagle_jax.defaults import default_model_dir
from eagle_jax.environment import fingerprint
from eagle_jax.experiments.harness import prefill_ttft as ttft
from eagle_jax.runtime.plan import prompt_buckets_for
from eagle_jax.runtime.step_table import StepTable
from eagle_jax.serving.scheduler import chunk_plan
from eagle_jax.spec.sampling import SamplingParams


def chat_prompts(path: Path, tok: Tokenizer) -> list[list[int]]:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            out.append(tok.apply_chat_template(json.loads(line)["messages"], add_generation_prompt=True, tokenize=True))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--prompts", type=Path, default=Path("data/prompts/heldout-prompts.jsonl"))
    p.add_argument("--steps", type=int, nargs="+", default=[0, 32, 16])
    p.add_argument("--sample", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("results") / "prefill" / "chunk_lengths.json")
    args = p.parse_args(argv)
    model_dir = args.model or default_model_dir()
    tok = Tokenizer.from_dir(model_dir)
    prompts = chat_prompts(args.prompts, tok)
    lengths = np.asarray([len(x) for x in prompts])
    max_seq_len = 1 << int(lengths.max() + 1).bit_length()
    sets = {s: prompt_buckets_for(int(lengths.max()), max_seq_len, step=s) for s in args.steps}
    rows = []
    for s, chunks in sets.items():
        padded = np.asarray([sum(chunk_plan(int(n), chunks)) for n in lengths])
        rows.append({"step": s, "chunks": list(chunks), "prompts": len(lengths), "prompt_tokens": int(lengths.sum()),
                     "padded_tokens": int(padded.sum()), "padding": 1 - lengths.sum() / padded.sum()})
    print(f"{len(prompts)} prompts from {args.prompts.name}: tokens median {np.median(lengths):.0f}, "
          f"10-90% {np.percentile(lengths, 10):.0f}-{np.percentile(lengths, 90):.0f}")

    target = load_model(model_dir)
    every = sorted(set().union(*sets.values()))
    table = StepTable(target, None, shapes=(), batch_buckets=(1,), prompt_buckets=tuple(every), max_seq_len=max_seq_len,
                      prefill_token_budget=max(every), plain=True, sampled=False)
    table.build()
    samp = table.sampling([SamplingParams()], 1)
    idx = np.linspace(0, len(prompts) - 1, min(args.sample, len(prompts))).round().astype(int)
    sample = [prompts[i] for i in idx]
    for x in sample[:4]:
        for chunks in sets.values():
            ttft(table, samp, x, chunks)  # warm-up: first calls allocate
    times = {s: np.zeros((args.repeats, len(sample))) for s in sets}
    for r in range(args.repeats):
        for j, x in enumerate(sample):
            for s, chunks in sets.items():
                times[s][r, j] = ttft(table, samp, x, chunks)
        print(f"round {r + 1}/{args.repeats} done", file=sys.stderr)
    base = np.median(times[args.steps[0]], axis=0)
    for row in rows:
        t = times[row["step"]]
        per_prompt = np.median(t, axis=0)
        row.update({
            "sample": len(sample),
            "sample_padded_tokens": int(sum(sum(chunk_plan(len(x), sets[row["step"]])) for x in sample)),
            "ttft_sum_s": float(np.median(t.sum(axis=1))),
            "ttft_median_s": float(np.median(per_prompt)),
            "ttft_ratio_median": float(np.median(per_prompt / base)),
            "graphs_batch_1": len(row["chunks"]),
        })
    print(f"{'step':>4} {'chunks':<24} {'padding':>8} {'TTFT sum s':>10} {'median s':>9} {'vs step ' + str(args.steps[0]):>10}")
    for row in rows:
        print(f"{row['step']:>4} {'/'.join(map(str, row['chunks'])):<24} {row['padding']:>8.3f} {row['ttft_sum_s']:>10.2f} "
              f"{row['ttft_median_s']:>9.3f} {row['ttft_ratio_median']:>9.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "python scripts/bench_chunk_lengths.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "fingerprint": fingerprint("float32"), "repeats": args.repeats, "sample_indices": idx.tolist(),
        "rows": rows, "raw_s": {str(s): t.tolist() for s, t in times.items()},
    }, indent=1))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
