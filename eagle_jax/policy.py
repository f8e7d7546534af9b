"""Speculation policies: which compiled step the engine runs for the current batch bucket.

The engine asks ``choose(bucket)`` before every step and gets a ``SpeculativeConfig`` (a
speculative step of that shape) or None (the plain step; the draft stays in sync). After
the step's results are read it calls ``observe(...)`` with what happened. Every shape a
policy can return is listed in ``shapes``, so the step table compiles them all at
start-up; returning anything else is a bug the engine reports.

``ThresholdPolicy`` is the seed system's ``--spec-disable-batch-threshold`` with
hysteresis; ``FixedPolicy`` always speculates with one shape; ``PlainPolicy`` never does.
A measured cost model (the adaptive policy) plugs in through the same two calls.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from eagle_jax.errors import ConfigError
from eagle_jax.spec_config import SpeculativeConfig


@runtime_checkable
class SpeculationPolicy(Protocol):
    shapes: tuple[SpeculativeConfig, ...]  # every speculative shape it may choose
    runs_plain: bool  # whether it may choose the plain step

    def choose(self, bucket: int) -> SpeculativeConfig | None:
        """The step to run next for a padded batch of ``bucket`` rows (None: plain)."""

    def observe(self, bucket: int, shape: SpeculativeConfig | None, accept_lengths: np.ndarray, step_s: float | None) -> None:
        """A step of ``shape`` ran for ``bucket``: the accept length of each live row
        (``[n]``; 1 for plain steps) and, when measured, the step's seconds."""

    def describe(self) -> str:
        """One line for the start-up log."""


class PlainPolicy:
    """Never speculate (no draft, or speculation switched off)."""

    shapes: tuple[SpeculativeConfig, ...] = ()
    runs_plain = True

    def choose(self, bucket: int) -> None:
        return None

    def observe(self, bucket, shape, accept_lengths, step_s) -> None:
        pass

    def describe(self) -> str:
        return "off"


class FixedPolicy:
    """Always speculate with ``shape``."""

    def __init__(self, shape: SpeculativeConfig):
        if not isinstance(shape, SpeculativeConfig):
            raise ConfigError(f"FixedPolicy needs a SpeculativeConfig, got {type(shape).__name__}")
        self.shape = shape
        self.shapes = (shape,)
        self.runs_plain = False

    def choose(self, bucket: int) -> SpeculativeConfig:
        return self.shape

    def observe(self, bucket, shape, accept_lengths, step_s) -> None:
        pass

    def describe(self) -> str:
        return f"fixed {self.shape.shape}"


class ThresholdPolicy:
    """Speculate with ``shape`` while the padded batch is at most ``threshold``.

    Above it the plain step runs. Speculation returns only after ``hysteresis``
    consecutive steps at or below the threshold, so the mode does not flip every step
    when the batch hovers there; the very first step speculates at once if allowed.
    ``threshold`` None: always on (the same as ``FixedPolicy``).
    """

    def __init__(self, shape: SpeculativeConfig, threshold: int | None, hysteresis: int = 4):
        if not isinstance(shape, SpeculativeConfig):
            raise ConfigError(f"ThresholdPolicy needs a SpeculativeConfig, got {type(shape).__name__}")
        if threshold is not None and (not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0):
            raise ConfigError(f"threshold={threshold!r} must be an integer >= 0 or None")
        if not isinstance(hysteresis, int) or hysteresis < 1:
            raise ConfigError(f"hysteresis={hysteresis!r} must be an integer >= 1")
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

    def observe(self, bucket, shape, accept_lengths, step_s) -> None:
        pass

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
