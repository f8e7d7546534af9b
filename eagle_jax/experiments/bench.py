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

Per request, each eagle-jax system's first timed pass records the time to first token
as the engine's completions carry it (``ttft_s``, from arrival, so at a small batch it
includes the wait behind earlier prompts; ``ttft_after_admission_s``, from the request's
admission, the figure a one-at-a-time peer is compared with) and its decode tokens/s.

A peer side by side (``--export-prompts FILE``, then ``scripts/peers/vllm_cpu.sh``, then
``--peer RESULT.json``): bench writes the exact prompt token ids it runs, a peer runs
them elsewhere, and bench reads the peer's figures back (refusing a file run on other
prompt ids) and sets them beside eagle-jax plain's: time to first token, decode tokens/s,
end-to-end tokens/s one request at a time and all at once, and how many greedy outputs
equal plain decoding's.

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

from eagle_jax.errors import ConfigError, EagleJaxError, InputError
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
    tokenizer = Tokenizer.from_dir(model_dir)
    suite, prompts = runner.prompts(args.suite, args.max_prompts, tokenizer)
    ids = [r.id for r in suite.records]
    peers = [(path, load_peer(path, ids, prompts, args.max_new_tokens)) for path in (args.peer or [])]
    target, draft = runner.models(model_dir, args.draft, args.dtype)
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
    plain_outputs = None
    for b, systems in plans.items():
        engines = {}
        for s in systems:
            if s.kind != "transformers":
                engines[s.name] = runner.engine(target, draft, tokenizer, s.point, max_seq_len, buckets,
                                                speculative=s.kind == "speculative")

        def one_pass(s: System) -> tuple[float, list[list[int]], list[int], list[dict[str, Any]]]:
            if s.kind == "transformers":
                t0 = time.perf_counter()
                outs = hf.generate(prompts, b, args.max_new_tokens)
                return sum(map(len, outs)) / (time.perf_counter() - t0), outs, [], []
            done, tps = harness.timed_generate(engines[s.name], prompts, params)
            return (tps, [list(c.token_ids) for c in done], [a for c in done for a in c.accept_lengths],
                    request_rows(ids, prompts, done))

        for s in systems:  # warm-up pass: compiles, first allocations, transformers' caches
            one_pass(s)
        rates: dict[str, list[float]] = {s.name: [] for s in systems}
        first: dict[str, tuple] = {}
        for rep in range(args.repeats):
            for s in systems:
                tps, outs, accepts, requests = one_pass(s)
                rates[s.name].append(tps)
                if rep == 0:
                    first[s.name] = (outs, accepts, requests)
        plain_name = "eagle-jax plain"
        plain_out = first[plain_name][0]
        roof = b * bandwidth / wbytes
        rows = []
        for s in systems:
            outs, accepts, requests = first[s.name]
            row: dict[str, Any] = {"system": s.name, "kind": s.kind, "tokens_per_second": harness.spread(rates[s.name]),
                                   "generated_tokens": sum(map(len, outs))}
            if requests:
                row.update(request_medians(requests))
                row["requests"] = requests
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
        if plain_outputs is None:  # greedy plain output, the first batch size's: what peers are checked against
            plain_outputs = plain_out
    report = {
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
    if peers:
        eos = set(tokenizer.eos_token_ids)
        report["side_by_side"] = [plain_side_by_side(by_batch, len(prompts))] + [
            peer_row(path, data, plain_outputs, eos) for path, data in peers]
        for r in report["side_by_side"][1:]:
            log(f"peer {r['system']}: TTFT median {r['ttft_median_s'] * 1e3:.1f} ms, greedy outputs identical to "
                f"eagle-jax plain on {r['prompts_identical_to_plain']}/{r['prompts']} prompts")
    return report


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


# ----------------------------------------------------------------------------- per request


def request_rows(ids: list, prompts: list[list[int]], done) -> list[dict[str, Any]]:
    """Each completion's time to first token, as the engine recorded it: ``ttft_s`` from
    arrival (every prompt arrives at the pass's start, so it includes the wait for a
    seat), ``queue_s`` arrival to admission, ``ttft_after_admission_s`` the difference."""
    rows = []
    for rid, p, c in zip(ids, prompts, done):
        ttft, queue = c.ttft_s, c.queue_s
        rows.append({"id": rid, "prompt_tokens": len(p), "output_tokens": len(c.token_ids), "ttft_s": ttft,
                     "queue_s": queue, "ttft_after_admission_s": None if ttft is None or queue is None else ttft - queue,
                     "decode_tokens_per_second": c.decode_tokens_per_second})
    return rows


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def request_medians(requests: list[dict[str, Any]]) -> dict[str, float | None]:
    return {"ttft_median_s": _median([r["ttft_s"] for r in requests]),
            "ttft_after_admission_median_s": _median([r["ttft_after_admission_s"] for r in requests]),
            "decode_tokens_per_second_median": _median([r["decode_tokens_per_second"] for r in requests])}


# ----------------------------------------------------------------------------- peers

PEER_PROMPTS_FORMAT = "eagle-jax-peer-prompts"  # what --export-prompts writes (scripts/peers/vllm_driver.py reads it)
PEER_RESULT_FORMAT = "eagle-jax-peer-result"  # what the driver writes and --peer reads
PEER_FORMAT_VERSION = 1


def export_prompts(args: argparse.Namespace, log=print) -> Path:
    """Write the prompt token ids this bench run would use (its suite and --max-prompts
    selection, tokenized as the run tokenizes them) in the peer driver's input format:
    a header line, then one ``{"id", "prompt_token_ids"}`` per prompt."""
    from eagle_jax.checkpoint.tokenizer import Tokenizer
    from eagle_jax.defaults import default_model_dir

    model_dir = Path(args.model or default_model_dir())
    tokenizer = Tokenizer.from_dir(model_dir)
    suite, prompts = harness.Runner(log).prompts(args.suite, args.max_prompts, tokenizer)
    path = Path(args.export_prompts)
    # Relative to the prompt file (the driver resolves it there): no machine's path in a
    # file that results/ keeps, and it still names the model wherever the checkout is.
    model_ref = os.path.relpath(model_dir.resolve(), path.parent.resolve())
    header = {"format": PEER_PROMPTS_FORMAT, "version": PEER_FORMAT_VERSION, "model": model_ref,
              "max_new_tokens": args.max_new_tokens, "prompts": len(prompts),
              "bench": {"suite": suite.name, "max_prompts": args.max_prompts, "max_new_tokens": args.max_new_tokens,
                        "dtype": args.dtype, "command": command_line(args)},
              "written_at": harness.timestamp()}
    lines = [json.dumps(header)] + [json.dumps({"id": r.id, "prompt_token_ids": p}) for r, p in zip(suite.records, prompts)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def load_peer(path: Path, ids: list, prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    """A peer's result file, checked against this run: the same prompts (ids and token ids,
    in order) and the same number of new tokens; an InputError names the first prompt
    that differs."""
    where = f"--peer {path}"
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise InputError(f"{where}: no such file (scripts/peers/vllm_cpu.sh writes it)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"{where}: cannot read it as JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != PEER_RESULT_FORMAT:
        raise InputError(f"{where}: not a peer result file (format {PEER_RESULT_FORMAT!r}, as scripts/peers/vllm_driver.py "
                         "writes)")
    if data.get("version") != PEER_FORMAT_VERSION:
        raise InputError(f"{where}: version {data.get('version')!r}, this bench reads version {PEER_FORMAT_VERSION}")
    reqs = data.get("requests")
    keys = ("id", "prompt_token_ids", "output_token_ids", "ttft_s", "total_s")
    if not isinstance(reqs, list) or not all(isinstance(r, dict) and all(k in r for k in keys) for r in reqs):
        raise InputError(f"{where}: 'requests' must be a list of objects with {', '.join(keys)}")
    again = "run the peer on this run's prompts: eagle-jax bench --export-prompts FILE with the same --suite, --model and --max-prompts"
    for i, rid in enumerate(ids):
        if i >= len(reqs):
            raise InputError(f"{where}: prompt {rid!r} is missing (the peer ran {len(reqs)} prompts, this run has "
                             f"{len(ids)}); {again}")
        r = reqs[i]
        if r["id"] != rid:
            raise InputError(f"{where}: prompt {rid!r} differs: the peer's prompt {i + 1} is {r['id']!r}; {again}")
        if r["prompt_token_ids"] != prompts[i]:
            n = harness.first_difference(r["prompt_token_ids"], prompts[i])
            raise InputError(f"{where}: prompt {rid!r} differs: the peer ran other prompt token ids (from token {n}); "
                             f"{again}")
    if len(reqs) > len(ids):
        raise InputError(f"{where}: prompt {reqs[len(ids)]['id']!r} differs: this run has no such prompt (the peer ran "
                         f"{len(reqs)} prompts, this run {len(ids)}); {again}")
    if data.get("max_new_tokens") != max_new_tokens:
        raise InputError(f"{where}: the peer generated up to {data.get('max_new_tokens')!r} new tokens, this run "
                         f"--max-new-tokens {max_new_tokens}")
    return data


def same_greedy_output(plain: list[int], peer: list[int], eos: set[int]) -> bool:
    """The peer's output, cut after its first EOS token (a peer run with ignore_eos goes
    on past it), against plain decoding's (which stops there, EOS included); a peer that
    leaves the EOS token out of its output still matches."""
    cut = next((j + 1 for j, t in enumerate(peer) if t in eos), len(peer))
    peer = list(peer[:cut])
    return peer == plain or (bool(plain) and plain[-1] in eos and peer == plain[:-1])


def peer_row(path: Path, data: dict[str, Any], plain_outputs: list[list[int]], eos: set[int]) -> dict[str, Any]:
    """A peer's row of the side-by-side table: its medians, and how many of its greedy
    outputs equal eagle-jax plain decoding's."""
    m = data.get("medians") or {}
    same = [same_greedy_output(p, r["output_token_ids"], eos) for p, r in zip(plain_outputs, data["requests"])]
    name = f"{data.get('peer', 'peer')} {data.get('dtype', '')}".strip()
    return {
        "system": name, "kind": "peer", "file": str(path), "dtype": data.get("dtype"),
        "self_check": bool(data.get("self_check")), "ignore_eos": bool(data.get("ignore_eos")),
        "command": data.get("command"), "versions": (data.get("fingerprint") or {}).get("versions"),
        "ttft_median_s": m.get("ttft_s"),
        "decode_tokens_per_second_median": m.get("decode_tokens_per_second"),
        "end_to_end_tokens_per_second": m.get("end_to_end_tokens_per_second"),
        "concurrent_tokens_per_second": m.get("concurrent_tokens_per_second"),
        "prompts": len(same), "prompts_identical_to_plain": sum(same),
        "requests": [{"id": r["id"], "prompt_tokens": len(r["prompt_token_ids"]), "ttft_s": r["ttft_s"],
                      "total_s": r["total_s"], "decode_tokens_per_second": r.get("decode_tokens_per_second"),
                      "output_tokens": len(r["output_token_ids"]), "identical_to_plain": s}
                     for r, s in zip(data["requests"], same)],
    }


def plain_side_by_side(by_batch: list[dict[str, Any]], n_prompts: int) -> dict[str, Any]:
    """eagle-jax plain's figures in the peers' terms: TTFT (from admission) and decode
    tokens/s medians at the smallest batch size run, end-to-end tokens/s at batch 1
    (one request at a time) and at the smallest batch that seats every prompt (all at
    once); None where that batch size was not run."""
    def plain(b):
        return next(r for r in b["rows"] if r["kind"] == "plain")

    first = plain(by_batch[0])
    one = next((plain(b) for b in by_batch if b["batch_size"] == 1), None)
    seats = sorted((b for b in by_batch if b["batch_size"] >= n_prompts), key=lambda b: b["batch_size"])
    return {
        "system": first["system"], "kind": "plain", "batch_size": by_batch[0]["batch_size"],
        "ttft_median_s": first.get("ttft_after_admission_median_s"),
        "decode_tokens_per_second_median": first.get("decode_tokens_per_second_median"),
        "end_to_end_tokens_per_second": one["tokens_per_second"]["median"] if one else None,
        "concurrent_tokens_per_second": plain(seats[0])["tokens_per_second"]["median"] if seats else None,
        "concurrent_batch_size": seats[0]["batch_size"] if seats else None,
        "prompts": n_prompts,
        "requests": [{"id": r["id"], "prompt_tokens": r["prompt_tokens"], "ttft_s": r["ttft_after_admission_s"]}
                     for r in first.get("requests", [])],
    }


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
    if report.get("side_by_side"):
        lines += ["", *side_by_side_markdown(report["side_by_side"])]
    return "\n".join(lines) + "\n"


def side_by_side_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The peers beside eagle-jax plain, on the same prompt token ids."""
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    plain = rows[0]
    lines = ["Side by side on the same prompt token ids (greedy). TTFT: eagle-jax plain's from admission at batch "
             f"{plain['batch_size']}, as its completions record it; a peer's from a max_tokens=1 request run alone. "
             "One at a time: batch 1; all at once: every prompt in one batch"
             + (f" (eagle-jax: batch {plain['concurrent_batch_size']})." if plain.get("concurrent_batch_size") else "."),
             "",
             "| system | TTFT median (ms) | decode tok/s median | tok/s one at a time | tok/s all at once | "
             "outputs identical to plain |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        ttft = None if r["ttft_median_s"] is None else 1e3 * r["ttft_median_s"]
        same = "-" if r["kind"] == "plain" else f"{r['prompts_identical_to_plain']}/{r['prompts']}"
        name = r["system"] + (" (ignore_eos)" if r.get("ignore_eos") else "")
        lines.append(f"| {name} | {num(ttft, '.1f')} | {num(r['decode_tokens_per_second_median'], '.1f')} | "
                     f"{num(r['end_to_end_tokens_per_second'], '.1f')} | {num(r['concurrent_tokens_per_second'], '.1f')} | "
                     f"{same} |")
    return lines


def save_figure(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2, ax3) = plt.subplots(1, 3, figsize=(18, 4.5))
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
    # Time to first token against prompt length: eagle-jax plain (from admission, first
    # batch size) and the peers (a max_tokens=1 request alone).
    plain = next(r for r in b0["rows"] if r["kind"] == "plain")
    series = [(f"{plain['system']} (batch {b0['batch_size']})",
               [(q["prompt_tokens"], q["ttft_after_admission_s"]) for q in plain.get("requests", [])])]
    series += [(r["system"], [(q["prompt_tokens"], q["ttft_s"]) for q in r["requests"]])
               for r in report.get("side_by_side", [])[1:]]
    for name, pts in series:
        pts = sorted((x, 1e3 * y) for x, y in pts if y is not None)
        if pts:
            ax3.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name)
    ax3.set_xlabel("prompt tokens")
    ax3.set_ylabel("time to first token (ms)")
    ax3.set_title("time to first token by prompt length")
    if ax3.lines:
        ax3.legend(fontsize=7)
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
    for path in getattr(args, "peer", None) or []:
        parts += ["--peer", str(path)]
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
    p.add_argument("--export-prompts", type=Path, metavar="FILE",
                   help="write the prompt token ids this run would use (for scripts/peers/vllm_cpu.sh) and exit")
    p.add_argument("--peer", type=Path, action="append", default=[], metavar="RESULT.json",
                   help="a peer's results on the same prompt token ids (scripts/peers/vllm_cpu.sh), set beside "
                        "eagle-jax plain; repeatable")
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
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        check_args(args)
        if args.export_prompts is not None:
            if args.peer:
                raise ConfigError("--export-prompts writes the prompts and exits: --peer goes with a bench run")
            path = export_prompts(args, log)
            print(f"wrote the prompt token ids to {path}; next: scripts/peers/vllm_cpu.sh --prompts {path}",
                  file=sys.stderr)
            return 0
        report = run_bench(args, log=log)
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
