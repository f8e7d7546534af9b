#!/usr/bin/env python
"""The device check: everything the project needs from a lent GPU, in one call.

    OUT=/some/dir scripts/device/check.sh            # on the GPU machine (about 8 minutes)
    OUT=/tmp/dry scripts/device/check.sh --dry-run   # tiny shapes on the CPU (the slow suite runs it)

Sections run in this order, each in its own process under its own time limit, so a
section that fails, hangs or runs out of memory records why and the next one still runs
(and a cut-off call still returns what came first):

1. ``env``: versions, device, memory, CUDA; the device's measured copy bandwidth and
   bf16 matrix rate (the ceilings the step costs are compared against); the execution
   plan of every graph (attention path per shape, MoE formulation per token count).
2. ``kernels``: ``pytest tests/kernels`` natively (no interpreter), then every kernel
   against its jnp reference at the shapes the engine runs (Llama-3.1-8B heads, cache
   2k, chain and tree, batch 1-64), timed against the reference.
3. ``lossless``: an engine on a SmolLM2-shaped target (random weights: the real one is
   too large to carry in one call) with the released draft, the oracle proposer fixing
   partial acceptance; plain against auto, chain S=3 and the tree, greedy and seeded
   sampling, 16 prompts at batch 1 and 8, bf16 (the Pallas paths) and fp32; plus which
   kernels the compiled verify step calls.
4. ``llama8b``: step costs of a Llama-3.1-8B-shaped target with its EAGLE-3 draft shape,
   random bf16 weights, context 2k, batch 1/8/32/64: plain, chain S=1/3/5, tree 3/4/8 and
   6/10/60; ms per step, HBM bandwidth against the measured ceiling, the break-even
   accept length, and what ``AutoPolicy`` would choose at accept lengths 2, 3 and 4.
5. ``deepseek``: a Kimi-K2-shaped slice (one dense and two MoE layers at the real widths,
   INT4 experts, random weights, MLA draft), batch 1/8/64, plain and chain S=3, with the
   MoE formulation auto picks and each other one.

Each section writes ``OUT/<section>.json`` after every measurement; ``OUT/summary.md``
is rewritten after every section and ``OUT/check.log`` holds every section's output.
docs/measuring.md documents the sections, their limits and their outputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# (name, seconds on the GPU). The whole run stays under 8 minutes with the start-ups.
SECTIONS = (("env", 25), ("kernels", 95), ("lossless", 100), ("llama8b", 170), ("deepseek", 80))
DRY_LIMIT_S = 240  # per section on the CPU dry run (tiny shapes; compiles dominate)
CONTEXT = 2048
SPEC_SHAPES = ("chain S=1", "chain S=3", "chain S=5", "tree 3/4/8", "tree 6/10/60")


# ----------------------------------------------------------------------------- records


class Record:
    """One section's results, saved to ``OUT/<name>.json`` after every change, with its
    own deadline. ``attempt`` runs one measurement: its error is recorded (and printed
    with its traceback) and the section goes on to the next one."""

    def __init__(self, out: Path, name: str, limit_s: float, dry: bool, cases: tuple[str, ...] = ()):
        self.path = out / f"{name}.json"
        self.cases = cases  # regular expressions: run only the items whose key matches one (none: all)
        self.opts: dict = {}
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + limit_s
        self.dry = dry
        self.data = {"section": name, "status": "running", "limit_s": round(limit_s, 1), "dry_run": dry,
                     "items": {}, "skipped": [], "errors": []}
        self.save()

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self.t0, 2)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        tmp.replace(self.path)

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.save()

    def selected(self, key: str) -> bool:
        import re

        return not self.cases or any(re.search(c, f"{self.data['section']}/{key}") for c in self.cases)

    def attempt(self, key: str, fn, need_s: float = 0.0):
        if not self.selected(key):
            return None
        if self.left() < need_s:
            self.data["skipped"].append(f"{key}: needs about {need_s:.0f} s, {self.left():.0f} s left")
            print(f"[skip] {key}: not enough time left", flush=True)
            self.save()
            return None
        t = time.perf_counter()
        try:
            value = fn()
        except Exception as e:  # recorded, printed, and the section goes on
            traceback.print_exc()
            msg = f"{type(e).__name__}: {e}"
            self.data["items"][key] = {"error": msg[:3000]}
            self.data["errors"].append(f"{key}: {msg.splitlines()[0][:300] if msg else type(e).__name__}")
            self.save()
            return None
        print(f"[done] {key} in {time.perf_counter() - t:.1f} s", flush=True)
        self.data["items"][key] = value
        self.save()
        return value


def sig3(x: float) -> float:
    """``x`` to 3 significant digits: a rate rounded to a fixed decimal read 0.0 where the
    machine is slow (a CPU dry run's bfloat16 matmul, 0.03 TFLOP/s on an AVX2 CPU)."""
    return float(f"{x:.3g}")


def median_ms(fn, reps: int, warm: int = 1) -> float:
    """Median wall time of ``fn()`` (which must block until its results are ready) in ms."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def spec_shapes():
    from eagle_jax.spec.config import SpeculativeConfig

    return {
        "chain S=1": SpeculativeConfig(num_steps=1),
        "chain S=3": SpeculativeConfig(num_steps=3),
        "chain S=5": SpeculativeConfig(num_steps=5),
        "tree 3/4/8": SpeculativeConfig(num_steps=3, topk=4, num_draft_tokens=8),
        "tree 6/10/60": SpeculativeConfig(num_steps=6, topk=10, num_draft_tokens=60),
    }


def read_section(out: Path, name: str) -> dict:
    p = out / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else {}


# ----------------------------------------------------------------------------- 1. env


def section_env(rec: Record, out: Path) -> None:
    import importlib.metadata as md

    import jax
    import jax.numpy as jnp

    def versions():
        v = {"python": sys.version.split()[0]}
        for pkg in ("jax", "jaxlib", "flax", "numpy", "optax", "jax-cuda13-plugin", "jax-cuda13-pjrt",
                    "jax-cuda12-plugin", "jax-cuda12-pjrt", "safetensors", "tokenizers"):
            try:
                v[pkg] = md.version(pkg)
            except md.PackageNotFoundError:
                pass
        return v

    rec.attempt("versions", versions)
    rec.attempt("date", lambda: time.strftime("%Y-%m-%d", time.gmtime()))

    def devices():
        d = jax.devices()[0]
        info = {"backend": jax.default_backend(), "count": jax.device_count(), "kind": d.device_kind,
                "platform": d.platform, "compute_capability": getattr(d, "compute_capability", None)}
        try:
            stats = d.memory_stats() or {}
            info["memory_limit_gib"] = round(stats.get("bytes_limit", 0) / 2**30, 1)
        except Exception as e:  # not every backend reports memory
            info["memory_stats"] = f"unavailable: {type(e).__name__}: {e}"
        return info

    rec.attempt("device", devices)
    rec.attempt("environment_info", lambda: jax.print_environment_info(return_string=True))

    def nvidia_smi():
        q = "name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu"
        r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv"], capture_output=True, text=True, timeout=20)
        return r.stdout.strip() or r.stderr.strip()

    if not rec.dry:
        rec.attempt("nvidia_smi", nvidia_smi)

    # The two ceilings (METHOD: measure them on the machine rather than trust a datasheet).
    def copy_bandwidth():
        n = (1 << 20) if rec.dry else (2 << 30)  # bf16 elements: 2 MiB / 4 GiB
        xs = [jax.random.normal(jax.random.key(i), (n,), jnp.bfloat16) for i in range(2)]
        f = jax.jit(lambda x: x * 1.0001)
        i = [0]

        def run():
            i[0] ^= 1
            f(xs[i[0]]).block_until_ready()

        ms = median_ms(run, 10 if not rec.dry else 3, warm=2)
        moved = 2 * n * 2  # read + write
        return {"bytes": moved, "ms": round(ms, 4), "gb_per_s": sig3(moved / ms / 1e6)}

    rec.attempt("copy_bandwidth", copy_bandwidth)

    def matmul_rate():
        n = 256 if rec.dry else 8192
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
        b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
        f = jax.jit(lambda a, b: a @ b)
        ms = median_ms(lambda: f(a, b).block_until_ready(), 10 if not rec.dry else 3, warm=2)
        return {"n": n, "ms": round(ms, 4), "tflop_per_s": sig3(2 * n**3 / ms / 1e9)}

    rec.attempt("bf16_matmul", matmul_rate)

    def plan():
        from eagle_jax.models.deepseek import moe_impl_for
        from pallas_kernels.tree_attention import select_tree_attention_path

        backend = jax.default_backend()
        cc = getattr(jax.devices()[0], "compute_capability", None)
        shapes = spec_shapes()
        attention = {}
        for b in (1, 8, 32, 64):
            for name, s in shapes.items():
                q = (b, s.num_draft_tokens, 32, 128)
                kv = (b, CONTEXT + 128, 8, 128)
                for dt in ("bfloat16", "float32"):
                    path, why = select_tree_attention_path("auto", backend, q, kv, jnp.dtype(dt), compute_capability=cc)
                    attention[f"b{b} {name} {dt}"] = f"{path}: {why}"
        moe = {f"{n} tokens": moe_impl_for(n, 8, 384, backend, int4=True) for n in (1, 4, 8, 32, 64, 256, 512)}
        return {"backend": backend, "verify_attention (Llama-8B heads, cache 2k+)": attention,
                "moe_formulation (384 experts, top-8, INT4)": moe,
                "verify_kernels": "Pallas (Mosaic GPU) on GPU, jnp reference elsewhere (kernel_impl='auto')"}

    rec.attempt("plan", plan)


# ----------------------------------------------------------------------------- 2. kernels


def _junit_counts(path: Path) -> dict:
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        for bad in list(case):
            if bad.tag in ("failure", "error"):
                failed.append(f"{case.get('classname')}::{case.get('name')}: {(bad.get('message') or '')[:300]}")
    total["failed"] = failed
    total["passed"] = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return total


def section_kernels(rec: Record, out: Path) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    def pytest_kernels():
        xml = Path("/tmp") / f"eagle_jax_kernels_{os.getpid()}.xml"
        text = Path("/tmp") / f"eagle_jax_kernels_{os.getpid()}.txt"
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", f"--junitxml={xml}", "tests/kernels"]
        if rec.dry:  # the plumbing only: one small interpreted test per kernel
            cmd += ["-k", "test_root_only_and_nothing_accepted or test_edge_cases or test_query_that_sees_nothing"]
        t0 = time.perf_counter()
        limit = max(10.0, rec.left() - 5)
        with text.open("w") as f:
            try:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=limit).returncode
            except subprocess.TimeoutExpired:
                rc = None
        lines = text.read_text().splitlines()
        print("\n".join(lines[-60:]), flush=True)
        if xml.exists() and rc is not None:
            res = _junit_counts(xml)
        else:  # cut off: count the verbose lines written so far
            res = {"cut_off_after_s": round(limit, 1), "passed": sum(" PASSED" in ln for ln in lines),
                   "failures": sum(" FAILED" in ln for ln in lines), "errors": sum(" ERROR" in ln for ln in lines),
                   "skipped": sum(" SKIPPED" in ln for ln in lines),
                   "failed": [ln[:300] for ln in lines if " FAILED" in ln or " ERROR" in ln]}
        res.update(exit_code=rc, seconds=round(time.perf_counter() - t0, 1), native=jax.default_backend() == "gpu")
        return res

    from pallas_kernels.testing import chain_parents, random_trees
    from pallas_kernels.tree import tree_ancestor_mask
    from pallas_kernels.tree_attention import tree_attention
    from pallas_kernels.verify_greedy import verify_greedy
    from pallas_kernels.verify_sampling import tree_speculative_sample

    kernel_impl = "kernel"  # natively on a GPU, interpreted on the dry run's CPU
    reps = 1 if rec.dry else 20  # the dry run's kernels are interpreted: 0.1 s a call

    def pipelined_ms(f, args, n):
        """Per-call ms of ``n`` calls launched back to back (device time once dispatch keeps up)."""
        jax.block_until_ready(f(*args))
        t0 = time.perf_counter()
        outs = [f(*args) for _ in range(n)]
        jax.block_until_ready(outs)
        return (time.perf_counter() - t0) / n * 1e3

    def trees_for(rng, b, s):
        if s.is_chain:
            p = np.tile(chain_parents(s.num_draft_tokens), (b, 1))
            return p, rng.integers(0, 50, p.shape).astype(np.int32)
        return random_trees(rng, b, s.num_draft_tokens, s.num_steps, 50, pad_prob=0.1)

    # Cases in order of interest (the budget may cut the tail): tree attention over the
    # engine's verify widths, then the walks, then the vocabulary-wide sampling path.
    if rec.dry:
        heads, s_len, vocab = (4, 2, 64), 128, 512
        att_cases = [(2, "tree 3/4/8")]
        walk_cases = [(2, "tree 3/4/8")]
        sample_cases = [(2, "tree 3/4/8", "bfloat16")]
    else:
        heads, s_len, vocab = (32, 8, 128), CONTEXT + 128, 128256
        att_cases = [(b, n) for b in (1, 8, 32, 64) for n in ("chain S=1", "chain S=3", "tree 3/4/8", "tree 6/10/60")]
        walk_cases = [(b, n) for b in (1, 64) for n in SPEC_SHAPES]
        sample_cases = ([(b, n, "float32") for b in (1, 64) for n in ("chain S=3", "tree 3/4/8", "tree 6/10/60")]
                        + [(64, "tree 3/4/8", "bfloat16")])
    shapes = spec_shapes()
    hq, hkv, d = heads

    def attention_case(b, name):
        s = shapes[name]
        t = s.num_draft_tokens
        rng = np.random.default_rng(b * 100 + t)
        parents, _ = trees_for(rng, b, s)
        mask = tree_ancestor_mask(jnp.asarray(parents))
        ks = jax.random.split(jax.random.key(b * 7 + t), 3)
        q = jax.random.normal(ks[0], (b, t, hq, d), jnp.bfloat16)
        k = jax.random.normal(ks[1], (b, s_len, hkv, d), jnp.bfloat16)
        v = jax.random.normal(ks[2], (b, s_len, hkv, d), jnp.bfloat16)
        lens = jnp.asarray(rng.integers(s_len // 2, s_len - t + 1, b), jnp.int32)
        fns = {impl: jax.jit(lambda q, k, v, l, m, impl=impl: tree_attention(q, k, v, l, m, scale=d ** -0.5, impl=impl))
               for impl in (kernel_impl, "reference")}
        got = np.asarray(fns[kernel_impl](q, k, v, lens, mask), np.float32)
        ref = np.asarray(fns["reference"](q, k, v, lens, mask), np.float32)
        err = float(np.abs(got - ref).max())
        res = {"max_abs_err": round(err, 5), "ok": bool(np.isfinite(got).all() and err < 2e-2)}
        for impl, f in fns.items():
            res[f"{'kernel' if impl == kernel_impl else 'reference'}_ms"] = round(
                pipelined_ms(f, (q, k, v, lens, mask), reps), 4)
        res["kernel_speedup"] = round(res["reference_ms"] / res["kernel_ms"], 2)
        # KV bytes the kernel must read at least: the visible prefix of every row, K and V.
        kv_bytes = int(jnp.sum(lens + t)) * hkv * d * 2 * 2
        res["kernel_gb_per_s"] = round(kv_bytes / res["kernel_ms"] / 1e6, 1)
        return res

    for b, name in att_cases:
        rec.attempt(f"tree_attention b{b} {name} bf16 (Hq{hq}/Hkv{hkv}/D{d}, cache {s_len})",
                    lambda b=b, name=name: attention_case(b, name), need_s=4)

    def greedy_case(b, name):
        s = shapes[name]
        rng = np.random.default_rng(b + s.num_draft_tokens)
        parents, cand = trees_for(rng, b, s)
        # Target picks that often follow a child, so accepted paths get long.
        targ = np.where(rng.random(cand.shape) < 0.7, np.roll(cand, -1, axis=1), rng.integers(0, 50, cand.shape)).astype(np.int32)
        args = tuple(jnp.asarray(x) for x in (cand, parents, targ))
        fns = {impl: jax.jit(lambda c, p, t, impl=impl: verify_greedy(c, p, t, max_depth=s.num_steps, impl=impl))
               for impl in (kernel_impl, "reference")}
        got, ref = fns[kernel_impl](*args), fns["reference"](*args)
        equal = all(np.array_equal(np.asarray(g), np.asarray(r)) for g, r in zip(got, ref))
        return {"equal": equal, "mean_accept_length": float(np.asarray(ref.accept_length).mean()),
                "kernel_ms": round(pipelined_ms(fns[kernel_impl], args, reps), 4),
                "reference_ms": round(pipelined_ms(fns["reference"], args, reps), 4)}

    def sampling_case(b, name, dtype):
        s = shapes[name]
        t = s.num_draft_tokens
        rng = np.random.default_rng(3 * b + t)
        parents, cand = trees_for(rng, b, s)
        logits = jax.random.normal(jax.random.key(b + t), (b, t, vocab), jnp.float32) * 3
        # Make the drafted tokens likely, so the walk accepts some of them.
        logits = logits.at[jnp.arange(b)[:, None], jnp.arange(t)[None], jnp.asarray(np.roll(cand, -1, 1))].add(6.0)
        probs = jax.nn.softmax(logits, -1).astype(dtype)
        coins = jnp.asarray(1.0 - rng.random((b, t)), jnp.float32)
        bonus = jnp.asarray(rng.random(b), jnp.float32)
        args = (jnp.asarray(cand), jnp.asarray(parents), probs, coins, bonus)
        fns = {impl: jax.jit(lambda c, p, pr, co, bo, impl=impl: tree_speculative_sample(
            c, p, pr.astype(jnp.float32), co, bo, max_depth=s.num_steps, impl=impl)) for impl in (kernel_impl, "reference")}
        got, ref = fns[kernel_impl](*args), fns["reference"](*args)
        equal = all(np.array_equal(np.asarray(g), np.asarray(r)) for g, r in zip(got, ref))
        return {"equal": equal, "mean_accept_length": float(np.asarray(ref.accept_length).mean()),
                "kernel_ms": round(pipelined_ms(fns[kernel_impl], args, reps), 4),
                "reference_ms": round(pipelined_ms(fns["reference"], args, reps), 4)}

    for b, name in walk_cases:
        rec.attempt(f"verify_greedy b{b} {name}", lambda b=b, name=name: greedy_case(b, name), need_s=2)
    for b, name, dt in sample_cases:
        rec.attempt(f"tree_speculative_sample b{b} {name} probs {dt} (V={vocab})",
                    lambda b=b, name=name, dt=dt: sampling_case(b, name, jnp.dtype(dt)), need_s=3)
    # Last: the whole kernel test suite natively, in what time is left (cut off, it
    # reports the tests that finished).
    rec.attempt("pytest_tests_kernels", pytest_kernels, need_s=20)


# ----------------------------------------------------------------------------- 3. lossless


SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
               max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,))
TINY_LLAMA = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, eos_token_ids=(2,))
RELEASED_DRAFT = ROOT / "checkpoints" / "smollm2-135m-instruct-eagle3"


def _target_and_draft(dtype, dry: bool, layers: int = 0):
    """The lossless section's pair: a SmolLM2-shaped random target with the released draft;
    with ``layers`` > 0, SmolLM2's widths with that many layers and a random draft (each
    verify graph compiles one tree-attention kernel per layer, about a second each on the
    H200, so the 30-layer pair's 21 graphs do not fit a short call); a tiny random pair on
    the dry run."""
    import jax.numpy as jnp
    from flax import nnx

    from eagle_jax.checkpoint.draft_io import load_draft, random_draft, read_draft_config
    from eagle_jax.models.config import ModelConfig
    from eagle_jax.models.llama import LlamaModel

    if dry:
        cfg = ModelConfig(**TINY_LLAMA)
        target = LlamaModel(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))
        return target, random_draft(cfg, seed=1, draft_vocab_size=128, dtype=jnp.dtype(dtype)), "tiny random target, random draft"
    if layers:
        cfg = ModelConfig(**{**SMOLLM2, "num_hidden_layers": layers}).replace(aux_layer_ids=(0, layers // 2, layers - 1))
        target = LlamaModel(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))
        draft = random_draft(cfg, seed=1, draft_vocab_size=8192, dtype=jnp.dtype(dtype))
        return target, draft, f"SmolLM2 widths, {layers} layers, random weights; random draft (vocabulary 8192)"
    cfg = ModelConfig(**SMOLLM2)
    cfg = cfg.replace(aux_layer_ids=read_draft_config(RELEASED_DRAFT, target_cfg=cfg).aux_layer_ids)
    target = LlamaModel(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))
    draft = load_draft(RELEASED_DRAFT, target=target, dtype=dtype)
    return target, draft, "SmolLM2-shaped random target, released draft (checkpoints/smollm2-135m-instruct-eagle3)"


def section_lossless(rec: Record, out: Path) -> None:
    import jax
    import numpy as np

    from eagle_jax.serving.engine import Engine, EngineConfig
    from eagle_jax.spec.oracle import OracleProposer
    from eagle_jax.serving.policy import FixedPolicy, PlainPolicy
    from eagle_jax.spec.sampling import SamplingParams

    shapes = spec_shapes()
    chain, tree = shapes["chain S=3"], shapes["tree 3/4/8"]
    n_prompts, new_tokens = (4, 8) if rec.dry else (16, 32)
    max_seq = 128
    rng = np.random.default_rng(0)
    noise = 0.3  # the oracle proposes the reference continuation, 30% of it made wrong

    def run_dtype(dtype, buckets, kernel_impl):
        target, draft, what = _target_and_draft(dtype, rec.dry, int(rec.opts.get("lossless_layers", 0)))
        vocab = target.config.vocab_size
        prompts = [rng.integers(3, vocab, int(n)).tolist() for n in rng.integers(8, 60, n_prompts)]
        config = EngineConfig(max_batch=max(buckets), batch_buckets=buckets, prompt_buckets=(64,), max_seq_len=max_seq,
                              speculative=chain, spec_policy="auto", spec_shapes=(chain, tree),
                              spec_calibration_s=2.0, kernel_impl=kernel_impl, draft_sync="eager")
        t0 = time.perf_counter()
        oracle_rows: dict = {}  # prompt -> its oracle row, set per run below
        engine = Engine(target, draft, config, proposer=OracleProposer(row_width=max_seq, noise=noise, vocab_size=vocab),
                        proposer_rows=lambda rid, prompt: oracle_rows[tuple(prompt)], progress=False)
        build_s = time.perf_counter() - t0
        auto = engine.policy
        table = engine.table
        res = {"pair": what, "dtype": dtype, "build_s": round(build_s, 1), "graphs": table.report.graphs,
               "kernels": table.plan.kernel_path, "verify_attention": table.verify_attention_path(), "runs": {}}
        # Which custom calls the compiled greedy tree step makes (the Pallas paths on a GPU).
        hlo = table.compiled(("step", max(buckets), tree, True)).as_text()
        res["tree_step_custom_calls"] = {
            "mosaic_gpu": hlo.count('custom_call_target="mosaic_gpu'),
            "all": hlo.count("custom-call("),
            "layers": target.config.num_hidden_layers,
        }
        sampled = [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_new_tokens=new_tokens, ignore_eos=True)
                   for i in range(n_prompts)]
        greedy = [SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)] * n_prompts
        zeros = [[0] * max_seq] * n_prompts

        def generate(params, hook, batch):
            oracle_rows.clear()
            oracle_rows.update({tuple(p): h for p, h in zip(prompts, hook)})
            if batch > 1:
                return engine.generate(prompts, params)
            return [engine.generate([p], [sp])[0] for p, sp in zip(prompts, params)]

        for batch in buckets:
            for how, params in (("greedy", greedy), ("sampled", sampled)):
                if rec.left() < 8:
                    rec.data["skipped"].append(f"{dtype} batch {batch} {how}: out of time")
                    continue
                engine.use_policy(PlainPolicy())
                ref = generate(params, zeros, batch)
                want = [c.token_ids for c in ref]
                hook = [p + w for p, w in zip(prompts, want)]
                for label, policy in (("chain S=3", FixedPolicy(chain)), ("tree 3/4/8", FixedPolicy(tree)), ("auto", auto)):
                    engine.use_policy(policy)
                    t0 = time.perf_counter()
                    got = generate(params, hook, batch)
                    secs = time.perf_counter() - t0
                    mism = [i for i, (c, w) in enumerate(zip(got, want)) if c.token_ids != w]
                    first = {}
                    for i in mism:
                        a, b = got[i].token_ids, want[i]
                        first[i] = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
                    acc = [x for c in got for x in c.accept_lengths]
                    res["runs"][f"{dtype} batch {batch} {how} {label}"] = {
                        "identical": n_prompts - len(mism), "prompts": n_prompts, "first_mismatch_at": first,
                        "mean_accept_length": round(float(np.mean(acc)), 3) if acc else None, "seconds": round(secs, 2)}
                    rec.save()
        return res

    # bf16 takes the Pallas paths on a GPU (tree attention wants bf16/f16) at batch 1 and
    # 8; fp32 (XLA attention, Pallas verify) at batch 8 if the time is left. If the
    # kernels' engine fails to build, the same run with the XLA references still says
    # whether the rest of the GPU path is lossless.
    plan = [("bfloat16", (1, 8)), ("float32", (8,))] if not rec.dry else [("float32", (1, 2))]
    for dtype, buckets in plan:
        got = rec.attempt(f"engine {dtype}", lambda dtype=dtype, buckets=buckets: run_dtype(dtype, buckets, "auto"), need_s=25)
        jax.clear_caches()
        if got is None and f"engine {dtype}" in rec.data["items"]:
            rec.attempt(f"engine {dtype} kernel_impl=reference",
                        lambda dtype=dtype, buckets=buckets: run_dtype(dtype, buckets, "reference"), need_s=25)
            jax.clear_caches()


# ----------------------------------------------------------------------------- 4. llama8b


LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                max_position_embeddings=131072, tie_word_embeddings=False, eos_token_ids=(128009,))


def _param_bytes(module) -> int:
    import jax
    from flax import nnx

    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(module)))


def time_table(rec: Record, table, b: int, options: dict, context: int, *, prefix: str, min_bytes,
               ceiling_gbs: float | None, reps: int, need_s: float) -> dict:
    """Compile and time every option (None = plain) of one batch bucket: the synchronous
    step (launch to results ready, what the policy calibrates on) and the per-step time of
    ``reps`` steps launched back to back (device time once the host keeps up).
    ``min_bytes(b, shape)``: the fewest bytes such a step must move (bandwidth figure)."""
    import jax
    import numpy as np

    from eagle_jax.spec.sampling import SamplingParams

    ms = {}
    table.compile_graph(("zeros", b))
    for name, shape in options.items():
        def one(shape=shape):
            compile_s = table.compile_graph(("step", b, shape, True))
            table.time_step(b, shape, context=context)  # warm-up: first runs allocate
            sync = statistics.median(table.time_step(b, shape, context=context) for _ in range(max(3, reps // 2))) * 1e3
            state = table.zeros(b)
            seq = jax.device_put(np.full(b, context, np.int32), state.seq_lens.sharding)
            state = dataclasses.replace(state, seq_lens=seq)
            samp = table.sampling([SamplingParams()] * b, b)
            state, *_ = table.step(state, samp, shape, True)
            jax.block_until_ready(state)
            t0 = time.perf_counter()
            for _ in range(reps):
                state, out, acc, _fin = table.step(state, samp, shape, True)
            jax.block_until_ready((state, out))
            piped = (time.perf_counter() - t0) / reps * 1e3
            moved = min_bytes(b, shape)
            r = {"compile_s": round(compile_s, 1), "sync_ms": round(sync, 3), "pipelined_ms": round(piped, 3),
                 "min_bytes_gb": round(moved / 1e9, 2), "gb_per_s": round(moved / piped / 1e6, 1)}
            if ceiling_gbs:
                r["of_copy_ceiling"] = round(moved / piped / 1e6 / ceiling_gbs, 3)
            return r

        r = rec.attempt(f"{prefix} b{b} {name}", one, need_s=need_s)
        if r is not None:
            ms[name] = r
    return ms


def auto_choices(options: dict, per_batch: dict, lengths=(2, 3, 4)) -> dict:
    """What ``AutoPolicy`` picks from measured step times when the draft accepts each
    depth with rate ``p = 1 - 1/L`` (an unbounded chain would accept ``L`` on average);
    trees get the chains' rates (auto's own prior for a tree), which undersells them."""
    from eagle_jax.serving.policy import AutoPolicy, Calibration

    shapes = {n: s for n, s in options.items() if s is not None}
    out = {}
    for L in lengths:
        p = 1 - 1 / L
        for b, times in per_batch.items():
            have = {n for n in times if "pipelined_ms" in times[n]}
            if "plain" not in have:
                continue
            cand = [s for n, s in shapes.items() if n in have]
            if not cand:
                continue
            pol = AutoPolicy(cand, prior=[p] * 8, prior_weight=1e9)
            secs = {(b, shapes.get(n)): times[n]["pipelined_ms"] / 1e3 for n in have}
            pol.calibration = Calibration(secs, 1, 0.0, 0.0)
            best = pol.best(b)
            name = next((n for n, s in shapes.items() if s == best), "plain")
            out[f"L={L} b{b}"] = {
                "choice": name,
                "predicted_speedup": round(pol.predicted_tokens_per_second(b, best) / pol.predicted_tokens_per_second(b, None), 3),
                "expected_accept_length": {n: round(pol.expected_length(s), 3) for n, s in shapes.items() if n in have},
            }
    return out


def section_llama8b(rec: Record, out: Path) -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from eagle_jax.checkpoint.draft_io import random_draft
    from eagle_jax.models.config import ModelConfig
    from eagle_jax.models.llama import LlamaModel
    from eagle_jax.runtime.step_table import StepTable

    if rec.dry:
        cfg, batches, context, reps, dv = ModelConfig(**TINY_LLAMA), (1, 2), 64, 2, 128
        names = ("plain", "chain S=1", "tree 3/4/8")
    else:
        cfg, batches, context, reps, dv = ModelConfig(**LLAMA_8B), (1, 8, 64, 32), CONTEXT, 10, 32000
        names = ("plain",) + SPEC_SHAPES
    shapes = spec_shapes()
    options = {n: (None if n == "plain" else shapes[n]) for n in names}
    dtype = jnp.bfloat16
    t0 = time.perf_counter()
    target = LlamaModel(cfg, dtype=dtype, rngs=nnx.Rngs(0))
    draft = random_draft(cfg, seed=1, draft_vocab_size=dv, dtype=dtype)
    jax.block_until_ready(nnx.state(target))
    weight_bytes = _param_bytes(target)
    # Per committed position: K and V of every layer (bf16).
    kv_per_pos = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    ceiling = (read_section(out, "env").get("items", {}).get("copy_bandwidth") or {}).get("gb_per_s")
    rec.put("model", {"config": "Llama-3.1-8B shape" if not rec.dry else "tiny", "init_s": round(time.perf_counter() - t0, 1),
                      "target_weight_gb": round(weight_bytes / 1e9, 2), "draft_weight_gb": round(_param_bytes(draft) / 1e9, 2),
                      "draft_vocab": dv, "context": context, "kv_bytes_per_position": kv_per_pos,
                      "copy_ceiling_gb_per_s": ceiling, "dtype": "bfloat16"})
    # The draft's weights are read S times a step; the plain step reads the target's only
    # (eager draft sync adds a one-token draft extend): counted in the plain figure below.
    per_batch = {}
    kernel_impl = "auto"

    def table_for(b, impl):
        return StepTable(target, draft, shapes=[s for s in options.values() if s is not None], batch_buckets=(b,),
                         prompt_buckets=(16,), max_seq_len=context + 256, plain=True, sampled=False,
                         draft_sync="eager", kernel_impl=impl)

    draft_step_bytes = _param_bytes(draft) - draft.embed_tokens[...].nbytes

    def min_bytes(b, shape):
        """Every target weight once, every row's KV prefix once, the draft's weights (all
        but its embedding table, which is gathered) once per draft step."""
        steps = 0 if shape is None else shape.num_steps
        return weight_bytes + b * context * kv_per_pos + steps * draft_step_bytes

    timing = dict(min_bytes=min_bytes, ceiling_gbs=ceiling, reps=reps, need_s=8 if not rec.dry else 1)
    for b in batches:
        if rec.left() < 15:
            rec.data["skipped"].append(f"batch {b}: out of time")
            rec.save()
            continue
        table = table_for(b, kernel_impl)
        if b == batches[0]:
            rec.put("verify_attention", table.verify_attention_path())
            rec.put("kernels", table.plan.kernel_path)
        per_batch[b] = time_table(rec, table, b, options, context, prefix="step", **timing)
        failed = {n: s for n, s in options.items()
                  if s is not None and "error" in rec.data["items"].get(f"step b{b} {n}", {})}
        if failed and kernel_impl == "auto":
            # The Pallas paths failed here: time the rest with the XLA references, so the
            # costs still come back (the errors above say what to fix).
            kernel_impl = "reference"
            rec.put("kernel_impl_fallback", f"reference from batch {b} on: {sorted(failed)} failed with the Pallas kernels")
            del table
            table = table_for(b, kernel_impl)
            per_batch[b].update(time_table(rec, table, b, failed, context, prefix="step (XLA reference kernels)", **timing))
        plain = per_batch[b].get("plain", {}).get("pipelined_ms")
        if plain:
            rec.put("break_even", {**rec.data.get("break_even", {}), **{
                f"b{b} {n}": round(r["pipelined_ms"] / plain, 3) for n, r in per_batch[b].items() if n != "plain"}})
        rec.put("auto_choices", auto_choices(options, per_batch))
        del table
        jax.clear_caches()


# ----------------------------------------------------------------------------- 5. deepseek


# Kimi-K2: 384 routed experts of width 2048, top-8, one shared; MLA with 64 heads.
KIMI_K2_DIMS = dict(vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                    num_attention_heads=64, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=384)
INT4_GROUP = 32


def int4_expert_bytes(hidden: int, width: int, group: int = INT4_GROUP, scale_bytes: int = 2) -> int:
    """Bytes of one INT4 SwiGLU expert (gate, up: [width, hidden]; down: [hidden, width]):
    4 bits a weight, one scale per ``group`` inputs."""
    per_matrix = lambda o, i: o * i // 2 + o * (i // group) * scale_bytes  # noqa: E731
    return 2 * per_matrix(width, hidden) + per_matrix(hidden, width)


def section_deepseek(rec: Record, out: Path) -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from eagle_jax.checkpoint.draft_io import random_draft
    from eagle_jax.models.deepseek import MLAConfig, DeepseekV3Config, DeepseekV3Model, mla_form, moe_impl_for
    from eagle_jax.models.quant import QuantConfig
    from eagle_jax.runtime.step_table import StepTable

    if rec.dry:
        dims = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_attention_heads=4,
                    kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                    n_routed_experts=16)
        batches, context, reps, dv = (2,), 64, 2, 128
        impls = ("auto", "gather")
    else:
        dims = dict(KIMI_K2_DIMS)
        batches, context, reps, dv = (1, 8, 64), CONTEXT, 5, 32000
        impls = ("auto", "gather", "blocked", "ragged", "dense")
    cfg = DeepseekV3Config(**dims, num_hidden_layers=3, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1,
                           routed_scaling_factor=2.827, max_position_embeddings=8192, aux_layer_ids=(0, 1, 2),
                           quant=QuantConfig(group_size=INT4_GROUP, targets=("re:.*experts.*",)), int4_moe_layers=(1, 2))
    dtype = jnp.bfloat16
    t0 = time.perf_counter()
    target = DeepseekV3Model(cfg, dtype=dtype, rngs=nnx.Rngs(0))
    # INT4 packs are created zero (a checkpoint fills them): random words and scales, so no
    # formulation times zeros.
    state = nnx.state(target, nnx.Param)
    key = jax.random.key(7)
    for path, var in jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        name = jax.tree_util.keystr(path)
        if "_packed" in name:
            key, k = jax.random.split(key)
            var.set_value(jax.lax.bitcast_convert_type(jax.random.bits(k, var.shape, jnp.uint32), jnp.int32))
        elif "_scale" in name and "experts" in name:
            key, k = jax.random.split(key)
            var.set_value(jax.random.uniform(k, var.shape, var.dtype, 0.5, 1.5) * 0.002)
    nnx.update(target, state)
    mla = MLAConfig(hidden_size=dims["hidden_size"], num_attention_heads=dims["num_attention_heads"],
                    kv_lora_rank=dims["kv_lora_rank"], q_lora_rank=dims["q_lora_rank"],
                    qk_nope_head_dim=dims["qk_nope_head_dim"], qk_rope_head_dim=dims["qk_rope_head_dim"],
                    v_head_dim=dims["v_head_dim"])
    draft = random_draft(cfg, seed=1, draft_vocab_size=dv, mla=mla, dtype=dtype)
    jax.block_until_ready(nnx.state(target))
    weight_bytes = _param_bytes(target)
    # Per committed position: the latent and the rope key of every layer (bf16).
    kv_per_pos = cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    ceiling = (read_section(out, "env").get("items", {}).get("copy_bandwidth") or {}).get("gb_per_s")
    chain = spec_shapes()["chain S=3"]
    plan = {}
    for b in batches:
        for label, n in (("plain", b), ("chain S=3", b * 4)):
            plan[f"b{b} {label} ({n} tokens)"] = {"moe_auto": moe_impl_for(n, 8, cfg.n_routed_experts, jax.default_backend(), int4=True),
                                                 "mla_form": mla_form(cfg, n // b, context + 256)}
    rec.put("model", {"config": "Kimi-K2 slice: 1 dense + 2 MoE layers (INT4 experts, group 32)" if not rec.dry else "tiny",
                      "init_s": round(time.perf_counter() - t0, 1), "target_weight_gb": round(weight_bytes / 1e9, 2),
                      "context": context, "copy_ceiling_gb_per_s": ceiling, "plan": plan})
    moes = [layer.mlp for layer in target.layers if hasattr(layer.mlp, "impl")]
    expert_bytes = sum(getattr(moes[0], f"experts_{n}_{k}")[...].nbytes for n in ("gate", "up", "down")
                       for k in ("packed", "scale")) // cfg.n_routed_experts
    assert expert_bytes == int4_expert_bytes(cfg.hidden_size, cfg.moe_intermediate_size), expert_bytes
    routed_bytes = expert_bytes * cfg.n_routed_experts * len(moes)

    def min_bytes(b, shape):
        """The weights but the routed experts, each expert a step's tokens choose once (at
        most all of them), every row's latent cache once; the draft is left out."""
        tokens = b * (1 if shape is None else shape.num_draft_tokens)
        used = min(cfg.n_routed_experts, tokens * cfg.num_experts_per_tok)
        return weight_bytes - routed_bytes + used * expert_bytes * len(moes) + b * context * kv_per_pos

    options = {"plain": None, "chain S=3": chain}
    results = {}
    for impl in impls:
        for b in batches:
            if impl == "dense" and b > 1:
                continue  # every expert for every token: hundreds of times the work at batch 8+
            if rec.left() < 12:
                rec.data["skipped"].append(f"{impl} b{b}: out of time")
                rec.save()
                continue
            for m in moes:
                m.impl = impl
            table = StepTable(target, draft, shapes=[chain], batch_buckets=(b,), prompt_buckets=(16,),
                              max_seq_len=context + 256, plain=True, sampled=False, draft_sync="eager")
            results[f"{impl} b{b}"] = time_table(rec, table, b, options, context, prefix=f"moe {impl}",
                                                 min_bytes=min_bytes, ceiling_gbs=ceiling, reps=reps,
                                                 need_s=10 if not rec.dry else 1)
            del table
            jax.clear_caches()
    for m in moes:
        m.impl = "auto"


SECTION_FNS = {"env": section_env, "kernels": section_kernels, "lossless": section_lossless,
               "llama8b": section_llama8b, "deepseek": section_deepseek}


# ----------------------------------------------------------------------------- summary


def _table(header, rows) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return lines


def summary(out: Path) -> str:
    """The markdown summary of whatever the sections have written so far."""
    lines = ["# Device check", ""]
    for name, _ in SECTIONS:
        d = read_section(out, name)
        if not d:
            lines += [f"## {name}: not run", ""]
            continue
        items = d.get("items", {})
        lines += [f"## {name}: {d.get('status')} ({d.get('elapsed_s')} s of {d.get('limit_s')} s)", ""]
        if d.get("error"):
            lines += ["```", str(d["error"])[-1500:], "```", ""]
        if name == "env":
            for k in ("versions", "device", "copy_bandwidth", "bf16_matmul"):
                if k in items:
                    lines.append(f"- {k}: `{json.dumps(items[k])}`")
            lines.append("")
        elif name == "kernels":
            pt = items.get("pytest_tests_kernels") or {}
            lines.append(f"- pytest tests/kernels (native: {pt.get('native')}): {pt.get('passed')} passed, "
                         f"{pt.get('failures')} failed, {pt.get('errors')} errors, {pt.get('skipped')} skipped "
                         f"in {pt.get('seconds')} s")
            for f in (pt.get("failed") or [])[:20]:
                lines.append(f"  - {f}")
            rows = []
            for k, v in items.items():
                if k == "pytest_tests_kernels" or not isinstance(v, dict):
                    continue
                ok = v.get("error") or v.get("ok", v.get("equal"))
                rows.append((k, ok, v.get("max_abs_err", ""), v.get("kernel_ms", ""), v.get("reference_ms", ""),
                             v.get("kernel_speedup", ""), v.get("kernel_gb_per_s", ""), v.get("mean_accept_length", "")))
            lines += [""] + _table(("case", "ok / equal", "max err", "kernel ms", "reference ms", "speedup", "kernel GB/s",
                                    "accept len"), rows) + [""]
        elif name == "lossless":
            rows = []
            for k, v in items.items():
                if not isinstance(v, dict) or "runs" not in v:
                    lines.append(f"- {k}: `{json.dumps(v)[:500]}`")
                    continue
                lines.append(f"- {k}: {v['pair']}; {v['graphs']} graphs built in {v['build_s']} s; kernels {v['kernels']}; "
                             f"tree step custom calls {v['tree_step_custom_calls']}")
                lines.append(f"  - verify attention: {v['verify_attention']}")
                for run, r in v["runs"].items():
                    rows.append((run, f"{r['identical']}/{r['prompts']}", r["mean_accept_length"], r["first_mismatch_at"] or ""))
            lines += [""] + _table(("run", "identical to plain", "mean accept length", "first mismatch (prompt: token)"), rows) + [""]
        elif name in ("llama8b", "deepseek"):
            if "model" in d:
                lines += [f"- model: `{json.dumps(d['model'])}`"]
            if "verify_attention" in d:
                lines += [f"- verify attention: {d['verify_attention']}"]
            rows = []
            for k, v in items.items():
                if "error" in v:
                    rows.append((k, "error: " + v["error"][:200], "", "", "", ""))
                else:
                    rows.append((k, v["sync_ms"], v["pipelined_ms"], v["gb_per_s"], v.get("of_copy_ceiling", ""), v["compile_s"]))
            lines += [""] + _table(("step", "sync ms", "pipelined ms", "GB/s (min bytes)", "of copy ceiling", "compile s"), rows)
            if d.get("break_even"):
                lines += ["", "Break-even accept length (step time / plain step time):", ""]
                lines += _table(("batch, shape", "break-even"), sorted(d["break_even"].items()))
            if d.get("auto_choices"):
                lines += ["", "AutoPolicy's choice from these times:", ""]
                lines += _table(("accept length, batch", "choice", "predicted speedup"),
                                [(k, v["choice"], v["predicted_speedup"]) for k, v in d["auto_choices"].items()])
            lines.append("")
        for s in d.get("skipped", []):
            lines.append(f"- skipped: {s}")
        for e in d.get("errors", []):
            lines.append(f"- error: {e}")
        lines.append("")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- report


def _fmt(x, nd=3):
    if not isinstance(x, float):
        return "" if x is None else str(x)
    text = f"{x:.{nd}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def report(dirs) -> str:
    """Markdown tables of committed device-check runs (``results/gpu/<run>/``), one row
    per measured item and run, for docs/results.md. MoE steps' GB/s are recomputed here
    with the bytes ``section_deepseek`` counts now (a run made before that counted every
    expert)."""
    dirs = [Path(d) for d in dirs]
    lines = []
    env_rows, kern_rows, step_rows, moe_rows, notes = [], [], [], [], []
    for d in dirs:
        run = d.name
        env = read_section(d, "env").get("items", {})
        dev, ver = env.get("device", {}), env.get("versions", {})
        env_rows.append((run, dev.get("kind"), dev.get("compute_capability"), ver.get("jax"), ver.get("flax"),
                         (env.get("copy_bandwidth") or {}).get("gb_per_s"), (env.get("bf16_matmul") or {}).get("tflop_per_s")))
        for k, v in read_section(d, "kernels").get("items", {}).items():
            if k == "pytest_tests_kernels":
                notes.append(f"{run}: `pytest tests/kernels` natively: " + (
                    f"{v.get('passed')} passed, {v.get('failures')} failed" if "passed" in v else v.get("error", "?")[:200]))
                continue
            if "error" in v:
                kern_rows.append((run, k, "error: " + v["error"][:120], "", "", "", ""))
                continue
            kern_rows.append((run, k, v.get("ok", v.get("equal")), _fmt(v.get("max_abs_err"), 4), _fmt(v.get("kernel_ms"), 3),
                              _fmt(v.get("reference_ms"), 3), _fmt(v.get("kernel_gb_per_s"), 0)))
        llama = read_section(d, "llama8b")
        for k, v in llama.get("items", {}).items():
            if "error" in v:
                step_rows.append((run, k, "error: " + v["error"][:120], "", "", "", ""))
                continue
            step_rows.append((run, k.removeprefix("step "), _fmt(v["pipelined_ms"], 2), _fmt(v["sync_ms"], 2),
                              _fmt(v["gb_per_s"], 0), _fmt(v.get("of_copy_ceiling"), 2), _fmt(v["compile_s"], 1)))
        ds = read_section(d, "deepseek")
        model = ds.get("model", {})
        for k, v in ds.get("items", {}).items():
            if "error" in v:
                moe_rows.append((run, k, "error: " + v["error"][:120], "", "", ""))
                continue
            impl, b, step = k.split(" ", 3)[1], int(k.split(" ")[2][1:]), k.split(" ", 3)[3]
            gbs = v["gb_per_s"]
            if model.get("config", "").startswith("Kimi-K2 slice") and "target_weight_gb" in model:
                dims, layers = KIMI_K2_DIMS, 2
                e = int4_expert_bytes(dims["hidden_size"], dims["moe_intermediate_size"])
                tokens = b * (1 if step == "plain" else int(step.split("S=")[1]) + 1)
                used = min(dims["n_routed_experts"], tokens * 8)
                kv = b * model["context"] * 3 * (dims["kv_lora_rank"] + dims["qk_rope_head_dim"]) * 2
                moved = model["target_weight_gb"] * 1e9 - e * dims["n_routed_experts"] * layers + used * e * layers + kv
                gbs = moved / v["pipelined_ms"] / 1e6
            moe_rows.append((run, impl, b, step, _fmt(v["pipelined_ms"], 2), _fmt(gbs, 0), _fmt(v["compile_s"], 1)))
        for name, _ in SECTIONS:
            sec = read_section(d, name)
            if sec and (sec.get("skipped") or sec.get("errors") or not sec.get("status", "").startswith("done")):
                notes.append(f"{run}/{name}: {sec.get('status')}; {len(sec.get('items', {}))} items, "
                             f"{len(sec.get('skipped', []))} skipped, {len(sec.get('errors', []))} errors")
    lines += _table(("run", "device", "cc", "jax", "flax", "copy GB/s", "bf16 TFLOP/s"), env_rows) + [""]
    lines += ["Kernels against their XLA references (natively; ms per call, back to back):", ""]
    lines += _table(("run", "case", "matches", "max err", "kernel ms", "XLA ms", "kernel GB/s"), kern_rows) + [""]
    lines += ["Llama-3.1-8B-shaped steps (bf16, context 2048):", ""]
    lines += _table(("run", "batch, step", "pipelined ms", "sync ms", "GB/s", "of copy ceiling", "compile s"), step_rows) + [""]
    lines += ["Kimi-K2 slice steps (bf16, INT4 experts, context 2048; GB/s of the weights a step must read):", ""]
    lines += _table(("run", "MoE formulation", "batch", "step", "pipelined ms", "GB/s", "compile s"), moe_rows) + [""]
    lines += ["What did not run to the end:", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- driver


def run_section(name: str, out: Path, limit_s: float, dry: bool, cases=(), opts=None) -> int:
    if dry:
        import jax

        jax.config.update("jax_platforms", "cpu")
    import logging

    # The engine's start-up lines and the step table's per-graph compile times go to the
    # log: a section cut off while building says how far it got.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
    logging.getLogger("eagle_jax.runtime.step_table").setLevel(logging.DEBUG)
    rec = Record(out, name, limit_s, dry, tuple(cases))
    rec.opts = dict(opts or {})
    try:
        SECTION_FNS[name](rec, out)
    except Exception as e:
        traceback.print_exc()
        rec.data["status"] = "error"
        rec.data["error"] = "".join(traceback.format_exception(e))[-4000:]
        rec.save()
        return 1
    rec.data["status"] = "done" if not rec.data["errors"] else "done with errors"
    rec.save()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=os.environ.get("OUT"), help="results folder (default: $OUT)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, kernels interpreted")
    ap.add_argument("--sections", nargs="+", default=[n for n, _ in SECTIONS], choices=[n for n, _ in SECTIONS])
    ap.add_argument("--total-s", type=float, default=None, help="stop starting sections after this many seconds")
    ap.add_argument("--limits", nargs="+", default=[], metavar="SECTION=SECONDS", help="override sections' time limits")
    ap.add_argument("--cases", nargs="+", default=[], metavar="REGEX",
                    help="run only the items whose 'section/item' matches one (e.g. a rerun of what a cut-off run skipped)")
    ap.add_argument("--lossless-layers", type=int, default=4,
                    help="layers of the lossless section's SmolLM2-width target with a random draft; 0: the 30-layer "
                         "shape with the released draft (default 4: compiles fit the call)")
    ap.add_argument("--report", nargs="+", type=Path, default=None, metavar="RUN_DIR",
                    help="print the markdown tables of committed runs (results/gpu/<run>) and exit")
    ap.add_argument("--section", default=None, help=argparse.SUPPRESS)  # internal: run one section in this process
    ap.add_argument("--limit-s", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.report:
        print(report(args.report))
        return 0
    if args.out is None:
        ap.error("--out or $OUT is required")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    opts = {"lossless_layers": args.lossless_layers}
    if args.section:
        return run_section(args.section, out, args.limit_s, args.dry_run, args.cases, opts)

    limits = dict(SECTIONS)
    for item in args.limits:
        name, _, value = item.partition("=")
        if name not in limits or not value:
            ap.error(f"--limits {item!r}: expected SECTION=SECONDS with SECTION one of {', '.join(limits)}")
        limits[name] = float(value)
    start = time.perf_counter()
    total = args.total_s or (len(args.sections) * DRY_LIMIT_S if args.dry_run else sum(limits[s] for s in args.sections) + 30)
    log_path = out / "check.log"
    worst = 0
    with log_path.open("a") as log:
        for name in args.sections:
            left = total - (time.perf_counter() - start)
            limit = min(DRY_LIMIT_S if args.dry_run and not args.limits else limits[name], left - 5)
            if limit < 10:
                d = {"section": name, "status": "not run: the check's total time was spent", "items": {}}
                (out / f"{name}.json").write_text(json.dumps(d, indent=1) + "\n")
                (out / "summary.md").write_text(summary(out))
                worst = max(worst, 1)
                continue
            header = f"==== {name} (limit {limit:.0f} s) ===="
            print(header, flush=True)
            log.write(header + "\n")
            log.flush()
            cmd = [sys.executable, __file__, "--section", name, "--out", str(out), "--limit-s", str(limit - 8),
                   "--lossless-layers", str(args.lossless_layers)]
            if args.cases:
                cmd += ["--cases", *args.cases]
            if args.dry_run:
                cmd.append("--dry-run")
            t0 = time.perf_counter()
            try:
                # The section's own deadline is 8 s before this kill: it skips what does not fit.
                rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=limit).returncode
                status = None if rc == 0 else f"exit code {rc}"
            except subprocess.TimeoutExpired:
                status = f"killed at its time limit ({limit:.0f} s)"
            d = read_section(out, name) or {"section": name, "items": {}}
            if status:
                worst = max(worst, 1)
                d["status"] = f"{d.get('status', 'not started')}; {status}"
                (out / f"{name}.json").write_text(json.dumps(d, indent=1, default=str) + "\n")
            line = f"{name}: {d.get('status')} in {time.perf_counter() - t0:.0f} s; {len(d.get('items', {}))} items, " \
                   f"{len(d.get('errors', []))} errors, {len(d.get('skipped', []))} skipped"
            print(line, flush=True)
            log.write(line + "\n")
            log.flush()
            (out / "summary.md").write_text(summary(out))
    print((out / "summary.md").read_text(), flush=True)
    return worst


if __name__ == "__main__":
    sys.exit(main())
