"""What the engine measures: the process-wide compile counter, engine-wide counters
(``EngineMetrics``) and the timing of steady-state steps (``StepTimings``), which the
engine records once and hands to the policy.

A step is timed as the interval between its results and the previous step's. That is
what the step costs in the loop only when the device had nothing else queued between
the two (no prefill, insert or resize), the previous step was in flight, and it was the
same step (shape and bucket): the first step of another graph runs slower than a steady
one (a lone plain step between speculative ones measured 17x a steady one on a tiny
model). Other steps are not timed.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import numpy as np

from eagle_jax.spec.config import SpeculativeConfig

_COMPILES = collections.Counter()


def _on_event(event: str, duration: float, **_: Any) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES["total"] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compile_count() -> int:
    """Backend compilations in this process so far (every jit, eager ops included). For
    observation only: the guard against compiling in steady state is the step table's."""
    return _COMPILES["total"]


def shape_name(shape: SpeculativeConfig | None) -> str:
    return "plain" if shape is None else shape.shape


@dataclasses.dataclass
class StepTimings:
    """Steady-state step times per (batch bucket, shape name): count, seconds and the
    live rows' tokens, and the policy's latest prediction for a full bucket."""

    steps: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    seconds: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    tokens: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    predicted_tokens_per_second: dict = dataclasses.field(default_factory=dict)

    def add(self, bucket: int, shape: SpeculativeConfig | None, seconds: float, tokens: int,
            predicted: float | None) -> None:
        key = (bucket, shape_name(shape))
        self.steps[key] += 1
        self.seconds[key] += seconds
        self.tokens[key] += tokens
        if predicted is not None:
            self.predicted_tokens_per_second[key] = predicted

    def summary(self) -> dict[str, Any]:
        return {
            # Tokens/s of the timed steady-state steps (live rows only) and, where the
            # policy predicts, its prediction for a full bucket.
            "measured_tokens_per_second_by_bucket": {
                f"{b}: {name}": round(self.tokens[(b, name)] / s, 2) for (b, name), s in sorted(self.seconds.items()) if s > 0
            },
            "step_ms_by_bucket": {
                f"{b}: {name}": round(1000 * s / self.steps[(b, name)], 3)
                for (b, name), s in sorted(self.seconds.items()) if self.steps[(b, name)]
            },
            "predicted_tokens_per_second_by_bucket": {
                f"{b}: {name}": round(v, 2) for (b, name), v in sorted(self.predicted_tokens_per_second.items())
            },
        }


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
    timings: StepTimings = dataclasses.field(default_factory=StepTimings)  # steady-state steps only
    tokens: int = 0
    prefill_chunks: int = 0  # prefill calls launched (one chunk of one job each)
    prefill_tokens: int = 0  # prompt tokens they carried (padding excluded)
    prefill_padded_tokens: int = 0  # their rows x chunk lengths (padding included)
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
            **self.timings.summary(),
            "mean_accept_length": (sum(k * v for k, v in hist.items()) / n) if n else 0.0,
            "accept_length_histogram": hist,
            "acceptance_rate_by_depth": (
                (self.accepted_at_depth / max(self.spec_rows, 1)).round(4).tolist() if self.accepted_at_depth is not None else []
            ),
            "tokens": self.tokens,
            "prefill_chunks": self.prefill_chunks,
            "prefill_tokens": self.prefill_tokens,
            "prefill_padding": 1 - self.prefill_tokens / self.prefill_padded_tokens if self.prefill_padded_tokens else 0.0,
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
