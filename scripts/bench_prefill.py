"""What a prompt costs to prefill, by the largest chunk compiled, against transformers'
forward over the same prompt, and the machine's GEMM rate in the same run.

    python scripts/bench_prefill.py [--model DIR] [--lengths 128 512 1024 1800]
                                    [--max-chunks 128 256 512 1024] [--repeats 3]

For each prompt length and each largest chunk, the engine's path: the prompt split by
``scheduler.chunk_plan`` over powers of two from 64 up to that chunk, each chunk a call
of the step table's compiled prefill graph (batch 1, float32, the plan the engine
resolves: the packed CPU kernels where they build), timed from the first call to the
first token on the host. Beside it, transformers' forward over the same prompt (float32,
``torch.set_num_threads`` = the cores, last-position logits) and the rate of the
target's body matrix products at M = the chunk length (XLA's dot and the packed kernel),
as GFLOP/s. Interleaved: every configuration once per round, ``--repeats`` rounds,
medians reported.

``--stall``: the engine as the CLI builds it (continuous batching, ``max_batch`` 8,
prompt chunks up to each largest chunk, ``prefill_token_budget`` = that chunk): four
requests decode, then a prompt of ``--stall-tokens`` arrives (twice: the first arrival
is the first call of the chunk graphs; the second is measured); reported per largest chunk:
the largest gap between two tokens of a running request while the long prompt is
prefilled, against the median gap before it arrived and against one chunk's prefill
time measured above (the issue's goal: at most 2x one chunk).

Saves ``results/prefill/bench_prefill.json`` (``--out``) with the command and an
environment fingerprint.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.checkpoint.hf import load_model
from eagle_jax.defaults import default_model_dir
from eagle_jax.environment import fingerprint
from eagle_jax.kernels import cpu_matmul
from eagle_jax.experiments.harness import prefill_ttft
from eagle_jax.runtime.step_table import StepTable
from eagle_jax.serving.scheduler import chunk_plan
from eagle_jax.spec.sampling import SamplingParams


def chunks_up_to(top: int) -> tuple[int, ...]:
    out, v = [], 64
    while v < top:
        out.append(v)
        v *= 2
    return tuple(out) + (top,)


def body_flops_per_token(cfg) -> int:
    """2 x the non-embedding weights one token multiplies (the attention's own products
    excluded)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size
    return 2 * per_layer * cfg.num_hidden_layers


class EnginePrefill:
    """One step table holding every chunk length up to the largest asked for."""

    def __init__(self, target, max_chunk: int, max_seq_len: int):
        self.chunks = chunks_up_to(max_chunk)
        self.table = StepTable(target, None, shapes=(), batch_buckets=(1,), prompt_buckets=self.chunks,
                               max_seq_len=max_seq_len, prefill_token_budget=max_chunk, plain=True, sampled=False)
        self.table.build()
        self.samp = self.table.sampling([SamplingParams()], 1)

    def ttft(self, prompt: list[int], max_chunk: int) -> float:
        return prefill_ttft(self.table, self.samp, prompt, tuple(c for c in self.chunks if c <= max_chunk))


def gemm_rates(target, m: int, repeats: int) -> dict[str, float]:
    """GFLOP/s of one layer's body products at M = m rows, XLA's dot and the packed kernel."""
    cfg = target.config
    h, hd = cfg.hidden_size, cfg.head_dim
    shapes = [(h, cfg.num_attention_heads * hd), (h, cfg.num_key_value_heads * hd), (h, cfg.num_key_value_heads * hd),
              (cfg.num_attention_heads * hd, h), (h, cfg.intermediate_size), (h, cfg.intermediate_size),
              (cfg.intermediate_size, h)]
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal(s, dtype=np.float32)) for s in shapes]
    x = jnp.asarray(rng.standard_normal((m, max(h, cfg.intermediate_size)), dtype=np.float32))
    flops = 2 * m * sum(a * b for a, b in shapes)
    out = {}
    fns = {"xla": (jax.jit(lambda x, *w: [x[:, : v.shape[0]] @ v for v in w]), ws)}
    if cpu_matmul.status(jax.default_backend())[0]:
        wp = [cpu_matmul.pack(w) for w in ws]
        fns["packed"] = (jax.jit(lambda x, *w: [cpu_matmul.packed_matmul(x[:, : v.shape[1]], v) for v in w]), wp)
    for name, (f, w) in fns.items():
        jax.block_until_ready(f(x, *w))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x, *w))
            times.append(time.perf_counter() - t0)
        out[name] = flops / statistics.median(times) / 1e9
    return out


def stall(target, max_chunk: int, stall_tokens: int, rng) -> dict:
    """Gaps between tokens of 4 decoding requests while a long prompt arrives, twice on
    one engine: the first arrival is the first call of the large chunk graphs (XLA's
    first run of an executable costs 0.1-0.3 s more here), the second is the engine in
    service. Both are reported; the second is the figure."""
    from eagle_jax.serving.engine import Engine, EngineConfig

    max_seq_len = 1 << (stall_tokens + 64).bit_length()
    cfg = EngineConfig(max_batch=8, max_seq_len=max_seq_len, prompt_buckets=chunks_up_to(max_chunk),
                       prefill_token_budget=max_chunk, spec_policy="plain", sampled_steps=False)
    eng = Engine(target, None, cfg, progress=False)
    vocab = target.config.vocab_size

    def arrival() -> dict:
        running = [eng.scheduler.get(eng.add_request(rng.integers(10, vocab, 40).tolist(),
                                                     SamplingParams(max_new_tokens=400, ignore_eos=True)))
                   for _ in range(4)]
        seen = [0] * 4
        times: list[list[float]] = [[] for _ in range(4)]

        def step():
            eng.step()
            now = time.perf_counter()
            for i, r in enumerate(running):
                if len(r.progress.tokens) > seen[i]:
                    seen[i] = len(r.progress.tokens)
                    times[i].append(now)

        while min(seen) < 30:
            step()
        chunks0 = eng.metrics.prefill_chunks
        arrive = time.perf_counter()
        long_req = eng.scheduler.get(eng.add_request(rng.integers(10, vocab, stall_tokens).tolist(),
                                                     SamplingParams(max_new_tokens=4)))
        while not long_req.progress.tokens:
            step()
        first = time.perf_counter()
        for _ in range(5):
            step()
        for r in running:
            eng.cancel(r.id)
        eng.run_until_done()
        before = [b - a for ts in times for a, b in zip(ts, ts[1:]) if b <= arrive]
        during = [b - a for ts in times for a, b in zip(ts, ts[1:]) if b > arrive and a < first]
        return {"median_gap_before_s": statistics.median(before), "max_gap_during_s": max(during),
                "long_prompt_ttft_s": first - arrive, "prefill_chunks": eng.metrics.prefill_chunks - chunks0}

    first_pass = arrival()
    return {"max_chunk": max_chunk, "stall_tokens": stall_tokens, **arrival(), "first_arrival": first_pass}


def transformers_forward(model_dir: Path):
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(prompt: list[int]) -> float:
        with torch.no_grad():
            t0 = time.perf_counter()
            out = hf(torch.tensor([prompt]), logits_to_keep=1)
            int(out.logits[0, -1].argmax())
            return time.perf_counter() - t0

    return run


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 1800])
    p.add_argument("--max-chunks", type=int, nargs="+", default=[128, 256, 512, 1024])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--transformers", choices=("on", "off"), default="on")
    p.add_argument("--stall", action="store_true", help="also measure running requests' token gaps while a long prompt arrives")
    p.add_argument("--stall-tokens", type=int, default=1800)
    p.add_argument("--out", type=Path, default=Path("results") / "prefill" / "bench_prefill.json")
    args = p.parse_args(argv)
    model_dir = args.model or default_model_dir()
    target = load_model(model_dir)
    max_seq_len = 1 << (max(args.lengths) + 1).bit_length()
    eng = EnginePrefill(target, max(args.max_chunks), max_seq_len)
    hf = transformers_forward(model_dir) if args.transformers == "on" else None
    vocab = target.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(10, vocab, n).tolist() for n in args.lengths}
    times: dict[str, list[float]] = {}
    for name, fn in [(f"chunk {c}", lambda pr, c=c: eng.ttft(pr, c)) for c in args.max_chunks] + (
        [("transformers", hf)] if hf else []
    ):
        for pr in prompts.values():
            fn(pr)  # warm-up: first calls allocate
    for r in range(args.repeats):
        for n, pr in prompts.items():
            for c in args.max_chunks:
                times.setdefault(f"{n} chunk {c}", []).append(eng.ttft(pr, c))
            if hf:
                times.setdefault(f"{n} transformers", []).append(hf(pr))
        print(f"round {r + 1}/{args.repeats} done", file=sys.stderr)
    fpt = body_flops_per_token(target.config)
    rows = []
    for n in args.lengths:
        ref = statistics.median(times[f"{n} transformers"]) if hf else None
        for c in args.max_chunks:
            s = statistics.median(times[f"{n} chunk {c}"])
            rows.append({"prompt_tokens": n, "max_chunk": c, "plan": list(chunk_plan(n, chunks_up_to(c))),
                         "ttft_s": s, "body_gflops": fpt * n / s / 1e9,
                         "vs_transformers": s / ref if ref else None})
        if hf:
            rows.append({"prompt_tokens": n, "max_chunk": None, "system": "transformers forward", "ttft_s": ref,
                         "body_gflops": fpt * n / ref / 1e9})
    gemm = {m: gemm_rates(target, m, 5) for m in sorted({64, 128, 256, 512, 1024} | set(args.max_chunks))}
    print(f"{'tokens':>6} {'max chunk':>9} {'plan':<22} {'TTFT s':>8} {'GFLOP/s':>8} {'/ transformers':>14}")
    for row in rows:
        plan = "transformers forward" if row["max_chunk"] is None else "+".join(map(str, row["plan"]))
        vs = f"{row['vs_transformers']:.2f}x" if row.get("vs_transformers") else ""
        print(f"{row['prompt_tokens']:>6} {row['max_chunk'] or '':>9} {plan:<22} {row['ttft_s']:>8.3f} "
              f"{row['body_gflops']:>8.1f} {vs:>14}")
    print("body products alone, GFLOP/s by M: " + "; ".join(
        f"M={m}: " + ", ".join(f"{k} {v:.0f}" for k, v in r.items()) for m, r in gemm.items()))
    stalls = []
    if args.stall:
        for c in args.max_chunks:
            st = stall(target, c, args.stall_tokens, rng)
            # One chunk's prefill time: the chunk-c prefill of a c-token prompt above, if measured.
            one = statistics.median(times[f"{c} chunk {c}"]) if f"{c} chunk {c}" in times else None
            st["one_chunk_s"] = one
            st["max_gap_over_one_chunk"] = st["max_gap_during_s"] / one if one else None
            stalls.append(st)
            print(f"stall, largest chunk {c}: max gap {st['max_gap_during_s']:.3f} s while {args.stall_tokens} tokens "
                  f"prefill (median gap before {st['median_gap_before_s']:.3f} s; one chunk "
                  f"{'%.3f s' % one if one else 'not measured (add its length to --lengths)'}; "
                  f"long prompt's TTFT {st['long_prompt_ttft_s']:.2f} s; first arrival on the new engine: "
                  f"max gap {st['first_arrival']['max_gap_during_s']:.3f} s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "python scripts/bench_prefill.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "fingerprint": fingerprint("float32"), "repeats": args.repeats, "body_flops_per_token": fpt,
        "rows": rows, "stall": stalls, "gemm_gflops": {str(m): r for m, r in gemm.items()}, "raw_s": times,
    }, indent=1))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
