"""Plain (non-speculative) batched generation with static shapes.

Shapes come from buckets: the batch is padded to a batch bucket, prompts to a prompt-
length bucket, and the KV cache is sized to a cache bucket that holds the longest
prompt plus its new tokens. Each (bucket, greedy-or-sampled) pair compiles once; the
KV cache is donated to every step. The host loop dispatches step i+1 before reading
step i's tokens, so host work (stop checks, detokenising) overlaps the device.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from eagle_jax.errors import ConfigError, InputError
from eagle_jax.model import BoundModules, KVCache, LlamaModel, causal_mask
from eagle_jax.sampling import SamplingArrays, SamplingParams, sample_tokens

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Static shapes the compiled steps are built for."""

    batch: tuple[int, ...] = (1, 2, 4, 8)
    prompt: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048)
    cache: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)

    def __post_init__(self):
        for name in ("batch", "prompt", "cache"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v <= 0 for v in values) or list(values) != sorted(set(values)):
                raise ConfigError(f"buckets.{name}={values!r} must be a non-empty increasing tuple of positive ints")

    @staticmethod
    def pick(values: Sequence[int], n: int, what: str) -> int:
        for v in values:
            if v >= n:
                return v
        raise InputError(f"{what} {n} exceeds the largest bucket {values[-1]}")


@dataclasses.dataclass
class Completion:
    """One finished request. ``finish_reason`` is "stop" (EOS, stop id or string) or "length"."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    tokens_per_second: float


# ----------------------------------------------------------------------------- device steps


def prefill_impl(
    model: LlamaModel,
    tokens: Int[Array, "B P"],
    lengths: Int[Array, "B"],
    cache: KVCache,
    samp: SamplingArrays,
    *,
    greedy_only: bool,
):
    """Prefill right-padded prompts; returns (first new token [B], cache)."""
    b, p = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    h, _, cache = model(tokens, pos, cache, pos, causal_mask(pos, cache.max_len))
    last = h[jnp.arange(b), lengths - 1]  # only the last real token needs logits
    nxt = sample_tokens(model.logits(last), samp, lengths, greedy_only=greedy_only)
    return nxt, cache


def decode_impl(
    model: LlamaModel,
    tokens: Int[Array, "B"],
    seq_lens: Int[Array, "B"],
    cache: KVCache,
    samp: SamplingArrays,
    *,
    greedy_only: bool,
):
    """Feed one token per row at position ``seq_lens``; returns (next token, seq_lens + 1, cache)."""
    pos = seq_lens[:, None]
    h, _, cache = model(tokens[:, None], pos, cache, pos, causal_mask(pos, cache.max_len))
    nxt = sample_tokens(model.logits(h[:, 0]), samp, seq_lens + 1, greedy_only=greedy_only)
    # Finished or padding rows keep running; clamp so they never index past the cache.
    return nxt, jnp.minimum(seq_lens + 1, cache.max_len - 1), cache


class PlainSteps:
    """Prefill and decode compiled for one model (parameters bound, cache donated)."""

    def __init__(self, model: LlamaModel):
        bound = BoundModules(model)
        self.params = bound.params

        def prefill(params, tokens, lengths, cache, samp, *, greedy_only):
            return prefill_impl(bound.modules(params)[0], tokens, lengths, cache, samp, greedy_only=greedy_only)

        def decode(params, tokens, seq_lens, cache, samp, *, greedy_only):
            return decode_impl(bound.modules(params)[0], tokens, seq_lens, cache, samp, greedy_only=greedy_only)

        self._prefill = jax.jit(prefill, static_argnames=("greedy_only",), donate_argnames=("cache",))
        self._decode = jax.jit(decode, static_argnames=("greedy_only",), donate_argnames=("cache",))

    def prefill(self, tokens, lengths, cache, samp, *, greedy_only: bool):
        return self._prefill(self.params, tokens, lengths, cache, samp, greedy_only=greedy_only)

    def decode(self, tokens, seq_lens, cache, samp, *, greedy_only: bool):
        return self._decode(self.params, tokens, seq_lens, cache, samp, greedy_only=greedy_only)


# ----------------------------------------------------------------------------- host side


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

    def final_text(self, tokenizer) -> str:
        # The text cut at a stop string comes from the stream; otherwise decode whole.
        if self.stopped_by_string:
            return self.text
        return tokenizer.decode(self.tokens) if tokenizer is not None else ""


@dataclasses.dataclass
class PaddedBatch:
    """A batch laid out for the compiled shapes: right-padded prompts, bucket sizes."""

    batch: int  # batch bucket
    prompt_len: int  # prompt bucket
    cache_len: int  # cache bucket: the longest prompt plus its new tokens (capped)
    tokens: np.ndarray  # [batch, prompt_len]
    lengths: np.ndarray  # [batch]

    @staticmethod
    def build(buckets: "Buckets", prompts: list[list[int]], params: Sequence[SamplingParams], max_seq_len: int) -> "PaddedBatch":
        b = Buckets.pick(buckets.batch, len(prompts), "batch size")
        longest = max(len(p) for p in prompts)
        need = max(len(p) + sp.max_new_tokens for p, sp in zip(prompts, params))
        s_len = Buckets.pick(buckets.cache, min(need, max_seq_len), "sequence length")
        # Prompts longer than every prompt bucket are padded to the cache length itself.
        p_len = min((v for v in buckets.prompt if v >= longest), default=s_len)
        s_len = max(s_len, Buckets.pick(buckets.cache, p_len, "prompt length"))
        tokens = np.zeros((b, p_len), np.int32)
        lengths = np.ones(b, np.int32)  # padding rows: a 1-token dummy prompt
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
            lengths[i] = len(p)
        return PaddedBatch(b, p_len, s_len, tokens, lengths)


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


class Generator:
    """Plain generation for a loaded target model.

    Args:
      model: the target.
      tokenizer: optional ``eagle_jax.tokenizer.Tokenizer`` (text output, stop strings).
      buckets: static shapes to compile for.
      max_seq_len: context limit (default: the model's ``max_position_embeddings``,
        capped by the largest cache bucket).
    """

    def __init__(self, model: LlamaModel, tokenizer=None, *, buckets: Buckets = Buckets(), max_seq_len: int | None = None):
        cfg = model.config
        limit = min(cfg.max_position_embeddings, buckets.cache[-1])
        if max_seq_len is not None and not 1 < max_seq_len <= limit:
            raise ConfigError(f"max_seq_len={max_seq_len} must be in [2, {limit}] (model context and largest cache bucket)")
        self.model = model
        self.tokenizer = tokenizer
        self.buckets = buckets
        self.max_seq_len = max_seq_len or limit
        self.eos_ids = tuple(tokenizer.eos_token_ids) if tokenizer is not None else cfg.eos_token_ids
        self.steps = PlainSteps(model)
        self._compiled: set[tuple] = set()

    def compile(self, batch: int, prompt_len: int, cache_len: int, greedy_only: bool) -> None:
        """Compile prefill and decode for one shape by running them once on dummy input,
        so timings (and the first request) never include compilation."""
        key = (batch, prompt_len, cache_len, greedy_only)
        if key in self._compiled:
            return
        samp = SamplingArrays.build([], batch)
        cache = KVCache.zeros(self.model.config, batch, cache_len, self.model.dtype)
        ones = jnp.ones((batch,), jnp.int32)
        nxt, cache = self.steps.prefill(jnp.zeros((batch, prompt_len), jnp.int32), ones, cache, samp, greedy_only=greedy_only)
        self.steps.decode(nxt, ones, cache, samp, greedy_only=greedy_only)[0].block_until_ready()
        self._compiled.add(key)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        *,
        on_text: Callable[[int, str], None] | None = None,
    ) -> list[Completion]:
        """Generate for every prompt (token ids); ``on_text(index, delta)`` streams text."""
        params = normalize_params(prompts, params)
        for i, p in enumerate(prompts):
            check_prompt(i, p, self.max_seq_len, self.model.config.vocab_size)
        out: list[Completion] = []
        step = self.buckets.batch[-1]
        for start in range(0, len(prompts), step):
            chunk = range(start, min(start + step, len(prompts)))
            out.extend(self._generate_batch([list(prompts[i]) for i in chunk], [params[i] for i in chunk], list(chunk), on_text))
        return out

    def _generate_batch(self, prompts, params, indices, on_text) -> list[Completion]:
        pb = PaddedBatch.build(self.buckets, prompts, params, self.max_seq_len)
        reqs = [
            RequestProgress(idx, p, sp, self.eos_ids, min(sp.max_new_tokens, pb.cache_len - len(p)), self.tokenizer, on_text)
            for idx, p, sp in zip(indices, prompts, params)
        ]
        greedy_only = all(sp.greedy for sp in params)
        samp = SamplingArrays.build(params, pb.batch)
        self.compile(pb.batch, pb.prompt_len, pb.cache_len, greedy_only)
        cache = KVCache.zeros(self.model.config, pb.batch, pb.cache_len, self.model.dtype)
        t0 = time.perf_counter()
        nxt, cache = self.steps.prefill(jnp.asarray(pb.tokens), jnp.asarray(pb.lengths), cache, samp, greedy_only=greedy_only)
        seq = jnp.asarray(pb.lengths)
        while True:
            # Dispatch the next step before reading this one's tokens (async overlap).
            following, seq, cache = self.steps.decode(nxt, seq, cache, samp, greedy_only=greedy_only)
            host = np.asarray(nxt)
            for i, r in enumerate(reqs):
                if r.finish_reason is None:
                    r.push(int(host[i]))
            if all(r.finish_reason is not None for r in reqs):
                break
            nxt = following
        return [
            Completion(r.prompt, r.tokens, r.final_text(self.tokenizer), r.finish_reason,
                       len(r.tokens) / max(r.end_time - t0, 1e-9))
            for r in reqs
        ]
