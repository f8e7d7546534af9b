#!/usr/bin/env python
"""Plain greedy decode speed on SmolLM2 (float32), beside transformers' generate.

Prints, for batch 1 and 8: our decode-step time and tokens/s (median over repeated
timed runs of the compiled step), end-to-end generate tokens/s, and transformers'
``generate`` tokens/s on the same prompts; plus the bandwidth roofline: weight bytes
read per decode step over the matrix-vector bandwidth measured on this machine.
Saves the figures to results/bench_decode.json (--out overrides).

    python scripts/bench_decode.py [--model DIR] [--new-tokens 64] [--repeats 5] [--batches 1 8] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

from eagle_jax.experiments.bench import matvec_bandwidth, weight_bytes_per_step
from eagle_jax.checkpoint.hf import load_model
from eagle_jax.defaults import default_model_dir
from eagle_jax.environment import fingerprint
from eagle_jax.experiments.harness import timed_generate
from eagle_jax.serving.generate import Buckets, Generator
from eagle_jax.runtime.step_table import StepTable
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.checkpoint.tokenizer import Tokenizer

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one paragraph.",
    "List three uses of Python.",
    "Why do cats purr?",
    "How does a bicycle stay upright?",
    "Give me a short recipe for pancakes.",
    "What is a prime number?",
]


def time_decode_steps(gen: Generator, prompts, steps: int, repeats: int) -> list[float]:
    """Median-able list of seconds per decode step for a batch of prompts (greedy).

    Runs the plain step of a plain-only step table sized from ``gen.buckets`` as before
    (batch bucket, prompt bucket, cache bucket ``s_len``): prefill into a fresh state, then
    ``steps`` steps, timed. The table's target cache holds ``s_len + 2`` slots
    (``state_spec`` sizes it for one tree of the default 1-step shape, 2 tokens; no
    rounding up to the GPU kernel block) where the old ``PlainSteps`` cache held exactly
    ``s_len``: a 2-slot difference, negligible."""
    b = Buckets.pick(gen.buckets.batch, len(prompts), "batch")
    p_len = Buckets.pick(gen.buckets.prompt, max(map(len, prompts)), "prompt")
    s_len = Buckets.pick(gen.buckets.cache, p_len + steps + 1, "cache")
    table = StepTable(gen.model, None, shapes=(), batch_buckets=(b,), prompt_buckets=(p_len,), max_seq_len=s_len,
                      prefill_token_budget=b * p_len, plain=True, sampled=False, cache_align=1)
    table.build()  # compiled before timing (the old code compiled in its first, discarded run)
    tokens = np.zeros((b, p_len), np.int32)
    lengths = np.ones(b, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
        lengths[i] = len(p)
    samp = table.sampling([SamplingParams()] * len(prompts), b)
    tokens, lengths = table.device_put_rows(tokens), table.device_put_rows(lengths)
    rows = table.device_put_rows(np.arange(b, dtype=np.int32))
    per_step = []
    for _ in range(repeats + 1):  # the first run warms up
        rows_state, _ = table.prefill(tokens, lengths, samp)
        state = table.insert(table.zeros(b), rows_state, rows)
        jax.block_until_ready(state)
        t = time.perf_counter()
        for _ in range(steps):
            state, nxt, _, _ = table.step(state, samp, None, greedy=True)
        nxt.block_until_ready()
        per_step.append((time.perf_counter() - t) / steps)
    return per_step[1:]


def hf_generate_tps(model_dir: Path, prompts, new_tokens: int, repeats: int) -> float:
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n = max(map(len, prompts))
    ids = torch.zeros((len(prompts), n), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as transformers wants for batched generate
        ids[i, n - len(p) :] = torch.tensor(p)
        attn[i, n - len(p) :] = 1
    rates = []
    for r in range(repeats + 1):
        t = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(
                input_ids=ids, attention_mask=attn, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, pad_token_id=0,
            )
        dt = time.perf_counter() - t
        if r:
            rates.append(len(prompts) * (out.shape[1] - n) / dt)
    return statistics.median(rates)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--out", type=Path, default=Path("results/bench_decode.json"))
    args = ap.parse_args()
    model_dir = args.model or default_model_dir()

    tok = Tokenizer.from_dir(model_dir)
    model = load_model(model_dir, dtype="float32")
    gen = Generator(model, tok, buckets=Buckets(batch=(1, 8), prompt=(32, 64), cache=(128, 256)))
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True))
        for q in QUESTIONS
    ]

    bw = matvec_bandwidth()
    wbytes = weight_bytes_per_step(model)
    roofline = bw / wbytes
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cores, {platform.processor() or platform.machine()}")
    print(f"matrix-vector bandwidth: {bw / 1e9:.1f} GB/s; weights read per step: {wbytes / 1e6:.0f} MB; "
          f"batch-1 roofline {roofline:.1f} steps/s")
    rows = []
    for b in args.batches:
        batch_prompts = [prompts[i % len(prompts)] for i in range(b)]
        steps = time_decode_steps(gen, batch_prompts, args.new_tokens, args.repeats)
        step_s = statistics.median(steps)
        ours_tps = b / step_s
        sp = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
        gen.generate(batch_prompts, sp)  # warm
        e2e = []
        for _ in range(args.repeats):
            e2e.append(timed_generate(gen, batch_prompts, sp)[1])
        e2e_tps = statistics.median(e2e)
        hf_tps = None if args.no_transformers else hf_generate_tps(model_dir, batch_prompts, args.new_tokens, max(1, args.repeats // 2))
        row = {
            "batch": b,
            "decode_step_ms_median": step_s * 1e3,
            "decode_tokens_per_s": ours_tps,
            "generate_tokens_per_s": e2e_tps,
            "transformers_tokens_per_s": hf_tps,
            "speedup_vs_transformers": None if hf_tps is None else e2e_tps / hf_tps,
            "fraction_of_roofline": (1 / step_s) / roofline,
        }
        rows.append(row)
        print(
            f"batch {b}: step {step_s * 1e3:.2f} ms (median of {len(steps)}), decode {ours_tps:.1f} tok/s, "
            f"generate {e2e_tps:.1f} tok/s, "
            + (f"transformers {hf_tps:.1f} tok/s, ratio {e2e_tps / hf_tps:.2f}x, " if hf_tps else "")
            + f"steps/s at {100 * row['fraction_of_roofline']:.0f}% of roofline"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "python scripts/bench_decode.py " + " ".join(sys.argv[1:]), "environment": fingerprint("float32"),
        "matvec_GBps": bw / 1e9, "weight_MB_per_step": wbytes / 1e6, "roofline_steps_per_s": roofline,
        "new_tokens": args.new_tokens, "rows": rows,
    }, indent=2))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
