#!/usr/bin/env python
"""The main job of `make demo`: generate with the default target and draft, and measure
speculation against plain decoding in the same run.

With a draft (--draft, or the released one at checkpoints/smollm2-135m-instruct-eagle3)
it runs the same chat prompts greedily through a speculative engine and a plain one,
checks that the outputs are identical, and prints the mean accept length and the
speedup. Without a draft it generates plainly and says why there is no speedup to show.

    python scripts/demo.py [--model DIR] [--draft DIR] [--max-new-tokens 128] [--steps 3 --topk 4 --draft-tokens 8]
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from eagle_jax.defaults import default_draft_dir, default_model_dir
from eagle_jax.defaults import enable_compilation_cache as _enable_compilation_cache
from eagle_jax.engine import Engine, EngineConfig
from eagle_jax.sampling import SamplingParams
from eagle_jax.speculative import SpeculativeConfig
from eagle_jax.tokenizer import Tokenizer

QUESTIONS = [
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "What are three benefits of regular exercise?",
    "Give me a one-line Python function that reverses a string.",
]


def run_once(engine: Engine, prompts, sp):
    """(completions, tokens/s) of one pass over the prompts."""
    t = time.perf_counter()
    out = engine.generate(prompts, sp)
    return out, sum(len(c.token_ids) for c in out) / (time.perf_counter() - t)


def timed_run(engine: Engine, prompts, sp):
    engine.generate(prompts[:1], sp)  # warm the host path
    return run_once(engine, prompts, sp)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--draft", type=Path, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    # Tied fastest (with chain S=2) for the released draft on a 2-core CPU (results/bench_draft.json).
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--draft-tokens", type=int, default=8)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("eagle_jax").setLevel(logging.INFO)
    _enable_compilation_cache()

    model_dir = args.model or default_model_dir()
    draft_dir = args.draft or default_draft_dir()
    tok = Tokenizer.from_dir(model_dir)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    sp = SamplingParams(max_new_tokens=args.max_new_tokens)
    base = dict(max_batch=1, max_seq_len=256, prompt_buckets=(64, 256))

    plain = Engine(str(model_dir), None, EngineConfig(speculative=None, **base), tok)
    plain_out, plain_tps = timed_run(plain, prompts, sp)
    for q, c in zip(QUESTIONS, plain_out):
        print(f"\n> {q}\n{c.text}")
    print(f"\nplain decoding: {plain_tps:.1f} tokens/s (batch 1, greedy, float32)")
    if not draft_dir.is_dir():
        print(
            f"\nno EAGLE-3 draft at {draft_dir} (the released one is committed there; was it deleted?), "
            "so there is no speculative speedup to show. Pass --draft DIR to measure one."
        )
        return
    spec_cfg = SpeculativeConfig(num_steps=args.steps, topk=args.topk, num_draft_tokens=args.draft_tokens)
    spec = Engine(str(model_dir), str(draft_dir), EngineConfig(speculative=spec_cfg, **base), tok)
    spec_out, spec_tps = timed_run(spec, prompts, sp)
    same = [a.token_ids == b.token_ids for a, b in zip(plain_out, spec_out)]
    accepts = [a for c in spec_out for a in c.accept_lengths]
    print(
        f"speculative ({spec_cfg.shape}, "
        f"draft {draft_dir}): {spec_tps:.1f} tokens/s, mean accept length "
        f"{sum(accepts) / max(len(accepts), 1):.2f}, speedup {spec_tps / plain_tps:.2f}x; "
        f"outputs identical to plain decoding: {all(same)}"
    )
    print(f"(one pass over {len(prompts)} prompts; `python scripts/bench_draft.py` takes medians over 20 held-out prompts)")


if __name__ == "__main__":
    main()
