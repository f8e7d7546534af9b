"""The engine thread: the only thread that touches the engine (and so JAX).

HTTP handlers hand it requests through the engine's thread-safe inbox
(``Engine.submit`` / ``Engine.cancel_soon``); it adds them between steps, so a new
request joins the running batch at the next step, as in ``generate``. Each request's
events (accepted or refused, text deltas, the finished ``Completion``) come back through
its ``Sink``, onto the HTTP side's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

from eagle_jax.errors import EagleJaxError, InputError
from eagle_jax.serving.engine import Engine
from eagle_jax.serving.requests import Completion
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

# Seconds the idle engine thread waits for a submission before looking at its stop flag.
IDLE_WAIT_S = 0.05
# The window of the tokens-per-second gauge.
RATE_WINDOW_S = 5.0


class EngineStopped(EagleJaxError):
    """The engine thread is stopping (shutdown) or died: no new request is taken."""


@dataclasses.dataclass(frozen=True)
class Added:
    error: InputError | None  # None: the engine queued the request


@dataclasses.dataclass(frozen=True)
class Text:
    delta: str


@dataclasses.dataclass(frozen=True)
class Done:
    completion: Completion


@dataclasses.dataclass(frozen=True)
class Failed:
    error: BaseException  # the engine thread died with it


class Sink:
    """One request's events, passed from the engine thread onto the HTTP side's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, arrival: float, prompt_tokens: int):
        self.loop = loop
        self.arrival = arrival  # time.perf_counter() when the HTTP request arrived
        self.prompt_tokens = prompt_tokens
        self.events: asyncio.Queue[Added | Text | Done | Failed] = asyncio.Queue()

    def put(self, event: Added | Text | Done | Failed) -> None:
        """From any thread."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class EngineThread:
    """Owns ``engine`` on a thread of its own; see the module docstring.

    ``submit`` and ``cancel`` are for other threads; everything else of the engine runs
    here. If a step raises, the thread records the error, fails every open request with
    it (``Failed``), logs the traceback and stops; ``error`` then says why.
    """

    def __init__(self, engine: Engine, metrics: ServerMetrics, on_failure: Callable[[], None] | None = None):
        self.engine = engine
        self.speculation_ready = engine.speculation_ready
        self.on_failure = on_failure  # called on the engine thread if it dies (serve stops the HTTP side)
        self.metrics = metrics
        self.error: BaseException | None = None
        self._open: dict[Any, Sink] = {}  # submitted and not finished; both threads, under _lock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eagle-jax-engine", daemon=True)
        self._steps_seen: collections.Counter = collections.Counter()
        self._rate: collections.deque[tuple[float, int]] = collections.deque()

    # -- any thread

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set() and self.error is None

    def open_requests(self) -> int:
        with self._lock:
            return len(self._open)

    def submit(self, request_id, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> None:
        """Queue a request; ``sink`` gets ``Added``, then ``Text`` deltas, then ``Done`` (or ``Failed``)."""
        with self._lock:
            if not self.alive:
                raise EngineStopped("the server is shutting down" if self.error is None else f"the engine failed: {self.error!r}")
            self._open[request_id] = sink
        self.engine.submit(prompt_ids, params, request_id=request_id, on_added=self._added,
                           on_text=lambda _, delta: sink.put(Text(delta)))

    def cancel(self, request_id) -> None:
        """Cancel a request (its client went away): its slot is freed within one step."""
        self.engine.cancel_soon(request_id)

    def stop(self, timeout: float) -> bool:
        """Stop taking requests, finish the open ones (the HTTP side cancels those it gives
        up on) and end the thread; whether it ended within ``timeout`` seconds."""
        self._stop.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- the engine thread

    def _added(self, request_id, error: InputError | None) -> None:
        with self._lock:
            sink = self._open[request_id] if error is None else self._open.pop(request_id)
        if error is None:
            self.metrics.prompt_tokens.inc(sink.prompt_tokens)
        sink.put(Added(error))

    def _run(self) -> None:
        e = self.engine
        try:
            while True:
                busy = e.has_unfinished() or e.scheduler.live > 0
                if self._stop.is_set() and not busy and e.submissions_waiting() == 0:
                    return
                # Speculation starts (after calibrating) as soon as the background compile
                # is done, not at the next request; its error fails the engine here.
                e.poll_background()
                e.take_submitted(timeout=0.0 if busy else IDLE_WAIT_S)
                # A finished or cancelled request holds its row until the next step frees it.
                if e.has_unfinished() or e.scheduler.live > 0:
                    e.step()
                self._collect()
                self._observe()
        except BaseException as exc:
            self.error = exc
            log.exception("the engine thread failed; failing every open request")
            with self._lock:
                failed, self._open = list(self._open.values()), {}
            for sink in failed:
                sink.put(Failed(exc))
                self.metrics.requests.labels("failed").inc()
            if self.on_failure is not None:
                self.on_failure()
            raise

    def _collect(self) -> None:
        """Hand finished requests their ``Completion`` and record their figures."""
        e, m = self.engine, self.metrics
        with self._lock:
            open_ids = list(self._open)
        for rid in open_ids:
            if rid not in e.scheduler.requests:
                continue  # still in the inbox
            c = e.result(rid)
            if c is None:
                continue
            with self._lock:
                sink = self._open.pop(rid)
            sink.put(Done(c))
            m.requests.labels(c.finish_reason).inc()
            rm = c.metrics
            if rm.first_token is not None:
                m.ttft.observe(rm.first_token - sink.arrival)
                m.e2e.observe(rm.last_token - sink.arrival)
            if len(c.token_ids) > 1 and rm.last_token > rm.first_token:
                m.tpot.observe((rm.last_token - rm.first_token) / (len(c.token_ids) - 1))
            for n in rm.accept_lengths:
                m.accept_length.observe(n)
        e.pop_finished()  # drop what was handed over (rows are free by now)

    def _observe(self) -> None:
        """Gauges and the step and token counters, from the engine's own metrics."""
        e, m = self.engine, self.metrics
        live = e.scheduler.live
        m.running.set(live)
        self.speculation_ready = e.speculation_ready  # what /health reports (read on the HTTP side)
        m.speculative_pending.set(0 if self.speculation_ready else e.table.speculative_pending)
        m.free_slots.set(e.config.max_batch - live)
        m.queue_length.set(sum(not r.done for r in e.scheduler.queue) + e.submissions_waiting())
        steps = e.metrics.steps_by_bucket
        for key, count in steps.items():
            if count != self._steps_seen[key]:
                m.steps.labels(str(key[0]), key[1]).inc(count - self._steps_seen[key])
                self._steps_seen[key] = count
        now, tokens = time.perf_counter(), e.metrics.tokens
        before = self._rate[-1][1] if self._rate else 0
        if tokens > before:
            m.generated_tokens.inc(tokens - before)
        self._rate.append((now, tokens))
        while len(self._rate) > 1 and now - self._rate[0][0] > RATE_WINDOW_S:
            self._rate.popleft()
        t0, n0 = self._rate[0]
        m.tokens_per_second.set((tokens - n0) / (now - t0) if now > t0 else 0.0)
