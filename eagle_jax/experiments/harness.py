"""What the measurement commands share: ``eagle-jax bench``, ``ablate`` and ``eval-draft``
each import this module and never one another (``tests/test_experiments_imports.py``).

- Prompts: the suites (built in, or a JSONL prompt file in ``generate``'s format),
  ``select`` (spread evenly over a suite) and ``encode`` (as ``generate`` encodes them).
- Sizing: ``context_sizes``, the cache length and prompt buckets for the longest prompt.
- A run configuration: ``FIELDS`` and ``resolve``, which check a setting of speculative,
  sampling, policy and engine fields and say what runs (a ``Point``): ablate's grid
  points and bench's systems alike.
- Models and engines: ``load_models``, and ``Runner``, which loads models and suites once
  each and builds (and keeps) the engine, with its policy, for a point.
- Timing and figures: ``timed_generate`` (one pass, tokens/s), ``spread`` (median, min,
  max of the passes), ``acceptance`` (accept lengths by depth), ``first_difference``.
- Results: ``timestamp``; every results file's fingerprint is
  ``eagle_jax.environment.fingerprint``.

Module-level imports are the standard library and ``eagle_jax`` leaf modules only, so the
CLI stays fast to start; jax and the engine load on use.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.resources
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from eagle_jax.defaults import pow2_at_least
from eagle_jax.runtime.plan import prompt_buckets_for
from eagle_jax.errors import ConfigError, InputError
from eagle_jax.serving.prompts import PromptRecord, iter_prompt_file
from eagle_jax.serving.scheduler import chunk_plan
from eagle_jax.spec.config import DRAFT_SYNC_MODES, SpeculativeConfig, parse_shape
from eagle_jax.validate import int_at_least, is_number, one_of

# The EAGLE papers' suites (eval-draft's default), then the project's own held-out set:
# chat prompts on topics no training prompt used, and the `make demo` questions.
SUITES = ("mt_bench", "humaneval", "gsm8k", "alpaca")
BUILTIN_SUITES = SUITES + ("held_out",)
# Smallest prefill bucket: shorter buckets would add a compiled graph per engine for
# little saving, since every chat prompt carries the template's system text.
MIN_PROMPT_BUCKET = 64


# ----------------------------------------------------------------------------- suites


@dataclasses.dataclass(frozen=True)
class Suite:
    """One evaluation suite: its name (built-in name or the path as given) and its prompts.

    ``where[i]`` is ``"FILE:LINE"`` of ``records[i]``, for error messages.
    """

    name: str
    path: Path
    records: tuple[PromptRecord, ...]
    where: tuple[str, ...]

    @property
    def builtin(self) -> bool:
        return self.name in BUILTIN_SUITES


def builtin_suite_path(name: str) -> Path:
    """The vendored file of a built-in suite (inside the installed package)."""
    return Path(str(importlib.resources.files("eagle_jax") / "data" / "eval" / f"{name}.jsonl"))


def load_suite(spec: str) -> Suite:
    """A built-in suite by name, or a JSONL prompt file by path; checks every record."""
    if spec in BUILTIN_SUITES:
        path = builtin_suite_path(spec)
    elif spec.endswith(".jsonl") or Path(spec).is_file():
        path = Path(spec)
    else:
        raise InputError(f"unknown suite {spec!r}; valid: {', '.join(BUILTIN_SUITES)}, or a path to a .jsonl prompt file")
    records, where, first_line = [], [], {}
    for loc, rec in iter_prompt_file(path):
        if rec.messages is not None and rec.messages[-1]["role"] != "user":
            raise InputError(f"{loc}: the last message is the {rec.messages[-1]['role']!r}'s; the model answers a 'user' turn")
        if rec.id in first_line:
            raise InputError(f"{loc}: id {rec.id!r} was already used at {first_line[rec.id]}")
        first_line[rec.id] = loc
        records.append(rec)
        where.append(loc)
    if not records:
        raise InputError(f"prompt file {path} holds no prompts")
    return Suite(spec, path, tuple(records), tuple(where))


def select(suite: Suite, max_prompts: int) -> Suite:
    """``max_prompts`` records spread evenly over the suite (0: all).

    Evenly spaced, not the first N: the built-in files are grouped by category (MT-bench
    holds ten questions of each of its eight), so the first ten would all be writing.
    """
    n = len(suite.records)
    if max_prompts == 0 or max_prompts >= n:
        return suite
    idx = [i * n // max_prompts for i in range(max_prompts)]
    return dataclasses.replace(
        suite, records=tuple(suite.records[i] for i in idx), where=tuple(suite.where[i] for i in idx)
    )


def encode(tokenizer, rec: PromptRecord) -> list[int]:
    """Token ids of a record, as ``generate --prompt-file`` makes them."""
    if rec.messages is not None:
        # The chat template already holds BOS where the model wants it.
        return tokenizer.encode(tokenizer.apply_chat_template(list(rec.messages), add_generation_prompt=True))
    return tokenizer.encode(rec.prompt, add_special_tokens=True)


def context_sizes(longest: int, max_new_tokens: int, context: int) -> tuple[int, tuple[int, ...]]:
    """(max_seq_len, prompt_buckets) for the longest prompt: the CLI's rule
    (``runtime.plan.prompt_buckets_for`` from ``MIN_PROMPT_BUCKET``)."""
    max_seq_len = min(context, pow2_at_least(longest + max_new_tokens))
    return max_seq_len, prompt_buckets_for(longest, max_seq_len, MIN_PROMPT_BUCKET)


# ----------------------------------------------------------------------------- a run configuration

POLICIES = ("fixed", "threshold", "auto")
VERIFY = ("coupled", "rejection")


def _int(lo: int) -> Callable[[str, Any], int]:
    def check(field: str, v: Any) -> int:
        return int_at_least(field, v, lo)
    return check


def _float(lo: float, hi: float | None = None, lo_open: bool = False) -> Callable[[str, Any], float]:
    def check(field: str, v: Any) -> float:
        if not is_number(v) or v < lo or (lo_open and v == lo) or (hi is not None and v > hi):
            rng = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}{']' if hi is not None else ')'}"
            raise ConfigError(f"{field}={v!r} must be a number in {rng}")
        return float(v)
    return check


def _choice(options: tuple[str, ...]) -> Callable[[str, Any], str]:
    def check(field: str, v: Any) -> str:
        return one_of(field, v, options)
    return check


def _text(field: str, v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ConfigError(f"{field}={v!r} must be a non-empty string")
    return v


def _shape(field: str, v: Any) -> str:
    v = _text(field, v)
    if v.strip() != "plain":
        parse_shape(v)  # a ConfigError names the forms
    return v.strip()


# name: (check, default, what). None default: not set unless given.
FIELDS: dict[str, tuple[Callable[[str, Any], Any], Any, str]] = {
    "shape": (_shape, None, "draft shape: plain, 'chain S=n' or 'tree S=n k=n T=n'"),
    "steps": (_int(1), None, "draft steps S (with topk, draft_tokens: another way to give the shape)"),
    "topk": (_int(1), 1, "draft top-k per step"),
    "draft_tokens": (_int(1), None, "tree size T (topk > 1)"),
    "policy": (_choice(POLICIES), "fixed", "speculation policy"),
    "threshold": (_int(1), None, "spec_disable_batch_threshold (policy threshold)"),
    "temperature": (_float(0.0), 0.0, "sampling temperature (0: greedy)"),
    "top_p": (_float(0.0, 1.0, lo_open=True), 1.0, "nucleus sampling"),
    "top_k": (_int(0), 0, "top-k sampling (0: off)"),
    "sampling_verify": (_choice(VERIFY), "coupled", "how sampled drafts are verified"),
    "batch_size": (_int(1), 1, "engine batch (continuous batching over the prompts)"),
    "draft": (_text, None, "draft checkpoint directory"),
    "model": (_text, None, "target model directory (default: the default model)"),
    "suite": (_text, "mt_bench", "built-in suite name or .jsonl prompt file"),
    "max_prompts": (_int(0), 8, "prompts taken evenly from the suite (0: all)"),
    "max_new_tokens": (_int(1), 64, "tokens generated per prompt"),
    "repeats": (_int(1), 3, "interleaved timed passes per point"),
    "seed": (_int(0), 0, "seed of prompt i is seed + i"),
    "dtype": (_choice(("float32", "bfloat16")), "float32", "parameter dtype"),
    # None default: points that do not set it keep the keys they had before the field existed.
    "draft_sync": (_choice(DRAFT_SYNC_MODES), None, "how the draft follows plain steps (unset: the engine's auto)"),
}


@dataclasses.dataclass(frozen=True)
class Point:
    """One resolved run configuration: every field's value, and what runs."""

    values: dict[str, Any]
    speculative: SpeculativeConfig | None  # None: plain decoding only

    @property
    def key(self) -> str:
        return json.dumps(self.values, sort_keys=True)


def resolve(given: dict[str, Any]) -> Point:
    """Field values (checked, defaults filled) and the speculative setting they mean."""
    values = {}
    for k, (check, default, _) in FIELDS.items():
        if k in given:
            values[k] = check(k, given[k])
        elif default is not None:
            values[k] = default
    shape = values.get("shape")
    if shape is not None and any(k in given for k in ("steps", "draft_tokens")):
        raise ConfigError("shape and steps/draft_tokens both given: use one way to name the draft shape")
    verify = dict(sampling_verify=values["sampling_verify"])
    policy = values["policy"]
    if policy == "auto":
        if shape not in (None, "plain") or "steps" in values:
            raise ConfigError("policy='auto' picks among its own candidate shapes; drop shape/steps from this point")
        spec = SpeculativeConfig(num_steps=1, **verify)  # auto's sampling settings; its candidates are its own
    elif shape == "plain" or (shape is None and "steps" not in values):
        if policy != "fixed" or "threshold" in values:
            raise ConfigError(f"policy={policy!r} needs a draft shape (shape or steps)")
        spec = None
    elif shape is not None:
        spec = parse_shape(shape, **verify)
    else:
        s, k = values["steps"], values["topk"]
        t = values.get("draft_tokens")
        if k == 1 and t is not None and t != s:
            raise ConfigError(f"draft_tokens={t} with topk=1: a chain of steps={s} drafts {s} tokens")
        if k > 1 and t is None:
            raise ConfigError(f"topk={k} needs draft_tokens (the tree size T)")
        spec = SpeculativeConfig(num_steps=s, topk=k, num_draft_tokens=t if k > 1 else None, **verify)
    if policy == "threshold" and "threshold" not in values:
        raise ConfigError("policy='threshold' needs threshold (the batch size above which speculation is off)")
    if "threshold" in values and policy != "threshold":
        raise ConfigError(f"threshold={values['threshold']} goes with policy='threshold' (not {policy!r})")
    if spec is not None and "draft" not in values:
        raise ConfigError("a speculative point needs draft (a draft checkpoint directory)")
    return Point(values, spec)


# ----------------------------------------------------------------------------- models and engines


def load_models(model_dir: str | Path, draft_dir: str | Path | None, dtype: str | None):
    """Target and draft (None without a draft directory), loaded once for every engine; with
    a draft, the target is built to return the draft's feature layers."""
    from eagle_jax.checkpoint.hf import load_model

    if draft_dir is None:
        return load_model(model_dir, dtype=dtype), None
    from eagle_jax.checkpoint.draft_io import load_draft, read_draft_config
    from eagle_jax.models.registry import read_target_config

    tcfg = read_target_config(Path(model_dir))
    dcfg = read_draft_config(Path(draft_dir), target_cfg=tcfg)
    target = load_model(Path(model_dir), dtype=dtype, config=tcfg.replace(aux_layer_ids=dcfg.aux_layer_ids))
    return target, load_draft(Path(draft_dir), target=target, dtype=dtype)


class Runner:
    """Loads models, suites and engines once each: the engine for a run configuration
    (a ``Point``), built with its policy."""

    MAX_ENGINES = 6  # bound the compiled graphs held

    def __init__(self, log=print):
        self.log = log
        self._models: dict = {}
        self._engines: dict = {}
        self._suites: dict = {}

    def models(self, model_dir: str, draft_dir: str | None, dtype: str):
        """The models every engine of ``dtype`` shares, loaded as the engine would load
        them from their directories: float32 where the plan streams bfloat16 weight panels
        (bfloat16 on a CPU with the packed kernel; loaded in bfloat16 they would run XLA's
        emulated bfloat16 arithmetic, about 10x slower)."""
        from eagle_jax.runtime.plan import model_dtype, resolve_plan

        key = (model_dir, draft_dir, dtype)
        if key not in self._models:
            self._models[key] = load_models(model_dir, draft_dir, model_dtype(resolve_plan(dtype=dtype), dtype))
        return self._models[key]

    def prompts(self, suite: str, max_prompts: int, tokenizer) -> tuple[Suite, list[list[int]]]:
        key = (suite, max_prompts)
        if key not in self._suites:
            s = select(load_suite(suite), max_prompts)
            self._suites[key] = (s, [encode(tokenizer, r) for r in s.records])
        return self._suites[key]

    def engine(self, target, draft, tokenizer, point: Point, max_seq_len: int, buckets, speculative: bool):
        """The point's plain engine (no draft) or its speculative one, at its batch size."""
        from eagle_jax.serving.engine import Engine, EngineConfig, default_policy

        v = point.values
        sampled = v["temperature"] > 0
        spec = point.speculative if speculative else None
        # Every setting the engine is built with: a sweep over suites needs other cache
        # and prompt buckets for each (a longer suite's prompts do not fit the last one's).
        key = (id(target), id(draft) if spec is not None else None, max_seq_len, tuple(buckets), v["batch_size"], sampled,
               v["policy"] if spec is not None else None, spec.shape if spec is not None else None,
               v.get("threshold"), spec.sampling_verify if spec is not None else None, v.get("draft_sync"))
        if key in self._engines:
            return self._engines[key]
        if len(self._engines) >= self.MAX_ENGINES:
            self._engines.pop(next(iter(self._engines)))
        # The point's dtype reaches the engine too: its plan (bfloat16 panels on a CPU with
        # the packed kernel) follows it, as it does for an engine loading a directory.
        base = dict(max_batch=v["batch_size"], batch_buckets=(v["batch_size"],), max_seq_len=max_seq_len,
                    prompt_buckets=buckets, sampled_steps=sampled, dtype=v["dtype"])
        if spec is not None and v.get("draft_sync") is not None:
            base["draft_sync"] = v["draft_sync"]
        if spec is None:
            cfg = EngineConfig(spec_policy="plain", **base)
        else:
            threshold = v["threshold"] if v["policy"] == "threshold" else None
            cfg = EngineConfig(speculative=spec, spec_policy=v["policy"], spec_disable_batch_threshold=threshold, **base)
        policy = default_policy(cfg, v.get("draft"))  # auto: the draft's model card is its prior
        engine = Engine(target, draft if spec is not None else None, cfg, tokenizer, policy=policy, progress=False)
        self._engines[key] = engine
        return engine


# ----------------------------------------------------------------------------- timing and figures


def timed_generate(engine, prompts, params) -> tuple[list, float]:
    """(completions, tokens/s) of one pass of ``engine.generate`` over the prompts: the
    tokens generated (each up to its stop) over the pass's wall time."""
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    return out, sum(len(c.token_ids) for c in out) / (time.perf_counter() - t0)


def spread(xs: list[float]) -> dict[str, Any]:
    """Median, min and max of the timed passes, and the passes."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def acceptance(accept_lengths: Sequence[int], num_steps: int) -> dict[str, Any]:
    """Mean accept length and acceptance rate by depth from per-step accept lengths.

    An accept length n counts the n-1 accepted drafts plus the target's bonus token, so a
    step accepted depth d (1..S) when n-1 >= d; the rate at depth d is the share of
    speculative steps that did (the definition ``EngineMetrics`` uses).
    """
    n = len(accept_lengths)
    hist = collections.Counter(accept_lengths)
    if n == 0:
        return {"steps": 0, "mean_accept_length": None, "acceptance_rate_by_depth": None, "accept_length_histogram": {}}
    return {
        "steps": n,
        "mean_accept_length": sum(accept_lengths) / n,
        "acceptance_rate_by_depth": [sum(v for k, v in hist.items() if k - 1 >= d) / n for d in range(1, num_steps + 1)],
        "accept_length_histogram": {str(k): hist[k] for k in sorted(hist)},
    }


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first index where two token sequences differ (the shorter's length when one is
    a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def prefill_ttft(table, samp, prompt: list[int], chunks: tuple[int, ...]) -> float:
    """Seconds from a batch-1 prefill's first chunk launch (``scheduler.chunk_plan`` over
    ``chunks``, each a compiled prefill graph of ``table``) to its first token on the host."""
    put = table.device_put_rows
    length = put(np.asarray([len(prompt)], np.int32))
    t0 = time.perf_counter()
    state, start = table.zeros(1), 0
    for c in chunk_plan(len(prompt), chunks):
        tok = np.zeros((1, c), np.int32)
        piece = prompt[start : start + c]
        tok[0, : len(piece)] = piece
        nxt = np.asarray([prompt[start + c] if start + c < len(prompt) else 0], np.int32)
        state, first = table.prefill_chunk(state, put(tok), put(np.asarray([start], np.int32)), length, put(nxt), samp)
        start += c
    int(np.asarray(first)[0])
    return time.perf_counter() - t0


def timestamp() -> str:
    """UTC now, as every results file records when it finished."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
