"""Requests on the host: prompt checks, per-request progress (tokens, streamed text, stop
checks), a request's timing (``RequestMetrics``) and the one result type (``Completion``).

Request timing: ``queue_s`` is arrival to admission, ``ttft_s`` arrival to the first
token, ``decode_tokens_per_second`` the tokens after the first over the time from the
first to the last, and ``tokens_per_second`` all tokens over the time from arrival to
the last (so it includes queueing and prefill).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Sequence

import numpy as np

from eagle_jax.errors import InputError
from eagle_jax.spec.sampling import SamplingParams


class RequestProgress:
    """Host-side progress of one request: tokens, text, stop checks."""

    def __init__(self, index: int, prompt: list[int], params: SamplingParams, eos_ids: tuple[int, ...], limit: int, tokenizer, on_text):
        self.index = index
        self.prompt = prompt
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.limit = limit  # max new tokens allowed by the request and the context
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stopped_by_string = False
        self.end_time = 0.0
        self.on_text = on_text
        self.stream = tokenizer.stream_decoder() if tokenizer is not None else None

    def push(self, token: int) -> None:
        self.tokens.append(token)
        if token in self.stop_ids:
            self._finish("stop")
            return
        if self.stream is not None:
            delta = self.stream.push(token)
            if delta:
                self._add_text(delta)
        if self.finish_reason is None and len(self.tokens) >= self.limit:
            self._finish("length")

    def _add_text(self, delta: str) -> None:
        start = max(0, len(self.text) - max((len(s) for s in self.params.stop_strings), default=0))
        self.text += delta
        for s in self.params.stop_strings:
            i = self.text.find(s, start)
            if i >= 0:
                delta = delta[: max(0, len(delta) - (len(self.text) - i))]
                self.text = self.text[:i]
                self._emit(delta)
                self.stopped_by_string = True
                self._finish("stop")
                return
        self._emit(delta)

    def _emit(self, delta: str) -> None:
        if self.on_text is not None and delta:
            self.on_text(self.index, delta)

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.end_time = time.perf_counter()
        # Text the detokenizer held back (an incomplete UTF-8 sequence at the very end)
        # still belongs to the stream; a stop string already cut the text, so not then.
        if self.stream is not None and not self.stopped_by_string and reason != "cancelled":
            tail = self.stream.flush()
            self.text += tail
            self._emit(tail)

    def final_text(self, tokenizer) -> str:
        # The text cut at a stop string comes from the stream; otherwise decode whole.
        if self.stopped_by_string:
            return self.text
        return tokenizer.decode(self.tokens) if tokenizer is not None else ""


def check_prompt(i, prompt: Sequence[int], max_seq_len: int | None, vocab_size: int) -> None:
    """Reject an empty prompt, one with no room for a new token (unless ``max_seq_len`` is
    None: the caller handles length), or out-of-vocabulary ids."""
    if len(prompt) == 0:
        raise InputError(f"prompt {i} is empty")
    if max_seq_len is not None and len(prompt) >= max_seq_len:
        raise InputError(
            f"prompt {i} has {len(prompt)} tokens; the context holds {max_seq_len} "
            f"(max_seq_len), leaving no room for a new token"
        )
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise InputError(f"prompt {i} has token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})")


def normalize_params(prompts, params) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * len(prompts)
    if len(params) != len(prompts):
        raise InputError(f"{len(prompts)} prompts but {len(params)} sampling params")
    return list(params)


@dataclasses.dataclass
class RequestMetrics:
    """One request's accept lengths and times (``time.perf_counter`` seconds)."""

    accept_lengths: list[int] = dataclasses.field(default_factory=list)
    spec_steps: int = 0
    plain_steps: int = 0
    # shape name ("plain", "chain S=3", ...) -> the steps this request took part in.
    steps_by_shape: collections.Counter = dataclasses.field(default_factory=collections.Counter)
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
        """Arrival to admission (seated; its first prefill chunk dispatched)."""
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


class Request:
    """One request inside the engine: its prompt ids, sampling settings, progress and timing."""

    def __init__(self, rid, prompt: list[int], params: SamplingParams, progress: RequestProgress, truncated: bool, proposer_row=None):
        self.id = rid
        self.prompt = prompt
        self.params = params
        self.progress = progress
        self.truncated = truncated
        self.proposer_row = proposer_row  # the proposer's data for this request (None: it reads none)
        self.metrics = RequestMetrics(arrival=time.perf_counter())
        self.cancelled = False
        self.decoding = False  # its prefill is in the batch state (False: queued or still prefilling)

    @property
    def done(self) -> bool:
        return self.progress.finish_reason is not None

    def completion(self, tokenizer) -> Completion:
        p = self.progress
        return Completion(self.id, self.prompt, p.tokens, p.final_text(tokenizer), p.finish_reason, self.metrics, self.truncated)
