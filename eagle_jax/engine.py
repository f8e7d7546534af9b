"""The engine: continuous batching over compiled steps, with the batch-size speculation cutoff.

Lifecycle (objects are whole or absent):

1. ``EngineConfig`` validates every field in ``__post_init__``.
2. ``Engine(...)`` loads the models, checks that the draft fits the target, and compiles
   every graph it will ever run — prefill per prompt bucket, row insert and resize per
   batch bucket, and the speculative and plain steps per batch bucket — by running each
   once (our CUDA-graph capture). Only then does an ``Engine`` instance come into being
   (the build happens in ``__new__``), so a failure anywhere raises the original error,
   with a note saying what was being built, and leaves no half-built engine to call.
3. ``step()`` is the host loop's unit: admit queued requests into free slots (growing the
   batch bucket if needed), pick speculative or plain by the cutoff, dispatch the step,
   then handle the *previous* step's tokens while the device runs this one.

Phase timing (``EngineConfig.time_phases``): the speculative step is then run as its two
graphs, the draft phase and the verify phase (``SpecSteps.draft_phase`` /
``verify_phase``), each waited for, so ``EngineMetrics`` can say how the step's time
splits between drafting and verification. It is a measuring mode: the syncs cost the
host/device overlap, so steps are slower than the default fused step.

Slots: the live batch is a ``SpecState`` whose rows are slots. A bucket change (more
requests than rows, or few enough to fit a smaller bucket for a while) gathers the live
rows into a state of the new size; within a bucket, requests join and leave in place.

The cutoff: speculation runs while the padded batch is at most
``spec_disable_batch_threshold``; above it the plain step runs (the draft still extends
over every new token, so switching back loses no acceptance). Speculation returns only
after ``spec_hysteresis_steps`` consecutive steps at or below the threshold, so the mode
does not flip every step when the batch hovers at the threshold.
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

from eagle_jax.draft import Eagle3Draft, check_compatible
from eagle_jax.errors import ConfigError, EagleJaxError, InputError
from eagle_jax.generate import RequestProgress, check_prompt
from eagle_jax.model import LlamaModel
from eagle_jax.sampling import SamplingArrays, SamplingParams
from eagle_jax.speculative import SpeculativeConfig, SpecState, SpecSteps, new_state

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
    """Backend compilations in this process so far (every jit, eager ops included)."""
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
      prompt_buckets: padded prompt lengths compiled for prefill (default 32, 64, ... up
        to max_seq_len).
      dtype: "float32", "bfloat16", "float16" or None (float32 on CPU, bfloat16 on GPU).
      speculative: draft shape, or None for plain decoding only.
      spec_disable_batch_threshold: speculation runs while the padded batch is <= this;
        None: always on.
      spec_hysteresis_steps: consecutive steps at or below the threshold before
        speculation comes back on.
      detect_nan: check every step's logits; a non-finite row raises ``NonFiniteError``.
      long_prompt: "error" (reject prompts that leave no room) or "truncate" (keep the
        prompt's last tokens, and say so in the completion).
      kernel_impl: verification kernels: "auto", "kernel" or "reference".
      time_phases: measure draft and verify time separately: each speculative step runs
        as two compiled graphs (draft phase, verify phase), each waited for and timed, so
        ``EngineMetrics.summary()`` reports ``draft_s``, ``verify_s`` and ``draft_share``.
        Costs the host/device overlap of speculative steps (a measuring mode, not for
        serving); plain steps are unaffected. Needs ``speculative``.
    """

    max_batch: int = 8
    max_seq_len: int = 1024
    batch_buckets: tuple[int, ...] | None = None
    prompt_buckets: tuple[int, ...] | None = None
    dtype: str | None = None
    speculative: SpeculativeConfig | None = SpeculativeConfig(num_steps=5)
    spec_disable_batch_threshold: int | None = None
    spec_hysteresis_steps: int = 4
    detect_nan: bool = False
    long_prompt: str = "error"
    kernel_impl: str = "auto"
    time_phases: bool = False

    def __post_init__(self):
        def positive_int(name):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name}={v!r} must be an integer >= 1")

        for name in ("max_batch", "max_seq_len", "spec_hysteresis_steps"):
            positive_int(name)
        if self.max_seq_len < 2:
            raise ConfigError(f"max_seq_len={self.max_seq_len} must be >= 2 (a prompt token and a new one)")
        if self.batch_buckets is None:
            object.__setattr__(self, "batch_buckets", _powers_of_two(1, self.max_batch))
        if self.prompt_buckets is None:
            object.__setattr__(self, "prompt_buckets", _powers_of_two(min(32, self.max_seq_len), self.max_seq_len))
        for name, top in (("batch_buckets", self.max_batch), ("prompt_buckets", self.max_seq_len)):
            v = tuple(getattr(self, name))
            object.__setattr__(self, name, v)
            if not v or any(not isinstance(x, int) or x < 1 for x in v) or list(v) != sorted(set(v)):
                raise ConfigError(f"{name}={v!r} must be an increasing tuple of positive integers")
            if v[-1] != top:
                raise ConfigError(f"{name}={v!r} must end at {top} (the {'max_batch' if name == 'batch_buckets' else 'max_seq_len'})")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype={self.dtype!r}; valid: None, float32, bfloat16, float16")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ConfigError(f"speculative={self.speculative!r} must be a SpeculativeConfig or None")
        t = self.spec_disable_batch_threshold
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 0):
            raise ConfigError(f"spec_disable_batch_threshold={t!r} must be an integer >= 0 or None (never off)")
        if t is not None and self.speculative is None:
            raise ConfigError("spec_disable_batch_threshold is set but speculative is None (nothing to switch off)")
        if self.long_prompt not in ("error", "truncate"):
            raise ConfigError(f"long_prompt={self.long_prompt!r}; valid: error, truncate")
        if self.kernel_impl not in ("auto", "kernel", "reference"):
            raise ConfigError(f"kernel_impl={self.kernel_impl!r}; valid: auto, kernel, reference")
        if not isinstance(self.time_phases, bool):
            raise ConfigError(f"time_phases={self.time_phases!r} must be True or False")
        if self.time_phases and self.speculative is None:
            raise ConfigError("time_phases is set but speculative is None (no draft or verify phase to time)")

    def speculation_allowed(self, padded_batch: int) -> bool:
        t = self.spec_disable_batch_threshold
        return self.speculative is not None and (t is None or padded_batch <= t)


# ----------------------------------------------------------------------------- requests and metrics


@dataclasses.dataclass
class RequestMetrics:
    accept_lengths: list[int] = dataclasses.field(default_factory=list)
    spec_steps: int = 0
    plain_steps: int = 0
    arrival: float = 0.0
    first_token: float | None = None
    finished: float | None = None

    @property
    def mean_accept_length(self) -> float:
        return float(np.mean(self.accept_lengths)) if self.accept_lengths else 0.0

    def tokens_per_second(self, n_tokens: int) -> float:
        if self.finished is None or self.first_token is None:
            return 0.0
        return n_tokens / max(self.finished - self.arrival, 1e-9)


@dataclasses.dataclass
class Completion:
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
        return self.metrics.tokens_per_second(len(self.token_ids))


class _Request:
    def __init__(self, rid, prompt: list[int], params: SamplingParams, progress: RequestProgress, truncated: bool):
        self.id = rid
        self.prompt = prompt
        self.params = params
        self.progress = progress
        self.truncated = truncated
        self.metrics = RequestMetrics(arrival=time.perf_counter())
        self.cancelled = False

    @property
    def done(self) -> bool:
        return self.progress.finish_reason is not None

    def completion(self, tokenizer) -> Completion:
        p = self.progress
        return Completion(self.id, self.prompt, p.tokens, p.final_text(tokenizer), p.finish_reason, self.metrics, self.truncated)


@dataclasses.dataclass
class EngineMetrics:
    """Engine-wide counters; ``summary()`` gives the derived figures."""

    spec_steps: int = 0
    plain_steps: int = 0
    accept_histogram: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    accepted_at_depth: np.ndarray | None = None  # [S] drafts accepted at depth d+1
    spec_rows: int = 0  # row-steps with speculation (the denominator per depth)
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
            "compiles_after_warmup": compile_count() - self.compiles_at_ready,
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


# ----------------------------------------------------------------------------- device helpers


@functools.partial(jax.jit, donate_argnums=(0,))
def _insert_row(state: SpecState, row_state: SpecState, row: jax.Array) -> SpecState:
    """Write a one-row state into row ``row`` of ``state`` (in place: ``state`` is donated)."""
    return jax.tree.map(lambda s, r: jax.lax.dynamic_update_slice_in_dim(s, r.astype(s.dtype), row, axis=0), state, row_state)


@jax.jit
def _gather_rows(state: SpecState, rows: jax.Array) -> SpecState:
    """A state made of ``state``'s rows ``rows`` (a bucket change)."""
    return jax.tree.map(lambda s: jnp.take(s, rows, axis=0), state)


def _load(target, draft, dtype):
    from eagle_jax.checkpoint.draft_io import load_draft, read_draft_config
    from eagle_jax.checkpoint.hf import load_model
    from eagle_jax.config import ModelConfig

    if isinstance(target, (str, Path)):
        path = Path(target)
        cfg = None
        if isinstance(draft, (str, Path)):
            # The draft says which target layers feed it; build the target to return those.
            dcfg = read_draft_config(draft, target_cfg=ModelConfig.from_dir(path))
            cfg = ModelConfig.from_dir(path).replace(aux_layer_ids=dcfg.aux_layer_ids)
        target = load_model(path, dtype=dtype, config=cfg)
    if isinstance(draft, (str, Path)):
        draft = load_draft(draft, target=target, dtype=dtype)
    if not isinstance(target, LlamaModel):
        raise ConfigError(f"target must be a LlamaModel or a checkpoint path, got {type(target).__name__}")
    if draft is not None and not isinstance(draft, Eagle3Draft):
        raise ConfigError(f"draft must be an Eagle3Draft, a checkpoint path or None, got {type(draft).__name__}")
    return target, draft


def _tokenizer_for(target_path, tokenizer):
    if tokenizer is not None or not isinstance(target_path, (str, Path)):
        return tokenizer
    from eagle_jax.tokenizer import Tokenizer

    return Tokenizer.from_dir(target_path)


# ----------------------------------------------------------------------------- engine


class Engine:
    """Serve many requests on compiled steps, with the batch-size speculation cutoff.

    Args:
      target: a loaded ``LlamaModel`` or a Hugging Face checkpoint directory.
      draft: an ``Eagle3Draft``, a draft checkpoint directory, or None (needs
        ``config.speculative`` None).
      config: ``EngineConfig``.
      tokenizer: for text prompts and output (default: the target directory's).
      progress: show a progress bar while compiling.
    """

    def __new__(cls, target, draft=None, config: EngineConfig = EngineConfig(), tokenizer=None, *, progress: bool = True):
        # Everything is built before the instance exists: a failure leaves no engine.
        parts = _build(target, draft, config, tokenizer, progress)
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

    def add_request(self, prompt, params: SamplingParams = SamplingParams(), *, request_id=None, on_text: Callable[[Any, str], None] | None = None):
        """Queue a request (text, chat messages or token ids); returns its id."""
        if not isinstance(params, SamplingParams):
            raise InputError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self._encode(prompt)
        rid = request_id if request_id is not None else next(self._ids)
        if rid in self._requests:
            raise InputError(f"request id {rid!r} is already in use")
        # Length is checked below: the engine can truncate instead of refusing.
        check_prompt(repr(rid), ids, None, self.target.config.vocab_size)
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
        req = _Request(rid, ids, params, progress, truncated)
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

    # -- the host loop

    def step(self) -> None:
        """One iteration: admit, pick the mode, dispatch, then handle the previous step."""
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
        """Call a jitted function, counting the time as dispatch, not host work."""
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.metrics.dispatch_s += time.perf_counter() - t

    def run_until_done(self) -> None:
        while self.has_unfinished():
            self.step()

    def generate(self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] = SamplingParams()) -> list[Completion]:
        """Run every prompt (text, chat messages or token ids) to completion, in order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise InputError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
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
        for i in range(len(self._slots)):
            if not self._queue:
                break
            if self._slots[i] is None:
                req = self._queue.popleft()
                if req.done:
                    continue
                self._prefill_into(req, i)

    def _bucket_for(self, n: int) -> int:
        return next(b for b in self.config.batch_buckets if b >= n)

    def _resize(self, new_b: int) -> None:
        """Gather the live rows into a state of ``new_b`` rows (a bucket change)."""
        live = [i for i, r in enumerate(self._slots) if r is not None]
        rows = live + [0] * (new_b - len(live))  # padding rows copy row 0; they are free slots
        self._state = self._launch(_gather_rows, self._state, jax.device_put(np.asarray(rows[:new_b], np.int32)))
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

    def _prefill_into(self, req: _Request, row: int) -> None:
        p_len = next(b for b in self.config.prompt_buckets if b >= len(req.prompt))
        tokens = np.zeros((1, p_len), np.int32)
        tokens[0, : len(req.prompt)] = req.prompt
        samp = SamplingArrays.build([req.params], 1)
        row_state, first = self._launch(
            self._steps.prefill_new, jax.device_put(tokens), jax.device_put(np.asarray([len(req.prompt)], np.int32)), samp,
            greedy_only=False, max_seq_len=self.config.max_seq_len,
        )
        self._state = self._launch(_insert_row, self._state, row_state, np.int32(row))
        self._slots[row] = req
        self._samp_dirty = True
        self._first_tokens.append((req, first))

    def _samp(self) -> SamplingArrays:
        if self._samp_dirty:
            params = [r.params if r is not None else SamplingParams() for r in self._slots]
            self._samp_arrays = SamplingArrays.build(params, len(self._slots))
            self._greedy_only = all(p.greedy for p in params)
            self._samp_dirty = False
        return self._samp_arrays

    def _choose_mode(self, b: int) -> bool:
        cfg = self.config
        allowed = cfg.speculation_allowed(b)
        if not allowed:
            self._below = 0
            on = False
        elif self._spec_on:
            on = True
        else:
            self._below += 1
            on = self._below >= cfg.spec_hysteresis_steps or self.metrics.spec_steps + self.metrics.plain_steps == 0
        if on != self._spec_on and self.metrics.spec_steps + self.metrics.plain_steps:
            self.metrics.mode_switches += 1
        self._spec_on = on
        return on

    def _dispatch(self) -> dict:
        b = len(self._slots)
        samp = self._samp()
        spec = self._choose_mode(b)
        kw = dict(greedy_only=self._greedy_only, max_seq_len=self.config.max_seq_len)
        if spec and self.config.time_phases:
            out = self._timed_speculative(samp, kw)
        else:
            out = self._launch(self._steps.speculative if spec else self._steps.plain, self._state, samp, **kw)
        if spec:
            self.metrics.spec_steps += 1
        else:
            self.metrics.plain_steps += 1
        self._state, tokens, acc, finite = out
        self._step_no += 1
        firsts, self._first_tokens = self._first_tokens, []
        # The rows' owners at dispatch time: slots may change before the tokens are read.
        return {
            "reqs": list(self._slots), "tokens": tokens, "acc": acc, "finite": finite,
            "spec": spec, "step": self._step_no, "first": firsts,
        }

    def _timed_speculative(self, samp: SamplingArrays, kw: dict):
        """The speculative step as its draft and verify phases, each waited for and timed."""
        m = self.metrics
        t = time.perf_counter()
        jax.block_until_ready(self._state)  # work queued before (prefill, insert, a plain step) is not drafting
        t0 = time.perf_counter()
        m.device_wait_s += t0 - t
        launched = m.dispatch_s
        state, tree = self._launch(self._steps.draft_phase, self._state, samp)
        self._state = None  # its draft cache was donated
        jax.block_until_ready((state, tree))
        t1 = time.perf_counter()
        out = self._launch(self._steps.verify_phase, state, tree, samp, **kw)
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
        firsts = [(r, int(np.asarray(f)[0])) for r, f in pending["first"]]
        tokens, acc = np.asarray(pending["tokens"]), np.asarray(pending["acc"])
        finite = None if pending["finite"] is None else np.asarray(pending["finite"])
        wait = time.perf_counter() - t0
        now = time.perf_counter()
        for req, tok in firsts:
            if not req.done:
                req.metrics.first_token = now
                req.progress.push(tok)
                self.metrics.tokens += 1
                if req.done:
                    req.metrics.finished = now
        m = self.metrics
        for row, req in enumerate(pending["reqs"]):
            if req is None:
                continue
            if finite is not None and not finite[row] and not req.done:
                raise NonFiniteError(
                    f"step {pending['step']} produced non-finite logits for request {req.id!r} (row {row}, "
                    f"{'speculative' if pending['spec'] else 'plain'} step)"
                )
            if req.done:
                continue
            n = int(acc[row])
            if pending["spec"]:
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
                if req.done:
                    req.metrics.finished = now
                    break
        return wait

    def __repr__(self) -> str:
        return f"Engine({self._describe})"


def _build(target, draft, config: EngineConfig, tokenizer, progress: bool) -> dict:
    """Load, check, compile; returns the engine's attributes (or raises)."""
    if not isinstance(config, EngineConfig):
        raise ConfigError(f"config must be an EngineConfig, got {type(config).__name__}")
    if config.speculative is not None and draft is None:
        raise ConfigError("config.speculative is set but no draft was given (pass draft=, or speculative=None)")
    target_path = target
    target, draft = _load(target, draft, config.dtype)
    if draft is not None:
        check_compatible(draft.config, target.config)
    limit = target.config.max_position_embeddings
    if config.max_seq_len > limit:
        raise ConfigError(f"max_seq_len={config.max_seq_len} exceeds the target's max_position_embeddings={limit}")
    tokenizer = _tokenizer_for(target_path, tokenizer)
    spec_sizing = config.speculative or SpeculativeConfig(num_steps=1)
    parts = dict(
        config=config, target=target, draft=draft, tokenizer=tokenizer,
        eos_ids=tuple(tokenizer.eos_token_ids) if tokenizer is not None else target.config.eos_token_ids,
        _steps=SpecSteps(target, draft, config.speculative, kernel_impl=config.kernel_impl, check_finite=config.detect_nan),
        _spec_sizing=spec_sizing,
    )
    t0 = time.perf_counter()
    n_graphs = _compile_all(parts, progress)
    elapsed = time.perf_counter() - t0
    b0 = config.batch_buckets[0]
    metrics = EngineMetrics(compiles_at_ready=compile_count(), phase_timing=config.time_phases)
    if config.speculative is not None:
        metrics.accepted_at_depth = np.zeros(config.speculative.num_steps, np.int64)
    spec = config.speculative
    spec_desc = (
        "off" if spec is None else f"{spec.shape}, sampling verify {spec.sampling_verify}"
    )
    cutoff = (
        "none" if config.spec_disable_batch_threshold is None or spec is None else
        f"off above padded batch {config.spec_disable_batch_threshold}, back on after {config.spec_hysteresis_steps} steps at or below"
    )
    describe = (
        f"speculation {spec_desc}; cutoff {cutoff}; batch buckets {config.batch_buckets}; prompt buckets "
        f"{config.prompt_buckets}; max_seq_len {config.max_seq_len}; dtype {jnp.dtype(target.dtype).name}; "
        f"devices {[str(d) for d in jax.devices()]}; kernels {config.kernel_impl}; NaN check {'on' if config.detect_nan else 'off'}"
        + ("; time_phases on (draft and verify phases compiled and timed separately, slower than the fused step)"
           if config.time_phases else "")
    )
    log.info("eagle-jax engine ready: %s; %d graphs compiled in %.1f s", describe, n_graphs, elapsed)
    parts.update(
        _describe=describe, _requests={}, _queue=collections.deque(), _ids=itertools.count(),
        _slots=[None] * b0, _state=new_state(target, draft, spec_sizing, b0, config.max_seq_len),
        _pending=None, _first_tokens=[], _samp_dirty=True, _samp_arrays=None, _greedy_only=True,
        _spec_on=False, _below=0, _shrink_wait=0, _step_no=0, metrics=metrics,
    )
    return parts


def _compile_all(parts: dict, progress: bool) -> int:
    """Run every graph once on dummy input: prefill per prompt bucket, insert and both
    step modes (greedy-only and sampled) per batch bucket, resize between buckets. With
    ``time_phases`` the speculative step is compiled as its two phase graphs instead."""
    cfg: EngineConfig = parts["config"]
    target, draft = parts["target"], parts["draft"]
    steps: SpecSteps = parts["_steps"]
    sizing = parts["_spec_sizing"]
    jobs: list[tuple[str, Callable[[], Any]]] = []

    def fresh(b):
        return new_state(target, draft, sizing, b, cfg.max_seq_len)

    samp1 = SamplingArrays.build([], 1)
    for p in cfg.prompt_buckets:
        jobs.append((f"prefill prompt {p}", lambda p=p: steps.prefill_new(
            jax.device_put(np.zeros((1, p), np.int32)), jax.device_put(np.ones((1,), np.int32)),
            samp1, greedy_only=False, max_seq_len=cfg.max_seq_len)[1]))
    modes = [False] + ([True] if cfg.speculative is not None else [])
    for b in cfg.batch_buckets:
        samp = SamplingArrays.build([], b)
        jobs.append((f"insert batch {b}", lambda b=b: _insert_row(fresh(b), fresh(1), np.int32(0)).seq_lens))
        for other in cfg.batch_buckets:
            if other != b:
                jobs.append((f"resize {b}->{other}", lambda b=b, o=other: _gather_rows(fresh(b), jax.device_put(np.zeros((o,), np.int32))).seq_lens))
        for spec in modes:
            phases = spec and cfg.time_phases
            if phases:  # the draft phase does not depend on greedy_only
                jobs.append((f"draft phase batch {b}", lambda b=b, samp=samp: steps.draft_phase(fresh(b), samp)[1]))
            for greedy in (True, False):
                kw = dict(greedy_only=greedy, max_seq_len=cfg.max_seq_len)
                how = "greedy" if greedy else "sampled"
                if phases:
                    fn = lambda b=b, kw=kw, samp=samp: steps.verify_phase(*steps.draft_phase(fresh(b), samp), samp, **kw)[1]  # noqa: E731
                    jobs.append((f"verify phase batch {b} {how}", fn))
                    continue
                step_fn = steps.speculative if spec else steps.plain
                fn = lambda b=b, kw=kw, samp=samp, f=step_fn: f(fresh(b), samp, **kw)[1]  # noqa: E731
                jobs.append((f"{'speculative' if spec else 'plain'} step batch {b} {how}", fn))
    if progress:
        from rich.progress import Progress

        with Progress(transient=True) as bar:
            task = bar.add_task("compiling", total=len(jobs))
            for name, job in jobs:
                bar.update(task, description=f"compiling {name}")
                _run_job(name, job)
                bar.advance(task)
    else:
        for name, job in jobs:
            _run_job(name, job)
    return len(jobs)


def _run_job(name: str, job: Callable[[], Any]) -> None:
    try:
        jax.block_until_ready(job())
    except Exception as e:
        e.add_note(f"eagle-jax: while compiling the {name} graph at engine start-up")
        raise
