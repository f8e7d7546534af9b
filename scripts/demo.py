#!/usr/bin/env python
"""The main job of `make demo`: generate with the default target and draft, and measure
speculation against plain decoding in the same run.

With a draft (--draft, or the released one at checkpoints/smollm2-135m-instruct-eagle3)
it runs the same chat prompts greedily through a plain engine and an engine under the
auto policy (``AutoPolicy``: it times the plain step and every candidate shape on this
machine at start-up and runs whichever it predicts fastest, learning the draft's
acceptance as it goes), checks that the outputs are identical, and prints what auto
chose, its predicted and measured tokens/s, and the speedup. Where no shape pays on this
machine it says so and why: each shape's step cost against the tokens it accepts.
Without a draft it generates plainly and says why there is no speedup to show.

    python scripts/demo.py [--model DIR] [--draft DIR] [--max-new-tokens 128] [--shapes 'chain S=2, tree S=3 k=4 T=8']
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from eagle_jax.defaults import default_draft_dir, default_model_dir
from eagle_jax.defaults import enable_compilation_cache as _enable_compilation_cache
from eagle_jax.experiments.harness import timed_generate
from eagle_jax.serving.engine import Engine, EngineConfig
from eagle_jax.serving.policy import parse_shapes
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.spec.config import SpeculativeConfig
from eagle_jax.checkpoint.tokenizer import Tokenizer

QUESTIONS = [
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "What are three benefits of regular exercise?",
    "Give me a one-line Python function that reverses a string.",
]


def timed_run(engine: Engine, prompts, sp):
    """(completions, tokens/s) of one pass over the prompts, after a warm-up request."""
    engine.generate(prompts[:1], sp)  # warm the host path
    return timed_generate(engine, prompts, sp)


def explain(engine: Engine) -> None:
    """What auto ran at batch 1 and why: every option's step time on this machine, the
    accept length it expects, and the tokens/s that gives."""
    policy = engine.policy
    report = policy.report()[1]
    summary = engine.metrics.summary()
    ran = {k.split(": ", 1)[1]: v for k, v in summary["steps_by_bucket"].items() if k.startswith("1: ")}
    plain_ms = report["step_ms"]["plain"]
    print(f"auto at batch 1: chose {report['chosen']} (steps run: {ran}); "
          f"measured {summary['measured_tokens_per_second_by_bucket'].get('1: ' + report['chosen'], float('nan')):.1f} tok/s "
          f"in steady state, predicted {report['predicted_tokens_per_second'][report['chosen']]:.1f}")
    print(f"  {'option':<20}{'step ms':>9}{'x plain':>9}{'accept len':>12}{'pred. tok/s':>13}")
    for name, ms in report["step_ms"].items():
        print(f"  {name:<20}{ms:>9.1f}{ms / plain_ms:>9.2f}{report['expected_accept_length'][name]:>12.2f}"
              f"{report['predicted_tokens_per_second'][name]:>13.1f}")
    if report["chosen"] == "plain":
        print("  No shape pays with this draft on this machine: a speculative step pays only when its accept length "
              "exceeds its cost in plain steps (the 'x plain' column), and none does here. "
              "A draft that accepts more, or a cheaper verify forward, changes that; auto re-checks as it runs.")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--draft", type=Path, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--shapes", default=None, help="auto's candidate shapes (default: eagle_jax.serving.policy.DEFAULT_AUTO_SHAPES)")
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

    plain = Engine(str(model_dir), None, EngineConfig(spec_policy="plain", **base), tok)
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
    config = EngineConfig(speculative=SpeculativeConfig(), spec_policy="auto",
                          spec_shapes=parse_shapes(args.shapes) if args.shapes else None, sampled_steps=False, **base)
    spec = Engine(str(model_dir), str(draft_dir), config, tok)
    spec_out, spec_tps = timed_run(spec, prompts, sp)
    same = all(a.token_ids == b.token_ids for a, b in zip(plain_out, spec_out))
    print(f"speculative, auto policy (draft {draft_dir}): {spec_tps:.1f} tokens/s, speedup {spec_tps / plain_tps:.2f}x; "
          f"outputs identical to plain decoding: {same}")
    explain(spec)
    print(f"(one pass over {len(prompts)} prompts; `eagle-jax eval-draft --draft DIR --suite held_out --repeats 3` "
          "takes medians over 20 held-out prompts, these 4 among them)")


if __name__ == "__main__":
    main()
