"""``eagle-jax bench``: on the same prompts, side by side in one run, transformers'
``generate`` (the peer a CPU user would otherwise pick), eagle-jax plain decoding and
eagle-jax speculative decoding (the chosen shapes and policies), at chosen batch sizes.

For every batch size, each system runs the whole prompt set once to warm up (compiles and
first allocations are not timed), then ``repeats`` timed passes, interleaved (system A,
B, C, A, B, C, ...) so a slow spell of the machine falls on all of them alike. Reported
per system: tokens/s as median with min and max; for speculation, mean accept length and
acceptance by depth (first pass), and the speedup over plain and over transformers
within the run. eagle-jax systems run with continuous batching (``max_batch`` = the batch
size); transformers runs the prompts in chunks of the batch size, left-padded, as its
``generate`` wants. Tokens are those generated up to and including the first EOS (each
system stops at EOS), so tokens/s counts what a user gets.

The bandwidth roofline: a plain decode step reads every weight once, so at batch b it
can deliver at most ``b * bandwidth / weight_bytes`` tokens/s, with the bandwidth of a
jitted matrix-vector product measured in the same run; a speculative step reads them
once per verify, so its ceiling is that times its mean accept length (the draft's own
reads left out). The fraction of the ceiling each system reaches is reported.

Greedy speculative output must equal plain decoding token for token (checked; a
mismatch fails the run). transformers' agreement with plain decoding is reported, not
enforced: batched, left-padded float32 on another library may differ in the last bits.

Output in ``--out`` (default ``results/bench``): ``bench.json`` (the command, an
environment fingerprint, every figure), ``bench.md`` (the table) and ``bench.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from eagle_jax.errors import ConfigError, EagleJaxError
from eagle_jax.experiments import harness
from eagle_jax.experiments.harness import POLICIES


# ----------------------------------------------------------------------------- roofline


def matvec_bandwidth(repeats: int = 20, n: int = 8192) -> float:
    """Bytes/s of float32 weights streamed by a jitted matrix-vector product (n x n)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    w = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), dtype=np.float32))
    x = jnp.ones((1, n), jnp.float32)
    f = jax.jit(lambda x, w: x @ w)
    f(x, w).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(x, w).block_until_ready()
        times.append(time.perf_counter() - t)
    return w.nbytes / statistics.median(times)


def weight_bytes_per_step(model) -> int:
    """Bytes of weights a decode step reads: every matrix and norm and the head, but only
    B rows of the embedding table (negligible, so the table is left out)."""
    from flax import nnx

    total = 0
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path == ("embed_tokens",):
            continue
        total += v[...].nbytes
    return total


# ----------------------------------------------------------------------------- systems


@dataclasses.dataclass(frozen=True)
class System:
    """One column of the comparison: ``kind`` is transformers, plain or speculative."""

    name: str
    kind: str
    point: Any = None  # a harness.Point for the eagle-jax systems


def systems_for(args: argparse.Namespace, batch_size: int, with_transformers: bool) -> list[System]:
    """The systems of one batch size, each resolved (and checked) as a run configuration
    (``harness.resolve``, as ablate's grid points are)."""
    base = dict(batch_size=batch_size, suite=args.suite, max_prompts=args.max_prompts,
                max_new_tokens=args.max_new_tokens, repeats=args.repeats, dtype=args.dtype, temperature=0.0)
    if args.model:
        base["model"] = args.model
    if args.draft:
        base["draft"] = args.draft
    out = [System("transformers", "transformers")] if with_transformers else []
    out.append(System("eagle-jax plain", "plain", harness.resolve(dict(base, shape="plain"))))
    if args.draft is None:
        return out
    for policy in args.policies:
        if policy == "auto":
            out.append(System("eagle-jax auto", "speculative", harness.resolve(dict(base, policy="auto"))))
            continue
        for shape in args.shapes:
            extra = dict(threshold=args.threshold) if policy == "threshold" else {}
            p = harness.resolve(dict(base, shape=shape, policy=policy, **extra))
            if p.speculative is None:
                raise ConfigError(f"--shapes {shape!r}: plain runs anyway; name draft shapes here")
            label = p.speculative.shape if policy == "fixed" else f"{policy} {p.speculative.shape}"
            out.append(System(f"eagle-jax {label}", "speculative", p))
    return out


class TransformersRunner:
    """transformers' greedy ``generate`` on the prompts in chunks of the batch size."""

    def __init__(self, model_dir: str, dtype: str):
        import torch
        import transformers

        torch.set_num_threads(os.cpu_count() or 1)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype)).eval()
        gc = self.model.generation_config
        eos = gc.eos_token_id if gc.eos_token_id is not None else self.model.config.eos_token_id
        self.eos = set([eos] if isinstance(eos, int) else (eos or []))
        self.pad = gc.pad_token_id if gc.pad_token_id is not None else (min(self.eos) if self.eos else 0)

    def generate(self, prompts: list[list[int]], batch_size: int, max_new_tokens: int) -> list[list[int]]:
        torch = self.torch
        outs = []
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i : i + batch_size]
            n = max(map(len, chunk))
            ids = torch.full((len(chunk), n), self.pad, dtype=torch.long)
            attn = torch.zeros_like(ids)
            for r, p in enumerate(chunk):  # left padding, as transformers wants for batched generate
                ids[r, n - len(p) :] = torch.tensor(p)
                attn[r, n - len(p) :] = 1
            with torch.no_grad():
                out = self.model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens,
                                          do_sample=False, pad_token_id=self.pad)
            for row in out[:, n:].tolist():
                cut = next((j + 1 for j, t in enumerate(row) if t in self.eos), len(row))
                outs.append(row[:cut])
        return outs


# ----------------------------------------------------------------------------- the run


def run_bench(args: argparse.Namespace, log=print) -> dict[str, Any]:
    """Every batch size's systems, interleaved; returns the report (also written to --out)."""
    from eagle_jax.defaults import default_model_dir
    from eagle_jax.environment import fingerprint
    from eagle_jax.serving.policy import policy_shapes
    from eagle_jax.spec.sampling import SamplingParams
    from eagle_jax.checkpoint.tokenizer import Tokenizer

    with_hf = _transformers_wanted(args.transformers)
    model_dir = args.model or str(default_model_dir())
    plans = {b: systems_for(args, b, with_hf) for b in args.batch_sizes}  # every point checked before any run
    runner = harness.Runner(log)
    target, draft = runner.models(model_dir, args.draft, args.dtype)
    tokenizer = Tokenizer.from_dir(model_dir)
    suite, prompts = runner.prompts(args.suite, args.max_prompts, tokenizer)
    max_seq_len, buckets = harness.context_sizes(max(map(len, prompts)), args.max_new_tokens,
                                         target.config.max_position_embeddings)
    params = [SamplingParams(max_new_tokens=args.max_new_tokens)] * len(prompts)
    hf = TransformersRunner(model_dir, args.dtype) if with_hf else None
    bandwidth = matvec_bandwidth()
    wbytes = weight_bytes_per_step(target)
    log(f"bench: {suite.name}, {len(prompts)} prompts x {args.max_new_tokens} new tokens, batch sizes "
        f"{', '.join(map(str, args.batch_sizes))}, {args.repeats} interleaved passes; matrix-vector bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s, {wbytes / 1e6:.0f} MB of weights per step")

    by_batch = []
    for b, systems in plans.items():
        engines = {}
        for s in systems:
            if s.kind != "transformers":
                engines[s.name] = runner.engine(target, draft, tokenizer, s.point, max_seq_len, buckets,
                                                speculative=s.kind == "speculative")

        def one_pass(s: System) -> tuple[float, list[list[int]], list[int]]:
            if s.kind == "transformers":
                t0 = time.perf_counter()
                outs = hf.generate(prompts, b, args.max_new_tokens)
                return sum(map(len, outs)) / (time.perf_counter() - t0), outs, []
            done, tps = harness.timed_generate(engines[s.name], prompts, params)
            return tps, [list(c.token_ids) for c in done], [a for c in done for a in c.accept_lengths]

        for s in systems:  # warm-up pass: compiles, first allocations, transformers' caches
            one_pass(s)
        rates: dict[str, list[float]] = {s.name: [] for s in systems}
        first: dict[str, tuple] = {}
        for rep in range(args.repeats):
            for s in systems:
                tps, outs, accepts = one_pass(s)
                rates[s.name].append(tps)
                if rep == 0:
                    first[s.name] = (outs, accepts)
        plain_name = "eagle-jax plain"
        plain_out = first[plain_name][0]
        roof = b * bandwidth / wbytes
        rows = []
        for s in systems:
            outs, accepts = first[s.name]
            row: dict[str, Any] = {"system": s.name, "kind": s.kind, "tokens_per_second": harness.spread(rates[s.name]),
                                   "generated_tokens": sum(map(len, outs))}
            if s.kind == "speculative":
                eng = engines[s.name]
                depth = max(x.num_steps for x in policy_shapes(eng.policy))
                row.update(harness.acceptance(accepts, depth))
                bad = [i for i, (p, q) in enumerate(zip(plain_out, outs)) if p != q]
                if bad:
                    raise RuntimeError(f"batch {b}, {s.name}: greedy speculative output differs from plain decoding "
                                       f"on prompt(s) {bad}")
                row["identical_to_plain"] = True
                row["policy"] = eng.policy.describe()
                row["steps_by_bucket"] = eng.metrics.summary()["steps_by_bucket"]
                # No speculative step at all (auto may run plain throughout): the plain ceiling.
                row["roofline_tokens_per_second"] = roof * (row["mean_accept_length"] or 1.0)
            else:
                row["roofline_tokens_per_second"] = roof
            if s.kind == "transformers":
                row["prompts_identical_to_plain"] = sum(p == q for p, q in zip(plain_out, outs))
            row["fraction_of_roofline"] = row["tokens_per_second"]["median"] / row["roofline_tokens_per_second"]
            rows.append(row)
        med = {r["system"]: r["tokens_per_second"]["median"] for r in rows}
        for r in rows:
            r["speedup_over_plain"] = med[r["system"]] / med[plain_name]
            if with_hf:
                r["speedup_over_transformers"] = med[r["system"]] / med["transformers"]
        by_batch.append({"batch_size": b, "rows": rows})
        log(summary_line(b, rows))
    return {
        "command": command_line(args),
        "suite": suite.name,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "matvec_GBps": bandwidth / 1e9,
        "weight_MB_per_step": wbytes / 1e6,
        "batches": by_batch,
        "fingerprint": fingerprint(args.dtype),
        "finished_at": harness.timestamp(),
    }


def _transformers_wanted(mode: str) -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        have = True
    except ImportError:
        have = False
    if mode == "on" and not have:
        raise ConfigError("--transformers on: transformers and torch are not installed (pip install transformers torch)")
    return have if mode == "auto" else mode == "on"


# ----------------------------------------------------------------------------- reports


def _accept(row: dict[str, Any]) -> str | None:
    """The row's mean accept length, formatted; None for transformers and plain, and for a
    policy that ran plain through the whole timed pass (no speculative step to average)."""
    acc = row.get("mean_accept_length")
    return None if acc is None else f"{acc:.2f}"


def summary_line(batch_size: int, rows: list[dict[str, Any]]) -> str:
    return f"batch {batch_size}: " + "; ".join(
        f"{r['system']} {r['tokens_per_second']['median']:.1f} tok/s" + (f" (accept {a})" if (a := _accept(r)) else "")
        for r in rows)


def markdown(report: dict[str, Any]) -> str:
    with_hf = any(r["kind"] == "transformers" for b in report["batches"] for r in b["rows"])
    head = "| batch | system | tok/s median [min, max] | accept length | speedup vs plain |"
    sep = "|---:|---|---:|---:|---:|"
    if with_hf:
        head += " vs transformers |"
        sep += "---:|"
    head += " % of roofline |"
    sep += "---:|"
    lines = [f"`{report['command']}`", "",
             f"{report['suite']}: {report['prompts']} prompts x {report['max_new_tokens']} new tokens, greedy, "
             f"{report['repeats']} interleaved passes after a warm-up; matrix-vector bandwidth "
             f"{report['matvec_GBps']:.1f} GB/s, {report['weight_MB_per_step']:.0f} MB of weights per step.", "",
             head, sep]
    for b in report["batches"]:
        for r in b["rows"]:
            t = r["tokens_per_second"]
            acc = _accept(r) or "-"
            line = (f"| {b['batch_size']} | {r['system']} | {t['median']:.1f} [{t['min']:.1f}, {t['max']:.1f}] | {acc} | "
                    f"{r['speedup_over_plain']:.2f}x |")
            if with_hf:
                line += f" {r['speedup_over_transformers']:.2f}x |"
            line += f" {100 * r['fraction_of_roofline']:.0f}% |"
            lines.append(line)
    return "\n".join(lines) + "\n"


def save_figure(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(dict.fromkeys(r["system"] for b in report["batches"] for r in b["rows"]))
    xs = [b["batch_size"] for b in report["batches"]]
    for name in names:
        pts = [(b["batch_size"], r) for b in report["batches"] for r in b["rows"] if r["system"] == name]
        x = [p[0] for p in pts]
        med = [p[1]["tokens_per_second"]["median"] for p in pts]
        lo = [m - p[1]["tokens_per_second"]["min"] for m, p in zip(med, pts)]
        hi = [p[1]["tokens_per_second"]["max"] - m for m, p in zip(med, pts)]
        ax.errorbar(x, med, yerr=[lo, hi], marker="o", capsize=3, label=name)
    roof = [next(r for r in b["rows"] if r["kind"] == "plain")["roofline_tokens_per_second"] for b in report["batches"]]
    ax.plot(xs, roof, "k--", lw=1, label="plain roofline (weights / bandwidth)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s (median, min-max bars)")
    ax.set_title(f"{Path(report['suite']).name}: tokens/s by system")
    ax.legend(fontsize=7)
    b0 = report["batches"][0]
    for r in b0["rows"]:
        if r.get("acceptance_rate_by_depth"):
            d = r["acceptance_rate_by_depth"]
            ax2.plot(range(1, len(d) + 1), d, marker="o", label=r["system"])
    ax2.xaxis.get_major_locator().set_params(integer=True)
    ax2.set_xlabel("draft depth d")
    ax2.set_ylabel("share of speculative steps accepting depth d")
    ax2.set_ylim(0, 1)
    ax2.set_title(f"acceptance by depth (batch {b0['batch_size']})")
    if ax2.lines:
        ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def command_line(args: argparse.Namespace) -> str:
    parts = ["eagle-jax", "bench", "--suite", args.suite]
    if args.model:
        parts += ["--model", args.model]
    if args.draft:
        parts += ["--draft", args.draft, "--shapes", *args.shapes, "--policies", *args.policies]
        if "threshold" in args.policies:
            parts += ["--threshold", str(args.threshold)]
    parts += ["--batch-sizes", *map(str, args.batch_sizes), "--max-prompts", str(args.max_prompts),
              "--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats),
              "--transformers", args.transformers, "--dtype", args.dtype, "--out", str(args.out)]
    return shlex.join(parts)


# ----------------------------------------------------------------------------- CLI


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench", help="transformers, eagle-jax plain and speculative side by side on the same prompts",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--model", help="target model directory (default: the default model)")
    p.add_argument("--draft", help="draft checkpoint directory (without one, only transformers and plain run)")
    p.add_argument("--suite", default="mt_bench",
                   help=f"built-in suite ({', '.join(harness.BUILTIN_SUITES)}) or a .jsonl file")
    p.add_argument("--shapes", nargs="+", default=["chain S=3", "tree S=3 k=4 T=8"],
                   help="draft shapes for the fixed and threshold policies")
    p.add_argument("--policies", nargs="+", default=["fixed"], choices=POLICIES,
                   help="fixed: one system per shape; threshold: the same, off above --threshold; auto: one system")
    p.add_argument("--threshold", type=int, default=1, help="the threshold policy's batch size cutoff")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1])
    p.add_argument("--max-prompts", type=int, default=8, help="prompts taken evenly from the suite (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed, interleaved passes after the warm-up")
    p.add_argument("--transformers", choices=("auto", "on", "off"), default="auto",
                   help="run transformers' generate too (auto: when installed)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--out", type=Path, default=Path("results") / "bench")
    p.set_defaults(func=cmd_bench)
    return p


def check_args(args: argparse.Namespace) -> None:
    for name in ("repeats", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.max_prompts < 0:
        raise ConfigError(f"--max-prompts {args.max_prompts}: must be >= 0 (0: all)")
    bad = [b for b in args.batch_sizes if b < 1]
    if bad:
        raise ConfigError(f"--batch-sizes {bad[0]}: batch sizes must be >= 1")
    if len(set(args.batch_sizes)) != len(args.batch_sizes):
        raise ConfigError("--batch-sizes repeats a value")
    if args.draft is None and set(args.policies) != {"fixed"}:
        raise ConfigError("--policies needs --draft (a draft checkpoint directory)")


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        check_args(args)
        report = run_bench(args, log=lambda m: print(m, file=sys.stderr, flush=True))
    except EagleJaxError as e:
        print(f"eagle-jax bench: error: {e}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "bench.md").write_text(markdown(report))
    save_figure(report, args.out / "bench.png")
    print(markdown(report))
    print(f"wrote {args.out / 'bench.json'}, bench.md and bench.png", file=sys.stderr)
    return 0
