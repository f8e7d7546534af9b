"""Speculation policies: which compiled step the engine runs for the current batch bucket.

The engine asks ``choose(bucket)`` before every step and gets a ``SpeculativeConfig`` (a
speculative step of that shape) or None (the plain step; the draft follows, eagerly or
deferred: ``EngineConfig.draft_sync``). After the step's results are read it calls
``observe(...)`` with what happened. Every shape a policy can return is listed in
``shapes``, so the step table compiles them all at start-up; returning anything else is a
bug the engine reports.

``ThresholdPolicy`` is ``--spec-disable-batch-threshold``, a manual batch cutoff, with
hysteresis; ``FixedPolicy`` always speculates with one shape; ``PlainPolicy`` never does.
``AutoPolicy`` is a measured cost model: it times every compiled step per batch bucket at
start-up (``calibrate``), estimates each shape's accept length from a prior (the draft's
model card) updated by what the engine observes, and runs whichever step is predicted to
give the most tokens per second, plain included.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from eagle_jax.errors import ConfigError, InputError
from eagle_jax.validate import is_int, non_negative_int, optional, positive_int
from eagle_jax.spec.config import SpeculativeConfig, parse_shape

log = logging.getLogger(__name__)


class SpeculationPolicy:
    """The interface between a policy and the engine; every policy subclasses it.

    A subclass sets ``shapes`` (every speculative shape it may choose: the step table
    compiles exactly these) and ``runs_plain`` (whether it may choose the plain step),
    and implements ``choose`` and ``describe``. The rest have defaults for a policy that
    does not measure: override them to learn from what the engine reports.
    """

    shapes: tuple[SpeculativeConfig, ...] = ()
    runs_plain: bool = True
    # Whether fit_buckets may leave shapes out per batch bucket: the engine then compiles
    # the speculative steps only after it has timed the plain ones.
    prune_buckets: bool = False
    # Whether choose() depends on measured step times. The engine refuses such a policy
    # on a mesh over several processes: each would measure its own times and could
    # launch another graph than the others, and their collectives would wait for good.
    uses_timings: bool = False

    def choose(self, bucket: int) -> SpeculativeConfig | None:
        """The step to run next for a padded batch of ``bucket`` rows (None: plain)."""
        raise NotImplementedError(f"{type(self).__name__}.choose")

    def observe(self, bucket: int, shape: SpeculativeConfig | None, accept_lengths: np.ndarray, step_s: float | None) -> None:
        """A step of ``shape`` ran for ``bucket``: the accept length of each live row
        (``[n]``; 1 for plain steps) and, when the engine could time it, the seconds it
        cost in the loop (``metrics.StepTimings``: results to results, the same step
        before it, nothing else queued between; else None)."""

    def shapes_at(self, bucket: int) -> tuple[SpeculativeConfig, ...]:
        """The shapes this policy may choose in batch bucket ``bucket`` (the step table
        compiles exactly these there): all of ``shapes`` unless ``fit_buckets`` left
        some out."""
        return self.shapes

    def fit_buckets(self, time_plain: Callable[[int, int], float], buckets: Sequence[int], *,
                    record: dict | None = None, context: int = 0) -> str | None:
        """Called once the plain steps are compiled and before the speculative ones are:
        a policy may leave out, per batch bucket, shapes that cannot pay there
        (``shapes_at``), so they are never compiled. ``time_plain(bucket, context)`` times
        one plain step; ``record``: a ``calibration_record()`` of an earlier engine of the
        same key (the cache), whose choice is taken instead of timing again where it
        fits; ``context``: the calibration's committed positions a row. Returns a line for
        the start-up log, or None (the default, and with ``prune_buckets`` off: every shape
        in every bucket)."""
        return None

    def calibrate(self, time_step: Callable[[int, SpeculativeConfig | None], float], buckets: Sequence[int], *,
                  resume: dict | None = None, on_progress: Callable[[dict], None] | None = None) -> str | None:
        """Called once the step table is built: ``time_step(bucket, shape)`` runs one
        compiled step on a fresh state (rows at ``EngineConfig.spec_calibration_context``)
        and returns its seconds. Returns a line for the start-up log, or None.
        ``resume``: a record an earlier engine of the same key saved part-way (its
        process ended while calibrating): the rows it holds are kept, not timed again.
        ``on_progress(record)``: called with the record so far after each bucket, so a
        run cut short leaves what it measured to the next one."""
        return None

    def calibration_record(self) -> dict | None:
        """What ``calibrate`` measured, as JSON-able data, for the engine's per-machine
        calibration cache (``serving.calibration``); None: nothing to keep (the default:
        a policy that does not calibrate)."""
        return None

    def restore_calibration(self, record: dict, buckets: Sequence[int]) -> str | None:
        """Take a ``calibration_record()`` of an earlier engine instead of timing again.
        Returns the start-up line, or None if the record does not fit this policy and
        ``buckets`` (the engine then calibrates)."""
        return None

    def predicted_tokens_per_second(self, bucket: int, shape: SpeculativeConfig | None) -> float | None:
        """What the policy expects ``shape`` to deliver in a full ``bucket`` (the engine
        reports it beside the measured figure), or None when it does not predict."""
        return None

    def describe(self) -> str:
        """One line for the start-up log."""
        raise NotImplementedError(f"{type(self).__name__}.describe")


class PlainPolicy(SpeculationPolicy):
    """Never speculate (no draft, or speculation switched off)."""

    shapes: tuple[SpeculativeConfig, ...] = ()
    runs_plain = True

    def choose(self, bucket: int) -> None:
        return None

    def describe(self) -> str:
        return "off"


class FixedPolicy(SpeculationPolicy):
    """Always speculate with ``shape``."""

    def __init__(self, shape: SpeculativeConfig):
        if not isinstance(shape, SpeculativeConfig):
            raise ConfigError(f"FixedPolicy needs a SpeculativeConfig, got {type(shape).__name__}")
        self.shape = shape
        self.shapes = (shape,)
        self.runs_plain = False

    def choose(self, bucket: int) -> SpeculativeConfig:
        return self.shape

    def describe(self) -> str:
        return f"fixed {self.shape.shape}"


class ThresholdPolicy(SpeculationPolicy):
    """Speculate with ``shape`` while the padded batch is at most ``threshold``.

    Above it the plain step runs. Speculation returns only after ``hysteresis``
    consecutive steps at or below the threshold, so the mode does not flip every step
    when the batch hovers there; the very first step speculates at once if allowed.
    ``threshold`` None: always on (the same as ``FixedPolicy``).
    """

    def __init__(self, shape: SpeculativeConfig, threshold: int | None, hysteresis: int = 4):
        if not isinstance(shape, SpeculativeConfig):
            raise ConfigError(f"ThresholdPolicy needs a SpeculativeConfig, got {type(shape).__name__}")
        optional(non_negative_int, "threshold", threshold)
        positive_int("hysteresis", hysteresis)
        self.shape, self.threshold, self.hysteresis = shape, threshold, hysteresis
        self.shapes = (shape,)
        self.runs_plain = threshold is not None
        self._on = False
        self._below = 0
        self._steps = 0

    def allowed(self, bucket: int) -> bool:
        return self.threshold is None or bucket <= self.threshold

    def choose(self, bucket: int) -> SpeculativeConfig | None:
        if not self.allowed(bucket):
            self._below = 0
            self._on = False
        elif not self._on:
            self._below += 1
            self._on = self._below >= self.hysteresis or self._steps == 0
        self._steps += 1
        return self.shape if self._on else None

    def describe(self) -> str:
        if self.threshold is None:
            return f"{self.shape.shape}, always on"
        return (f"{self.shape.shape}, off above padded batch {self.threshold}, back on after "
                f"{self.hysteresis} steps at or below")


def policy_shapes(policy: SpeculationPolicy) -> Sequence[SpeculativeConfig]:
    shapes = tuple(policy.shapes)
    for s in shapes:
        if not isinstance(s, SpeculativeConfig):
            raise ConfigError(f"policy {type(policy).__name__} lists {s!r} among its shapes; each must be a SpeculativeConfig")
    return shapes


# ----------------------------------------------------------------------------- the cost model

# Candidates when none are given: chains of 1 to 5 steps and three trees (cheap to wide).
DEFAULT_AUTO_SHAPES = (
    "chain S=1", "chain S=2", "chain S=3", "chain S=4", "chain S=5",
    "tree S=2 k=4 T=6", "tree S=3 k=4 T=8", "tree S=4 k=4 T=12",
)


# A draft depth whose prior expected gain (the chance a step accepts that deep) is below
# this cannot pay for its draft step where one costs at least this share of a plain step
# (measured: about 0.12 on the 2-core CPU with SmolLM2, about 0.06 at Llama-8B on an H200).
# The floor when the models' sizes are not known; with them, ``draft_step_share``.
AUTO_MIN_DEPTH_GAIN = 0.05


def draft_step_share(target, draft) -> float:
    """What one draft step reads over what one plain step of the target reads, in
    parameters: the draft's weights against the target's, leaving out the embedding
    tables (a step gathers a few rows; a tied LM head is its own parameter here) and
    counting a mixture-of-experts layer's routed experts at ``num_experts_per_tok /
    n_routed_experts``. Decode reads its weights once a step, so this is a lower bound of
    a draft step's cost as a share of a plain step's: SmolLM2-135M's 134.5 M against its
    draft's 9.8 M give 0.073 where the 2-core CPU measured 0.12; Llama-3.1-8B's shapes
    give 0.044 where an H200 measured 0.06.

    Why it bounds the depth worth compiling: a chain one step deeper adds ``g`` (the
    chance a step accepts that deep) to the expected accept length E and at least this
    share c to the step time T (in plain steps), so it pays only if ``g / c > E / T``,
    and E / T >= 1 wherever speculating beats plain; where it does not, the deeper chain
    beats plain only if ``g > c`` too. So ``g < c`` never pays."""
    import flax.nnx as nnx

    def read_per_step(model) -> float:
        cfg = getattr(model, "config", None)
        routed = getattr(cfg, "n_routed_experts", None)
        expert_share = cfg.num_experts_per_tok / routed if routed else 1.0
        total = 0.0
        for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            names = [str(getattr(p, "key", p)) for p in path]
            if "embed_tokens" in names:
                continue
            size = float(np.prod(leaf.get_value().shape))
            total += size * (expert_share if "experts" in names else 1.0)
        return total

    return read_per_step(draft) / read_per_step(target)


def prune_by_prior(
    shapes: Sequence[SpeculativeConfig], prior: Sequence[float], min_gain: float = AUTO_MIN_DEPTH_GAIN,
) -> tuple[tuple[SpeculativeConfig, ...], tuple[SpeculativeConfig, ...]]:
    """(kept, pruned): the shapes whose deepest draft step the prior expects to be accepted
    at least ``min_gain`` of the time (``prod(prior[:S])``, the last rate repeated past
    the prior's length), so auto compiles and calibrates no graph that could only pay if
    the draft were much better than its model card says. A tree's depth counts as a
    chain's (its top-1 path is one; its other branches add at the shallow depths). The
    shallowest shape is kept when none passes, so there is a speculative option."""
    if not shapes:
        return (), ()
    rates = list(prior)

    def gain(depth: int) -> float:
        r = rates + [rates[-1]] * max(0, depth - len(rates))
        return float(np.prod(r[:depth]))

    kept = tuple(s for s in shapes if gain(s.num_steps) >= min_gain)
    if not kept:
        kept = (min(shapes, key=lambda s: (s.num_steps, s.num_draft_tokens)),)
    return kept, tuple(s for s in shapes if s not in kept)


def least_step_seconds(bucket: int, shape: SpeculativeConfig, plain: dict, plain_empty: dict,
                       draft_share: float = 0.0) -> float:
    """The least a speculative step of ``shape`` can cost at ``bucket`` rows, from plain
    steps timed per bucket at the calibration context (``plain``) and at an empty one
    (``plain_empty``), {bucket: seconds}:

    - its verify forward runs the target over ``bucket * num_draft_tokens`` tokens: the
      products of a plain step of that many rows with no context to attend over
      (``plain_empty`` interpolated linearly between buckets, and past the largest along
      the slope of its last segment), and attends over ``bucket`` rows' contexts (what
      the context added to the plain step of ``bucket`` rows);
    - its ``num_steps`` draft steps each run the draft over ``bucket`` rows (the first)
      or ``bucket * topk`` (a tree's next ones), and a draft step costs at least
      ``draft_share`` (``draft_step_share``: the weights it reads over a plain step's)
      of the empty plain step of as many rows: its products are that share of the
      target's, per token, and so are its weights' reads.

    Leaving out the draft's attention, its catch-up and the step's bookkeeping keeps this
    a lower bound."""
    xs = sorted(plain_empty)
    ys = [plain_empty[x] for x in xs]

    def forward(n: int) -> float:
        if n <= xs[-1]:
            return float(np.interp(n, xs, ys))
        slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])) if len(xs) > 1 else 0.0
        return ys[-1] + slope * (n - xs[-1])

    draft = forward(bucket) + (shape.num_steps - 1) * forward(bucket * shape.topk)
    return forward(bucket * shape.num_draft_tokens) + draft_share * draft + max(0.0, plain[bucket] - plain_empty[bucket])


def parse_shapes(text: str | Sequence[str], **fields) -> tuple[SpeculativeConfig, ...]:
    """``"chain S=1, chain S=2, tree S=3 k=4 T=8"`` (or a list of such strings) as
    configs, in order, without repeats; an empty list or a bad entry is a ``ConfigError``."""
    items = [t.strip() for t in text.split(",")] if isinstance(text, str) else [str(t).strip() for t in text]
    items = [t for t in items if t]
    if not items:
        raise ConfigError(f"no speculative shapes in {text!r} (e.g. 'chain S=2, tree S=3 k=4 T=8')")
    return tuple(dict.fromkeys(parse_shape(t, **fields) for t in items))


def card_acceptance(draft_dir: str | Path) -> list[float] | None:
    """The draft's held-out acceptance by depth from its model card (``training.json``'s
    ``final_eval.acc``: top-1 agreement at each unrolled step, each conditional on the
    steps before), or None when the directory has no such record. A malformed record is
    an ``InputError`` naming the file."""
    path = Path(draft_dir) / "training.json"
    if not path.is_file():
        return None
    try:
        acc = json.loads(path.read_text())["final_eval"]["acc"]
        values = [float(a) for a in acc]
    except (ValueError, KeyError, TypeError) as e:
        raise InputError(f"{path}: final_eval.acc is not a list of numbers ({e})") from e
    if not values or not all(0.0 <= a <= 1.0 for a in values):
        raise InputError(f"{path}: final_eval.acc must be a non-empty list of rates in [0, 1], got {values}")
    return values


class DepthAcceptance:
    """Acceptance by depth for one shape family: at depth d, the chance a drafted token is
    accepted given depth d-1 was. Each depth is a Beta estimate: the prior's rate counts as
    ``weight`` observations, then every observed row adds its own.

    A step of depth S whose row accepted n tokens (the bonus included, so n - 1 drafts)
    reached depths 1..min(n, S) and accepted depths 1..n-1."""

    def __init__(self, prior: Sequence[float], weight: float, depth: int):
        p = np.asarray(list(prior) + [prior[-1]] * max(0, depth - len(prior)), np.float64)[:depth]
        self.prior, self.weight = p, float(weight)
        self.accepted = np.zeros(depth, np.float64)
        self.reached = np.zeros(depth, np.float64)

    def add(self, accept_lengths: np.ndarray, num_steps: int) -> None:
        n = np.asarray(accept_lengths, np.int64)
        if n.size == 0:
            return
        d = np.arange(1, num_steps + 1)[:, None]
        self.reached[:num_steps] += (d <= np.minimum(n, num_steps)[None]).sum(1)
        self.accepted[:num_steps] += (d <= (n - 1)[None]).sum(1)

    def rates(self, optimism: float = 0.0, prior: np.ndarray | None = None) -> np.ndarray:
        """Posterior mean by depth; ``optimism`` > 0 adds that many posterior standard
        deviations (an upper bound, for deciding what is worth trying). ``prior``
        replaces the prior's rates (a tree's prior follows the chains' estimate)."""
        prior = self.prior if prior is None else np.asarray(prior, np.float64)[: len(self.prior)]
        n = self.reached + self.weight
        p = (self.accepted + self.weight * prior) / n
        if optimism:
            p = p + optimism * np.sqrt(p * (1 - p) / (n + 1))
        return np.clip(p, 0.0, 1.0)

    def expected_length(self, num_steps: int, optimism: float = 0.0, prior: np.ndarray | None = None) -> float:
        """Expected accept length (bonus included) of a step of depth ``num_steps``."""
        return 1.0 + float(np.cumprod(self.rates(optimism, prior)[:num_steps]).sum())


@dataclasses.dataclass
class Calibration:
    """Start-up step timings: seconds per (bucket, shape name), medians of ``rounds``."""

    seconds: dict
    rounds: int
    wall_s: float
    budget_s: float


# Timed steps of its own after which an option's step time is its own measured ratio
# (before: its bucket's, over whatever ran there).
OWN_TIMINGS = 3


class AutoPolicy(SpeculationPolicy):
    """Run the step predicted to give the most tokens per second in each batch bucket.

    For a full bucket of b rows, a step of shape s delivers ``b * E[L_s] / t(b, s)``
    tokens per second, where ``E[L_s]`` is its expected accept length (1 for the plain
    step) and ``t(b, s)`` its time. Comparing shapes within a bucket, b cancels: the
    policy runs ``argmax_s E[L_s] / t(b, s)``.

    - ``t(b, s)``: timed at start-up (``calibrate``), then corrected by the engine's
      measured step times (``observe``'s ``step_s``), which include the attention over
      real contexts and the host loop: a shape's own measured-to-calibrated ratio once it
      has a few, the bucket's ratio before that. Both are running means that settle into
      exponential averages over about ``1 / timing_smoothing`` steps (20 by default): one
      step's time jitters by several percent and contexts differ between requests, while
      options at batch 1 can lie within 2-3% of each other (SmolLM2, released draft:
      chain S=1 27.5 tok/s against plain's 26.9 measured in the loop; an average over
      5 steps predicted them the other way round by 4%).
    - ``E[L_s]``: chains share one acceptance-by-depth estimate (``DepthAcceptance``),
      each tree has its own. The chains' prior is the draft's model card
      (``card_acceptance``) with weight ``prior_weight`` rows, or 0.5 per depth with weight
      ``uninformed_weight`` without one; a tree's prior is the chains' rates (a tree accepts
      at least what its top-1 path would) with the small weight, so a few observed steps
      decide.
    - Hysteresis: another choice takes over only after it has been predicted better by
      more than ``margin`` for ``hysteresis`` consecutive steps of that bucket.
    - Exploration: every ``explore_every`` steps of a bucket, the option with the best
      optimistic rate (one posterior standard deviation up, and ``timing_doubt`` faster
      while its step time is only the calibration's) runs once if that beats the
      current one's prediction for ``probe_steps`` consecutive steps (the first step
      after a switch is not a steady one and is not timed; the others are), or, while
      the option has fewer than ``OWN_TIMINGS`` timed steps of its own, until it has
      them: a probe that ends with the option still predicted from another shape's
      timings decides nothing (a noisy calibration that timed plain as dear as a
      random draft's chain S=3 kept the chain for 111 of 240 steps, one timed plain
      step per probe at 16, 48 and 112), so a prior
      that was wrong is corrected and stale timings are refreshed. Each probe that
      leaves the bucket's choice as it was doubles the gap to the next one, up to
      ``explore_max`` steps (default 256, or ``explore_every`` if longer); a change of
      choice resets it. A probe is dearer than its step: the first step of another
      graph runs slower than a steady one (switching every step cost 8% a step on
      SmolLM2 at batch 1), and under a deferred draft sync a speculative probe in a
      bucket held plain first runs the draft over everything since the last one. So
      the cost falls from a probe every ``explore_every`` steps to one every
      ``explore_max`` where the choice is settled.
    """

    runs_plain = True
    uses_timings = True

    def __init__(
        self, shapes: Sequence[SpeculativeConfig], *, prior: Sequence[float] | None = None, prior_weight: float = 16.0,
        uninformed_weight: float = 4.0, margin: float = 0.03, hysteresis: int = 4, explore_every: int = 16,
        explore_max: int | None = None, probe_steps: int = 2, timing_doubt: float = 0.1, timing_smoothing: float = 0.05,
        calibration_budget_s: float = 20.0, calibration_rounds: int = 5, pruned: Sequence[SpeculativeConfig] = (),
        pruned_below: float = AUTO_MIN_DEPTH_GAIN, prune_buckets: bool = False,
    ):
        shapes = tuple(dict.fromkeys(shapes))
        if not shapes:
            raise ConfigError("AutoPolicy needs at least one speculative shape to choose from")
        for s in shapes:
            if not isinstance(s, SpeculativeConfig):
                raise ConfigError(f"AutoPolicy shapes must be SpeculativeConfigs, got {s!r}")
        if prior is not None:
            prior = [float(p) for p in prior]
            if not prior or not all(0.0 <= p <= 1.0 for p in prior):
                raise ConfigError(f"prior={prior!r} must be a non-empty list of rates in [0, 1]")
        for name, v in (("prior_weight", prior_weight), ("uninformed_weight", uninformed_weight)):
            if not v > 0:
                raise ConfigError(f"{name}={v!r} must be > 0")
        if not 0 <= margin < 1:
            raise ConfigError(f"margin={margin!r} must be in [0, 1)")
        for name, v in (("hysteresis", hysteresis), ("explore_every", explore_every), ("calibration_rounds", calibration_rounds),
                        ("probe_steps", probe_steps)):
            positive_int(name, v)
        if explore_max is None:  # 16 doublings' worth of the default gap, or no back-off past a longer one
            explore_max = max(256, explore_every)
        if not is_int(explore_max) or explore_max < explore_every:
            raise ConfigError(f"explore_max={explore_max!r} must be an integer >= explore_every={explore_every}")
        if not calibration_budget_s > 0:
            raise ConfigError(f"calibration_budget_s={calibration_budget_s!r} must be > 0")
        self.shapes = shapes
        self.pruned = tuple(pruned)  # candidates left out before compiling (``prune_by_prior``), for the log
        self.pruned_below = pruned_below  # the depth gain they were pruned under
        # fit_buckets leaves out, per batch bucket, the shapes that cannot pay there.
        self.prune_buckets = bool(prune_buckets)
        self._at: dict = {}  # bucket -> the shapes kept there (fit_buckets); absent: all of them
        self.prior_source = "model card" if prior is not None else "none (0.5 per depth)"
        self.margin, self.hysteresis, self.explore_every, self.explore_max = margin, hysteresis, explore_every, explore_max
        self.probe_steps = probe_steps
        if not 0 <= timing_doubt < 1:
            raise ConfigError(f"timing_doubt={timing_doubt!r} must be in [0, 1)")
        self.timing_doubt = timing_doubt
        if not 0 < timing_smoothing <= 1:
            raise ConfigError(f"timing_smoothing={timing_smoothing!r} must be in (0, 1]")
        self.timing_smoothing = timing_smoothing
        self.calibration_budget_s, self.calibration_rounds = calibration_budget_s, calibration_rounds
        depth = max(s.num_steps for s in shapes)
        chain_prior = prior if prior is not None else [0.5]
        self._chains = DepthAcceptance(chain_prior, prior_weight if prior is not None else uninformed_weight, depth)
        self._trees = {s: DepthAcceptance([0.5], uninformed_weight, s.num_steps) for s in shapes if not s.is_chain}
        self.calibration: Calibration | None = None
        self._ratio: dict = {}  # (bucket, shape) -> [EMA of measured / calibrated seconds, count]
        self._bucket_ratio: dict = {}  # bucket -> EMA of measured / calibrated over all shapes
        self._current: dict = {}  # bucket -> the choice in force
        self._challenger: dict = {}  # bucket -> (option, consecutive steps it was predicted better)
        self._steps: dict = {}  # bucket -> steps chosen
        self._next_probe: dict = {}  # bucket -> (step number of the next probe, gap that led to it)
        self._probe_left: dict = {}  # bucket -> (the option being probed, steps of the probe still to run)
        self._last_observed: dict = {}  # bucket -> the shape of the step observed last

    # -- the model

    def _family(self, shape: SpeculativeConfig) -> DepthAcceptance:
        return self._chains if shape.is_chain else self._trees[shape]

    def expected_length(self, shape: SpeculativeConfig | None, optimism: float = 0.0) -> float:
        if shape is None:
            return 1.0
        if shape.is_chain:
            return self._chains.expected_length(shape.num_steps, optimism)
        # A tree accepts at least what its top-1 path would: its prior is the chains' estimate.
        return self._trees[shape].expected_length(shape.num_steps, optimism, prior=self._chains.rates())

    def step_seconds(self, bucket: int, shape: SpeculativeConfig | None) -> float:
        """The predicted time of one step: the calibrated time times the measured
        correction, but never less than a step it contains plus the extra work the
        calibration timed (a speculative step runs the plain forward and the draft, a
        chain of S steps what a shorter one does and more). The corrections are measured
        at different context lengths and with noise; a speculative step predicted no
        dearer than plain would win with any acceptance at all (a random draft's chain
        S=1 kept running that way)."""
        t = self._corrected_seconds(bucket, shape)
        if shape is None:
            return t
        cal = self.calibration.seconds
        smaller = [None] + [s for s in self.shapes_at(bucket)
                            if shape.is_chain and s.is_chain and s.num_steps < shape.num_steps]
        for s in smaller:
            t = max(t, self._corrected_seconds(bucket, s) + cal[(bucket, shape)] - cal[(bucket, s)])
        return t

    def _corrected_seconds(self, bucket: int, shape: SpeculativeConfig | None) -> float:
        if self.calibration is None:
            raise ConfigError("AutoPolicy has no step timings: the engine calls calibrate() once the step table is built")
        base = self.calibration.seconds.get((bucket, shape))
        if base is None:
            raise ConfigError(f"AutoPolicy was not calibrated for batch bucket {bucket} ({_name(shape)})")
        own = self._ratio.get((bucket, shape))
        ratio = own[0] if own is not None and own[1] >= OWN_TIMINGS else self._bucket_ratio.get(bucket, 1.0)
        return base * ratio

    def predicted_tokens_per_second(self, bucket: int, shape: SpeculativeConfig | None, optimism: float = 0.0) -> float:
        return bucket * self.expected_length(shape, optimism) / self.step_seconds(bucket, shape)

    def options(self, bucket: int | None = None) -> tuple:
        """Plain and the shapes of ``bucket`` (None: every shape of any bucket)."""
        return (None,) + (self.shapes if bucket is None else self.shapes_at(bucket))

    def shapes_at(self, bucket: int) -> tuple[SpeculativeConfig, ...]:
        return self._at.get(bucket, self.shapes)

    def _option_counts(self, buckets: Sequence[int]) -> str:
        """"x 6 options", or "with 1/3/6 options" where fit_buckets left some out."""
        counts = sorted({len(self.options(b)) for b in buckets}) or [len(self.options())]
        return f"x {counts[0]} options" if len(counts) == 1 else f"with {'/'.join(map(str, counts))} options"

    # -- which shapes each bucket compiles

    def fit_buckets(self, time_plain: Callable[[int, int], float], buckets: Sequence[int], *,
                    record: dict | None = None, context: int = 0, rounds: int = 5) -> str | None:
        """Leave out, per batch bucket, the shapes that cannot pay there, before they are
        compiled (with ``prune_buckets``; else nothing).

        A speculative step of a shape verifying T tokens a row, at b rows, runs at least
        the target's forward over b*T tokens, and attends over b rows' contexts. So it
        costs at least ``least_step_seconds``: a plain step of b*T rows at an empty
        context (the products; interpolated between the buckets' timings, extrapolated
        past the largest one along its last segment) plus what attending over the
        context added to the plain step of b rows, plus its S draft steps, each at
        least ``pruned_below`` (the draft step share the candidates were pruned under)
        of a plain step of as many rows. A shape is kept at bucket b only if
        even its optimistic expected accept length (``expected_length(shape,
        optimism=1)``, the bound the policy's exploration probes under) times plain's
        rate beats that least time: otherwise auto could never choose it there, not even
        to probe it. Where no shape passes in the smallest bucket its best one is kept,
        so speculation stays possible.

        On the 2-core CPU with SmolLM2-135M a plain step of 16 rows costs 2.6x one of 1:
        one cold start left out 7 of 25 steps (the trees at buckets 4-16, chain S=3 at
        16), another none (docs/measuring.md: the bound is loose past the largest
        bucket and leaves out the draft's steps). On a GPU a step is flat in rows up to
        hundreds and every shape is kept.

        ``time_plain(bucket, context)``: seconds of one plain step at ``context``
        committed positions (the calibration's ``context`` and an empty one), the least
        of ``rounds``, interleaved over the buckets, after a warm-up (noise only adds
        time, and the bound wants the step's own cost: one cold run's median of 3 timed
        4 rows below 1). ``record``:
        an earlier engine's calibration of the same key (``serving.calibration``): when
        it covers every bucket, its shapes per bucket are taken as they are (a warm start
        compiles what the cold one did)."""
        if not self.prune_buckets:
            return None
        kept = self._record_shapes(record, buckets) if isinstance(record, dict) and not record.get("partial") else None
        if kept is not None:
            self._at = kept
            return f"shapes per batch bucket from the calibration cache: {self._describe_at(buckets)}"
        t0 = time.perf_counter()
        at_ctx, empty = {}, {}
        points = [(b, ctx, out) for b in buckets for ctx, out in ((context, at_ctx), (0, empty))]
        for b, ctx, _ in points:
            time_plain(b, ctx)  # warm-up: first runs allocate
        # Rounds interleaved over the buckets: a noisy spell then slows one round of every
        # bucket, which the least of the rounds drops, rather than every round of one bucket
        # (which skewed the ratio between buckets the bound rests on: one cold start timed
        # 16 empty rows at 60.9 ms where the next timed 39.9, and left out 16 steps, not 0).
        for r in range(rounds):
            for b, ctx, out in points:
                t = time_plain(b, ctx)
                out[b] = t if r == 0 else min(out[b], t)
        self._at = {}
        smallest = min(buckets)
        for b in buckets:
            least = {s: least_step_seconds(b, s, at_ctx, empty, self.pruned_below) for s in self.shapes}
            keep = tuple(s for s in self.shapes if self.expected_length(s, optimism=1.0) * at_ctx[b] > least[s])
            if not keep and b == smallest:
                keep = (max(self.shapes, key=lambda s: self.expected_length(s, optimism=1.0) * at_ctx[b] / least[s]),)
            self._at[b] = keep
        plain = ", ".join(f"{b}: {1000 * at_ctx[b]:.1f}/{1000 * empty[b]:.1f}" for b in buckets)
        return (f"shapes per batch bucket by their least step cost (plain step ms at context {context}/empty: {plain}; "
                f"{time.perf_counter() - t0:.1f} s): {self._describe_at(buckets)}")

    def _describe_at(self, buckets: Sequence[int]) -> str:
        left = sum(len(self.shapes) - len(self.shapes_at(b)) for b in buckets)
        return ("; ".join(f"{b}: {', '.join(s.shape for s in self.shapes_at(b)) or 'plain only'}" for b in buckets)
                + f" ({left} of {len(self.shapes) * len(buckets)} speculative steps left out)")

    def _record_shapes(self, record: dict, buckets: Sequence[int]) -> dict | None:
        """{bucket: shapes} that ``record`` timed, when it covers every bucket with plain
        and shapes of this policy; else None."""
        rows = self._record_rows(record, buckets)
        if sorted(rows) != sorted(buckets):
            return None
        return {b: tuple(s for s in self.shapes if s in row) for b, row in rows.items()}

    def best(self, bucket: int) -> SpeculativeConfig | None:
        rates = {o: self.predicted_tokens_per_second(bucket, o) for o in self.options(bucket)}
        return max(rates, key=rates.get)

    # -- start-up

    def calibrate(self, time_step: Callable[[int, SpeculativeConfig | None], float], buckets: Sequence[int], *,
                  resume: dict | None = None, on_progress: Callable[[dict], None] | None = None) -> str:
        """Time every option in every bucket: a warm-up round, then interleaved rounds
        per bucket, up to ``calibration_rounds``, while the bucket's share of the budget
        lasts (at least one); the median per (bucket, option) is kept. The budget is
        shared out per bucket so the large buckets' slow steps do not leave the small
        ones, whose steps are cheap to repeat, with a single noisy round.

        Buckets a ``resume`` record holds (an earlier engine's part-way calibration) are
        taken from it; ``on_progress`` gets the record so far after each bucket timed
        here (the smallest first: the cheapest to finish). A background calibration of
        a short run, which the process's end cuts off, so still adds up over runs."""
        t0 = time.perf_counter()
        known = self._record_rows(resume, buckets) if isinstance(resume, dict) else {}
        known = {b: row for b, row in known.items() if set(row) == set(self.options(b))}
        try:
            prior_wall, prior_rounds = (float(resume["wall_s"]), int(resume["rounds"])) if known else (0.0, None)
        except (KeyError, TypeError, ValueError):  # a record of another layout: measure everything
            known, prior_wall, prior_rounds = {}, 0.0, None
        todo = sorted(b for b in buckets if b not in known)
        medians = {(b, o): s for b, row in known.items() for o, s in row.items()}
        keys = [(b, o) for b in todo for o in self.options(b)]
        samples: dict = {k: [] for k in keys}
        for k in keys:  # warm-up: first runs allocate
            time_step(*k)
        share = max(0.0, self.calibration_budget_s - (time.perf_counter() - t0)) / max(len(todo), 1)
        per_bucket = {b: f"{prior_rounds} (cached)" for b in sorted(known)}
        rounds_done = [prior_rounds] if prior_rounds is not None else []
        for b in todo:
            start, rounds = time.perf_counter(), 0
            while rounds < self.calibration_rounds:
                r0 = time.perf_counter()
                for o in self.options(b):
                    samples[(b, o)].append(time_step(b, o))
                rounds += 1
                now = time.perf_counter()
                if now - start + (now - r0) > share:
                    break
            per_bucket[b] = rounds
            rounds_done.append(rounds)
            medians.update({(b, o): float(np.median(samples[(b, o)])) for o in self.options(b)})
            if on_progress is not None and b != todo[-1]:
                on_progress(self._record(medians, min(rounds_done), prior_wall + time.perf_counter() - t0, partial=True))
        self.calibration = Calibration(
            _monotone(medians, buckets, self.shapes_at),
            min(rounds_done), prior_wall + time.perf_counter() - t0, self.calibration_budget_s,
        )
        resumed = f"; {len(known)} buckets resumed from an earlier run" if known else ""
        return (f"calibrated {len(keys)} steps ({len(todo)} batch buckets {self._option_counts(todo)}{resumed}) in "
                f"{time.perf_counter() - t0:.1f} s (rounds after a warm-up per bucket: "
                + ", ".join(f"{b}: {per_bucket[b]}" for b in sorted(per_bucket)) + f"; budget {self.calibration_budget_s:g} s); "
                f"predicted best: "
                + ", ".join(f"{b}: {_name(self.best(b))}" for b in buckets))

    def _record(self, seconds: dict, rounds: int, wall_s: float, partial: bool = False) -> dict:
        """Seconds by bucket and option (null: a shape ``fit_buckets`` left out there)."""
        buckets = sorted({b for b, _ in seconds})
        return {"options": [_name(o) for o in self.options()], "buckets": buckets, "rounds": rounds, "wall_s": wall_s,
                "budget_s": self.calibration_budget_s, "partial": partial,
                "seconds": [[seconds.get((b, o)) for o in self.options()] for b in buckets]}

    def _record_rows(self, record: dict, buckets: Sequence[int]) -> dict:
        """{bucket: {option: seconds}} of ``record`` for those of ``buckets`` it holds (a
        null is a shape left out there); {} when it is of another option set or layout
        (then everything is measured). A row without plain, or with a shape left out
        where this policy does not leave shapes out, is not taken."""
        try:
            names, got, seconds = record["options"], record["buckets"], record["seconds"]
            if names != [_name(o) for o in self.options()]:
                return {}
            rows = {int(b): {o: float(s) for o, s in zip(self.options(), row, strict=True) if s is not None}
                    for b, row in zip(got, seconds, strict=True)}
        except (KeyError, TypeError, ValueError):  # a record of another layout: measure instead
            return {}
        full = len(self.options())
        return {b: row for b, row in rows.items() if b in set(buckets) and None in row and all(s > 0 for s in row.values())
                and (self.prune_buckets or len(row) == full)}

    def calibration_record(self) -> dict | None:
        if self.calibration is None:
            return None
        c = self.calibration
        return self._record(c.seconds, c.rounds, c.wall_s)

    def restore_calibration(self, record: dict, buckets: Sequence[int]) -> str | None:
        if not isinstance(record, dict):
            return None
        rows = self._record_rows(record, buckets)
        if record.get("partial") or sorted(rows) != sorted(buckets):
            return None  # part of it, at most: calibrate(resume=record) measures the rest
        if any(set(row) != set(self.options(b)) for b, row in rows.items()):
            return None  # timed for other shapes per bucket than this table compiled
        try:
            table = {(b, o): s for b, row in rows.items() for o, s in row.items()}
            self.calibration = Calibration(_monotone(table, buckets, self.shapes_at), int(record["rounds"]),
                                           float(record["wall_s"]), float(record["budget_s"]))
        except (KeyError, TypeError, ValueError):  # a record of another layout: measure instead
            return None
        return (f"calibration of {len(table)} steps read from the cache (measured in {self.calibration.wall_s:.1f} s, "
                f"{self.calibration.rounds} rounds); predicted best: "
                + ", ".join(f"{b}: {_name(self.best(b))}" for b in sorted(buckets)))

    # -- the engine's calls

    def choose(self, bucket: int) -> SpeculativeConfig | None:
        n = self._steps[bucket] = self._steps.get(bucket, 0) + 1
        probe, left = self._probe_left.get(bucket, (None, 0))
        if left > 0:  # a probe runs on: its later steps are the timed ones
            self._probe_left[bucket] = (probe, left - 1)
            return probe
        best = self.best(bucket)
        if bucket not in self._current:
            self._current[bucket] = best
            log.info("auto: batch bucket %d starts with %s", bucket, _name(best))
        cur = self._current[bucket]
        if best != cur:
            rate = self.predicted_tokens_per_second
            if rate(bucket, best) > rate(bucket, cur) * (1 + self.margin):
                who, count = self._challenger.get(bucket, (None, 0))
                count = count + 1 if who == best else 1
                self._challenger[bucket] = (best, count)
                if count >= self.hysteresis:
                    log.info("auto: batch bucket %d switches %s -> %s (predicted %.1f vs %.1f tok/s)", bucket,
                              _name(cur), _name(best), rate(bucket, best), rate(bucket, cur))
                    self._current[bucket] = cur = best
                    self._challenger.pop(bucket, None)
                    self._next_probe[bucket] = (n + self.explore_every, self.explore_every)  # unsettled again
            else:
                self._challenger.pop(bucket, None)
        else:
            self._challenger.pop(bucket, None)
        at, gap = self._next_probe.setdefault(bucket, (self.explore_every, self.explore_every))
        if n >= at:
            # The gap doubles at each probe while the choice stands (reset on a switch above).
            gap = min(2 * gap, self.explore_max)
            self._next_probe[bucket] = (n + gap, gap)
            worth, probe = self._probe(bucket, cur)
            if worth:
                self._probe_left[bucket] = (probe, self._probe_length(bucket, probe) - 1)
                return probe
        return cur

    def _probe(self, bucket: int, cur) -> tuple[bool, SpeculativeConfig | None]:
        """(True, the option worth one exploratory step; None is plain) or (False, None)."""
        here = self.predicted_tokens_per_second(bucket, cur)
        hopes = {}
        for o in self.options(bucket):
            if o == cur:
                continue
            hope = self.predicted_tokens_per_second(bucket, o, optimism=1.0)
            own = self._ratio.get((bucket, o))
            if own is None or own[1] < OWN_TIMINGS:
                # Its time is the start-up calibration's (an empty cache, few rounds): allow
                # it the calibration's noise, so a close competitor gets measured for real.
                hope *= 1.0 + self.timing_doubt
            hopes[o] = hope
        if not hopes:  # a bucket where fit_buckets kept plain alone: nothing to explore
            return False, None
        o = max(hopes, key=hopes.get)
        return (True, o) if hopes[o] > here else (False, None)

    def _probe_length(self, bucket: int, option) -> int:
        """Steps a probe of ``option`` runs: ``probe_steps``, or enough for the option's
        own time (its first step is not timed, then ``OWN_TIMINGS`` that are)."""
        own = self._ratio.get((bucket, option))
        missing = max(0, OWN_TIMINGS - (own[1] if own is not None else 0))
        return max(self.probe_steps, 1 + missing) if missing else self.probe_steps

    def observe(self, bucket: int, shape: SpeculativeConfig | None, accept_lengths: np.ndarray, step_s: float | None) -> None:
        acc = np.asarray(accept_lengths, np.int64)
        if shape is not None and acc.size:
            self._family(shape).add(acc, shape.num_steps)
        previous = self._last_observed.get(bucket, _UNSET)
        self._last_observed[bucket] = shape
        if step_s is None or self.calibration is None or (bucket, shape) not in self.calibration.seconds:
            return
        if previous != shape:
            # The first step after a switch (an exploration probe, a change of choice) is
            # not what the shape costs in steady state: a lone plain step between
            # speculative ones measured 17x a steady one on a tiny model. Not counted.
            return
        ratio = step_s / self.calibration.seconds[(bucket, shape)]
        r = self._ratio.setdefault((bucket, shape), [ratio, 0])
        a = max(self.timing_smoothing, 1.0 / (r[1] + 1))  # a running mean until the average spans 1/smoothing steps
        r[0] = r[0] + a * (ratio - r[0]) if r[1] else ratio
        r[1] += 1
        br = self._bucket_ratio.get(bucket)
        self._bucket_ratio[bucket] = ratio if br is None else br + self.timing_smoothing * (ratio - br)

    # -- reporting

    def report(self) -> dict:
        """Per calibrated bucket: the choice in force, and every option's predicted
        tokens/s (full bucket), expected accept length and step time. What the steps
        measured is the engine's (``EngineMetrics.timings``)."""
        if self.calibration is None:
            return {}
        out = {}
        for b in sorted({b for b, _ in self.calibration.seconds}):
            out[b] = {
                "chosen": _name(self._current.get(b, self.best(b))),
                "predicted_tokens_per_second": {_name(o): round(self.predicted_tokens_per_second(b, o), 2) for o in self.options(b)},
                "expected_accept_length": {_name(o): round(self.expected_length(o), 3) for o in self.options(b)},
                "step_ms": {_name(o): round(1000 * self.step_seconds(b, o), 3) for o in self.options(b)},
            }
        return out

    def describe(self) -> str:
        pruned = (f"; left out by the prior (deepest step expected to accept < {self.pruned_below:.3g}): "
                  f"{', '.join(s.shape for s in self.pruned)}") if self.pruned else ""
        return (f"auto over plain and {', '.join(s.shape for s in self.shapes)} (acceptance prior: {self.prior_source}{pruned}; "
                f"margin {self.margin:g}, hysteresis {self.hysteresis}, explore every {self.explore_every} steps, "
                f"backing off to {self.explore_max} while the choice stands, {self.probe_steps} steps a probe, "
                f"more until the option has {OWN_TIMINGS} timed steps of its own)")


def _monotone(seconds: dict, buckets: Sequence[int], shapes_at: Callable[[int], Sequence[SpeculativeConfig]]) -> dict:
    """Timings made consistent with the work each step does, since a few noisy rounds can
    order them wrongly: a speculative step does the plain step's forward and more, and a
    chain of S+1 steps does what one of S does and more, so neither may come out cheaper
    (each is raised to the larger of the two). ``shapes_at(bucket)``: the shapes timed there."""
    out = dict(seconds)
    for b in buckets:
        shapes = shapes_at(b)
        chains = sorted((s for s in shapes if s.is_chain), key=lambda s: s.num_steps)
        plain = out[(b, None)]
        for s in shapes:
            out[(b, s)] = max(out[(b, s)], plain)
        for lo, hi in zip(chains, chains[1:]):
            out[(b, hi)] = max(out[(b, hi)], out[(b, lo)])
    return out


_UNSET = object()


def _name(shape: SpeculativeConfig | None) -> str:
    return "plain" if shape is None else shape.shape
