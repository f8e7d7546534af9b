"""``eagle-jax eval-draft``: a draft's acceptance and speedup on the suites the EAGLE papers
report (MT-bench, HumanEval, GSM8K, Alpaca), at batch 1, greedy.

Per suite, in one run: acceptance rate by draft depth and mean accept length for each
draft shape (default: chains S=1..5 and the tree S=3 k=4 T=8), and plain and speculative
tokens/s with their ratio. Passes are interleaved (plain, then each shape, over the same
prompts, ``--repeats`` times), so a slow drift of a shared machine hits every shape alike;
tokens/s are medians over the passes. Every speculative output must equal plain decoding
token for token: a difference is an ``OutputMismatchError`` naming suite, prompt and shape.

Suites: the four built-in files (``eagle_jax/data/eval``, the EAGLE authors' question
files, Apache-2.0: see NOTICE there), the built-in ``held_out`` set (20 chat prompts: 16
on topics no training prompt of ``draft-data``'s synthetic set used, and the 4 ``make
demo`` questions; not run unless named), or any JSONL prompt file in ``generate``'s format.
A record's ``messages`` go through the model's chat template (a ``prompt`` is raw text);
the model answers the last turn, which must be the user's. MT-bench records keep their
second question in ``second_turn``, which is not used: answering it needs the model's own
first answer in the context, and the papers' first-turn figures are what this compares.

Engines: a plain one without the draft (plain decoding pays nothing for a draft), and one
speculative engine holding every shape, whose policy (``SwitchedPolicy``) is set to one
shape per pass: the prefill graphs are compiled once, not once per shape. Both compile
greedy steps only.

Tokens/s: generated tokens over the wall time of ``Engine.generate`` on the whole suite
(requests queued and run one at a time, batch 1). It includes each prompt's prefill, the
decode steps, the host loop and incremental detokenization; it excludes compilation (done
when the engines are built, and checked: compiles during timed passes are counted) and
prompt tokenization. Plain and speculative runs produce the same tokens, so their ratio
is the ratio of wall times.

Module-level imports are the standard library and ``eagle_jax`` leaf modules only, so the
CLI stays fast to start; jax, the engine and matplotlib load on use.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

from eagle_jax.defaults import default_model_dir, enable_compilation_cache, positive_int
from eagle_jax.environment import fingerprint
from eagle_jax.errors import InputError
from eagle_jax.experiments.harness import (
    BUILTIN_SUITES,
    SUITES,
    Suite,
    acceptance,
    context_sizes,
    encode,
    first_difference,
    load_models,
    load_suite,
    select,
    timed_generate,
)
from eagle_jax.serving.policy import SpeculationPolicy

# Chains S=1..5 and the default tree of `generate`.
DEFAULT_SHAPES = ("1", "2", "3", "4", "5", "3/4/8")
DEFAULT_OUT = Path("results/eval_draft.json")
# Tokens generated with each shape (and plain) before timing, so one-time host-side costs are not timed.
WARMUP_TOKENS = 8


class OutputMismatchError(AssertionError):
    """A greedy speculative output differs from plain decoding (a bug, not bad input)."""


# ----------------------------------------------------------------------------- shapes


def parse_shape(text: str) -> tuple[int, ...]:
    """argparse type: ``S`` is a chain of S draft steps, ``S/k/T`` a tree (depth S,
    branching k, T tokens verified per step). Syntax only: ``shape_config`` checks the values
    (it needs jax, which the CLI does not import to parse its arguments)."""
    parts = text.split("/")
    if len(parts) not in (1, 3) or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"shape {text!r}: give S (a chain of S steps) or S/k/T (a tree), e.g. 3 or 3/4/8")
    return tuple(int(p) for p in parts)


def shape_config(nums: tuple[int, ...]):
    """The SpeculativeConfig of a parsed ``--shapes`` item."""
    from eagle_jax.errors import ConfigError
    from eagle_jax.spec.steps import SpeculativeConfig

    try:
        if len(nums) == 1:
            return SpeculativeConfig(num_steps=nums[0])
        return SpeculativeConfig(num_steps=nums[0], topk=nums[1], num_draft_tokens=nums[2])
    except ConfigError as e:
        raise InputError(f"--shapes {'/'.join(map(str, nums))}: {e}") from e


def shape_arg(cfg) -> str:
    """The ``--shapes`` text of a SpeculativeConfig (inverse of ``parse_shape``)."""
    return str(cfg.num_steps) if cfg.is_chain else f"{cfg.num_steps}/{cfg.topk}/{cfg.num_draft_tokens}"


# ----------------------------------------------------------------------------- figures


def check_identical(suite: Suite, shape: str, plain, spec, pass_no: int) -> int:
    """Raise ``OutputMismatchError`` unless every speculative output equals plain decoding;
    returns the number of outputs compared."""
    for where, rec, p, s in zip(suite.where, suite.records, plain, spec, strict=True):
        if p.token_ids != s.token_ids:
            j = first_difference(p.token_ids, s.token_ids)
            a = p.token_ids[j] if j < len(p.token_ids) else "end"
            b = s.token_ids[j] if j < len(s.token_ids) else "end"
            raise OutputMismatchError(
                f"suite {suite.name}, prompt {rec.id!r} ({where}), shape {shape}, pass {pass_no}: greedy speculative "
                f"output differs from plain decoding at token {j} (plain {a}, speculative {b}; lengths "
                f"{len(p.token_ids)} and {len(s.token_ids)})"
            )
    return len(plain)


# ----------------------------------------------------------------------------- paths


def _display_path(p: Path) -> str:
    """``p`` relative to the working directory when inside it: no machine paths in results."""
    try:
        return str(Path(p).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------- the run


class SwitchedPolicy(SpeculationPolicy):
    """A speculation policy (``eagle_jax.serving.policy.SpeculationPolicy``) that speculates with
    whichever of its shapes eval-draft set last: one engine holds every shape, so the
    prefill and insert graphs are compiled once, not once per shape."""

    runs_plain = False

    def __init__(self, shapes: Sequence):
        self.shapes = tuple(shapes)
        self.current = self.shapes[0]

    def choose(self, bucket: int):
        return self.current

    def observe(self, bucket, shape, accept_lengths, step_s) -> None:
        pass

    def describe(self) -> str:
        return f"eval-draft: one of {', '.join(s.shape for s in self.shapes)}, switched between passes"


def run_eval(
    target, draft, tokenizer, suites: Sequence[Suite], shapes: Sequence, *, max_new_tokens: int, repeats: int,
    log=print,
) -> dict[str, Any]:
    """Every suite through plain decoding and each shape; returns the figures.

    Two engines: a plain one without the draft (so plain decoding does not pay for keeping
    a draft in sync), and one holding every shape, switched between passes by its policy.
    Greedy-only steps are compiled (half the graphs; nothing here samples).
    """
    import jax.numpy as jnp

    from eagle_jax.serving.engine import Engine, EngineConfig, compile_count
    from eagle_jax.spec.sampling import SamplingParams

    prompts = {s.name: [encode(tokenizer, r) for r in s.records] for s in suites}
    context = target.config.max_position_embeddings
    longest = max(len(p) for ps in prompts.values() for p in ps)
    max_seq_len, buckets = context_sizes(longest, max_new_tokens, context)
    for s in suites:
        for where, rec, p in zip(s.where, s.records, prompts[s.name]):
            if len(p) >= max_seq_len:
                raise InputError(
                    f"suite {s.name}, prompt {rec.id!r} ({where}): {len(p)} tokens; the model's context holds "
                    f"{context}, leaving no room for a new token"
                )
    base = dict(max_batch=1, max_seq_len=max_seq_len, prompt_buckets=buckets, sampled_steps=False)
    progress = sys.stderr.isatty()
    log(f"building 2 engines (plain; {len(shapes)} shapes), max_seq_len {max_seq_len}, prompt buckets {buckets}")
    plain = Engine(target, None, EngineConfig(spec_policy="plain", **base), tokenizer, progress=progress)
    policy = SwitchedPolicy(shapes)
    spec = Engine(target, draft, EngineConfig(speculative=shapes[0], **base), tokenizer, policy=policy, progress=progress)
    runs_order = [("plain", None)] + [(cfg.shape, cfg) for cfg in shapes]

    def engine_for(cfg):
        if cfg is None:
            return plain
        policy.current = cfg
        return spec

    sp = SamplingParams(max_new_tokens=max_new_tokens)
    # Every accept length each engine produced, warm-up included, to check against its metrics.
    seen = []
    first = prompts[suites[0].name][:1]
    for name, cfg in runs_order:
        for c in engine_for(cfg).generate(first, SamplingParams(max_new_tokens=min(WARMUP_TOKENS, max_new_tokens))):
            seen += c.accept_lengths

    compiles_before = compile_count()
    results, plain_outputs = {}, {}
    for suite in suites:
        ps = prompts[suite.name]
        runs = {name: [] for name, _ in runs_order}
        accepts = {cfg.shape: [] for cfg in shapes}
        compared = collections.Counter()
        plain_out = None
        for rep in range(repeats):
            # Plain, then each shape, over the same prompts: drifts of a shared machine hit all alike.
            for name, cfg in runs_order:
                out, tps = timed_generate(engine_for(cfg), ps, sp)
                runs[name].append(tps)
                if cfg is None:
                    plain_out = out
                    continue
                got = [a for c in out for a in c.accept_lengths]
                seen += got
                if got and max(got) > cfg.max_accept:
                    raise RuntimeError(f"{name}: an accept length of {max(got)} (at most {cfg.max_accept}): another shape ran")
                compared[name] += check_identical(suite, name, plain_out, out, rep + 1)
                if rep == 0:  # greedy and identical to plain: later passes repeat these
                    accepts[name] = got
            log(f"{suite.name} pass {rep + 1}/{repeats}: " + ", ".join(f"{n} {r[-1]:.1f}" for n, r in runs.items()) + " tok/s")
        plain_tps = statistics.median(runs["plain"])
        lengths = [len(p) for p in ps]
        entry = {
            "source": "built-in" if suite.builtin else _display_path(suite.path),
            "prompts": len(ps),
            "prompt_ids": [r.id for r in suite.records],
            "prompt_tokens": {"min": min(lengths), "mean": sum(lengths) / len(lengths), "max": max(lengths)},
            "generated_tokens": sum(len(c.token_ids) for c in plain_out),
            "finish_reasons": dict(collections.Counter(c.finish_reason for c in plain_out)),
            "plain": {"tokens_per_s": plain_tps, "runs": runs["plain"]},
            "shapes": {},
        }
        for cfg in shapes:
            name = cfg.shape
            tps = statistics.median(runs[name])
            entry["shapes"][name] = {
                **acceptance(accepts[name], cfg.num_steps),
                "tokens_per_s": tps,
                "runs": runs[name],
                "speedup": tps / plain_tps,
                "speedup_per_pass": [s / p for s, p in zip(runs[name], runs["plain"])],
                "identical_to_plain": True,
                "outputs_compared": compared[name],
            }
        results[suite.name] = entry
        plain_outputs[suite.name] = (ps, plain_out)

    # The per-suite figures come from the completions; the engine counted the same steps.
    summary = spec.metrics.summary()
    engine_steps = sum(summary["accept_length_histogram"].values())
    ours = acceptance(seen, max(cfg.num_steps for cfg in shapes))
    if ours["steps"] != engine_steps or (engine_steps and (
        abs(ours["mean_accept_length"] - summary["mean_accept_length"]) > 1e-9
        or any(abs(a - b) > 1e-4 for a, b in zip(ours["acceptance_rate_by_depth"], summary["acceptance_rate_by_depth"]))
    )):
        raise RuntimeError(
            f"accept lengths of the completions ({ours['steps']} steps, mean {ours['mean_accept_length']}, by depth "
            f"{ours['acceptance_rate_by_depth']}) disagree with EngineMetrics ({engine_steps} steps, mean "
            f"{summary['mean_accept_length']}, by depth {summary['acceptance_rate_by_depth']})"
        )
    compiles_during_timing = compile_count() - compiles_before
    # After the timed passes: the features and the unrolled draft compile graphs of their own.
    for name, (ps, outs) in plain_outputs.items():
        results[name]["teacher_forced"] = _teacher_forced(target, draft, ps, outs, max(cfg.num_steps for cfg in shapes))
    return {
        "max_seq_len": max_seq_len,
        "prompt_buckets": list(buckets),
        "dtype": jnp.dtype(target.dtype).name,
        "compiles_during_timing": compiles_during_timing,
        "suites": results,
        "engine_totals": {
            "note": "every speculative step of the run (all suites and shapes, warm-up included), from EngineMetrics",
            "steps": engine_steps,
            **{k: summary[k] for k in ("mean_accept_length", "acceptance_rate_by_depth")},
        },
    }


def _teacher_forced(target, draft, prompts, outputs, steps: int) -> dict[str, Any]:
    """The draft's agreement with the target by step on this suite's plain (greedy)
    outputs, fed the true tokens, as training measures it on its held-out prompts
    (``ttt.teacher_forced_agreement``), and the chain accept length it predicts. Set
    beside the engine's acceptance by depth it tells a harder prompt set (agreement low
    here too) from a draft the engine runs differently (agreement high, acceptance low)."""
    from eagle_jax.train.data import Conversation, extract_features
    from eagle_jax.train.ttt import expected_accept_length, teacher_forced_agreement

    convs = [Conversation(list(p), list(c.token_ids)) for p, c in zip(prompts, outputs) if len(c.token_ids) > 1]
    if not convs:
        return {"agreement_by_step": None, "positions": [0] * steps, "predicted_chain_accept_length": None}
    data = extract_features(target, convs, max_len=max(len(c.prompt_ids) + len(c.response_ids) for c in convs), batch_size=1)
    got = teacher_forced_agreement(draft, target, data, steps)
    return {
        "measures": "top-1 agreement with the target's greedy token by draft step on the plain outputs, the true tokens "
                    "fed (training's held-out metric); predicted chain accept length = 1 + sum_k prod_{j<=k} agreement_j",
        "agreement_by_step": got["agreement"],
        "positions": got["positions"],
        "predicted_chain_accept_length": {str(s): expected_accept_length(got["agreement"][:s]) for s in range(1, steps + 1)},
    }


# ----------------------------------------------------------------------------- output


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown_table(report: dict[str, Any]) -> str:
    lines = [
        "| suite | shape | accept length | acceptance by depth | plain tok/s | spec tok/s | speedup |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for suite, entry in report["suites"].items():
        plain = entry["plain"]["tokens_per_s"]
        for shape, row in entry["shapes"].items():
            depth = row["acceptance_rate_by_depth"]
            lines.append(
                f"| {suite} | {shape} | {_fmt(row['mean_accept_length'], '.2f')} | "
                f"{' / '.join(f'{a:.2f}' for a in depth) if depth else '-'} | {plain:.1f} | "
                f"{row['tokens_per_s']:.1f} | {row['speedup']:.2f}x |"
            )
    for suite, entry in report["suites"].items():
        tf = entry.get("teacher_forced") or {}
        if tf.get("agreement_by_step"):
            lines.append(
                f"\n{suite}: teacher-forced agreement by step {' / '.join(f'{a:.2f}' for a in tf['agreement_by_step'])} "
                f"(chain accept length it predicts: "
                + ", ".join(f"S={s} {v:.2f}" for s, v in tf["predicted_chain_accept_length"].items()) + ")"
            )
    return "\n".join(lines)


def save_figure(report: dict[str, Any], path: Path) -> None:
    """Mean accept length per suite and shape (bars), and acceptance by depth per suite.

    A function of the report alone, so a saved JSON can be drawn again."""
    # The object API draws without pyplot's global state or an interactive backend.
    from matplotlib.figure import Figure

    suites = list(report["suites"])
    shapes = list(next(iter(report["suites"].values()))["shapes"])
    colors = {shape: f"C{j}" for j, shape in enumerate(shapes)}  # one color per shape in every panel
    fig = Figure(figsize=(4.5 * (1 + len(suites)), 4.6), layout="constrained")
    axes = fig.subplots(1, 1 + len(suites), squeeze=False)[0]
    ax = axes[0]
    width = 0.8 / len(shapes)
    top = 1.0
    for j, shape in enumerate(shapes):
        vals = [report["suites"][s]["shapes"][shape]["mean_accept_length"] or 1.0 for s in suites]
        top = max(top, *vals)
        # Bars start at 1: a step of plain decoding yields one token.
        ax.bar([i + (j - (len(shapes) - 1) / 2) * width for i in range(len(suites))], [v - 1 for v in vals], width,
               bottom=1, color=colors[shape], label=shape)
    ax.set_xticks(range(len(suites)), suites)
    ax.set_ylim(1, top + 0.1 * (top - 1) + 0.05)
    ax.set_ylabel("mean accept length (tokens per step)")
    ax.set_title("accept length")
    for ax, suite in zip(axes[1:], suites):
        deepest = 1
        for shape in shapes:
            depth = report["suites"][suite]["shapes"][shape]["acceptance_rate_by_depth"]
            if depth:
                ax.plot(range(1, len(depth) + 1), depth, marker="o", color=colors[shape])
                deepest = max(deepest, len(depth))
        ax.set_xticks(range(1, deepest + 1))
        ax.set_ylim(0, 1)
        ax.set_xlabel("draft depth")
        ax.set_ylabel("acceptance rate")
        ax.set_title(f"{suite}: acceptance by depth")
    fig.legend(loc="outside lower center", ncol=min(len(shapes), 6))
    fig.suptitle(f"{report['settings']['draft']}: batch 1, greedy, {report['settings']['max_new_tokens']} new tokens")
    fig.savefig(path, dpi=110)


def command_line(args: argparse.Namespace, model_dir: Path) -> str:
    """The run as one command with every option spelled out (defaults included)."""
    parts = ["eagle-jax", "eval-draft", "--draft", _display_path(args.draft), "--model", _display_path(model_dir)]
    for s in args.suite:
        parts += ["--suite", s if s in BUILTIN_SUITES else _display_path(Path(s))]
    parts += ["--shapes", *map(shape_arg, args.shapes)]
    parts += ["--max-prompts", str(args.max_prompts), "--max-new-tokens", str(args.max_new_tokens)]
    parts += ["--repeats", str(args.repeats), "--out", _display_path(args.out)]
    if args.dtype is not None:
        parts += ["--dtype", args.dtype]
    return shlex.join(parts)


def cmd_eval_draft(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from eagle_jax.checkpoint.hf import resolve_dtype
    from eagle_jax.checkpoint.tokenizer import Tokenizer

    args.suite = args.suite or list(SUITES)
    args.shapes = [shape_config(nums) for nums in args.shapes]
    for name, items in (("suite", args.suite), ("shape", [c.shape for c in args.shapes])):
        dup = next((x for i, x in enumerate(items) if x in items[:i]), None)
        if dup is not None:
            raise InputError(f"{name} {dup} is given twice")
    # Everything the user gave is checked before the slow part (loading, compiling).
    suites = [select(load_suite(s), args.max_prompts) for s in args.suite]
    model_dir = args.model or default_model_dir()
    if not model_dir.is_dir():
        raise InputError(f"model directory {model_dir} not found (run `make model`, or pass --model DIR)")
    if not args.draft.is_dir():
        raise InputError(f"draft directory {args.draft} not found")
    if args.out.suffix != ".json":
        raise InputError(f"--out {args.out}: give a .json path (the figure goes beside it as .png)")
    command = command_line(args, model_dir)
    enable_compilation_cache()
    dtype = resolve_dtype(args.dtype)
    tokenizer = Tokenizer.from_dir(model_dir)
    target, draft = load_models(model_dir, args.draft, dtype)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    log(f"eval-draft: {len(suites)} suite(s) x {len(args.shapes)} shape(s), {args.repeats} pass(es); {command}")
    figures = run_eval(
        target, draft, tokenizer, suites, args.shapes, max_new_tokens=args.max_new_tokens, repeats=args.repeats, log=log
    )
    figure_path = args.out.with_suffix(".png")
    report = {
        "command": command,
        "environment": fingerprint(jnp.dtype(dtype).name),
        "settings": {
            "model": _display_path(model_dir),
            "model_config_sha256": _sha256(model_dir / "config.json"),
            "draft": _display_path(args.draft),
            "draft_files_sha256": {p.name: _sha256(p) for p in sorted(args.draft.glob("*.safetensors"))},
            "suites": [s.name for s in suites],
            "shapes": [c.shape for c in args.shapes],
            "max_prompts": args.max_prompts,
            "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats,
            "batch": 1,
            "decoding": "greedy",
            "max_seq_len": figures.pop("max_seq_len"),
            "prompt_buckets": figures.pop("prompt_buckets"),
            "dtype": figures.pop("dtype"),
        },
        "tokens_per_s_measures": (
            "generated tokens / wall time of Engine.generate over the suite's prompts (batch 1, one request at a "
            "time): prefill, decode steps, host loop and detokenization; not compilation or prompt tokenization. "
            "Plain runs on an engine without the draft. Median over passes; passes interleave plain and each "
            "shape over the same prompts."
        ),
        **figures,
        "figure": _display_path(figure_path),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    save_figure(report, figure_path)
    print(markdown_table(report))
    print(
        f"\n{report['environment']['cpu']} ({report['environment']['cpus_usable']} usable CPUs), "
        f"{report['settings']['dtype']}; compiles during timed passes: {report['compiles_during_timing']}"
    )
    log(f"wrote {args.out} and {figure_path}")
    return 0


def _non_negative_int(s: str) -> int:
    v = int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"{s} must be >= 0")
    return v


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``eval-draft`` on the CLI's subparsers (its handler is ``args.func``)."""
    p = subparsers.add_parser(
        "eval-draft",
        help="a draft's acceptance and speedup on MT-bench, HumanEval, GSM8K, Alpaca",
        description=(
            "Run each suite at batch 1, greedy, through plain decoding and each draft shape (interleaved "
            "passes), check every speculative output equals plain decoding, and report acceptance by "
            "depth, mean accept length, tokens/s and speedup. Writes a JSON report with the command and "
            "an environment fingerprint, a PNG beside it, and prints a markdown table."
        ),
    )
    p.add_argument("--draft", type=Path, required=True, metavar="DIR", help="EAGLE-3 draft directory")
    p.add_argument("--model", type=Path, default=None, metavar="DIR", help="target model directory (default: checkpoints/<default>)")
    p.add_argument(
        "--suite", action="append", default=None, metavar="NAME|FILE.jsonl",
        help=f"repeatable: {', '.join(BUILTIN_SUITES)} (built in), or a JSONL prompt file (default: the EAGLE papers' "
             f"four, {', '.join(SUITES)})",
    )
    p.add_argument(
        "--shapes", nargs="+", type=parse_shape, default=[parse_shape(s) for s in DEFAULT_SHAPES], metavar="SHAPE",
        help=f"draft shapes: S (a chain of S steps) or S/k/T (a tree); default: {' '.join(DEFAULT_SHAPES)}",
    )
    p.add_argument("--max-prompts", type=_non_negative_int, default=20, help="prompts per suite, spread evenly (0 = all; default 20)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--repeats", type=positive_int, default=1, help="interleaved passes; tokens/s are medians (default 1)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="default: float32 on CPU, bfloat16 on GPU")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON report; the PNG goes beside it (default {DEFAULT_OUT})")
    p.set_defaults(func=cmd_eval_draft)
    return p
