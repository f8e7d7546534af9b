#!/usr/bin/env python
"""Cost of a speculative step on SmolLM2 (float32), and the break-even accept length.

For batch 1 and 8, prints: the time of a plain decode step; the time of one
speculative step for chain and tree configs, split into draft / verify / accept+commit /
draft extend (each phase jitted alone on the same shapes); and their ratio, the
break-even accept length: the mean accept length a draft must reach for speculation to
pay. Then checks it against reality: with a random draft (accept length ~1) the
measured slowdown of speculative over plain generation should match the ratio.
Also times the body's weight matrix products alone (every layer's q/k/v/o and MLP
matrices, as one jitted graph) on 1 row and on 6 rows (chain S=5 verifies 6 tokens), to
show how much of the verify forward's cost over a plain step the M=6 products explain.
Saves the figures to results/bench_spec.json (--out overrides).

    python scripts/bench_spec.py [--model DIR] [--batches 1 8] [--configs 0 1 ...] [--draft-vocab 8192] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.kernels import cpu_matmul
from eagle_jax.checkpoint.draft_io import random_draft
from eagle_jax.checkpoint.hf import load_model
from eagle_jax.defaults import default_model_dir
from eagle_jax.environment import fingerprint
from eagle_jax.serving.generate import Buckets, Generator, SpeculativeGenerator
from eagle_jax.models.llama import BoundModules
from eagle_jax.runtime.step_table import StepTable
from eagle_jax.spec.sampling import SamplingArrays, SamplingParams
from eagle_jax.spec.config import SpeculativeConfig
from eagle_jax.spec.steps import (
    SpecState,
    _draft_extend,
    accept_tree,
    commit_accepted,
    draft_tree,
    verify_tree,
)
from eagle_jax.checkpoint.tokenizer import Tokenizer

CONFIGS = [
    SpeculativeConfig(num_steps=1),
    SpeculativeConfig(num_steps=3),
    SpeculativeConfig(num_steps=5),
    SpeculativeConfig(num_steps=3, topk=4, num_draft_tokens=8),
    SpeculativeConfig(num_steps=5, topk=4, num_draft_tokens=16),
    SpeculativeConfig(num_steps=6, topk=10, num_draft_tokens=60),
]
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
    "List three uses of Python.", "Why do cats purr?", "How does a bicycle stay upright?",
    "Give me a short recipe for pancakes.", "What is a prime number?",
]
PROMPT_LEN, CACHE_LEN = 64, 256
# Step tables here keep the caches at the sizes the pre-StepTable code used (no rounding
# up to the tree-attention kernel's 64-slot block, which a GPU engine applies), so the
# figures stay comparable with older runs. Off a GPU the verify forward of this float32
# benchmark attends through the target's prefix attention anyway (the GPU kernel wants
# bf16/f16), which does not depend on the cache's rounding.
CACHE_ALIGN = 1


def name(c: SpeculativeConfig) -> str:
    return f"chain S={c.num_steps}" if c.is_chain else f"tree S={c.num_steps} k={c.topk} T={c.num_draft_tokens}"


def median_ms(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` (which must block) in ms, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def plain_step_ms(target, b, prompts, repeats):
    """Median ms of the plain greedy decode step (target only, no draft) at batch ``b``.

    A plain-only step table (greedy graphs only, no prompt buckets: nothing is prefilled,
    as before). Its target cache holds ``CACHE_LEN + 2`` slots (``state_spec`` sizes it for
    one tree of the default 1-step shape, 2 tokens); the old ``PlainSteps`` cache was
    exactly ``CACHE_LEN``: a 2-slot difference, negligible. The state starts zeroed with
    the rows' lengths at the prompt lengths; each step advances them by one (the dense
    attention mask spans the whole cache, so the step costs the same at any length)."""
    t = StepTable(target, None, shapes=(), batch_buckets=(b,), prompt_buckets=(), max_seq_len=CACHE_LEN,
                  plain=True, sampled=False, cache_align=CACHE_ALIGN)
    t.build()
    samp = t.sampling([SamplingParams()] * b, b)
    seq = t.device_put_rows(np.asarray([len(p) for p in prompts], np.int32))
    holder = {"state": dataclasses.replace(t.zeros(b), seq_lens=seq)}

    def run():
        holder["state"], out, _, _ = t.step(holder["state"], samp, None, greedy=True)
        out.block_until_ready()

    return median_ms(run, repeats)


def spec_ms(target, draft, cfg, b, prompts, repeats):
    """(full step ms, {phase: ms}) on a state prefilled with real prompts.

    The full step is a step table's compiled speculative step (greedy, this shape only);
    its state is sized by ``state_spec`` for ``cfg`` as the old ``new_state`` was:
    target cache ``CACHE_LEN + T``, draft cache ``CACHE_LEN + max(T, S+1, scratch+1)``."""
    t = StepTable(target, draft, shapes=(cfg,), batch_buckets=(b,), prompt_buckets=(PROMPT_LEN,),
                  max_seq_len=CACHE_LEN, prefill_token_budget=b * PROMPT_LEN, plain=False, sampled=False,
                  cache_align=CACHE_ALIGN)
    t.build()
    pack = t.plan.matmul == "packed"
    bd, bt = BoundModules(draft, pack=pack), BoundModules(target, pack=pack)
    (dp,), (tp,) = bd.params, bt.params
    samp = SamplingArrays.build([SamplingParams()] * b, b)  # for the phases jitted below
    t_samp = t.sampling([SamplingParams()] * b, b)
    tokens = np.zeros((b, PROMPT_LEN), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    rows_state, _ = t.prefill(t.device_put_rows(tokens), t.device_put_rows(lengths), t_samp)
    state = t.insert(t.zeros(b), rows_state, t.device_put_rows(np.arange(b, dtype=np.int32)))
    seq0_np = np.asarray(state.seq_lens)
    holder = {"state": state}

    def full():
        # Reset the lengths each call so every timed step sees the same context.
        st = dataclasses.replace(holder["state"], seq_lens=t.device_put_rows(seq0_np.copy()))
        holder["state"], out, _, _ = t.step(st, t_samp, cfg, greedy=True)
        out.block_until_ready()

    step = median_ms(full, repeats)
    st = holder["state"]
    seq0 = jnp.asarray(seq0_np)
    # The drafting phase reads only the lengths, root and hidden; the caches travel apart.
    lite = SpecState(None, None, seq0, st.root, st.draft_hidden)

    # Each phase alone, jitted on the same shapes, its inputs produced by the earlier phase.
    def draft_of(dp):
        return bd.modules((dp,))[0]

    def target_of(tp):
        return bt.modules((tp,))[0]

    @functools.partial(jax.jit, donate_argnums=(1,))
    def j_draft(dp, dcache, st):
        return draft_tree(draft_of(dp), dcache, st, cfg, t.plan)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def j_verify(tp, tcache, seq, tree):
        return verify_tree(target_of(tp), tcache, seq, tree, plan=t.plan)

    @functools.partial(jax.jit, donate_argnums=(3,))
    def j_accept_commit(logits, tree, seq, tcache, feats):
        acc_index, acc_len, out = accept_tree(logits, tree, seq, samp, cfg, greedy_only=True, plan=t.plan)
        tcache, acc_feats = commit_accepted(tcache, feats, seq, acc_index, acc_len, cfg)
        return tcache, acc_feats, out, acc_len

    @functools.partial(jax.jit, donate_argnums=(1,))
    def j_extend(dp, dcache, out, acc_feats, seq, acc_len):
        return _draft_extend(draft_of(dp), dcache, out, acc_feats, seq, acc_len - 1, t.plan)

    h = {"d": st.draft_cache, "t": st.target_cache}
    tree, h["d"] = j_draft(dp, h["d"], lite)
    logits, feats, h["t"] = j_verify(tp, h["t"], seq0, tree)
    h["t"], acc_feats, out, acc_len = j_accept_commit(logits, tree, seq0, h["t"], feats)

    def p_draft():
        tr, h["d"] = j_draft(dp, h["d"], lite)
        tr.tokens.block_until_ready()

    def p_verify():
        lg, _, h["t"] = j_verify(tp, h["t"], seq0, tree)
        lg.block_until_ready()

    def p_accept():
        h["t"], _, o, _ = j_accept_commit(logits, tree, seq0, h["t"], feats)
        o.block_until_ready()

    def p_extend():
        g, h["d"] = j_extend(dp, h["d"], out, acc_feats, seq0, acc_len)
        g.block_until_ready()

    phases = {k: median_ms(f, repeats) for k, f in [("draft", p_draft), ("verify", p_verify), ("accept_commit", p_accept), ("draft_extend", p_extend)]}
    return step, phases


def body_matmul_ms(target, rows: int, repeats: int, packed: bool = False) -> float:
    """Median ms of the target body's weight matrix products alone on ``rows`` activation
    rows: every layer's ``[in, out]`` kernels (attention q/k/v/o, MLP gate/up/down) in one
    jitted graph, each applied to its own input, so nothing but the products is timed.
    ``packed``: through the packed-weight CPU kernel (``cpu_matmul``) instead of XLA's dot."""
    from flax import nnx

    kernels = [
        v[...] for path, v in nnx.to_flat_state(nnx.state(target, nnx.Param))
        if "layers" in path and path[-1] == "kernel" and v[...].ndim == 2
    ]
    rng = np.random.default_rng(0)
    xs = [jnp.asarray(rng.standard_normal((rows, w.shape[0]), dtype=np.float32)).astype(w.dtype) for w in kernels]
    if packed:
        kernels = [cpu_matmul.pack(w) for w in kernels]
    products = jax.jit(lambda xs, ws: [cpu_matmul.matmul(x, w) for x, w in zip(xs, ws)])

    def run():
        jax.block_until_ready(products(xs, kernels))

    return median_ms(run, repeats)


def random_draft_slowdown(target, draft, tok, cfg, prompts, new_tokens):
    """Measured plain/speculative generate throughput with a (useless) random draft."""
    buckets = Buckets(batch=(len(prompts),), prompt=(PROMPT_LEN,), cache=(CACHE_LEN,))
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    plain = Generator(target, tok, buckets=buckets)
    spec = SpeculativeGenerator(target, draft, cfg, tok, buckets=buckets)
    rates = {}
    for label, gen in (("plain", plain), ("spec", spec)):
        gen.generate(prompts, sp)  # compile + warm
        runs = []
        for _ in range(3):
            t = time.perf_counter()
            out = gen.generate(prompts, sp)
            runs.append(sum(len(c.token_ids) for c in out) / (time.perf_counter() - t))
        rates[label] = statistics.median(runs)
        if label == "spec":
            rates["mean_accept"] = float(np.mean([a for c in out for a in c.accept_lengths]))
    return rates


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary of the random draft")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--configs", type=int, nargs="+", default=list(range(len(CONFIGS))), help="indices into CONFIGS")
    ap.add_argument("--out", type=Path, default=Path("results/bench_spec.json"))
    args = ap.parse_args()
    model_dir = args.model or default_model_dir()
    tok = Tokenizer.from_dir(model_dir)
    target = load_model(model_dir, dtype="float32")
    draft = random_draft(target.config, seed=0, draft_vocab_size=args.draft_vocab)
    chat = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)) for q in QUESTIONS]
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cores; SmolLM2-135M float32; "
          f"random draft, draft vocab {args.draft_vocab}; context {CACHE_LEN}; medians of {args.repeats}")
    packed, path = cpu_matmul.status(jax.default_backend())
    print(f"matrix products in the steps: {path}")
    body_matmuls = {"path": path}
    for label, pk in (("xla", False), ("packed", True)) if packed else (("xla", False),):
        m1, m6 = body_matmul_ms(target, 1, args.repeats, pk), body_matmul_ms(target, 6, args.repeats, pk)
        body_matmuls[label] = {"rows_1_ms": m1, "rows_6_ms": m6, "ratio_6_vs_1": m6 / m1}
        print(f"body matrix products alone ({label}): {m1:.2f} ms on 1 row, {m6:.2f} ms on 6 rows ({m6 / m1:.2f}x)")
    results = []
    for b in args.batches:
        prompts = [chat[i % len(chat)] for i in range(b)]
        plain = plain_step_ms(target, b, prompts, args.repeats)
        print(f"\nbatch {b}: plain decode step {plain:.2f} ms")
        print(f"  {'config':<24}{'step ms':>9}{'draft':>8}{'verify':>8}{'acc+com':>8}{'extend':>8}{'break-even':>12}")
        for ci in args.configs:
            cfg = CONFIGS[ci]
            step, ph = spec_ms(target, draft, cfg, b, prompts, args.repeats)
            be = step / plain
            print(f"  {name(cfg):<24}{step:>9.2f}{ph['draft']:>8.2f}{ph['verify']:>8.2f}{ph['accept_commit']:>8.2f}{ph['draft_extend']:>8.2f}{be:>12.2f}")
            results.append({"batch": b, "config": name(cfg), "plain_step_ms": plain, "spec_step_ms": step, "phases_ms": ph, "break_even_accept_length": be})
        cfg = SpeculativeConfig(num_steps=5)
        r = random_draft_slowdown(target, draft, tok, cfg, prompts, args.new_tokens)
        slowdown = r["plain"] / r["spec"]
        be = next(x["break_even_accept_length"] for x in results if x["batch"] == b and x["config"] == name(cfg)) if any(
            x["batch"] == b and x["config"] == name(cfg) for x in results) else float("nan")
        predicted = (f"predicted {be / r['mean_accept']:.2f}x" if be == be
                     else f"no prediction ({name(cfg)} is not among --configs)")
        print(f"  random draft, {name(cfg)}: plain {r['plain']:.1f} tok/s, speculative {r['spec']:.1f} tok/s "
              f"(mean accept {r['mean_accept']:.3f}): slowdown {slowdown:.2f}x, {predicted}")
        results.append({"batch": b, "random_draft_check": name(cfg), **r, "slowdown": slowdown, "predicted": be / r["mean_accept"]})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": "python scripts/bench_spec.py " + " ".join(sys.argv[1:]),
                                    "environment": fingerprint("float32"), "draft_vocab": args.draft_vocab, "context": CACHE_LEN,
                                    "body_matmuls": body_matmuls, "results": results}, indent=2))
    print(f"\nsaved {args.out}")


if __name__ == "__main__":
    main()
