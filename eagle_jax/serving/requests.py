"""Host-side request handling shared by every entry point: prompt checks, per-request
progress (tokens, streamed text, stop checks).
"""

from __future__ import annotations

import time
from typing import Sequence

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
