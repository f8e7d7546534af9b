"""``EngineConfig``: everything an engine is built for, validated before anything is
loaded; and the decisions that follow from it alone (``default_policy``,
``resolve_draft_sync``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from eagle_jax.errors import ConfigError
from eagle_jax.kernels.plan import check_kernel_impl
from eagle_jax.runtime.plan import prompt_buckets_for
from eagle_jax.runtime.sharding import check_draft_sharding, check_mesh_shape
from eagle_jax.serving.policy import (
    AUTO_MIN_DEPTH_GAIN, DEFAULT_AUTO_SHAPES, AutoPolicy, FixedPolicy, PlainPolicy, SpeculationPolicy, ThresholdPolicy, card_acceptance, parse_shapes,
    policy_shapes, prune_by_prior,
)
from eagle_jax.spec.config import DRAFT_SYNC_MODES, SpeculativeConfig, default_shape
from eagle_jax.validate import flag, int_in, is_int, is_number, non_negative_int, one_of, optional, positive_int

# EngineConfig.spec_policy's values (the command line's --spec-policy, plus plain).
SPEC_POLICIES = ("auto", "fixed", "threshold", "plain")


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
      prompt_buckets: the prefill chunk lengths compiled (default
        ``runtime.plan.prompt_buckets_for(max_seq_len, max_seq_len)``: powers of two from
        64 up to ``min(max_seq_len, runtime.plan.default_max_chunk())``, 512 on a GPU; on
        a CPU 64, 96 and 128, since padding costs compute there). A prompt is prefilled in chunks
        of these (``scheduler.chunk_plan``): full chunks of the largest that fit, then one
        that pads by less than the smallest, so a prompt costs what its own length costs
        and any prompt shorter than ``max_seq_len`` is served.
      dtype: "float32", "bfloat16", "float16" or None (float32 on CPU, bfloat16 on GPU).
        "bfloat16" on a CPU with the packed kernel loads the models in float32 and binds
        their matrices as bfloat16 panels (half the bytes a decode step streams; the
        arithmetic, activations and caches stay float32, since XLA:CPU emulates bfloat16
        arithmetic about 10x slower); elsewhere the models run in the dtype given.
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
        defaults when it is None; with a draft's model card, the defaults whose deepest
        step its acceptance prior expects to accept at least as often as a draft step
        costs against a plain step (``policy.prune_by_prior`` under
        ``policy.draft_step_share`` of the loaded models) are kept: the others can never
        pay, and are never compiled. Shapes given here are all compiled).
      spec_prune_buckets: with the default candidates and a draft's model card, leave out
        at each batch bucket the shapes that cannot pay there (``AutoPolicy.fit_buckets``:
        the least a verify of that many tokens costs, from plain steps timed at start-up,
        against the prior's optimistic accept length), so they are never compiled nor
        calibrated. Shapes given in ``spec_shapes`` are compiled at every bucket.
      spec_calibration_s: the "auto" policy's start-up timing budget in seconds.
      spec_calibration_context: the committed positions of every row while the "auto"
        policy times the steps (default ``max_seq_len // 2``): a tree's verify attends
        from several queries over the context, so timed on an empty state it looks
        cheaper against plain than it runs (tree S=2 k=4 T=6 on SmolLM2: 45 ms timed
        empty, 79 ms in the loop on MT-bench prompts, chain S=1 38 and 42).
      calibration_cache: keep the "auto" policy's start-up timings per machine, models
        and compiled configuration (``serving.calibration``), and read them back on the
        next start-up instead of timing again (models given as directories only).
      recalibrate: time again even where the cache holds the timings (and replace them).
      detect_nan: check every step's logits; a non-finite row raises ``NonFiniteError``.
      long_prompt: "error" (reject prompts that leave no room) or "truncate" (keep the
        prompt's last tokens, and say so in the completion).
      kernel_impl: verification kernels: "auto", "kernel" or "reference".
      time_phases: measure draft and verify time separately: each speculative step runs
        as two compiled graphs (draft phase, verify phase), each waited for and timed, so
        ``EngineMetrics.summary()`` reports ``draft_s``, ``verify_s`` and ``draft_share``.
        Costs the host/device overlap of speculative steps (a measuring mode, not for
        serving); plain steps are unaffected. Needs a draft and a policy that speculates.
      prefill_token_budget: the prefill tokens (padded) launched per engine step: one
        chunk at least, then more while they fit. While other requests decode, a long
        prompt delays each of their steps by this much prefill rather than its whole
        prompt. Requests admitted together that share a chunk plan are prefilled in one
        call while their chunks fit it (``runtime.default_prefill_batches``).
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
      background_compile: compile the speculative steps in a background thread: the
        engine is returned once prefill and the plain steps are compiled, and serves
        plain steps (greedy-identical, the draft kept in sync) until the speculative
        graphs exist; the same thread then calibrates the policy (from the calibration
        cache where it holds the timings, else timed beside the running steps) and
        speculation starts at the next step (the start-up and "speculation ready" log
        lines say so). An error there is raised from the next ``Engine.step()``. For a
        policy that can run plain steps ("auto", "threshold"), in one process; no effect
        without a draft.
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
    spec_prune_buckets: bool = True
    spec_calibration_s: float = 20.0
    spec_calibration_context: int | None = None
    detect_nan: bool = False
    calibration_cache: bool = True
    recalibrate: bool = False
    long_prompt: str = "error"
    kernel_impl: str = "auto"
    time_phases: bool = False
    prefill_token_budget: int = 512
    sampled_steps: bool = True
    cache_align: int | None = None
    mesh: tuple[int, int] | tuple[int, int, int] | str = (1, 1)
    draft_sharding: str = "replicated"
    draft_sync: str = "auto"
    background_compile: bool = False

    def __post_init__(self):
        for name in ("max_batch", "max_seq_len", "spec_hysteresis_steps", "prefill_token_budget"):
            positive_int(name, getattr(self, name))
        if self.max_seq_len < 2:
            raise ConfigError(f"max_seq_len={self.max_seq_len} must be >= 2 (a prompt token and a new one)")
        if self.batch_buckets is None:
            object.__setattr__(self, "batch_buckets", _powers_of_two(1, self.max_batch))
        if self.prompt_buckets is None:
            object.__setattr__(self, "prompt_buckets", prompt_buckets_for(self.max_seq_len, self.max_seq_len))
        for name, top in (("batch_buckets", self.max_batch), ("prompt_buckets", self.max_seq_len)):
            v = tuple(getattr(self, name))
            object.__setattr__(self, name, v)
            if not v or any(not is_int(x) or x < 1 for x in v) or list(v) != sorted(set(v)):
                raise ConfigError(f"{name}={v!r} must be an increasing tuple of positive integers")
            if name == "batch_buckets" and v[-1] != top:
                raise ConfigError(f"{name}={v!r} must end at {top} (the max_batch)")
            if name == "prompt_buckets" and v[-1] > top:
                raise ConfigError(f"{name}={v!r} must not go past {top} (the max_seq_len)")
        one_of("dtype", self.dtype, (None, "float32", "bfloat16", "float16"))
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ConfigError(f"speculative={self.speculative!r} must be a SpeculativeConfig or None")
        t = self.spec_disable_batch_threshold
        optional(non_negative_int, "spec_disable_batch_threshold", t, note="never off")
        check_draft_sharding(self.draft_sharding)
        one_of("draft_sync", self.draft_sync, ("auto",) + DRAFT_SYNC_MODES)
        policy = self.spec_policy
        if policy is None:  # as the command line picks (see spec_policy)
            policy = "threshold" if t is not None else "fixed" if self.speculative is not None else "auto"
            object.__setattr__(self, "spec_policy", policy)
        one_of("spec_policy", policy, SPEC_POLICIES)
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
        if not (is_number(self.spec_calibration_s) and self.spec_calibration_s > 0):
            raise ConfigError(f"spec_calibration_s={self.spec_calibration_s!r} must be > 0")
        c = self.spec_calibration_context
        if c is None:
            object.__setattr__(self, "spec_calibration_context", self.max_seq_len // 2)
        else:
            int_in("spec_calibration_context", c, 0, self.max_seq_len, hi_text=f"max_seq_len={self.max_seq_len}")
        one_of("long_prompt", self.long_prompt, ("error", "truncate"))
        check_kernel_impl(self.kernel_impl)
        optional(positive_int, "cache_align", self.cache_align)
        flag("sampled_steps", self.sampled_steps)
        flag("time_phases", self.time_phases)
        flag("calibration_cache", self.calibration_cache)
        flag("recalibrate", self.recalibrate)
        flag("spec_prune_buckets", self.spec_prune_buckets)
        flag("background_compile", self.background_compile)
        if self.background_compile and policy == "fixed":
            raise ConfigError("background_compile serves plain steps until the speculative ones are compiled; "
                              "spec_policy='fixed' never runs plain (use 'auto' or 'threshold')")
        if self.time_phases and policy == "plain":
            raise ConfigError("time_phases is set but spec_policy='plain' (no draft or verify phase to time)")
        object.__setattr__(self, "mesh", check_mesh_shape(self.mesh))


def default_policy(config: EngineConfig, draft_dir: str | Path | None = None, *, has_draft: bool = True,
                   draft_share: float | None = None) -> SpeculationPolicy:
    """The policy an ``EngineConfig`` implies (``spec_policy``): the measured cost model
    (with the model card of the draft in ``draft_dir`` as its prior), the fixed shape,
    the threshold cutoff, or plain; plain under "auto" when there is no draft.
    ``draft_share``: a draft step's least cost as a share of a plain step
    (``policy.draft_step_share`` of the loaded models), the depth gain under which auto's
    default candidates are left out (``AUTO_MIN_DEPTH_GAIN`` when not given)."""
    name = config.spec_policy
    if name == "plain" or (name == "auto" and not has_draft):
        return PlainPolicy()
    if name == "auto":
        s = config.speculative or SpeculativeConfig()
        fields = dict(sampling_verify=s.sampling_verify, threshold_single=s.threshold_single, threshold_acc=s.threshold_acc)
        prior = card_acceptance(draft_dir) if draft_dir is not None else None
        shapes, pruned = config.spec_shapes, ()
        floor = AUTO_MIN_DEPTH_GAIN if draft_share is None else draft_share
        by_bucket = False
        if shapes is None:
            shapes = parse_shapes(DEFAULT_AUTO_SHAPES, **fields)
            # The default candidates only: shapes the user listed are all compiled.
            if prior is not None:
                shapes, pruned = prune_by_prior(shapes, prior, min_gain=floor)
                by_bucket = config.spec_prune_buckets
        return AutoPolicy(shapes, prior=prior, hysteresis=config.spec_hysteresis_steps,
                          calibration_budget_s=config.spec_calibration_s, pruned=pruned,
                          pruned_below=floor, prune_buckets=by_bucket)
    if name == "fixed":
        return FixedPolicy(config.speculative)
    return ThresholdPolicy(config.speculative, config.spec_disable_batch_threshold, config.spec_hysteresis_steps)


def resolve_draft_sync(mode: str, policy: SpeculationPolicy, devices: int) -> str:
    """``EngineConfig.draft_sync`` for this policy and mesh: "auto" is deferred where the
    policy may both run plain steps and speculate (a fixed shape never runs plain: the
    prompt is all a deferral would move) on a single device, eager otherwise."""
    if mode != "auto":
        return mode
    return "deferred" if policy.runs_plain and policy_shapes(policy) and devices == 1 else "eager"
