"""The device side of the host loop: the step table's graphs launched on the live state,
and their results read back as typed values.

The executor owns the batch state (a ``SpecState`` whose rows are the scheduler's slots)
and never looks inside a request beyond its prompt and sampling settings. A step is
launched (``InFlight``) and read back a step later (``StepResult``), so the host handles
one step's tokens while the device runs the next.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import numpy as np

from eagle_jax.runtime.step_table import StepTable
from eagle_jax.serving.metrics import EngineMetrics
from eagle_jax.serving.requests import Request
from eagle_jax.serving.scheduler import PrefillJob, Scheduler
from eagle_jax.spec.config import SpeculativeConfig
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.spec.steps import SpecState


@dataclasses.dataclass
class InFlight:
    """A launched step whose results are not read yet."""

    rows: list[Request | None]  # each row's request when the step was launched
    tokens: jax.Array  # [B, S+1] new tokens per row
    accepted: jax.Array  # [B] how many of them count
    finite: jax.Array | None  # [B] logits were finite (with the NaN check)
    shape: SpeculativeConfig | None  # None: the plain step
    bucket: int
    step: int  # steps launched so far, this one included
    first_tokens: list[tuple[list[Request], jax.Array]]  # prefills launched since the last step
    steady: bool  # may be timed (see metrics.StepTimings)


@dataclasses.dataclass
class StepResult:
    """A step's results on the host."""

    rows: list[Request | None]
    tokens: np.ndarray  # [B, S+1]
    accepted: np.ndarray  # [B]
    finite: np.ndarray | None  # [B]
    shape: SpeculativeConfig | None
    bucket: int
    step: int
    step_s: float | None  # the step's cost in the loop, when steady; else None
    ready_at: float  # when the results were on the host (time.perf_counter)
    wait_s: float  # blocked reading them


class Executor:
    """Launches the step table's graphs on the live state, and keeps the proposer's
    per-row data (``Request.proposer_row``) beside it, moved with the rows.

    Under the table's ``time_phases`` the speculative steps wait for each phase: the
    executor books those seconds as device waits and into ``metrics.draft_s`` /
    ``verify_s``."""

    def __init__(self, table: StepTable, metrics: EngineMetrics, rows: int):
        self.table, self.metrics = table, metrics
        self.state = table.zeros(rows)
        width = table.proposer.row_width
        self._rows = np.zeros((rows, width), np.int32) if width else None  # host copy, [B, W]
        self._rows_dev = None  # its device copy (None: put it again)
        self._samp = None  # sampling arrays of the current rows (None: rebuild)
        self._greedy_only = True
        self._other_work = False  # device work queued since the last step (not a steady interval)
        self._last_key = None  # (bucket, shape) of the last step launched
        self._last_ready: float | None = None
        self._steps = 0
        self._first_tokens: list[tuple[list[Request], jax.Array]] = []
        # The last one-row prefill state, kept after its rows joined the batch: the next
        # one-row prefill zeroes it in place (table.rezero) instead of allocating anew.
        self._spare: SpecState | None = None

    def _launch(self, fn, *args):
        """Call a compiled graph, counting the time as dispatch, not host work."""
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.metrics.dispatch_s += time.perf_counter() - t

    def rows_changed(self) -> None:
        """Rows were freed or seated: rebuild the sampling arrays before the next step."""
        self._samp = None

    def gather(self, rows: Sequence[int]) -> None:
        """A bucket change: row i of the new state is row ``rows[i]`` of the old."""
        t = self.table
        self.state = self._launch(t.gather, self.state, rows)
        self._other_work = True
        self._samp = None
        if self._rows is not None:
            self._rows, self._rows_dev = self._rows[np.asarray(rows)], None

    def prefill(self, s: Scheduler, budget: int) -> list[Request]:
        """Launch the queued prefill jobs' next chunks, oldest job first, while they fit
        ``budget`` padded tokens (one chunk at least, however large); a job whose last
        chunk is launched joins the batch at its requests' rows now (they decode from the
        next step on, and their first tokens come back with its results). Returns the
        requests that joined."""
        spent, joined = 0, []
        while s.prefilling:
            job = s.prefilling[0]
            if all(r.done for r in job.requests):  # every request cancelled while prefilling
                s.prefilling.popleft()
                continue
            if spent and spent + job.next_tokens > budget:
                break
            spent += job.next_tokens
            self._chunk(job)
            if job.chunk == len(job.plan):
                s.prefilling.popleft()
                self._join(job, s)
                joined += [r for r in job.requests if not r.done]
        return joined

    def _chunk(self, job: PrefillJob) -> None:
        t, n = self.table, len(job.requests)
        c, start = job.plan[job.chunk], job.start
        tokens = np.zeros((n, c), np.int32)
        nxt = np.zeros(n, np.int32)
        lengths = np.asarray([len(r.prompt) for r in job.requests], np.int32)
        for i, r in enumerate(job.requests):
            piece = r.prompt[start : start + c]
            tokens[i, : len(piece)] = piece
            if start + c < len(r.prompt):
                nxt[i] = r.prompt[start + c]
        if job.state is None:
            if n == 1 and self._spare is not None:
                spare, self._spare = self._spare, None  # donated
                job.state = self._launch(t.rezero, spare)
            else:
                job.state = self._launch(t.zeros, n)
            job.samp = t.sampling([r.params for r in job.requests], n)
        put = t.device_put_rows
        state, job.state = job.state, None  # donated
        job.state, first = self._launch(t.prefill_chunk, state, put(tokens), put(np.full(n, start, np.int32)),
                                        put(lengths), put(nxt), job.samp)
        job.chunk += 1
        m = self.metrics
        m.prefill_chunks += 1
        m.prefill_tokens += int(np.clip(lengths - start, 0, c).sum())
        m.prefill_padded_tokens += n * c
        self._other_work = True  # the next step's interval would include this chunk
        if job.chunk == len(job.plan):
            self._first_tokens.append((list(job.requests), first))

    def _join(self, job: PrefillJob, s: Scheduler) -> None:
        """The job's rows into the batch state at its requests' current rows (a request
        cancelled meanwhile has no row: its row of the job is dropped)."""
        t, b = self.table, len(self.state.seq_lens)
        rows = [s.row_of(r) if not r.done else None for r in job.requests]
        rows = [b if i is None else i for i in rows]  # past the end: dropped
        self.state = self._launch(t.insert, self.state, job.state, t.device_put_rows(np.asarray(rows, np.int32)))
        if len(rows) == 1:
            self._spare = job.state
        job.state = None
        self._samp = None
        for r, row in zip(job.requests, rows):
            if row < b:
                r.decoding = True
                if self._rows is not None:
                    self._rows[row] = r.proposer_row
                    self._rows_dev = None

    def _sampling(self, slots: list[Request | None]):
        if self._samp is None:
            params = [r.params if r is not None else SamplingParams() for r in slots]
            self._samp = self.table.sampling(params, len(slots))
            self._greedy_only = all(p.greedy for p in params)
        return self._samp

    def step(self, slots: list[Request | None], shape: SpeculativeConfig | None, in_flight: bool) -> InFlight:
        """Launch one step (plain, or speculative of ``shape``) over every row.
        ``in_flight``: the previous step's results are not read yet (a steady interval
        needs it)."""
        b, samp = len(slots), self._sampling(slots)
        key = (b, shape)
        steady = in_flight and not self._other_work and key == self._last_key
        self._other_work, self._last_key = False, key
        rows = None
        if shape is not None and self._rows is not None:
            if self._rows_dev is None:
                self._rows_dev = self.table.device_put_rows(self._rows)
            rows = self._rows_dev
        phases = sum(self.table.phase_seconds.values())
        draft, verify = self.table.phase_seconds["draft"], self.table.phase_seconds["verify"]
        state, self.state = self.state, None  # donated to the step (a failure leaves no stale state to reuse)
        self.state, tokens, accepted, finite = self._launch(self.table.step, state, samp, shape, self._greedy_only, rows)
        waited = sum(self.table.phase_seconds.values()) - phases
        if waited:  # time_phases: the step waited for its phases; that is device time, not dispatch
            m = self.metrics
            m.draft_s += self.table.phase_seconds["draft"] - draft
            m.verify_s += self.table.phase_seconds["verify"] - verify
            m.dispatch_s -= waited
            m.device_wait_s += waited
        self._steps += 1
        firsts, self._first_tokens = self._first_tokens, []
        return InFlight(list(slots), tokens, accepted, finite, shape, b, self._steps, firsts, steady)

    def read_first(self, f: InFlight) -> tuple[list[tuple[list[Request], np.ndarray]], float, float]:
        """The first tokens of the prefills whose last chunks were launched before ``f``'s
        step, waited for alone: ``(firsts, ready_at, wait_s)``; ``f`` keeps none. They are
        on the host when those prefills end, a step before ``f``'s own tokens, so a new
        request's first token does not also wait for the decode step queued behind it
        (one step of time to first token: ~22 ms at batch 1 on the 2-core CPU)."""
        t0 = time.perf_counter()
        firsts = [(reqs, np.asarray(first)) for reqs, first in f.first_tokens]
        f.first_tokens = []
        now = time.perf_counter()
        return firsts, now, now - t0

    def read(self, f: InFlight) -> StepResult:
        """Wait for ``f``'s results and bring them to the host (after ``read_first``)."""
        if f.first_tokens:  # they would be lost: a request's first token, never delivered
            raise RuntimeError("Executor.read before read_first: the step's first tokens are still unread")
        t0 = time.perf_counter()
        tokens, accepted = np.asarray(f.tokens), np.asarray(f.accepted)
        finite = None if f.finite is None else np.asarray(f.finite)
        now = time.perf_counter()
        step_s = now - self._last_ready if f.steady and self._last_ready is not None else None
        self._last_ready = now
        return StepResult(f.rows, tokens, accepted, finite, f.shape, f.bucket, f.step, step_s, now, now - t0)
