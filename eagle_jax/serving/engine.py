"""The engine: one host loop over a step table, with a speculation policy.

Lifecycle (objects are whole or absent):

1. ``EngineConfig`` validates every field in ``__post_init__``.
2. ``Engine(...)`` loads the models, checks that the draft fits the target, builds the
   ``runtime.StepTable`` (every graph it will ever run: prefill per prompt bucket and
   prefill batch, row insert and resize per batch bucket, the plain step and every
   speculative shape the policy may choose per batch bucket) and compiles it. Only then
   does an ``Engine`` instance come into being (the build happens in ``__new__``), so a
   failure anywhere raises the original error, with a note saying what was being built,
   and leaves no half-built engine to call. After that the table cannot compile.
3. ``step()`` is the host loop's unit: admit queued requests into free slots (growing the
   batch bucket if needed; requests admitted together are prefilled in one call per
   prompt bucket), ask the policy which step to run, dispatch it, then handle the
   *previous* step's tokens while the device runs this one.

This is the only host loop: ``generate.Generator`` and ``generate.SpeculativeGenerator``
are thin wrappers that size an engine to their call.

Phase timing (``EngineConfig.time_phases``): speculative steps run as their two graphs,
the draft phase and the verify phase, each waited for, so ``EngineMetrics`` can say how
the step's time splits between drafting and verification. It is a measuring mode: the
syncs cost the host/device overlap, so steps are slower than the default fused step.

Slots: the live batch is a ``SpecState`` whose rows are slots. A bucket change (more
requests than rows, or few enough to fit a smaller bucket for a while) gathers the live
rows into a state of the new size; within a bucket, requests join and leave in place.

The policy (``eagle_jax.serving.policy``): by default a ``ThresholdPolicy`` built from
``speculative``, ``spec_disable_batch_threshold`` and ``spec_hysteresis_steps`` (the
batch-size cutoff with hysteresis); while a plain step runs the draft still extends over
every new token, so switching back loses no acceptance.

Request timing (``RequestMetrics``): ``queue_s`` is arrival to admission, ``ttft_s``
arrival to the first token, ``decode_tokens_per_second`` the tokens after the first over
the time from the first to the last, and ``tokens_per_second`` all tokens over the time
from arrival to the last (so it includes queueing and prefill).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.models.draft import Eagle3Draft, check_compatible
from eagle_jax.errors import ConfigError, EagleJaxError, InputError
from eagle_jax.serving.policy import (
    DEFAULT_AUTO_SHAPES, AutoPolicy, FixedPolicy, PlainPolicy, SpeculationPolicy, ThresholdPolicy, card_acceptance, parse_shapes,
    policy_shapes,
)
from eagle_jax.serving.requests import RequestProgress, check_prompt
from eagle_jax.runtime.step_table import StepTable
from eagle_jax.kernels.plan import check_kernel_impl
from eagle_jax.spec.config import DRAFT_SYNC_MODES
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.runtime.sharding import check_draft_sharding, check_mesh_shape, describe_mesh, make_mesh, spans_processes
from eagle_jax.spec.config import SpeculativeConfig, default_shape
from eagle_jax.models.target import TargetModel

# EngineConfig.spec_policy's values (the command line's --spec-policy, plus plain).
SPEC_POLICIES = ("auto", "fixed", "threshold", "plain")

log = logging.getLogger(__name__)


class NonFiniteError(EagleJaxError):
    """A step produced NaN or infinite logits (raised when ``detect_nan`` is on)."""


# ----------------------------------------------------------------------------- compile counter

_COMPILES = collections.Counter()


def _on_event(event: str, duration: float, **_: Any) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES["total"] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compile_count() -> int:
    """Backend compilations in this process so far (every jit, eager ops included). For
    observation only: the guard against compiling in steady state is the step table's."""
    return _COMPILES["total"]


# ----------------------------------------------------------------------------- config


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    out, v = [], lo
    while v < hi:
        out.append(v)
        v *= 2
    return tuple(out) + (hi,)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built for; validated before anything is loaded.

    Args:
      max_batch: requests decoded at once (more are queued).
      max_seq_len: context of one request (prompt + new tokens).
      batch_buckets: padded batch sizes compiled (default powers of two up to max_batch).
      prompt_buckets: padded prompt lengths compiled for prefill (default powers of two
        from 64 up to max_seq_len), so a prompt costs what its own bucket costs. A prompt
        longer than the largest bucket is refused (or truncated, with ``long_prompt``).
      dtype: "float32", "bfloat16", "float16" or None (float32 on CPU, bfloat16 on GPU).
      speculative: the draft shape of the "fixed" and "threshold" policies (default
        ``spec_config.default_shape()``, tree S=3 k=4 T=8), and the sampling settings
        (``sampling_verify``, thresholds) of every policy's shapes.
      spec_disable_batch_threshold: the "threshold" policy's cutoff: speculation runs
        while the padded batch is <= this.
      spec_hysteresis_steps: consecutive steps at or below the threshold before
        speculation comes back on (and the "auto" policy's switching hysteresis).
      spec_policy: which steps run, the command line's ``--spec-policy`` (one of
        ``SPEC_POLICIES``):

        - "auto" (``AutoPolicy``): times every candidate step per batch bucket at start-up
          and runs the one predicted fastest, plain included; its acceptance prior comes
          from the draft's model card when the draft is given as a directory;
        - "fixed" (``FixedPolicy``): always the ``speculative`` shape;
        - "threshold" (``ThresholdPolicy``): that shape, off above
          ``spec_disable_batch_threshold``;
        - "plain" (``PlainPolicy``): never speculate (a draft given is not used).

        None (the default) picks as the command line does: "threshold" when
        ``spec_disable_batch_threshold`` is set, "fixed" when ``speculative`` is, else
        "auto". Without a draft the engine decodes plainly under "auto" (so
        ``EngineConfig()`` serves a target alone, and speculates once a draft is given);
        "fixed" and "threshold" need one.
      spec_shapes: the candidates of the "auto" policy (default
        ``policy.DEFAULT_AUTO_SHAPES``, with ``speculative``'s sampling settings, or the
        defaults when it is None).
      spec_calibration_s: the "auto" policy's start-up timing budget in seconds.
      spec_calibration_context: the committed positions of every row while the "auto"
        policy times the steps (default ``max_seq_len // 2``): a tree's verify attends
        from several queries over the context, so timed on an empty state it looks
        cheaper against plain than it runs (tree S=2 k=4 T=6 on SmolLM2: 45 ms timed
        empty, 79 ms in the loop on MT-bench prompts, chain S=1 38 and 42).
      detect_nan: check every step's logits; a non-finite row raises ``NonFiniteError``.
      long_prompt: "error" (reject prompts that leave no room) or "truncate" (keep the
        prompt's last tokens, and say so in the completion).
      kernel_impl: verification kernels: "auto", "kernel" or "reference".
      time_phases: measure draft and verify time separately: each speculative step runs
        as two compiled graphs (draft phase, verify phase), each waited for and timed, so
        ``EngineMetrics.summary()`` reports ``draft_s``, ``verify_s`` and ``draft_share``.
        Costs the host/device overlap of speculative steps (a measuring mode, not for
        serving); plain steps are unaffected. Needs a draft and a policy that speculates.
      prefill_token_budget: requests admitted together are prefilled in one call while
        their padded prompts fit this many tokens (``runtime.default_prefill_batches``).
      sampled_steps: compile steps for batches with sampled requests; False compiles the
        greedy steps only (half the graphs) and refuses requests with temperature > 0.
      cache_align: round the target cache up to a multiple of this many slots (default:
        64 on GPUs, the tree-attention kernel's block, so the kernel applies; 1 on CPU).
      mesh: the device mesh, ``(data, model)`` or ``(data, expert, model)`` sizes, ``"data=D,model=M"`` (optionally ``expert=E``) or ``"auto"``
        (every device, of every process, on ``model``); held as ``(D, M)`` or ``"auto"``. ``model``
        splits the target's heads, MLP width and vocabulary (tensor parallelism; KV heads
        that do not divide it are replicated), ``data`` the batch rows of one engine: a
        batch bucket that is a multiple of ``data`` is split over it, others run
        replicated (see ``eagle_jax.runtime.sharding``). Under more than one device the Pallas
        kernels run under shard_map (``eagle_jax.kernels.sharded``) and the CPU FFI
        kernels are off (the start-up line says so).
      draft_sharding: "replicated" (default: the draft whole on every device, its rows
        on ``data``) or "model" (its heads, MLP width and vocabularies split over
        ``model``; its sizes must divide it). ``scripts/bench_draft_sharding.py`` times both.
      draft_sync: how the draft follows the target where speculation is off
        (``speculative.DraftSync``): "eager" (prefill runs the draft over the prompt and
        every plain step runs a 1-token draft extend), "deferred" (they only store the
        draft's inputs, one vector of the draft's width per position; the next
        speculative step runs the draft over what is pending: a request that never
        speculates never pays for the draft) or "auto" (default: deferred where the policy
        can run plain steps and speculate, on one device; eager otherwise, where the
        catch-up's row gather would cross the "data" shards).
    """

    max_batch: int = 8
    max_seq_len: int = 1024
    batch_buckets: tuple[int, ...] | None = None
    prompt_buckets: tuple[int, ...] | None = None
    dtype: str | None = None
    speculative: SpeculativeConfig | None = None
    spec_disable_batch_threshold: int | None = None
    spec_hysteresis_steps: int = 4
    spec_policy: str | None = None
    spec_shapes: tuple[SpeculativeConfig, ...] | None = None
    spec_calibration_s: float = 20.0
    spec_calibration_context: int | None = None
    detect_nan: bool = False
    long_prompt: str = "error"
    kernel_impl: str = "auto"
    time_phases: bool = False
    prefill_token_budget: int = 512
    sampled_steps: bool = True
    cache_align: int | None = None
    mesh: tuple[int, int] | tuple[int, int, int] | str = (1, 1)
    draft_sharding: str = "replicated"
    draft_sync: str = "auto"

    def __post_init__(self):
        def positive_int(name):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name}={v!r} must be an integer >= 1")

        for name in ("max_batch", "max_seq_len", "spec_hysteresis_steps", "prefill_token_budget"):
            positive_int(name)
        if self.max_seq_len < 2:
            raise ConfigError(f"max_seq_len={self.max_seq_len} must be >= 2 (a prompt token and a new one)")
        if self.batch_buckets is None:
            object.__setattr__(self, "batch_buckets", _powers_of_two(1, self.max_batch))
        if self.prompt_buckets is None:
            object.__setattr__(self, "prompt_buckets", _powers_of_two(min(64, self.max_seq_len), self.max_seq_len))
        for name, top in (("batch_buckets", self.max_batch), ("prompt_buckets", self.max_seq_len)):
            v = tuple(getattr(self, name))
            object.__setattr__(self, name, v)
            if not v or any(not isinstance(x, int) or x < 1 for x in v) or list(v) != sorted(set(v)):
                raise ConfigError(f"{name}={v!r} must be an increasing tuple of positive integers")
            if name == "batch_buckets" and v[-1] != top:
                raise ConfigError(f"{name}={v!r} must end at {top} (the max_batch)")
            if name == "prompt_buckets" and v[-1] > top:
                raise ConfigError(f"{name}={v!r} must not go past {top} (the max_seq_len)")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype={self.dtype!r}; valid: None, float32, bfloat16, float16")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ConfigError(f"speculative={self.speculative!r} must be a SpeculativeConfig or None")
        t = self.spec_disable_batch_threshold
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 0):
            raise ConfigError(f"spec_disable_batch_threshold={t!r} must be an integer >= 0 or None (never off)")
        check_draft_sharding(self.draft_sharding)
        if self.draft_sync not in ("auto",) + DRAFT_SYNC_MODES:
            raise ConfigError(f"draft_sync={self.draft_sync!r}; valid: auto, {', '.join(DRAFT_SYNC_MODES)}")
        policy = self.spec_policy
        if policy is None:  # as the command line picks (see spec_policy)
            policy = "threshold" if t is not None else "fixed" if self.speculative is not None else "auto"
            object.__setattr__(self, "spec_policy", policy)
        if policy not in SPEC_POLICIES:
            raise ConfigError(f"spec_policy={policy!r}; valid: {', '.join(SPEC_POLICIES)}")
        if policy in ("fixed", "threshold") and self.speculative is None:
            object.__setattr__(self, "speculative", default_shape())
        if policy == "threshold" and t is None:
            raise ConfigError("spec_policy='threshold' needs spec_disable_batch_threshold (the batch size above which "
                              "speculation is off)")
        if policy != "threshold" and t is not None:
            raise ConfigError(f"spec_disable_batch_threshold goes with spec_policy='threshold', not {policy!r}")
        if self.spec_shapes is not None:
            if policy != "auto":
                raise ConfigError(f"spec_shapes are the candidates of spec_policy='auto', not {policy!r}")
            shapes = tuple(self.spec_shapes)
            object.__setattr__(self, "spec_shapes", shapes)
            if not shapes or not all(isinstance(x, SpeculativeConfig) for x in shapes):
                raise ConfigError(f"spec_shapes={shapes!r} must be a non-empty tuple of SpeculativeConfig")
        if not (isinstance(self.spec_calibration_s, (int, float)) and self.spec_calibration_s > 0):
            raise ConfigError(f"spec_calibration_s={self.spec_calibration_s!r} must be > 0")
        c = self.spec_calibration_context
        if c is None:
            object.__setattr__(self, "spec_calibration_context", self.max_seq_len // 2)
        elif not isinstance(c, int) or isinstance(c, bool) or not 0 <= c < self.max_seq_len:
            raise ConfigError(f"spec_calibration_context={c!r} must be an integer in [0, max_seq_len={self.max_seq_len})")
        if self.long_prompt not in ("error", "truncate"):
            raise ConfigError(f"long_prompt={self.long_prompt!r}; valid: error, truncate")
        check_kernel_impl(self.kernel_impl)
        if self.cache_align is not None:
            positive_int("cache_align")
        if not isinstance(self.sampled_steps, bool):
            raise ConfigError(f"sampled_steps={self.sampled_steps!r} must be True or False")
        if not isinstance(self.time_phases, bool):
            raise ConfigError(f"time_phases={self.time_phases!r} must be True or False")
        if self.time_phases and policy == "plain":
            raise ConfigError("time_phases is set but spec_policy='plain' (no draft or verify phase to time)")
        object.__setattr__(self, "mesh", check_mesh_shape(self.mesh))


# ----------------------------------------------------------------------------- requests and metrics


@dataclasses.dataclass
class RequestMetrics:
    """One request's accept lengths and times (``time.perf_counter`` seconds)."""

    accept_lengths: list[int] = dataclasses.field(default_factory=list)
    spec_steps: int = 0
    plain_steps: int = 0
    arrival: float = 0.0
    admitted: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None

    @property
    def mean_accept_length(self) -> float:
        return float(np.mean(self.accept_lengths)) if self.accept_lengths else 0.0

    @property
    def queue_s(self) -> float | None:
        """Arrival to admission (prefill dispatched)."""
        return None if self.admitted is None else self.admitted - self.arrival

    @property
    def ttft_s(self) -> float | None:
        """Arrival to the first token on the host."""
        return None if self.first_token is None else self.first_token - self.arrival

    def decode_tokens_per_second(self, n_tokens: int) -> float | None:
        """Tokens after the first over the time from the first to the last (None with
        fewer than two tokens)."""
        if n_tokens < 2 or self.first_token is None or self.last_token is None or self.last_token <= self.first_token:
            return None
        return (n_tokens - 1) / (self.last_token - self.first_token)

    def tokens_per_second(self, n_tokens: int) -> float:
        """All tokens over arrival to the last token: includes queueing and prefill."""
        end = self.last_token if self.last_token is not None else self.finished
        if end is None or n_tokens == 0:
            return 0.0
        return n_tokens / max(end - self.arrival, 1e-9)


@dataclasses.dataclass
class Completion:
    """One finished request: the only result type (engine, ``Generator`` and
    ``SpeculativeGenerator`` all return it)."""

    id: Any
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop", "length" or "cancelled"
    metrics: RequestMetrics
    truncated_prompt: bool = False

    @property
    def accept_lengths(self) -> list[int]:
        return self.metrics.accept_lengths

    @property
    def mean_accept_length(self) -> float:
        return self.metrics.mean_accept_length

    @property
    def tokens_per_second(self) -> float:
        """Counted from arrival (includes queueing and prefill); see ``decode_tokens_per_second``."""
        return self.metrics.tokens_per_second(len(self.token_ids))

    @property
    def decode_tokens_per_second(self) -> float | None:
        return self.metrics.decode_tokens_per_second(len(self.token_ids))

    @property
    def queue_s(self) -> float | None:
        return self.metrics.queue_s

    @property
    def ttft_s(self) -> float | None:
        return self.metrics.ttft_s

    def timing(self) -> dict[str, float | None]:
        """The timing fields of an output row (CLI JSONL), rounded."""
        r = lambda v, n=4: None if v is None else round(v, n)  # noqa: E731
        return {
            "queue_s": r(self.queue_s), "ttft_s": r(self.ttft_s),
            "decode_tokens_per_second": r(self.decode_tokens_per_second, 3),
            "tokens_per_second": r(self.tokens_per_second, 3),
        }


class _Request:
    def __init__(self, rid, prompt: list[int], params: SamplingParams, progress: RequestProgress, truncated: bool, hook_data=None):
        self.id = rid
        self.prompt = prompt
        self.params = params
        self.progress = progress
        self.truncated = truncated
        self.hook_data = hook_data
        self.metrics = RequestMetrics(arrival=time.perf_counter())
        self.cancelled = False

    @property
    def done(self) -> bool:
        return self.progress.finish_reason is not None

    def completion(self, tokenizer) -> Completion:
        p = self.progress
        return Completion(self.id, self.prompt, p.tokens, p.final_text(tokenizer), p.finish_reason, self.metrics, self.truncated)


def _shape_name(shape: SpeculativeConfig | None) -> str:
    return "plain" if shape is None else shape.shape


@dataclasses.dataclass
class EngineMetrics:
    """Engine-wide counters; ``summary()`` gives the derived figures."""

    spec_steps: int = 0
    plain_steps: int = 0
    accept_histogram: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    accepted_at_depth: np.ndarray | None = None  # [S_max] drafts accepted at depth d+1
    spec_rows: int = 0  # row-steps with speculation (the denominator per depth)
    # (batch bucket, shape name) -> steps run; says which shape ran in each bucket.
    steps_by_bucket: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    # Steps timed in steady state (see Engine._dispatch) per (bucket, shape name): count,
    # seconds and tokens, and the policy's latest prediction for a full bucket.
    timed_steps: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    timed_step_s: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    timed_tokens: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    predicted_tokens_per_second: dict = dataclasses.field(default_factory=dict)
    tokens: int = 0
    host_s: float = 0.0  # Python work of the host loop
    device_wait_s: float = 0.0  # blocked reading results
    dispatch_s: float = 0.0  # inside calls that launch device work (they block when the device queue is full)
    wall_s: float = 0.0
    compiles_at_ready: int = 0  # process-wide compile count when the engine became ready
    mode_switches: int = 0
    # With EngineConfig.time_phases: per speculative step, the seconds from launching each
    # phase to its results being ready (the device queue drained before the draft phase).
    phase_timing: bool = False
    draft_s: float = 0.0
    verify_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        hist = dict(sorted(self.accept_histogram.items()))
        n = sum(hist.values())
        return {
            "spec_steps": self.spec_steps,
            "plain_steps": self.plain_steps,
            "mode_switches": self.mode_switches,
            "steps_by_bucket": {f"{b}: {name}": c for (b, name), c in sorted(self.steps_by_bucket.items())},
            # Tokens/s of the timed steady-state steps (live rows only) and, where the
            # policy predicts, its prediction for a full bucket.
            "measured_tokens_per_second_by_bucket": {
                f"{b}: {name}": round(self.timed_tokens[(b, name)] / s, 2)
                for (b, name), s in sorted(self.timed_step_s.items()) if s > 0
            },
            "step_ms_by_bucket": {
                f"{b}: {name}": round(1000 * s / self.timed_steps[(b, name)], 3)
                for (b, name), s in sorted(self.timed_step_s.items()) if self.timed_steps[(b, name)]
            },
            "predicted_tokens_per_second_by_bucket": {
                f"{b}: {name}": round(v, 2) for (b, name), v in sorted(self.predicted_tokens_per_second.items())
            },
            "mean_accept_length": (sum(k * v for k, v in hist.items()) / n) if n else 0.0,
            "accept_length_histogram": hist,
            "acceptance_rate_by_depth": (
                (self.accepted_at_depth / max(self.spec_rows, 1)).round(4).tolist() if self.accepted_at_depth is not None else []
            ),
            "tokens": self.tokens,
            "tokens_per_second": self.tokens / self.wall_s if self.wall_s else 0.0,
            "host_s": round(self.host_s, 4),
            "device_wait_s": round(self.device_wait_s, 4),
            "dispatch_s": round(self.dispatch_s, 4),
            "host_fraction": self.host_s / self.wall_s if self.wall_s else 0.0,
            # Process-wide (other engines and libraries count too); the step table itself
            # cannot compile after start-up.
            "process_compiles_since_ready": compile_count() - self.compiles_at_ready,
            **self._phase_summary(),
        }

    def _phase_summary(self) -> dict[str, Any]:
        if not self.phase_timing:
            return {
                "phase_timing": "off (EngineConfig.time_phases=True measures draft and verify separately)",
                "draft_s": None, "verify_s": None, "draft_share": None,
                "draft_ms_per_step": None, "verify_ms_per_step": None,
            }
        both, n = self.draft_s + self.verify_s, self.spec_steps
        return {
            "phase_timing": "on (draft and verify run as separate graphs with a sync between: slower than the fused step)",
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "draft_share": self.draft_s / both if both else None,
            "draft_ms_per_step": 1000 * self.draft_s / n if n else None,
            "verify_ms_per_step": 1000 * self.verify_s / n if n else None,
        }


# ----------------------------------------------------------------------------- loading


def _load(target, draft, dtype, mesh=None):
    from eagle_jax.checkpoint.draft_io import load_draft, read_draft_config
    from eagle_jax.checkpoint.hf import load_model
    from eagle_jax.models.registry import read_target_config

    if isinstance(target, (str, Path)):
        path = Path(target)
        cfg = None
        if isinstance(draft, (str, Path)):
            # The draft says which target layers feed it; build the target to return those.
            tcfg = read_target_config(path)
            dcfg = read_draft_config(draft, target_cfg=tcfg)
            cfg = tcfg.replace(aux_layer_ids=dcfg.aux_layer_ids)
        # On a mesh of several devices each parameter is read straight into its shards.
        target = load_model(path, dtype=dtype, config=cfg, mesh=mesh)
    if isinstance(draft, (str, Path)):
        draft = load_draft(draft, target=target, dtype=dtype)
    if not isinstance(target, TargetModel):
        raise ConfigError(f"target must be a target model (eagle_jax.models.target.TargetModel) or a checkpoint path, got {type(target).__name__}")
    if draft is not None and not isinstance(draft, Eagle3Draft):
        raise ConfigError(f"draft must be an Eagle3Draft, a checkpoint path or None, got {type(draft).__name__}")
    return target, draft


def _tokenizer_for(target_path, tokenizer):
    if tokenizer is not None or not isinstance(target_path, (str, Path)):
        return tokenizer
    from eagle_jax.checkpoint.tokenizer import Tokenizer

    return Tokenizer.from_dir(target_path)


# ----------------------------------------------------------------------------- engine


class Engine:
    """Serve many requests on compiled steps, with a speculation policy.

    Args:
      target: a loaded target model or a Hugging Face checkpoint directory.
      draft: an ``Eagle3Draft``, a draft checkpoint directory, or None (plain decoding
        under the default "auto" policy; "fixed" and "threshold" need a draft).
      config: ``EngineConfig``.
      tokenizer: for text prompts and output (default: the target directory's).
      policy: a ``SpeculationPolicy`` (default: ``default_policy(config)``, the one
        ``config.spec_policy`` names). Every shape it lists is compiled.
      draft_hook: a tree hook traced into speculative steps, e.g. ``oracle.OracleHook``
        (measurement only); requests then pass ``hook_data`` rows of ``hook_width`` ints.
      progress: show a progress bar while compiling.
    """

    def __new__(cls, target, draft=None, config: EngineConfig = EngineConfig(), tokenizer=None, *,
                policy: SpeculationPolicy | None = None, draft_hook=None, hook_width: int = 0, progress: bool = True):
        # Everything is built before the instance exists: a failure leaves no engine.
        parts = _build(target, draft, config, tokenizer, policy, draft_hook, hook_width, progress)
        self = super().__new__(cls)
        self.__dict__.update(parts)
        return self

    # -- requests

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InputError("a text prompt needs a tokenizer (pass tokenizer=, or token ids)")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            if self.tokenizer is None:
                raise InputError("chat messages need a tokenizer")
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True))
        if isinstance(prompt, (list, tuple, np.ndarray)):
            return [int(t) for t in prompt]
        raise InputError(f"a prompt is text, a list of chat messages or a list of token ids, not {type(prompt).__name__}")

    def add_request(self, prompt, params: SamplingParams = SamplingParams(), *, request_id=None,
                    on_text: Callable[[Any, str], None] | None = None, hook_data: Sequence[int] | None = None):
        """Queue a request (text, chat messages or token ids); returns its id.

        ``hook_data``: with a ``draft_hook``, this request's row of hook data (e.g. the
        oracle's reference sequence), truncated or zero-padded to ``hook_width``."""
        if not isinstance(params, SamplingParams):
            raise InputError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self._encode(prompt)
        rid = request_id if request_id is not None else next(self._ids)
        if rid in self._requests:
            raise InputError(f"request id {rid!r} is already in use")
        # Length is checked below: the engine can truncate instead of refusing.
        check_prompt(repr(rid), ids, None, self.target.config.vocab_size)
        if not params.greedy and not self.config.sampled_steps:
            raise InputError(
                f"temperature={params.temperature}: this engine compiled greedy steps only (EngineConfig.sampled_steps=False)"
            )
        truncated = False
        limit = self.config.max_seq_len
        longest = self.config.prompt_buckets[-1]
        if len(ids) > longest and len(ids) < limit:
            if self.config.long_prompt == "error":
                raise InputError(
                    f"request {rid!r}: the prompt has {len(ids)} tokens; the largest prompt bucket is {longest} "
                    f"(EngineConfig.prompt_buckets; set long_prompt='truncate' to keep the last tokens)"
                )
            log.warning("request %r: prompt of %d tokens truncated to its last %d (largest prompt bucket)", rid, len(ids), longest)
            ids, truncated = ids[-longest:], True
        if len(ids) >= limit:
            if self.config.long_prompt == "error":
                raise InputError(
                    f"request {rid!r}: the prompt has {len(ids)} tokens; max_seq_len={limit} leaves no room for a "
                    f"new token (set long_prompt='truncate' to keep the last tokens)"
                )
            keep = max(1, limit - params.max_new_tokens) if params.max_new_tokens < limit else limit // 2
            keep = min(keep, longest)
            log.warning("request %r: prompt of %d tokens truncated to its last %d (max_seq_len %d)", rid, len(ids), keep, limit)
            ids, truncated = ids[-keep:], True
        if (hook_data is not None) != (self._hook_width > 0):
            raise InputError("hook_data goes with an engine built with a draft_hook (and only then is required)")
        progress = RequestProgress(
            rid, ids, params, self.eos_ids, min(params.max_new_tokens, limit - len(ids)), self.tokenizer, on_text
        )
        row = None
        if hook_data is not None:
            row = np.zeros(self._hook_width, np.int32)
            h = np.asarray(hook_data, np.int32)[: self._hook_width]
            row[: len(h)] = h
        req = _Request(rid, ids, params, progress, truncated, row)
        self._requests[rid] = req
        self._queue.append(req)
        return rid

    def cancel(self, request_id) -> None:
        """Stop a request; its slot is freed at the next step, other requests go on."""
        req = self._requests.get(request_id)
        if req is None:
            raise InputError(f"no request {request_id!r}")
        if not req.done:
            req.cancelled = True
            req.progress._finish("cancelled")
            req.metrics.finished = time.perf_counter()

    def has_unfinished(self) -> bool:
        return any(not r.done for r in self._requests.values()) or self._pending is not None

    def pop_finished(self) -> list[Completion]:
        done = [r for r in self._requests.values() if r.done and r.id not in self._slot_ids()]
        for r in done:
            del self._requests[r.id]
        return [r.completion(self.tokenizer) for r in done]

    def _slot_ids(self):
        return {r.id for r in self._slots if r is not None}

    def use_policy(self, policy: SpeculationPolicy) -> None:
        """Run later steps under ``policy`` instead, on the graphs already compiled (to
        compare policies in one process, e.g. a fixed shape against ``AutoPolicy``).
        Only between requests, and only for a policy whose steps this engine compiled;
        it is not calibrated again (give it the timings yourself if it needs them)."""
        if not isinstance(policy, SpeculationPolicy):
            raise ConfigError(f"policy must be a SpeculationPolicy (eagle_jax.serving.policy), got {type(policy).__name__}")
        if self.has_unfinished() or self._queue:
            raise ConfigError("use_policy() is for an idle engine: requests are still running")
        missing = [s.shape for s in policy_shapes(policy) if s not in self._table.shapes]
        if missing:
            raise ConfigError(f"policy {policy.describe()!r} needs shapes this engine did not compile: {missing} "
                              f"(compiled: {[s.shape for s in self._table.shapes]})")
        if policy.runs_plain and not self._table.plain:
            raise ConfigError(f"policy {policy.describe()!r} may run the plain step, which this engine did not compile")
        self.policy = policy

    # -- the host loop

    def step(self) -> None:
        """One iteration: admit, pick the step, dispatch, then handle the previous step."""
        t_start = time.perf_counter()
        dispatch_before, wait_before = self.metrics.dispatch_s, self.metrics.device_wait_s
        self._free_finished_slots()
        self._admit()
        self._maybe_shrink()
        live = sum(r is not None for r in self._slots)
        dispatched = None
        if live:
            dispatched = self._dispatch()
        wait = self._handle(self._pending)
        self._pending = dispatched
        m = self.metrics
        m.wall_s += time.perf_counter() - t_start
        m.device_wait_s += wait
        # Waits inside the dispatch (phase timing) are in device_wait_s too, not host work.
        m.host_s += time.perf_counter() - t_start - (m.device_wait_s - wait_before) - (m.dispatch_s - dispatch_before)

    def _launch(self, fn, *args, **kwargs):
        """Call a compiled graph, counting the time as dispatch, not host work."""
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.metrics.dispatch_s += time.perf_counter() - t

    def run_until_done(self) -> None:
        while self.has_unfinished():
            self.step()

    def generate(self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] = SamplingParams(), *,
                 on_text: Callable[[int, str], None] | None = None, hook_data: Sequence | None = None) -> list[Completion]:
        """Run every prompt (text, chat messages or token ids) to completion, in order.
        ``on_text(index, delta)`` streams each request's text (index into ``prompts``)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise InputError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if hook_data is not None and len(hook_data) != len(prompts):
            raise InputError(f"{len(prompts)} prompts but {len(hook_data)} hook_data rows")
        ids = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            cb = None if on_text is None else (lambda _, d, i=i: on_text(i, d))
            ids.append(self.add_request(p, sp, on_text=cb, hook_data=None if hook_data is None else hook_data[i]))
        self.run_until_done()
        done = {c.id: c for c in self.pop_finished()}
        return [done[i] for i in ids]

    def stream(self, prompt, params: SamplingParams = SamplingParams()) -> Iterator[str]:
        """Yield the text of one request as it is generated (other requests keep going)."""
        deltas: collections.deque[str] = collections.deque()
        rid = self.add_request(prompt, params, on_text=lambda _, d: deltas.append(d))
        req = self._requests[rid]
        while not req.done:
            self.step()
            while deltas:
                yield deltas.popleft()
        while deltas:  # text flushed at the request's end
            yield deltas.popleft()
        del self._requests[rid]

    # -- internals

    def _free_finished_slots(self) -> None:
        for i, r in enumerate(self._slots):
            if r is not None and r.done:
                self._slots[i] = None
                self._samp_dirty = True

    def _admit(self) -> None:
        while self._queue and self._queue[0].done:  # cancelled while queued
            self._queue.popleft()
        if not self._queue:
            return
        live = sum(r is not None for r in self._slots)
        want = min(live + len(self._queue), self.config.max_batch)
        if want > len(self._slots):
            self._resize(self._bucket_for(want))
        free = [i for i, r in enumerate(self._slots) if r is None]
        admitted: list[tuple[_Request, int]] = []
        while self._queue and free:
            req = self._queue.popleft()
            if req.done:
                continue
            admitted.append((req, free.pop(0)))
        # Requests admitted together share one prefill call per prompt bucket.
        by_bucket: dict[int, list[tuple[_Request, int]]] = collections.defaultdict(list)
        for req, row in admitted:
            by_bucket[next(b for b in self.config.prompt_buckets if b >= len(req.prompt))].append((req, row))
        for p_len, group in by_bucket.items():
            while group:
                n = self._table.prefill_batch(p_len, len(group))
                chunk, group = group[:n], group[n:]
                self._prefill_into(chunk, p_len)

    def _bucket_for(self, n: int) -> int:
        return next(b for b in self.config.batch_buckets if b >= n)

    def _resize(self, new_b: int) -> None:
        """Gather the live rows into a state of ``new_b`` rows (a bucket change)."""
        live = [i for i, r in enumerate(self._slots) if r is not None]
        self._other_work = True
        rows = live + [0] * (new_b - len(live))  # padding rows copy row 0; they are free slots
        self._state = self._launch(self._table.gather, self._state, self._table.device_put_rows(np.asarray(rows[:new_b], np.int32)))
        self._slots = [self._slots[i] for i in live] + [None] * (new_b - len(live))
        self._samp_dirty = True

    def _maybe_shrink(self) -> None:
        live = sum(r is not None for r in self._slots)
        smaller = self._bucket_for(max(live, 1))
        if smaller < len(self._slots) and not self._queue:
            self._shrink_wait += 1
            if self._shrink_wait >= self.config.spec_hysteresis_steps:
                self._resize(smaller)
                self._shrink_wait = 0
        else:
            self._shrink_wait = 0

    def _prefill_into(self, chunk: list[tuple[_Request, int]], p_len: int) -> None:
        n = len(chunk)
        tokens = np.zeros((n, p_len), np.int32)
        lengths = np.zeros(n, np.int32)
        for i, (req, _) in enumerate(chunk):
            tokens[i, : len(req.prompt)] = req.prompt
            lengths[i] = len(req.prompt)
        hook = None
        if self._hook_width:
            hook = self._table.device_put_rows(np.stack([req.hook_data for req, _ in chunk]))
        t = self._table
        samp = t.sampling([req.params for req, _ in chunk], n)
        self._other_work = True  # the next step's measured time would include this prefill
        rows_state, first = self._launch(t.prefill, t.device_put_rows(tokens), t.device_put_rows(lengths), samp, hook)
        rows = t.device_put_rows(np.asarray([row for _, row in chunk], np.int32))
        self._state = self._launch(t.insert, self._state, rows_state, rows)
        now = time.perf_counter()
        for req, row in chunk:
            self._slots[row] = req
            req.metrics.admitted = now
        self._samp_dirty = True
        self._first_tokens.append(([req for req, _ in chunk], first))

    def _samp(self):
        if self._samp_dirty:
            params = [r.params if r is not None else SamplingParams() for r in self._slots]
            self._samp_arrays = self._table.sampling(params, len(self._slots))
            self._greedy_only = all(p.greedy for p in params)
            self._samp_dirty = False
        return self._samp_arrays

    def _choose(self, b: int) -> SpeculativeConfig | None:
        shape = self.policy.choose(b)
        if shape is None and not self._table.plain:
            raise ConfigError(f"policy {type(self.policy).__name__} chose the plain step but says runs_plain=False")
        if shape is not None and shape not in self._table.shapes:
            raise ConfigError(
                f"policy {type(self.policy).__name__} chose {shape.shape!r}, which it did not list in its shapes "
                f"(compiled: {[s.shape for s in self._table.shapes]})"
            )
        if self._steps_run and shape != self._last_shape:
            self.metrics.mode_switches += 1
        self._last_shape = shape
        self._steps_run += 1
        return shape

    def _dispatch(self) -> dict:
        b = len(self._slots)
        samp = self._samp()
        shape = self._choose(b)
        # Timed as the interval between its results and the previous step's: a fair
        # measure of what the step costs in this loop only when the device had nothing
        # else queued between the two (no prefill, insert or resize) and the previous
        # step was in flight.
        timed = self._pending is not None and not self._other_work
        self._other_work = False
        if shape is not None and self.config.time_phases:
            out = self._timed_speculative(samp, shape)
        else:
            out = self._launch(self._table.step, self._state, samp, shape, self._greedy_only)
        m = self.metrics
        if shape is not None:
            m.spec_steps += 1
        else:
            m.plain_steps += 1
        m.steps_by_bucket[(b, _shape_name(shape))] += 1
        self._state, tokens, acc, finite = out
        self._step_no += 1
        firsts, self._first_tokens = self._first_tokens, []
        # The rows' owners at dispatch time: slots may change before the tokens are read.
        return {
            "reqs": list(self._slots), "tokens": tokens, "acc": acc, "finite": finite,
            "shape": shape, "bucket": b, "step": self._step_no, "first": firsts, "timed": timed,
        }

    def _timed_speculative(self, samp, shape: SpeculativeConfig):
        """The speculative step as its draft and verify phases, each waited for and timed."""
        m = self.metrics
        t = time.perf_counter()
        jax.block_until_ready(self._state)  # work queued before (prefill, insert, a plain step) is not drafting
        t0 = time.perf_counter()
        m.device_wait_s += t0 - t
        launched = m.dispatch_s
        state, tree = self._launch(self._table.draft_phase, self._state, samp, shape)
        self._state = None  # its draft cache was donated
        jax.block_until_ready((state, tree))
        t1 = time.perf_counter()
        out = self._launch(self._table.verify_phase, state, tree, samp, shape, self._greedy_only)
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        m.draft_s += t1 - t0
        m.verify_s += t2 - t1
        # The time past the launches was spent waiting for the device.
        m.device_wait_s += (t2 - t0) - (m.dispatch_s - launched)
        return out

    def _handle(self, pending: dict | None) -> float:
        """Hand a finished step's tokens to its requests; returns seconds spent waiting."""
        if pending is None:
            return 0.0
        t0 = time.perf_counter()
        firsts = [(reqs, np.asarray(f)) for reqs, f in pending["first"]]
        tokens, acc = np.asarray(pending["tokens"]), np.asarray(pending["acc"])
        finite = None if pending["finite"] is None else np.asarray(pending["finite"])
        wait = time.perf_counter() - t0
        now = time.perf_counter()
        step_s = now - self._last_ready if pending["timed"] and self._last_ready is not None else None
        self._last_ready = now
        m = self.metrics
        for reqs, first in firsts:
            for req, tok in zip(reqs, first):
                if not req.done:
                    req.metrics.first_token = req.metrics.last_token = now
                    req.progress.push(int(tok))
                    m.tokens += 1
                    if req.done:
                        req.metrics.finished = now
        spec = pending["shape"] is not None
        live_acc = []
        for row, req in enumerate(pending["reqs"]):
            if req is None:
                continue
            if finite is not None and not finite[row] and not req.done:
                raise NonFiniteError(
                    f"step {pending['step']} produced non-finite logits for request {req.id!r} (row {row}, "
                    f"{_shape_name(pending['shape'])} step)"
                )
            if req.done:
                continue
            n = int(acc[row])
            live_acc.append(n)
            if spec:
                req.metrics.spec_steps += 1
                req.metrics.accept_lengths.append(n)
                m.accept_histogram[n] += 1
                m.spec_rows += 1
                m.accepted_at_depth[: n - 1] += 1
            else:
                req.metrics.plain_steps += 1
            for tok in tokens[row, :n]:
                req.progress.push(int(tok))
                m.tokens += 1
                req.metrics.last_token = now
                if req.done:
                    req.metrics.finished = now
                    break
        shape, b = pending["shape"], pending["bucket"]
        self.policy.observe(b, shape, np.asarray(live_acc, np.int64), step_s)
        if step_s is not None:
            key = (b, _shape_name(shape))
            m.timed_steps[key] += 1
            m.timed_step_s[key] += step_s
            m.timed_tokens[key] += sum(live_acc)
            predict = getattr(self.policy, "predicted_tokens_per_second", None)
            predicted = predict(b, shape) if predict is not None else None
            if predicted is not None:
                m.predicted_tokens_per_second[key] = predicted
        return wait

    def __repr__(self) -> str:
        return f"Engine({self._describe})"


def default_policy(config: EngineConfig, draft_dir: str | Path | None = None, *, has_draft: bool = True) -> SpeculationPolicy:
    """The policy an ``EngineConfig`` implies (``spec_policy``): the measured cost model
    (with the model card of the draft in ``draft_dir`` as its prior), the fixed shape,
    the threshold cutoff, or plain; plain under "auto" when there is no draft."""
    name = config.spec_policy
    if name == "plain" or (name == "auto" and not has_draft):
        return PlainPolicy()
    if name == "auto":
        s = config.speculative or SpeculativeConfig()
        fields = dict(sampling_verify=s.sampling_verify, threshold_single=s.threshold_single, threshold_acc=s.threshold_acc)
        shapes = config.spec_shapes or parse_shapes(DEFAULT_AUTO_SHAPES, **fields)
        prior = card_acceptance(draft_dir) if draft_dir is not None else None
        return AutoPolicy(shapes, prior=prior, hysteresis=config.spec_hysteresis_steps,
                          calibration_budget_s=config.spec_calibration_s)
    if name == "fixed":
        return FixedPolicy(config.speculative)
    return ThresholdPolicy(config.speculative, config.spec_disable_batch_threshold, config.spec_hysteresis_steps)


def _build(target, draft, config: EngineConfig, tokenizer, policy, draft_hook, hook_width, progress: bool) -> dict:
    """Load, check, compile; returns the engine's attributes (or raises)."""
    if not isinstance(config, EngineConfig):
        raise ConfigError(f"config must be an EngineConfig, got {type(config).__name__}")
    if draft is None and policy is None and config.spec_policy in ("fixed", "threshold"):
        raise ConfigError(f"spec_policy={config.spec_policy!r} speculates ({config.speculative.shape}) but no draft "
                          "was given (pass draft=, or spec_policy='plain')")
    if policy is None:
        policy = default_policy(config, draft if isinstance(draft, (str, Path)) else None, has_draft=draft is not None)
    if not isinstance(policy, SpeculationPolicy):
        raise ConfigError(f"policy must be a SpeculationPolicy (eagle_jax.serving.policy), got {type(policy).__name__}")
    shapes = policy_shapes(policy)
    if config.time_phases and not shapes:
        raise ConfigError("time_phases is set but nothing speculates (no draft, or a plain policy): no draft or "
                          "verify phase to time")
    if shapes and draft is None:
        raise ConfigError(f"policy {type(policy).__name__} speculates ({[s.shape for s in shapes]}) but no draft was given")
    if (draft_hook is None) != (hook_width == 0):
        raise ConfigError("draft_hook and hook_width go together")
    target_path = target
    mesh = make_mesh(config.mesh)  # before loading: too few devices fails fast
    if spans_processes(mesh) and getattr(policy, "uses_timings", False):
        # Each process would time its own steps and could pick another graph than the
        # others, and the processes' collectives would then wait on each other for good.
        raise ConfigError(
            f"policy {type(policy).__name__} decides from measured step times, which differ between the "
            f"{jax.process_count()} processes of this run; use a fixed or threshold policy across processes"
        )
    target, draft = _load(target, draft, config.dtype, mesh)
    if draft is not None:
        check_compatible(draft.config, target.config)
        for s in shapes:
            if s.topk > draft.config.draft_vocab_size:
                raise ConfigError(
                    f"speculative shape {s.shape}: top-{s.topk} of a draft vocabulary of {draft.config.draft_vocab_size}"
                )
    limit = target.config.max_position_embeddings
    if config.max_seq_len > limit:
        raise ConfigError(f"max_seq_len={config.max_seq_len} exceeds the target's max_position_embeddings={limit}")
    tokenizer = _tokenizer_for(target_path, tokenizer)
    # A draft without speculation still runs: plain steps keep it in sync, eagerly or
    # deferred (EngineConfig.draft_sync; a policy may switch speculation on); with no
    # shapes and no policy need for it, drop it.
    table = StepTable(
        target, draft if shapes else None, shapes=shapes, batch_buckets=config.batch_buckets,
        prompt_buckets=config.prompt_buckets, max_seq_len=config.max_seq_len,
        prefill_token_budget=config.prefill_token_budget, kernel_impl=config.kernel_impl,
        check_finite=config.detect_nan, time_phases=config.time_phases, tree_hook=draft_hook, hook_width=hook_width,
        plain=policy.runs_plain, sampled=config.sampled_steps, cache_align=config.cache_align, mesh=mesh,
        draft_sharding=config.draft_sharding,
        draft_sync=resolve_draft_sync(config.draft_sync, policy, mesh.size),  # the table ignores it without a draft
    )
    report = table.build(progress)
    calibrate = getattr(policy, "calibrate", None)
    calibration = None
    if calibrate is not None:
        ctx = config.spec_calibration_context
        calibration = calibrate(functools.partial(table.time_step, context=ctx), config.batch_buckets)
        calibration = f"{calibration} (each row at context {ctx})" if calibration else None
    b0 = config.batch_buckets[0]
    metrics = EngineMetrics(compiles_at_ready=compile_count(), phase_timing=config.time_phases)
    if shapes:
        metrics.accepted_at_depth = np.zeros(max(s.num_steps for s in shapes), np.int64)
    feature_note = ""
    if table.draft is not None:
        feature_note = f"; draft features {_feature_layers(target)}; draft sync {_sync_note(table, config)}"
    describe = (
        f"target {target.config.architecture} ({target.config.num_hidden_layers} layers); "
        f"speculation {policy.describe()}"
        + (f", sampling verify {shapes[0].sampling_verify}" if shapes else "")
        + f"; batch buckets {config.batch_buckets}; prompt buckets {config.prompt_buckets} "
        f"(prefill batches {dict(table.prefill_batches)}); max_seq_len {config.max_seq_len} "
        f"(target cache {table.target_cache_len} slots); dtype {jnp.dtype(target.dtype).name}; "
        f"{_mesh_note(table)}; {table.plan.describe(table.verify_attention_path())}; "
        f"NaN check {'on' if config.detect_nan else 'off'}"
        + feature_note
        + ("; time_phases on (draft and verify phases compiled and timed separately, slower than the fused step)"
           if config.time_phases else "")
        + ("; draft hook " + type(draft_hook).__name__ if draft_hook is not None else "")
    )
    log.info("eagle-jax engine ready: %s; %s%s", describe, report.describe(), f"; {calibration}" if calibration else "")
    return dict(
        config=config, target=target, draft=draft, tokenizer=tokenizer, policy=policy,
        eos_ids=tuple(tokenizer.eos_token_ids) if tokenizer is not None else target.config.eos_token_ids,
        _table=table, _hook_width=hook_width,
        _describe=describe, _requests={}, _queue=collections.deque(), _ids=itertools.count(),
        _slots=[None] * b0, _state=table.zeros(b0),
        _pending=None, _first_tokens=[], _samp_dirty=True, _samp_arrays=None, _greedy_only=True,
        _last_shape=None, _steps_run=0, _shrink_wait=0, _step_no=0, metrics=metrics,
        _other_work=False, _last_ready=None,
    )


def resolve_draft_sync(mode: str, policy: SpeculationPolicy, devices: int) -> str:
    """``EngineConfig.draft_sync`` for this policy and mesh: "auto" is deferred where the
    policy may both run plain steps and speculate (a fixed shape never runs plain: the
    prompt is all a deferral would move) on a single device, eager otherwise."""
    if mode != "auto":
        return mode
    return "deferred" if policy.runs_plain and policy_shapes(policy) and devices == 1 else "eager"


def _sync_note(table: StepTable, config: EngineConfig) -> str:
    s = table.draft_sync
    how = ("plain steps and prefill store the draft's inputs, a speculative step first runs the draft over "
           f"what is pending, {s.rows} rows x {s.width} positions at a time" if s.deferred
           else "prefill and plain steps run the draft")
    return f"{s.mode} ({how}; draft_sync={config.draft_sync})"


def _mesh_note(table: StepTable) -> str:
    """The mesh, its devices, and what the rules did that a reader would not guess."""
    mesh = table.mesh
    note = f"mesh {describe_mesh(mesh)} over {[str(d) for d in mesh.devices.flat]}"
    if table.multi_process:
        note += f" (process {jax.process_index()} of {jax.process_count()}; tokens read back replicated)"
    if mesh.shape["model"] > 1:
        kv = table.target.axis_sizes()["kv_heads"]
        note += (f" (KV heads: {kv}, replicated over model={mesh.shape['model']})" if table.rules["kv_heads"] is None
                 else f" (KV heads: {kv} split over model)")
        note += f"; draft {'split over' if table.draft_sharding == 'model' else 'replicated over'} model" \
            if table.draft is not None else ""
    shards = mesh.shape.get("expert", 1)
    if shards > 1:
        e = table.target.axis_sizes()["experts"]
        note += f" (routed experts: {e} split over expert={shards} ({e // shards} per device))"
    d = mesh.shape["data"]
    if d > 1:
        odd = [b for b in table.batch_buckets if b % d]
        note += (f"; batch buckets {odd} are not multiples of data={d}: their rows run replicated over data"
                 if odd else f"; batch rows split over data={d}")
    return note


def _feature_layers(target) -> str:
    from eagle_jax.checkpoint.draft_io import describe_feature_layers

    return describe_feature_layers(tuple(target.config.feature_layer_ids), target.config.num_hidden_layers)
