"""What a short prompt costs inside a file of long ones, against the same prompt alone.

    python scripts/bench_mixed_prompts.py [--short 12 --long 12 --long-tokens 1000 --new-tokens 64]

Batch 1, greedy, plain decoding (the engine as the CLI builds it: prompt buckets from 64 up
to the longest prompt, max_seq_len for the longest request). "Alone": the same short
prompts in an engine sized for them only. Per short request, the cost is admission to
the last token (prefill plus decode; queueing excluded). Medians over the short requests.
The alone run goes before and after the mixed one, so its two medians bound the
machine's drift.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from eagle_jax.checkpoint.hf import load_model
from eagle_jax.defaults import default_model_dir, pow2_at_least
from eagle_jax.runtime.plan import prompt_buckets_for
from eagle_jax.environment import fingerprint
from eagle_jax.serving.engine import Engine, EngineConfig
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.checkpoint.tokenizer import Tokenizer
from eagle_jax.train.synthetic_prompts import synthetic_prompts


def engine_for(target, tok, prompts, new_tokens):
    longest = max(len(p) for p in prompts)
    max_seq_len = min(target.config.max_position_embeddings, pow2_at_least(longest + new_tokens))
    cfg = EngineConfig(max_batch=1, max_seq_len=max_seq_len, prompt_buckets=prompt_buckets_for(longest, max_seq_len),
                       spec_policy="plain", sampled_steps=False)
    return Engine(target, None, cfg, tok, progress=False)


def costs(engine, prompts, sp, which):
    out = engine.generate(prompts, sp)
    return [c.metrics.last_token - c.metrics.admitted for c, w in zip(out, which) if w]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--short", type=int, default=12)
    p.add_argument("--long", type=int, default=12)
    p.add_argument("--long-tokens", type=int, default=1000)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("results/bench_mixed_prompts.json"))
    args = p.parse_args()
    model_dir = args.model or default_model_dir()
    tok = Tokenizer.from_dir(model_dir)
    target = load_model(model_dir, dtype="float32")
    questions = synthetic_prompts(args.short, split="eval", seed=3)
    short = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions]
    filler = tok.encode(" ".join(synthetic_prompts(200, split="train", seed=4)))
    long = [filler[i * 37: i * 37 + args.long_tokens] for i in range(args.long)]
    mixed, is_short = [], []
    for s, lg in zip(short, long):
        mixed += [s, lg]
        is_short += [True, False]
    sp = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    alone_engine = engine_for(target, tok, short, args.new_tokens)
    mixed_engine = engine_for(target, tok, mixed, args.new_tokens)
    alone_engine.generate(short[:1], sp)  # warm the host path
    mixed_engine.generate(short[:1], sp)
    t = time.perf_counter()
    before = costs(alone_engine, short, sp, [True] * len(short))
    inside = costs(mixed_engine, mixed, sp, is_short)
    after = costs(alone_engine, short, sp, [True] * len(short))
    wall = time.perf_counter() - t
    alone = statistics.median(before + after)
    res = {
        "command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "environment": fingerprint("float32"),
        "short_prompt_tokens": [len(s) for s in short], "long_prompt_tokens": args.long_tokens, "new_tokens": args.new_tokens,
        "mixed_engine": repr(mixed_engine), "alone_engine": repr(alone_engine),
        "short_alone_s": {"median_first_run": statistics.median(before), "median_last_run": statistics.median(after)},
        "short_in_mixed_s_median": statistics.median(inside),
        "ratio_in_mixed_vs_alone": statistics.median(inside) / alone,
        "wall_s": wall,
    }
    print(f"short prompt alone: {statistics.median(before):.2f} s then {statistics.median(after):.2f} s; "
          f"inside the mixed file: {statistics.median(inside):.2f} s; ratio {res['ratio_in_mixed_vs_alone']:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
