#!/usr/bin/env python
"""A draft's acceptance and speedup on held-out prompts, at batch 1, greedy.

Runs the same prompts through a plain engine and speculative engines (chains of several
depths and a tree), checks every output is token-identical to plain decoding, and
reports mean accept length, tokens/s and the speedup over plain decoding measured in the
same run. Prompts: the built-in "eval" split (topics never used for training data) and
the `make demo` questions. Saves results/bench_draft.json.

    python scripts/bench_draft.py --draft checkpoints/smollm2-135m-instruct-eagle3 [--prompts 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import jax

from eagle_jax.checkpoint.draft_io import load_draft
from eagle_jax.checkpoint.hf import load_model
from eagle_jax.defaults import default_draft_dir, default_model_dir
from eagle_jax.defaults import enable_compilation_cache as _enable_compilation_cache
from eagle_jax.serving.engine import Engine, EngineConfig
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.spec.steps import SpeculativeConfig
from eagle_jax.checkpoint.tokenizer import Tokenizer
from eagle_jax.train.synthetic_prompts import synthetic_prompts

sys.path.insert(0, str(Path(__file__).parent))
from demo import QUESTIONS, run_once  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

CONFIGS = {
    "chain S=1": SpeculativeConfig(num_steps=1),
    "chain S=2": SpeculativeConfig(num_steps=2),
    "chain S=3": SpeculativeConfig(num_steps=3),
    "chain S=4": SpeculativeConfig(num_steps=4),
    "chain S=5": SpeculativeConfig(num_steps=5),
    "tree S=3 k=4 T=8": SpeculativeConfig(num_steps=3, topk=4, num_draft_tokens=8),
}


def repo_path(path: Path) -> str:
    """``path`` relative to the repository when inside it, else its last component, so
    results/ files hold no machine's absolute paths."""
    resolved = Path(path).resolve()
    return resolved.relative_to(REPO).as_posix() if resolved.is_relative_to(REPO) else resolved.name


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--draft", type=Path, default=None)
    ap.add_argument("--prompts", type=int, default=16, help="held-out built-in prompts (plus the 4 demo questions)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved passes over the prompts; medians reported")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--out", type=Path, default=Path("results/bench_draft.json"))
    args = ap.parse_args()
    _enable_compilation_cache()
    model_dir = args.model or default_model_dir()
    draft_dir = args.draft or default_draft_dir()
    tok = Tokenizer.from_dir(model_dir)
    target = load_model(model_dir, dtype="float32")
    draft = load_draft(draft_dir, target=target, dtype="float32")
    questions = synthetic_prompts(1000, split="eval", seed=1)[: args.prompts] + QUESTIONS
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions]
    sp = SamplingParams(max_new_tokens=args.max_new_tokens)
    base = dict(max_batch=1, max_seq_len=256, prompt_buckets=(64, 256))
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cores; {model_dir} float32; "
          f"draft {draft_dir}; {len(prompts)} prompts, {args.max_new_tokens} new tokens, greedy, batch 1")
    engines = {"plain": Engine(target, None, EngineConfig(spec_policy="plain", **base), tok, progress=False)}
    for name in args.configs:
        engines[name] = Engine(target, draft, EngineConfig(speculative=CONFIGS[name], **base), tok, progress=False)
    for engine in engines.values():
        engine.generate(prompts[:1], sp)  # warm the host path
    # Repeats interleave the configurations, so slow drifts of the machine hit all alike.
    outs, runs = {}, {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            outs[name], tps = run_once(engine, prompts, sp)
            runs[name].append(tps)
    plain_tps = statistics.median(runs["plain"])
    plain_out = outs["plain"]
    print(f"{'plain':<18}{plain_tps:>8.1f} tok/s")
    rows = [{"config": "plain", "tokens_per_s": plain_tps, "runs": runs["plain"]}]
    for name in args.configs:
        out, tps = outs[name], statistics.median(runs[name])
        same = all(a.token_ids == b.token_ids for a, b in zip(out, plain_out))
        accepts = [a for c in out for a in c.accept_lengths]
        s = engines[name].metrics.summary()
        row = {
            "config": name, "tokens_per_s": tps, "runs": runs[name], "speedup": tps / plain_tps,
            "mean_accept_length": sum(accepts) / len(accepts), "identical_to_plain": same,
            "acceptance_rate_by_depth": s["acceptance_rate_by_depth"],
        }
        rows.append(row)
        print(f"{name:<18}{tps:>8.1f} tok/s  speedup {row['speedup']:.2f}x  accept {row['mean_accept_length']:.2f}  identical {same}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "draft": repo_path(draft_dir), "prompts": questions, "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats, "plain_tokens": sum(len(c.token_ids) for c in plain_out), "rows": rows,
    }, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
