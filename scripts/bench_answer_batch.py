"""Answer tokens per second of `draft-data`'s generation at several batch sizes.

    python scripts/bench_answer_batch.py --batch 32 --seconds 120

Builds the engine `draft-data` builds for the most common context group (prompts of up
to 128 tokens, answers of up to --max-new-tokens with end-of-sequence stop; a quarter
sampled at temperature 0.7, the rest greedy), keeps its queue full with the training
prompts in file order, and after a warm-up counts the answer tokens made in a timed
window (finished answers and those still running). One JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "checkpoints" / "smollm2-135m-instruct")
    ap.add_argument("--prompt-file", type=Path, default=ROOT / "data" / "prompts" / "train-prompts.jsonl.gz")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--warmup", type=float, default=20.0, help="seconds run before the timed window")
    ap.add_argument("--seconds", type=float, default=120.0, help="timed window")
    args = ap.parse_args()

    from eagle_jax.checkpoint.hf import load_model
    from eagle_jax.serving.engine import Engine, EngineConfig
    from eagle_jax.serving.prompts import read_prompt_file
    from eagle_jax.checkpoint.tokenizer import Tokenizer
    from eagle_jax.train.commands import _context_for
    from eagle_jax.train.data import answer_params

    tok = Tokenizer.from_dir(args.model)
    target = load_model(args.model)
    ctx = _context_for(1, args.max_new_tokens, args.max_seq_len)
    reqs = []
    for r in read_prompt_file(args.prompt_file):
        ids = tok.encode(tok.apply_chat_template(list(r.messages), add_generation_prompt=True))
        if _context_for(len(ids), args.max_new_tokens, args.max_seq_len) == ctx:
            reqs.append((r.id, ids))
        if len(reqs) >= 4000:
            break
    b = args.batch
    t_build = time.perf_counter()
    engine = Engine(target, None, EngineConfig(
        max_batch=b, max_seq_len=ctx, speculative=None, batch_buckets=tuple(sorted({min(16, b), b})),
        prompt_buckets=tuple(sorted({64, ctx - args.max_new_tokens, ctx}))), tok)
    t_build = time.perf_counter() - t_build
    nxt = 0
    finished_tokens = 0
    finished = 0

    def running_tokens():
        return sum(len(r.progress.tokens) for r in engine.scheduler.requests.values())

    def run_for(seconds):
        nonlocal nxt, finished_tokens, finished
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            while nxt - finished < 2 * b:
                rid, ids = reqs[nxt]
                engine.add_request(list(ids), answer_params(rid, seed=0, sampled_fraction=0.25, temperature=0.7,
                                                            max_new_tokens=args.max_new_tokens), request_id=nxt)
                nxt += 1
            engine.step()
            for c in engine.pop_finished():
                finished_tokens += len(c.token_ids)
                finished += 1

    run_for(args.warmup)
    tok0, fin0, t0 = finished_tokens + running_tokens(), finished, time.perf_counter()
    run_for(args.seconds)
    dt = time.perf_counter() - t0
    made = finished_tokens + running_tokens() - tok0
    print(json.dumps({"batch": b, "context": ctx, "max_new_tokens": args.max_new_tokens, "window_s": round(dt, 1),
                      "answer_tokens": made, "tokens_per_s": round(made / dt, 1), "answers_finished": finished - fin0,
                      "engine_build_s": round(t_build, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
