"""The engine: one host loop over a step table, with a speculation policy.

Lifecycle (objects are whole or absent):

1. ``EngineConfig`` (``serving.config``) validates every field in ``__post_init__``.
2. ``Engine(...)`` loads the models, checks that the draft fits the target, builds the
   ``runtime.StepTable`` (every graph it will ever run: prefill per prompt bucket and
   prefill batch, row insert and resize per batch bucket, the plain step and every
   speculative shape the policy may choose per batch bucket), compiles it and lets the
   policy calibrate. Only then are the engine's fields set, so a failure anywhere raises
   the original error, with a note saying what was being built, and no half-built engine
   is ever returned. After that the table cannot compile.
3. ``step()`` is the host loop's unit: the scheduler admits queued requests into free
   slots (growing the batch bucket if needed; requests admitted together are prefilled
   in one call per prompt bucket), the policy picks the step, the executor launches it,
   then the *previous* step's tokens are handed to their requests while the device runs
   this one.

Three parts, one module each: the ``Scheduler`` (which request is in which row), the
``Executor`` (the device state and the compiled graphs; typed ``InFlight`` and
``StepResult``) and ``EngineMetrics`` (counters, and the steady-state step timings the
policy learns from). This is the only host loop: ``generate.Generator`` and
``generate.SpeculativeGenerator`` are thin wrappers that size an engine to their call.

Phase timing (``EngineConfig.time_phases``): speculative steps run as their two graphs,
the draft phase and the verify phase, each waited for, so ``EngineMetrics`` can say how
the step's time splits between drafting and verification. It is a measuring mode: the
syncs cost the host/device overlap, so steps are slower than the default fused step.

Background compile (``EngineConfig.background_compile``): the engine is returned once
prefill and the plain steps are compiled; a thread compiles the speculative steps
meanwhile (``StepTable.build_later``: it only adds graphs, the host loop never waits on
it). Until they exist every step is plain, whatever the policy would choose, and the
policy is neither asked nor shown the steps (it has no timings yet). Once they do, the
same thread calibrates the policy (beside the running steps, not stalling them), and the
engine's thread lets it speculate from its next step (``poll_background``, run at the
start of every ``step()``); an error in either is raised from ``step()``, every time it
is called, so a failed compile never goes unnoticed.

Threads: the engine belongs to the one thread that calls ``step()``. Other threads reach
it only through its inbox (``submit``, ``cancel_soon``: thread-safe), which that thread
applies between steps (``take_submitted``); ``eagle-jax serve``'s engine thread does so.

The policy (``eagle_jax.serving.policy``): ``EngineConfig.spec_policy`` names it
(``config.default_policy``); while a plain step runs the draft still follows every new
token (``EngineConfig.draft_sync``), so switching back loses no acceptance.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import inspect
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.checkpoint.load import load_models, tokenizer_for
from eagle_jax.defaults import compile_workers
from eagle_jax.errors import ConfigError, EagleJaxError, InputError
from eagle_jax.models.draft import Eagle3Draft, check_compatible
from eagle_jax.models.target import TargetModel
from eagle_jax.runtime.plan import model_dtype, resolve_plan
from eagle_jax.runtime.sharding import make_mesh, spans_processes
from eagle_jax.runtime.step_table import StepTable
from eagle_jax.serving.calibration import CalibrationCache
from eagle_jax.serving.config import EngineConfig, default_policy, resolve_draft_sync
from eagle_jax.serving.executor import Executor, StepResult
from eagle_jax.serving.metrics import EngineMetrics, compile_count, shape_name
from eagle_jax.serving.policy import AutoPolicy, SpeculationPolicy, draft_step_share, policy_shapes
from eagle_jax.serving.requests import Completion, Request, RequestProgress, check_prompt
from eagle_jax.serving.scheduler import Scheduler
from eagle_jax.spec.config import SpeculativeConfig
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.spec.steps import EAGLE3, Proposer

log = logging.getLogger(__name__)


class NonFiniteError(EagleJaxError):
    """A step produced NaN or infinite logits (raised when ``detect_nan`` is on)."""


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
      proposer: what proposes the tokens speculative steps verify (``spec.steps.Proposer``;
        default EAGLE-3's draft). The oracle (``spec.oracle.OracleProposer``) measures the
        machinery at a chosen acceptance.
      proposer_rows: with a proposer that reads per-request data (``row_width`` > 0),
        ``proposer_rows(request_id, prompt_ids)`` gives a request's row when it is added
        (truncated or zero-padded to ``row_width``; e.g. the oracle's reference sequence).
      progress: show a progress bar while compiling.
    """

    config: EngineConfig
    target: TargetModel
    draft: Eagle3Draft | None
    tokenizer: Any  # eagle_jax.checkpoint.tokenizer.Tokenizer, or None (token ids only)
    policy: SpeculationPolicy
    table: StepTable  # every compiled graph
    description: str  # the start-up line's configuration part
    eos_ids: tuple[int, ...]
    metrics: EngineMetrics
    scheduler: Scheduler
    executor: Executor

    def __init__(self, target, draft=None, config: EngineConfig | None = None, tokenizer=None, *,
                 policy: SpeculationPolicy | None = None, proposer: Proposer = EAGLE3,
                 proposer_rows: Callable[[Any, list[int]], Sequence[int]] | None = None, progress: bool = True):
        # Everything is built before any field is set: a failure leaves nothing to call.
        if (proposer.row_width > 0) != (proposer_rows is not None):
            raise ConfigError(f"proposer {proposer.describe()} reads {proposer.row_width} ids per request: "
                              "proposer_rows goes with a proposer that reads rows (and only then is required)")
        # EngineConfig() here, not as the default argument: its defaults ask the backend
        # (runtime.plan.default_max_chunk), which must not happen at import, before
        # jax.distributed.initialize.
        built = _build(target, draft, EngineConfig() if config is None else config, tokenizer, policy, proposer,
                       progress)
        self.config, self.target, self.draft = built.config, built.target, built.draft
        self.tokenizer, self.policy, self.table, self.description = built.tokenizer, built.policy, built.table, built.description
        self.eos_ids = tuple(self.tokenizer.eos_token_ids) if self.tokenizer is not None else self.target.config.eos_token_ids
        shapes = policy_shapes(self.policy)
        self.metrics = EngineMetrics(compiles_at_ready=compile_count(), phase_timing=config.time_phases)
        if shapes:
            self.metrics.accepted_at_depth = np.zeros(max(s.num_steps for s in shapes), np.int64)
        self.scheduler = Scheduler(config.batch_buckets, config.prompt_buckets, config.max_batch, config.spec_hysteresis_steps)
        self.executor = Executor(self.table, self.metrics, config.batch_buckets[0])
        # Speculative graphs compiling in another thread (background_compile), or None.
        self._background = None
        if built.background:
            fit = functools.partial(_fit_buckets, self.policy, self.table, config, *built.calibration_for)
            calibrate = functools.partial(_calibrate, self.policy, self.table, config, *built.calibration_for)
            self._background = _BackgroundCompile(self.table, fit, calibrate)
        self._proposer_rows = proposer_rows
        self._pending = None  # the launched step whose results are read next
        self._last_shape: SpeculativeConfig | None = None
        self._steps_run = 0
        # What other threads asked for (``submit``, ``cancel_soon``), in order; the thread
        # that steps the engine applies it in ``take_submitted``.
        self._inbox: queue.SimpleQueue[_Submission] = queue.SimpleQueue()

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
                    on_text: Callable[[Any, str], None] | None = None):
        """Queue a request (text, chat messages or token ids); returns its id."""
        if not isinstance(params, SamplingParams):
            raise InputError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self._encode(prompt)
        rid = self.scheduler.new_id(request_id)
        # Length is checked below: the engine can truncate instead of refusing. A prompt
        # longer than the largest prompt bucket is prefilled in chunks.
        check_prompt(repr(rid), ids, None, self.target.config.vocab_size)
        if not params.greedy and not self.config.sampled_steps:
            raise InputError(
                f"temperature={params.temperature}: this engine compiled greedy steps only (EngineConfig.sampled_steps=False)"
            )
        truncated = False
        limit = self.config.max_seq_len
        if len(ids) >= limit:
            if self.config.long_prompt == "error":
                raise InputError(
                    f"request {rid!r}: the prompt has {len(ids)} tokens; max_seq_len={limit} leaves no room for a "
                    f"new token (set long_prompt='truncate' to keep the last tokens)"
                )
            keep = max(1, limit - params.max_new_tokens) if params.max_new_tokens < limit else limit // 2
            log.warning("request %r: prompt of %d tokens truncated to its last %d (max_seq_len %d)", rid, len(ids), keep, limit)
            ids, truncated = ids[-keep:], True
        progress = RequestProgress(
            rid, ids, params, self.eos_ids, min(params.max_new_tokens, limit - len(ids)), self.tokenizer, on_text
        )
        row = None
        if self._proposer_rows is not None:
            width = self.table.proposer.row_width
            row = np.zeros(width, np.int32)
            h = np.asarray(self._proposer_rows(rid, ids), np.int32)[:width]
            row[: len(h)] = h
        self.scheduler.add(Request(rid, ids, params, progress, truncated, row))
        return rid

    def cancel(self, request_id) -> None:
        """Stop a request; its slot is freed at the next step, other requests go on."""
        req = self.scheduler.get(request_id)
        if not req.done:
            req.cancelled = True
            req.progress._finish("cancelled")
            req.metrics.finished = time.perf_counter()

    def result(self, request_id) -> Completion | None:
        """The request's ``Completion`` as soon as it is done (its row is freed at the next
        step, and ``pop_finished`` returns it then too), or None while it runs."""
        req = self.scheduler.get(request_id)
        return req.completion(self.tokenizer) if req.done else None

    # -- other threads: the one thread that calls step() owns the engine; others only queue

    def submit(self, prompt, params: SamplingParams, *, request_id, on_added: Callable[[Any, InputError | None], None],
               on_text: Callable[[Any, str], None] | None = None) -> None:
        """Thread-safe ``add_request``: the engine's thread adds the request at its next
        ``take_submitted()``, then calls ``on_added(request_id, error)`` there, with the
        ``InputError`` that refused it or None. ``on_text`` also runs on that thread."""
        if request_id is None:
            raise InputError("submit() needs a request_id: the caller names the request it will cancel or read")
        self._inbox.put(_Submission(request_id, prompt, params, on_text, on_added))

    def cancel_soon(self, request_id) -> None:
        """Thread-safe ``cancel``, applied at the engine thread's next ``take_submitted()``
        (after any submission of the same id queued before it). A request that has already
        been popped is left alone: it finished before the cancel arrived."""
        self._inbox.put(_Submission(request_id, cancel=True))

    def submissions_waiting(self) -> int:
        """Submissions and cancels not yet taken (approximate while other threads queue)."""
        return self._inbox.qsize()

    def take_submitted(self, timeout: float = 0.0) -> int:
        """On the engine's thread: apply what other threads submitted, waiting up to
        ``timeout`` seconds for the first item when there is none; returns how many."""
        n = 0
        try:
            item = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return 0  # nothing was submitted in time
        while True:
            n += 1
            if item.cancel:
                if item.request_id in self.scheduler.requests:
                    self.cancel(item.request_id)
            else:
                try:
                    self.add_request(item.prompt, item.params, request_id=item.request_id, on_text=item.on_text)
                except InputError as e:  # the submitter's to report (e.g. as an HTTP 400)
                    item.on_added(item.request_id, e)
                else:
                    item.on_added(item.request_id, None)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return n

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._pending is not None

    def pop_finished(self) -> list[Completion]:
        return [r.completion(self.tokenizer) for r in self.scheduler.pop_finished()]

    def use_policy(self, policy: SpeculationPolicy) -> None:
        """Run later steps under ``policy`` instead, on the graphs already compiled (to
        compare policies in one process, e.g. a fixed shape against ``AutoPolicy``).
        Only between requests, and only for a policy whose steps this engine compiled;
        it is not calibrated again (give it the timings yourself if it needs them)."""
        if not isinstance(policy, SpeculationPolicy):
            raise ConfigError(f"policy must be a SpeculationPolicy (eagle_jax.serving.policy), got {type(policy).__name__}")
        if self.has_unfinished() or self.scheduler.queue:
            raise ConfigError("use_policy() is for an idle engine: requests are still running")
        if self._background is not None and policy_shapes(policy):
            raise ConfigError("use_policy(): the speculative steps are still compiling in the background "
                              "(wait_for_speculation() first)")
        policy_shapes(policy)  # checks what it lists
        missing = sorted({f"{s.shape} at batch bucket {b}" for b in self.table.batch_buckets for s in policy.shapes_at(b)
                          if s not in self.table.shapes_at(b)})
        if missing:
            raise ConfigError(f"policy {policy.describe()!r} needs steps this engine did not compile: {missing} "
                              f"(compiled: " + "; ".join(f"{b}: {[s.shape for s in self.table.shapes_at(b)]}"
                                                         for b in self.table.batch_buckets) + ")")
        if policy.runs_plain and not self.table.plain:
            raise ConfigError(f"policy {policy.describe()!r} may run the plain step, which this engine did not compile")
        self.policy = policy

    # -- background compile

    @property
    def speculation_ready(self) -> bool:
        """False while the speculative steps compile in the background (plain steps run)."""
        return self._background is None

    def background_progress(self) -> str | None:
        """None once speculation is ready (or with no background compile); else what the
        background thread has left, for a run that ends before it is done."""
        if self._background is None:
            return None
        left = self.table.speculative_pending
        return f"{left} speculative graphs still to compile" if left else "the policy still calibrating"

    def poll_background(self) -> bool:
        """On the engine's thread: once the background thread has compiled the
        speculative steps and calibrated the policy, let the policy speculate (or raise
        the error it met); whether speculation is ready. ``step()`` calls it first; an
        idle server loop calls it too, so speculation does not wait for the next request."""
        bg = self._background
        if bg is None:
            return True
        if not bg.done.is_set():
            return False
        if bg.error is not None:
            raise bg.error  # every call: the engine cannot speculate, and must not pretend to
        self.metrics.compiles_at_ready = compile_count()
        self._background = None
        bg.shut_down()  # finished: only drops its exit hook
        log.info("eagle-jax speculation ready %.1f s after start-up: %s in the background%s%s", bg.ready_s,
                 bg.report.describe(), f"; {bg.fit}" if bg.fit else "", f"; {bg.calibration}" if bg.calibration else "")
        return True

    def wait_for_speculation(self, timeout: float | None = None) -> bool:
        """On the engine's thread: wait up to ``timeout`` seconds (None: for good) for the
        background compile, then ``poll_background()``; whether speculation is ready."""
        bg = self._background
        if bg is not None:
            bg.done.wait(timeout)
        return self.poll_background()

    # -- the host loop

    def step(self) -> None:
        """One iteration: admit, pick the step, launch it, then handle the previous step."""
        self.poll_background()
        t_start = time.perf_counter()
        m = self.metrics
        dispatch_before, wait_before = m.dispatch_s, m.device_wait_s
        self._schedule()
        launched = None
        rows = self.scheduler.decoding_rows()
        if any(r is not None for r in rows):
            shape = self._choose(len(rows))
            launched = self.executor.step(rows, shape, in_flight=self._pending is not None)
            self._count_step(launched.bucket, shape)
        wait = 0.0
        if self._pending is not None:
            if self._pending.first_tokens:  # new requests' first tokens, before the step behind them
                firsts, ready_at, wait = self.executor.read_first(self._pending)
                self._deliver_first(firsts, ready_at)
            result = self.executor.read(self._pending)
            wait += result.wait_s
            self._deliver(result)
        self._pending = launched
        m.wall_s += time.perf_counter() - t_start
        m.device_wait_s += wait
        # Waits inside the dispatch (phase timing) are in device_wait_s too, not host work.
        m.host_s += time.perf_counter() - t_start - (m.device_wait_s - wait_before) - (m.dispatch_s - dispatch_before)

    def run_until_done(self) -> None:
        while self.has_unfinished():
            self.step()

    def generate(self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] = SamplingParams(), *,
                 on_text: Callable[[int, str], None] | None = None) -> list[Completion]:
        """Run every prompt (text, chat messages or token ids) to completion, in order.
        ``on_text(index, delta)`` streams each request's text (index into ``prompts``)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise InputError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            cb = None if on_text is None else (lambda _, d, i=i: on_text(i, d))
            ids.append(self.add_request(p, sp, on_text=cb))
        self.run_until_done()
        done = {c.id: c for c in self.pop_finished()}
        return [done[i] for i in ids]

    def stream(self, prompt, params: SamplingParams = SamplingParams()) -> Iterator[str]:
        """Yield the text of one request as it is generated (other requests keep going)."""
        deltas: collections.deque[str] = collections.deque()
        rid = self.add_request(prompt, params, on_text=lambda _, d: deltas.append(d))
        req = self.scheduler.get(rid)
        while not req.done:
            self.step()
            while deltas:
                yield deltas.popleft()
        while deltas:  # text flushed at the request's end
            yield deltas.popleft()
        self.scheduler.pop_finished()

    # -- internals

    def _schedule(self) -> None:
        """Free finished rows, grow or shrink the batch bucket, seat the queue, and launch
        this step's prefill chunks (``EngineConfig.prefill_token_budget`` tokens)."""
        s, x = self.scheduler, self.executor
        if s.free_finished():
            x.rows_changed()
        grow = s.grow_to()
        if grow is not None:
            x.gather(s.resize(grow))
        now = time.perf_counter()
        for job in s.admit(self.table.prefill_batch):
            for req in job.requests:
                req.metrics.admitted = now
        shrink = s.shrink_to()
        if shrink is not None:
            x.gather(s.resize(shrink))
        x.prefill(s, self.config.prefill_token_budget)

    def _choose(self, b: int) -> SpeculativeConfig | None:
        # Plain until the speculative graphs are compiled (background_compile).
        shape = self.policy.choose(b) if self.speculation_ready else None
        if shape is None and not self.table.plain:
            raise ConfigError(f"policy {type(self.policy).__name__} chose the plain step but says runs_plain=False")
        if shape is not None and shape not in self.table.shapes_at(b):
            raise ConfigError(
                f"policy {type(self.policy).__name__} chose {shape.shape!r} at batch bucket {b}, which it did not list "
                f"in its shapes there (compiled: {[s.shape for s in self.table.shapes_at(b)]})"
            )
        if self._steps_run and shape != self._last_shape:
            self.metrics.mode_switches += 1
        self._last_shape = shape
        self._steps_run += 1
        return shape

    def _count_step(self, b: int, shape: SpeculativeConfig | None) -> None:
        m = self.metrics
        if shape is not None:
            m.spec_steps += 1
        else:
            m.plain_steps += 1
        m.steps_by_bucket[(b, shape_name(shape))] += 1

    def _deliver_first(self, firsts, now: float) -> None:
        """Hand requests whose prefill ended their first tokens (sampled by the last chunk)."""
        m = self.metrics
        for reqs, first in firsts:
            for req, tok in zip(reqs, first):
                if not req.done:
                    req.metrics.first_token = req.metrics.last_token = now
                    req.progress.push(int(tok))
                    m.tokens += 1
                    if req.done:
                        req.metrics.finished = now

    def _deliver(self, r: StepResult) -> None:
        """Hand a finished step's tokens to its requests, then tell the metrics and the
        policy what the step did."""
        m, now = self.metrics, r.ready_at
        spec = r.shape is not None
        live_acc = []
        for row, req in enumerate(r.rows):
            if req is None:
                continue
            if r.finite is not None and not r.finite[row] and not req.done:
                raise NonFiniteError(
                    f"step {r.step} produced non-finite logits for request {req.id!r} (row {row}, "
                    f"{shape_name(r.shape)} step)"
                )
            if req.done:
                continue
            n = int(r.accepted[row])
            live_acc.append(n)
            if spec:
                req.metrics.spec_steps += 1
                req.metrics.accept_lengths.append(n)
                m.accept_histogram[n] += 1
                m.spec_rows += 1
                m.accepted_at_depth[: n - 1] += 1
            else:
                req.metrics.plain_steps += 1
            req.metrics.steps_by_shape[shape_name(r.shape)] += 1
            for tok in r.tokens[row, :n]:
                req.progress.push(int(tok))
                m.tokens += 1
                req.metrics.last_token = now
                if req.done:
                    req.metrics.finished = now
                    break
        # A policy not yet calibrated (background_compile) has nothing to learn from: it
        # did not choose the step, and its timing model does not exist yet.
        ready = self.speculation_ready
        if ready:
            self.policy.observe(r.bucket, r.shape, np.asarray(live_acc, np.int64), r.step_s)
        if r.step_s is not None:
            predicted = self.policy.predicted_tokens_per_second(r.bucket, r.shape) if ready else None
            m.timings.add(r.bucket, r.shape, r.step_s, sum(live_acc), predicted)

    def __repr__(self) -> str:
        return f"Engine({self.description})"


@dataclasses.dataclass(frozen=True)
class _Submission:
    """One item of the engine's inbox: a request to add, or (``cancel``) one to cancel."""

    request_id: Any
    prompt: Any = None
    params: SamplingParams | None = None
    on_text: Callable[[Any, str], None] | None = None
    on_added: Callable[[Any, InputError | None], None] | None = None
    cancel: bool = False


@dataclasses.dataclass
class _Built:
    """What ``_build`` hands the engine: every field it needs, all of it built."""

    config: EngineConfig
    target: TargetModel
    draft: Eagle3Draft | None
    tokenizer: Any
    policy: SpeculationPolicy
    table: StepTable
    description: str
    background: bool  # the speculative graphs are left to a background compile
    calibration_for: tuple  # (target, draft) as given: the calibration cache's key (background calibration)


class _BackgroundCompile:
    """A daemon thread that lets the policy leave out shapes per batch bucket
    (``fit(stop)``, ``_fit_buckets``), compiles the speculative graphs it kept
    (``StepTable.build_later``), then calibrates the policy (``calibrate(stop)``: from
    the calibration cache, or timed here, beside the steps the engine runs meanwhile,
    rather than stalling them); ``done`` is
    set when it has finished, with ``report`` and the ``calibration`` line, or the
    ``error`` it raised. Until ``done`` the engine neither asks nor shows the policy
    anything, so the policy is this thread's alone."""

    def __init__(self, table: StepTable, fit: Callable[[threading.Event], str | None],
                 calibrate: Callable[[threading.Event], str | None]):
        self.t0 = time.perf_counter()
        self.report = None
        self.fit: str | None = None
        self.calibration: str | None = None
        self.ready_s = 0.0
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(table, fit, calibrate), name="eagle-jax-compile",
                                        daemon=True)
        self._thread.start()
        # A process that ends while XLA still compiles here crashed at exit (SIGSEGV, seen
        # with a short `generate --background-compile`): at exit, stop between graphs and
        # wait for the one in progress.
        atexit.register(self.shut_down)

    def shut_down(self) -> None:
        self.stop.set()
        self._thread.join()
        atexit.unregister(self.shut_down)

    def _run(self, table: StepTable, fit: Callable[[threading.Event], str | None],
             calibrate: Callable[[threading.Event], str | None]) -> None:
        try:
            self.fit = fit(self.stop)
            self.report = table.build_later(self.stop)
            if self.report is None:
                raise ConfigError("the background compile was stopped (the process is exiting)")
            if self.stop.is_set():
                raise ConfigError("the background calibration was not started (the process is exiting)")
            self.calibration = calibrate(self.stop)
            self.ready_s = time.perf_counter() - self.t0
        except BaseException as e:  # noqa: BLE001 - handed to the engine's thread, raised from step()
            e.add_note("eagle-jax: in the background compile (EngineConfig.background_compile); the engine "
                       "served plain steps until then")
            self.error = e
        finally:
            self.done.set()


def _build(target, draft, config: EngineConfig, tokenizer, policy, proposer: Proposer, progress: bool) -> _Built:
    """Load, check, compile (or raise)."""
    if not isinstance(config, EngineConfig):
        raise ConfigError(f"config must be an EngineConfig, got {type(config).__name__}")
    if draft is None and policy is None and config.spec_policy in ("fixed", "threshold"):
        raise ConfigError(f"spec_policy={config.spec_policy!r} speculates ({config.speculative.shape}) but no draft "
                          "was given (pass draft=, or spec_policy='plain')")
    # The default policy is built again once the models are loaded, when their sizes can
    # prune auto's candidates (draft_step_share); this one serves the checks before.
    default = policy is None
    draft_dir = draft if isinstance(draft, (str, Path)) else None
    if default:
        policy = default_policy(config, draft_dir, has_draft=draft is not None)
    if not isinstance(policy, SpeculationPolicy):
        raise ConfigError(f"policy must be a SpeculationPolicy (eagle_jax.serving.policy), got {type(policy).__name__}")
    shapes = policy_shapes(policy)
    if config.time_phases and not shapes:
        raise ConfigError("time_phases is set but nothing speculates (no draft, or a plain policy): no draft or "
                          "verify phase to time")
    if shapes and draft is None:
        raise ConfigError(f"policy {type(policy).__name__} speculates ({[s.shape for s in shapes]}) but no draft was given")
    target_path, draft_path = target, draft
    mesh = make_mesh(config.mesh)  # before loading: too few devices fails fast
    if spans_processes(mesh) and policy.uses_timings:
        # Each process would time its own steps and could pick another graph than the
        # others, and the processes' collectives would then wait on each other for good.
        raise ConfigError(
            f"policy {type(policy).__name__} decides from measured step times, which differ between the "
            f"{jax.process_count()} processes of this run; use a fixed or threshold policy across processes"
        )
    # bfloat16 on a CPU with the packed kernel: float32 models whose products stream
    # bfloat16 panels (runtime.plan.model_dtype); elsewhere the models in the dtype asked.
    plan = resolve_plan(kernel_impl=config.kernel_impl, mesh=mesh, dtype=config.dtype)
    target, draft = load_models(target, draft, model_dtype(plan, config.dtype), mesh)
    if jnp.dtype(target.dtype) == jnp.bfloat16 and plan.backend == "cpu":
        log.warning("bfloat16 weights and arithmetic on a CPU: XLA emulates bfloat16 arithmetic here (about 10x slower "
                    "than float32 on a 2-core Xeon); %s", "the packed kernel is unavailable (" + plan.matmul_note + "), "
                    "use float32" if plan.matmul != "packed" else "give the target as a directory for the packed "
                    "bfloat16 path, or use float32")
    if draft is not None:
        check_compatible(draft.config, target.config)
        if default and isinstance(policy, AutoPolicy):
            policy = default_policy(config, draft_dir, has_draft=True, draft_share=draft_step_share(target, draft))
            shapes = policy_shapes(policy)
        for s in shapes:
            if s.topk > draft.config.draft_vocab_size:
                raise ConfigError(
                    f"speculative shape {s.shape}: top-{s.topk} of a draft vocabulary of {draft.config.draft_vocab_size}"
                )
    limit = target.config.max_position_embeddings
    if config.max_seq_len > limit:
        raise ConfigError(f"max_seq_len={config.max_seq_len} exceeds the target's max_position_embeddings={limit}")
    tokenizer = tokenizer_for(target_path, tokenizer)
    # A draft without speculation still runs: plain steps keep it in sync, eagerly or
    # deferred (EngineConfig.draft_sync; a policy may switch speculation on); with no
    # shapes and no policy need for it, drop it.
    table = StepTable(
        target, draft if shapes else None, shapes=shapes, batch_buckets=config.batch_buckets,
        prompt_buckets=config.prompt_buckets, max_seq_len=config.max_seq_len,
        prefill_token_budget=config.prefill_token_budget, kernel_impl=config.kernel_impl,
        check_finite=config.detect_nan, time_phases=config.time_phases, proposer=proposer,
        plain=policy.runs_plain, sampled=config.sampled_steps, cache_align=config.cache_align, mesh=mesh,
        draft_sharding=config.draft_sharding,
        draft_sync=resolve_draft_sync(config.draft_sync, policy, mesh.size),  # the table ignores it without a draft
        weight_dtype=config.dtype,
    )
    background = config.background_compile and bool(shapes)
    if background and not policy.runs_plain:
        raise ConfigError(f"background_compile serves plain steps until the speculative ones are compiled; policy "
                          f"{policy.describe()!r} never runs plain")
    if background and spans_processes(mesh):
        # Each process would start speculating at its own step, and the processes'
        # collectives would wait on each other for good.
        raise ConfigError("background_compile runs in one process: across processes every step must be the same graph")
    # A policy that leaves shapes out per bucket (fit_buckets) times plain steps first:
    # the speculative graphs compile after it has chosen.
    fits = bool(shapes) and policy.prune_buckets
    report = table.build(progress, speculative_later=background or fits)
    if background:
        calibration = (f"{table.speculative_pending} speculative graphs compiling in the background, then the policy "
                       "calibrates there: plain steps until both are done")
    else:
        fit = _fit_buckets(policy, table, config, target_path, draft_path) if fits else None
        if fits:
            report = report.plus(table.build_later(workers=compile_workers(), when="at start-up"))
            table.report = report
        calibration = _calibrate(policy, table, config, target_path, draft_path)
        if fit:
            calibration = f"{fit}; {calibration}" if calibration else fit
    features = f"; draft features {_feature_layers(target)}" if table.draft is not None else ""
    describe = (
        f"target {target.config.architecture} ({target.config.num_hidden_layers} layers); "
        f"speculation {policy.describe()}"
        + (f", sampling verify {shapes[0].sampling_verify}" if shapes else "")
        + f"; {table.describe()}; NaN check {'on' if config.detect_nan else 'off'}{features}"
        + (f"; draft_sync={config.draft_sync}" if table.draft is not None else "")
    )
    log.info("eagle-jax engine ready: %s; %s%s", describe, report.describe(), f"; {calibration}" if calibration else "")
    return _Built(config, target, draft, tokenizer, policy, table, describe, background, (target_path, draft_path))


def _calibration_cache(policy: SpeculationPolicy, table: StepTable, config: EngineConfig, target_path,
                       draft_path) -> CalibrationCache | None:
    """The per-machine calibration cache entry of this engine's policy and table, or None
    (off, or models not given as directories)."""
    if not config.calibration_cache:
        return None
    return CalibrationCache.for_engine(target=target_path, draft=draft_path, engine={
        "table": table.describe(), "dtype": config.dtype, "context": config.spec_calibration_context,
        "budget_s": config.spec_calibration_s, "buckets": list(config.batch_buckets), "policy": policy.describe(),
        "class": type(policy).__qualname__, "shapes": [s.shape for s in policy.shapes],
    })


def _fit_buckets(policy: SpeculationPolicy, table: StepTable, config: EngineConfig, target_path, draft_path,
                 stop: threading.Event | None = None) -> str | None:
    """Let the policy leave out shapes per batch bucket (``fit_buckets``: from the
    calibration cache's record, or from plain steps timed here) and the table leave their
    graphs uncompiled; the start-up line's part, or None when nothing is left out."""
    if not policy.prune_buckets:
        return None
    cache = _calibration_cache(policy, table, config, target_path, draft_path)
    record = cache.load() if cache is not None and not config.recalibrate else None
    line = policy.fit_buckets(lambda b, ctx: table.time_step(b, None, ctx), config.batch_buckets, record=record,
                              context=config.spec_calibration_context)
    if line is None:
        return None
    dropped = table.prune_later(policy.shapes_at)
    log.debug("speculative graphs left out per batch bucket: %d", dropped)
    return line


def _calibrate(policy: SpeculationPolicy, table: StepTable, config: EngineConfig, target_path, draft_path,
               stop: threading.Event | None = None) -> str | None:
    """The policy's start-up timings: read from the per-machine cache when an earlier
    engine of the same key measured them (``serving.calibration``), else measured (and
    kept). Returns the start-up line's part, or None for a policy that does not time.
    ``stop`` (the background compile's, set at the process's exit): checked after each
    bucket, once what was measured is saved, so an exit waits for one bucket at most."""
    ctx = config.spec_calibration_context
    cache = _calibration_cache(policy, table, config, target_path, draft_path)
    record = None
    if cache is not None and not config.recalibrate:
        record = cache.load()
        line = policy.restore_calibration(record, config.batch_buckets) if record is not None else None
        if line is not None:
            return f"{line} (each row at context {ctx}; {cache.path.name}; --recalibrate measures again)"
        if record is not None and not (isinstance(record, dict) and record.get("partial")):
            log.warning("calibration cache %s does not fit policy %s: measuring again", cache.path, policy.describe())
    # A part-way record (an earlier process ended while calibrating, as a short run with
    # the background compile does) is resumed; each bucket timed here is saved at once.
    def progress(partial: dict) -> None:
        if cache is not None:
            cache.save(partial)
        if stop is not None and stop.is_set():
            raise ConfigError(f"the background calibration was stopped (the process is exiting); the buckets "
                              f"{partial['buckets']} it measured are kept for the next start-up")

    time_step = functools.partial(table.time_step, context=ctx)
    params = inspect.signature(policy.calibrate).parameters
    if "resume" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        line = policy.calibrate(time_step, config.batch_buckets, resume=record, on_progress=progress)
    else:  # a policy written before calibrate took them: it measures everything, and it is kept at the end
        line = policy.calibrate(time_step, config.batch_buckets)
    if line is None:
        return None
    record = policy.calibration_record()
    if cache is not None and record is not None:
        cache.save(record)
        line += f"; kept in the calibration cache ({cache.path.name})"
    return f"{line} (each row at context {ctx})"


def _feature_layers(target) -> str:
    from eagle_jax.checkpoint.draft_io import describe_feature_layers

    return describe_feature_layers(tuple(target.config.feature_layer_ids), target.config.num_hidden_layers)
