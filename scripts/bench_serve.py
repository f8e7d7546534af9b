#!/usr/bin/env python
"""Serving benchmark: ``eagle-jax serve`` through the official OpenAI client.

For each mode (plain: ``--no-speculation``; auto: ``--draft`` under the auto policy) a
server is started (a subprocess on 127.0.0.1) and the same MT-bench prompts are sent as
streamed chat completions (greedy, ``--max-tokens`` each) at each concurrency: that
many clients, each sending its next prompt when its last answer ends. Reported per mode
and concurrency: output tokens/s (all tokens over the wall time), TTFT and TPOT
percentiles (p50, p90, p99; TTFT to the first content chunk, TPOT the rest of the
request's time over its other tokens) and the mean accept length (from the responses'
``eagle_jax`` field).

The reference for concurrency 1: ``eagle-jax generate --batch-size 1`` on the same prompts
and flags, its tokens/s the sum of its tokens over the sum of each request's time from
admission to its last token (so neither queueing nor start-up counts). Goals (the issue):
serve's tokens/s at concurrency 1 >= 0.95x generate's; p99 TTFT at concurrency 16 within
2x its p50.

Writes ``results/serve/bench_serve.json`` (the command, the environment fingerprint,
every figure) and ``bench_serve.png`` (tokens/s and TTFT against concurrency) under --out.

    python scripts/bench_serve.py --model checkpoints/smollm2-135m-instruct \\
        --draft checkpoints/smollm2-135m-instruct-eagle3 --prompts 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai

from eagle_jax.environment import fingerprint
from eagle_jax.experiments.harness import load_suite

REPO = Path(__file__).resolve().parents[1]


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between ranks."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mode_flags(args, mode: str) -> list[str]:
    engine = ["--model", str(args.model), "--batch-size", str(args.batch_size), "--max-seq-len", str(args.max_seq_len)]
    if mode == "plain":
        return engine + ["--no-speculation"]
    extra = ["--spec-policy", "auto", "--spec-calibration-s", str(args.calibration_s), "--draft-sync", args.draft_sync]
    if args.spec_shapes:
        extra += ["--spec-shapes", args.spec_shapes]
    return engine + ["--draft", str(args.draft)] + extra


class Server:
    def __init__(self, flags: list[str], log: Path, timeout: float):
        self.port = free_port()
        self.log = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "eagle_jax.cli", "serve", *flags, "--served-model-name",
                                      "bench", "--port", str(self.port)], stdout=self.log, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{self.port}/v1"
        t0 = time.monotonic()
        deadline = t0 + timeout
        client = openai.OpenAI(base_url=self.base, api_key="unused", max_retries=0, timeout=5)
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited with {self.proc.returncode}; see {log}")
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"server not up in {timeout:.0f} s; see {log}") from None
                time.sleep(1.0)
        self.listening_s = time.monotonic() - t0
        # serve compiles the speculative steps in the background by default: measure the
        # steady state, once /health says speculation is ready.
        while self._health().get("speculation", "ready") != "ready":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"speculation not ready in {timeout:.0f} s; see {log}")
            time.sleep(1.0)
        self.ready_s = time.monotonic() - t0

    def _health(self) -> dict:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        self.proc.terminate()
        rc = self.proc.wait(60)
        self.log.close()
        if rc != 0:
            raise SystemExit(f"server exited with {rc} on SIGTERM")


async def one(client: openai.AsyncOpenAI, messages, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = None
    stream = await client.chat.completions.create(model="bench", messages=messages, max_tokens=max_tokens,
                                                  temperature=0, stream=True, stream_options={"include_usage": True})
    ext, tokens = None, 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter()
        if chunk.choices and chunk.choices[0].finish_reason is not None:
            ext = chunk.model_extra["eagle_jax"]
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    first = end if first is None else first
    return {"ttft_s": first - t0, "tpot_s": (end - first) / (tokens - 1) if tokens > 1 else None, "tokens": tokens,
            "accept_lengths": ext["accept_lengths"], "steps_by_shape": ext["steps_by_shape"]}


async def drive(base: str, prompts, concurrency: int, max_tokens: int) -> dict:
    todo = list(enumerate(prompts))
    rows: list[dict] = []
    async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600) as client:
        async def worker():
            while todo:
                _, p = todo.pop(0)
                rows.append(await one(client, p, max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in rows)
    ttft = [r["ttft_s"] for r in rows]
    tpot = [r["tpot_s"] for r in rows if r["tpot_s"] is not None]
    accepts = [a for r in rows for a in r["accept_lengths"]]
    shapes: dict[str, int] = {}
    for r in rows:
        for k, v in r["steps_by_shape"].items():
            shapes[k] = shapes.get(k, 0) + v
    return {
        "concurrency": concurrency, "requests": len(rows), "tokens": tokens, "wall_s": round(wall, 3),
        "tokens_per_second": round(tokens / wall, 2),
        **{f"ttft_p{q}_ms": round(1000 * percentile(ttft, q), 2) for q in (50, 90, 99)},
        **{f"tpot_p{q}_ms": round(1000 * percentile(tpot, q), 2) for q in (50, 90, 99)},
        "mean_accept_length": round(statistics.mean(accepts), 3) if accepts else None,
        "request_steps_by_shape": shapes,
    }


def generate_reference(args, mode: str, prompt_file: Path, workdir: Path) -> dict:
    """``eagle-jax generate --batch-size 1`` on the same prompts: tokens/s over the requests'
    own time (admission to last token)."""
    out = workdir / f"generate_{mode}.jsonl"
    flags = mode_flags(args, mode)
    flags[flags.index("--batch-size") + 1] = "1"
    cmd = [sys.executable, "-m", "eagle_jax.cli", "generate", *flags, "--prompt-file", str(prompt_file),
           "--max-new-tokens", str(args.max_tokens), "--output", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    tokens, seconds = 0, 0.0
    for line in out.read_text().splitlines():
        row = json.loads(line)
        n = len(row["token_ids"])
        tokens += n
        seconds += n / row["tokens_per_second"] - row["queue_s"]  # arrival..last minus arrival..admission
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_second": round(tokens / seconds, 2)}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, runs in results["modes"].items():
        cs = [r["concurrency"] for r in runs["serve"]]
        a.plot(cs, [r["tokens_per_second"] for r in runs["serve"]], "o-", label=f"serve {mode}")
        if runs["generate_c1"]:
            a.axhline(runs["generate_c1"]["tokens_per_second"], ls=":", color=a.lines[-1].get_color(),
                      label=f"generate {mode} (batch 1)")
        b.plot(cs, [r["ttft_p50_ms"] for r in runs["serve"]], "o-", label=f"{mode} p50")
        b.plot(cs, [r["ttft_p99_ms"] for r in runs["serve"]], "s--", color=b.lines[-1].get_color(), label=f"{mode} p99")
    for ax, title, unit in ((a, "output tokens/s", "tokens/s"), (b, "time to first token", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (clients)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle(f"eagle-jax serve, {results['prompts']} MT-bench prompts, {results['max_tokens']} tokens each")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=REPO / "checkpoints" / "smollm2-135m-instruct")
    p.add_argument("--draft", type=Path, default=REPO / "checkpoints" / "smollm2-135m-instruct-eagle3")
    p.add_argument("--prompts", type=int, default=16, help="MT-bench prompts (first turns), the first N")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--modes", nargs="+", choices=("plain", "auto"), default=["plain", "auto"])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--spec-shapes", default=None, help="auto's candidates (default: the engine's)")
    p.add_argument("--calibration-s", type=float, default=20.0)
    p.add_argument("--draft-sync", choices=("auto", "eager", "deferred"), default="auto",
                   help="auto mode's --draft-sync (how the draft follows plain steps)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="one unmeasured pass at each concurrency before its measured one (the first pass at a "
                        "new concurrency is the first to run that batch bucket's graphs)")
    p.add_argument("--repeats", type=int, default=1,
                   help="measured passes per concurrency; the figures are the median pass's (by tokens/s)")
    p.add_argument("--generate-reference", action=argparse.BooleanOptionalAction, default=True,
                   help="time `eagle-jax generate --batch-size 1` on the same prompts (the concurrency-1 goal)")
    p.add_argument("--start-timeout", type=float, default=1800.0, help="seconds a server may take to compile")
    p.add_argument("--out", type=Path, default=REPO / "results" / "serve")
    args = p.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: must be >= 1")
    if max(args.concurrency) > args.prompts:
        raise SystemExit(f"--prompts {args.prompts} is fewer than the largest concurrency {max(args.concurrency)}")
    suite = load_suite("mt_bench")
    records = suite.records[: args.prompts]
    messages = [list(r.messages) for r in records]
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    prompt_file = work / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"id": r.id, "messages": list(r.messages)}) + "\n" for r in records))
    results = {
        "command": " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]),
        "environment": fingerprint("float32"),
        "taken": datetime.date.today().isoformat(),
        "prompts": len(records), "max_tokens": args.max_tokens, "batch_size": args.batch_size,
        "max_seq_len": args.max_seq_len, "warmup_pass": args.warmup, "modes": {},
    }
    for mode in args.modes:
        ref = None
        if args.generate_reference:
            print(f"[{mode}] eagle-jax generate --batch-size 1 ...", file=sys.stderr)
            ref = generate_reference(args, mode, prompt_file, work)
            print(f"[{mode}] generate: {ref['tokens_per_second']} tok/s", file=sys.stderr)
        print(f"[{mode}] starting the server ...", file=sys.stderr)
        server = Server(mode_flags(args, mode), work / f"server_{mode}.log", args.start_timeout)
        runs = []
        try:
            asyncio.run(drive(server.base, messages[: min(4, len(messages))], 1, 8))  # warm the HTTP path
            for c in args.concurrency:
                if args.warmup:
                    asyncio.run(drive(server.base, messages, c, args.max_tokens))
                passes = [asyncio.run(drive(server.base, messages, c, args.max_tokens)) for _ in range(args.repeats)]
                # The pass with the median tokens/s stands for the concurrency; every pass's rate is kept.
                r = sorted(passes, key=lambda x: x["tokens_per_second"])[(len(passes) - 1) // 2]
                r = {**r, "passes_tokens_per_second": [x["tokens_per_second"] for x in passes]}
                print(f"[{mode}] concurrency {c}: {json.dumps(r)}", file=sys.stderr)
                runs.append(r)
        finally:
            server.stop()
        c1 = next((r for r in runs if r["concurrency"] == 1), None)
        c16 = next((r for r in runs if r["concurrency"] == 16), None)
        results["modes"][mode] = {
            "serve": runs, "generate_c1": ref,
            "server_listening_s": round(server.listening_s, 1), "server_speculation_ready_s": round(server.ready_s, 1),
            "draft_sync": args.draft_sync if mode == "auto" else None,
            "serve_c1_over_generate": round(c1["tokens_per_second"] / ref["tokens_per_second"], 3) if c1 and ref else None,
            "ttft_p99_over_p50_c16": round(c16["ttft_p99_ms"] / c16["ttft_p50_ms"], 3) if c16 else None,
        }
    path = args.out / "bench_serve.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.out / "bench_serve.png")
    for mode, r in results["modes"].items():
        print(f"{mode}: serve c1 / generate = {r['serve_c1_over_generate']} (goal >= 0.95); "
              f"TTFT p99/p50 at c16 = {r['ttft_p99_over_p50_c16']} (goal <= 2)")
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
