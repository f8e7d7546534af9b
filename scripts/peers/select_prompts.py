#!/usr/bin/env python
"""A prompt file for the side by side with a peer, spread over prompt lengths: the first
``--per-group`` prompts (in file order) of each token-length group, from the repository's
real chat prompts (data/prompts: the held-out file first, then the training file, so a
long group that the held-out prompts cannot fill is topped up from the training ones).

Prefill, not decode, is where eagle-jax and vLLM's CPU build part (time to first token
grows with the prompt), and the built-in suites hold no prompt past 431 tokens; this file
holds short, middle and long ones, lengths counted as ``eagle-jax bench`` tokenizes them
(the chat template with its generation prompt).

    python scripts/peers/select_prompts.py --out results/peers/questions.jsonl
    eagle-jax bench --suite results/peers/questions.jsonl --max-prompts 0 ... --export-prompts ...

Writes ``{"id", "messages", "prompt_tokens"}`` lines, shortest group first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from eagle_jax.checkpoint.tokenizer import Tokenizer
from eagle_jax.experiments.harness import encode
from eagle_jax.serving.prompts import iter_prompt_file

REPO = Path(__file__).resolve().parents[2]


def parse_group(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    try:
        group = int(lo), int(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LO-HI prompt tokens, for example 448-895") from None
    if not 1 <= group[0] <= group[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 1 <= LO <= HI")
    return group


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=REPO / "checkpoints" / "smollm2-135m-instruct",
                   help="the tokenizer and chat template that count the tokens")
    p.add_argument("--groups", type=parse_group, nargs="+",
                   default=[(1, 135), (448, 895), (1025, 2048)], help="prompt-token ranges LO-HI")
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    tok = Tokenizer.from_dir(args.model)
    picked: list[list[dict]] = [[] for _ in args.groups]
    prompts = REPO / "data" / "prompts"
    records = itertools.chain(iter_prompt_file(prompts / "heldout-prompts.jsonl"),
                              iter_prompt_file(prompts / "train-prompts.jsonl.gz"))
    for _, rec in records:
        if rec.messages is None or rec.messages[-1]["role"] != "user":
            continue
        n = len(encode(tok, rec))
        for g, (lo, hi) in enumerate(args.groups):
            if lo <= n <= hi and len(picked[g]) < args.per_group:
                picked[g].append({"id": rec.id, "messages": list(rec.messages), "prompt_tokens": n})
        if all(len(g) == args.per_group for g in picked):
            break
    for (lo, hi), got in zip(args.groups, picked):
        if len(got) < args.per_group:
            print(f"note: only {len(got)} prompts of {lo}-{hi} tokens", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for group in picked:
            for row in group:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {sum(map(len, picked))} prompts to {args.out}: "
          + ", ".join(f"{lo}-{hi} tokens: {len(g)}" for (lo, hi), g in zip(args.groups, picked)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
