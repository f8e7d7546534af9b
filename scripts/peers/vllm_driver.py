"""Run vLLM's CPU build on the exact prompt token ids ``eagle-jax bench`` uses, and write
its figures in the file ``eagle-jax bench --peer`` reads.

Runs inside the vLLM virtualenv that ``scripts/peers/vllm_cpu.sh`` makes, so it imports
only the standard library and (in a real run) vllm; never eagle_jax.

Input: the JSONL file ``eagle-jax bench --export-prompts FILE`` writes: a header line
``{"format": "eagle-jax-peer-prompts", "version": 1, "model": ..., "max_new_tokens": ...,
"prompts": N, "bench": {...}}``, then one ``{"id": ..., "prompt_token_ids": [...]}`` per
prompt.

What is measured, greedy (temperature 0), on the same token ids:

- one request at a time: per request, time to first token (TTFT) and total time. There
  is no streaming: TTFT is the wall time of a ``generate`` of that prompt with
  ``max_tokens=1`` (prefill and the first token), then the full ``generate`` is timed
  alone. Prefix caching is off, so the full request prefills again, and its decode
  rate is (output tokens - 1) / (total - TTFT). End-to-end tokens/s one at a time is
  all output tokens over the sum of the totals.
- all requests at once (one ``generate`` call over every prompt): output tokens over
  the call's wall time.

A warm-up (one request alone, then every prompt at once) runs before anything is timed;
``--repeats`` timed passes follow, per-request figures are medians over them.

``--check`` validates the prompt file and writes nothing; ``--self-check`` runs the whole
measurement with a fake generator (no vllm needed) and writes a result file with the same
schema, which is how the schema is tested.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

PROMPTS_FORMAT = "eagle-jax-peer-prompts"
RESULT_FORMAT = "eagle-jax-peer-result"
VERSION = 1
ENV_VARS = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU", "OMP_NUM_THREADS",
            "VLLM_TARGET_DEVICE", "VLLM_USE_V1", "LD_PRELOAD")
TTFT_METHOD = ("no streaming: TTFT is the wall time of generate(prompt, max_tokens=1); the full generate is then "
               "timed alone (prefix caching off, so it prefills again); decode tokens/s = (output tokens - 1) / "
               "(total - TTFT)")


class InputFileError(Exception):
    pass


# ----------------------------------------------------------------------------- input


def read_prompts(path: Path) -> tuple[dict, list[dict]]:
    """(header, prompts) of a prompt file; InputFileError names the file and line."""
    if not path.is_file():
        raise InputFileError(f"prompt file {path} does not exist (write it with `eagle-jax bench --export-prompts FILE`)")
    lines = path.read_text().splitlines()
    if not lines:
        raise InputFileError(f"{path}: empty (write it with `eagle-jax bench --export-prompts FILE`)")

    def parse(i: int) -> dict:
        try:
            obj = json.loads(lines[i])
        except json.JSONDecodeError as e:
            raise InputFileError(f"{path}:{i + 1}: not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise InputFileError(f"{path}:{i + 1}: expected a JSON object")
        return obj

    header = parse(0)
    if header.get("format") != PROMPTS_FORMAT or header.get("version") != VERSION:
        raise InputFileError(f"{path}:1: not an eagle-jax prompt export (the header needs format={PROMPTS_FORMAT!r}, "
                             f"version={VERSION})")
    for key in ("model", "max_new_tokens", "prompts"):
        if key not in header:
            raise InputFileError(f"{path}:1: the header has no {key!r}")
    if not isinstance(header["max_new_tokens"], int) or header["max_new_tokens"] < 1:
        raise InputFileError(f"{path}:1: max_new_tokens={header['max_new_tokens']!r} must be an integer >= 1")
    prompts, seen = [], {}
    for i in range(1, len(lines)):
        if not lines[i].strip():
            continue
        rec = parse(i)
        if set(rec) != {"id", "prompt_token_ids"}:
            raise InputFileError(f"{path}:{i + 1}: expected the keys id and prompt_token_ids, got {sorted(rec)}")
        ids = rec["prompt_token_ids"]
        if (not isinstance(ids, list) or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
            raise InputFileError(f"{path}:{i + 1}: prompt_token_ids must be a non-empty list of token ids (ints >= 0)")
        key = json.dumps(rec["id"])
        if key in seen:
            raise InputFileError(f"{path}:{i + 1}: id {rec['id']!r} was already used on line {seen[key]}")
        seen[key] = i + 1
        prompts.append(rec)
    if len(prompts) != header["prompts"]:
        raise InputFileError(f"{path}: the header says {header['prompts']} prompts, the file holds {len(prompts)}")
    if not prompts:
        raise InputFileError(f"{path}: no prompts")
    return header, prompts


# ----------------------------------------------------------------------------- generators


class VllmGenerator:
    """Greedy vllm.LLM generate over token-id prompts."""

    name = "vllm-cpu"

    def __init__(self, model: str, dtype: str, max_model_len: int, ignore_eos: bool, seed: int, extra: dict):
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        self._sp, self._tp = SamplingParams, TokensPrompt
        self.ignore_eos = ignore_eos
        self.llm_kwargs = dict(model=model, dtype=dtype, max_model_len=max_model_len, enable_prefix_caching=False,
                               seed=seed, **extra)
        self.llm = LLM(**self.llm_kwargs)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], str | None]]:
        sp = self._sp(temperature=0.0, max_tokens=max_tokens, ignore_eos=self.ignore_eos)
        outs = self.llm.generate([self._tp(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]


class FakeGenerator:
    """The prompt's own tokens, cycled; sleeps 2 ms a request plus 5 ms a new token, so
    the times are real and a 4-token request takes clearly longer than its first token
    even on a loaded machine (at 10 us a token, scheduling noise reversed them in CI).
    Checks the schema and the measurement code without vllm."""

    name = "vllm-cpu (self-check: fake generator)"
    llm_kwargs: dict = {}

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], str | None]]:
        outs = []
        for p in prompts:
            time.sleep(2e-3 + 5e-3 * max_tokens)
            outs.append(([p[j % len(p)] for j in range(max_tokens)], "length"))
        return outs


# ----------------------------------------------------------------------------- measuring


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def measure(gen, prompts: list[dict], max_new_tokens: int, repeats: int, log) -> dict:
    """Warm-up, then ``repeats`` passes: one at a time (TTFT, total), then all at once."""
    ids = [p["prompt_token_ids"] for p in prompts]
    log("warm-up: one request alone, then every prompt at once")
    gen.generate(ids[:1], max_new_tokens)
    gen.generate(ids, max_new_tokens)
    ttft = [[] for _ in ids]
    total = [[] for _ in ids]
    outputs: list = [None] * len(ids)
    concurrent_wall, concurrent_tokens = [], []
    for rep in range(repeats):
        for i, p in enumerate(ids):
            t0 = time.perf_counter()
            gen.generate([p], 1)
            t1 = time.perf_counter()
            [(toks, reason)] = gen.generate([p], max_new_tokens)
            t2 = time.perf_counter()
            ttft[i].append(t1 - t0)
            total[i].append(t2 - t1)
            if rep == 0:
                outputs[i] = (toks, reason)
        t0 = time.perf_counter()
        outs = gen.generate(ids, max_new_tokens)
        concurrent_wall.append(time.perf_counter() - t0)
        concurrent_tokens.append(sum(len(t) for t, _ in outs))
        log(f"pass {rep + 1}/{repeats}: one at a time {sum(t[-1] for t in total):.2f} s, "
            f"all at once {concurrent_wall[-1]:.2f} s")
    rows = []
    for i, p in enumerate(prompts):
        toks, reason = outputs[i]
        t_first, t_all = statistics.median(ttft[i]), statistics.median(total[i])
        decode = (len(toks) - 1) / (t_all - t_first) if len(toks) > 1 and t_all > t_first else None
        rows.append({"id": p["id"], "prompt_tokens": len(p["prompt_token_ids"]), "prompt_token_ids": p["prompt_token_ids"],
                     "ttft_s": t_first, "total_s": t_all, "decode_tokens_per_second": decode,
                     "output_tokens": len(toks), "output_token_ids": toks, "finish_reason": reason,
                     "runs": {"ttft_s": ttft[i], "total_s": total[i]}})
    decodes = [r["decode_tokens_per_second"] for r in rows if r["decode_tokens_per_second"] is not None]
    rates = [n / w for n, w in zip(concurrent_tokens, concurrent_wall)]
    return {
        "requests": rows,
        "concurrent": {"requests": len(ids), "wall_s": spread(concurrent_wall), "tokens_per_second": spread(rates)},
        "medians": {
            "ttft_s": statistics.median(r["ttft_s"] for r in rows),
            "total_s": statistics.median(r["total_s"] for r in rows),
            "decode_tokens_per_second": statistics.median(decodes) if decodes else None,
            "end_to_end_tokens_per_second": sum(r["output_tokens"] for r in rows) / sum(r["total_s"] for r in rows),
            "concurrent_tokens_per_second": statistics.median(rates),
        },
    }


# ----------------------------------------------------------------------------- environment


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def version_of(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def fingerprint() -> dict:
    return {
        "cpu": cpu_model(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cores_total": os.cpu_count(),
        "machine": platform.machine(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "versions": {n: version_of(n) for n in ("vllm", "vllm-cpu", "torch", "transformers")},
        "env": {k: os.environ.get(k) for k in ENV_VARS},
        "ld_preload": os.environ.get("LD_PRELOAD"),
    }


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=Path, required=True, help="the file eagle-jax bench --export-prompts wrote")
    p.add_argument("--model", help="model directory (default: the one in the prompt file's header)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--max-new-tokens", type=int, help="default: the prompt file's (bench's)")
    p.add_argument("--max-model-len", type=int, help="default: the longest prompt + max new tokens")
    p.add_argument("--repeats", type=int, default=3, help="timed passes after the warm-up")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate max new tokens always (bench stops at EOS, so its outputs then differ)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llm-arg", action="append", default=[], metavar="KEY=JSON",
                   help="an extra vllm.LLM keyword (value parsed as JSON, else a string); repeatable")
    p.add_argument("--out", type=Path, default=Path("results") / "peers")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", "--dry-run", dest="check", action="store_true",
                      help="validate the prompt file and the arguments, print what would run, write nothing")
    mode.add_argument("--self-check", action="store_true",
                      help="measure a fake generator (no vllm) and write the result file with the real schema")
    return p.parse_args(argv)


def llm_extra(items: list[str]) -> dict:
    extra = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InputFileError(f"--llm-arg {item!r}: expected KEY=VALUE")
        try:
            extra[key] = json.loads(value)
        except json.JSONDecodeError:
            extra[key] = value
    return extra


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = lambda m: print(f"vllm_driver: {m}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        header, prompts = read_prompts(args.prompts)
        extra = llm_extra(args.llm_arg)
        if args.repeats < 1:
            raise InputFileError(f"--repeats {args.repeats}: must be >= 1")
        max_new = args.max_new_tokens or header["max_new_tokens"]
        if max_new < 1:
            raise InputFileError(f"--max-new-tokens {max_new}: must be >= 1")
        longest = max(len(p["prompt_token_ids"]) for p in prompts)
        max_model_len = args.max_model_len or longest + max_new
        if max_model_len < longest + max_new:
            raise InputFileError(f"--max-model-len {max_model_len}: the longest prompt ({longest}) and "
                                 f"{max_new} new tokens need {longest + max_new}")
        model = args.model or header["model"]
        # The header's model is relative to the prompt file (bench --export-prompts).
        load_from = model if args.model or os.path.isabs(model) else os.path.normpath(args.prompts.parent / model)
    except InputFileError as e:
        print(f"vllm_driver: error: {e}", file=sys.stderr)
        return 2
    out = args.out / f"vllm_cpu_{args.dtype}.json"
    log(f"{len(prompts)} prompts ({longest} tokens at most) x {max_new} new tokens, {args.dtype}, model {model}, "
        f"max_model_len {max_model_len}, {args.repeats} timed passes -> {out}")
    if args.check:
        log("check only: the prompt file and the arguments are valid; nothing written")
        return 0
    if args.self_check:
        gen = FakeGenerator()
    else:
        if not Path(load_from).is_dir():
            print(f"vllm_driver: error: model directory {load_from} does not exist (--model DIR)", file=sys.stderr)
            return 2
        gen = VllmGenerator(load_from, args.dtype, max_model_len, args.ignore_eos, args.seed, extra)
    figures = measure(gen, prompts, max_new, args.repeats, log)
    report = {
        "format": RESULT_FORMAT,
        "version": VERSION,
        "peer": gen.name,
        "self_check": bool(args.self_check),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None
        else shlex.join(["vllm_driver.py", *argv]),
        "model": model,
        "dtype": args.dtype,
        "max_new_tokens": max_new,
        "max_model_len": max_model_len,
        "ignore_eos": args.ignore_eos,
        "repeats": args.repeats,
        "llm_kwargs": {k: v for k, v in gen.llm_kwargs.items()},
        "prompts_file": str(args.prompts),
        "prompts_sha256": hashlib.sha256(args.prompts.read_bytes()).hexdigest(),
        "bench": header.get("bench"),
        "ttft_method": TTFT_METHOD,
        "fingerprint": fingerprint(),
        **figures,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    m = figures["medians"]
    decode = "-" if m["decode_tokens_per_second"] is None else f"{m['decode_tokens_per_second']:.1f}"
    log(f"TTFT median {m['ttft_s'] * 1e3:.1f} ms, decode {decode} tok/s, one at a time "
        f"{m['end_to_end_tokens_per_second']:.1f} tok/s, all at once {m['concurrent_tokens_per_second']:.1f} tok/s")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
