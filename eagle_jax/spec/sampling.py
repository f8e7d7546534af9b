"""Sampling parameters and the on-device sampling of next tokens.

Every request carries its own temperature, top-k, top-p and seed; they travel to the
device as per-row arrays so one compiled step serves a batch of mixed settings. The
random key of a request at a position is ``fold_in(PRNGKey(seed), position)``, so a
request's sampled output depends only on its seed and its own tokens, never on which
other requests share the batch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, UInt32

from eagle_jax.errors import InputError
from eagle_jax.validate import int_in, is_int, is_number, non_negative_int, positive_int


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    ``temperature == 0`` is greedy decoding (top-k/top-p are then ignored). ``top_k == 0``
    and ``top_p == 1`` switch those filters off.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if not is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InputError(f"temperature={self.temperature!r} must be a finite number >= 0 (0 = greedy)")
        non_negative_int("top_k", self.top_k, error=InputError, note="0 = off")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InputError(f"top_p={self.top_p!r} must be in (0, 1] (1 = off)")
        int_in("seed", self.seed, 0, 2**32, error=InputError, hi_text="2**32")
        positive_int("max_new_tokens", self.max_new_tokens, error=InputError)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        for t in self.stop_token_ids:
            if not is_int(t) or t < 0:
                raise InputError(f"stop_token_ids has {t!r}; token ids are integers >= 0")
        for s in self.stop_strings:
            if not isinstance(s, str) or not s:
                raise InputError(f"stop_strings has {s!r}; stop strings are non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    """Per-row sampling settings on the device (rows of padding are greedy)."""

    temperature: Float[Array, "B"]
    top_k: Int[Array, "B"]
    top_p: Float[Array, "B"]
    key: UInt32[Array, "B 2"]

    @staticmethod
    def build(params: Sequence[SamplingParams], batch: int) -> "SamplingArrays":
        """Arrays for ``params`` padded to ``batch`` rows."""
        temp = np.zeros(batch, np.float32)
        top_k = np.zeros(batch, np.int32)
        top_p = np.ones(batch, np.float32)
        key = np.zeros((batch, 2), np.uint32)
        for i, p in enumerate(params):
            temp[i], top_k[i], top_p[i] = p.temperature, p.top_k, p.top_p
            # = jax.random.PRNGKey(seed) for the threefry PRNG, built on the host so that
            # adding a request compiles nothing.
            key[i] = (0, p.seed)
        return SamplingArrays(*jax.device_put((temp, top_k, top_p, key)))


def filter_logits(
    logits: Float[Array, "B V"],
    temperature: Float[Array, "B"],
    top_k: Int[Array, "B"],
    top_p: Float[Array, "B"],
) -> Float[Array, "B V"]:
    """Temperature, then top-k, then top-p (nucleus) filtering; removed tokens get -inf.

    Rows with temperature 0 are returned scaled by 1 (callers take their argmax).
    The kept set depends only on the values: a token tied with the last one kept is kept
    too. For top-k that is what Hugging Face's ``TopKLogitsWarper`` does; its
    ``TopPLogitsWarper`` instead keeps an arbitrary subset of the tokens tied at the top-p
    cut-off (which ones depends on its sort order), where this keeps them all. ``top_k == 0`` and
    ``top_p == 1`` leave a row unfiltered, whatever the other rows ask for. The sort that
    top-k/top-p need runs only when some row asks for them.
    """
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    x = logits.astype(jnp.float32) / t
    return jax.lax.cond(jnp.any((top_k > 0) | (top_p < 1)), _top_k_top_p, lambda x, k, p: x, x, top_k, top_p)


def _top_k_top_p(x: Float[Array, "B V"], top_k: Int[Array, "B"], top_p: Float[Array, "B"]) -> Float[Array, "B V"]:
    v = x.shape[-1]
    desc = -jnp.sort(-x, axis=-1)  # [B, V] descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)  # [B, 1]
    desc = jnp.where(desc >= kth, desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token stays while the mass
    # before it is below top_p (the first token always stays). top_p = 1 keeps every
    # token: the float32 cumsum can reach 1.0 before the tail, which would otherwise cut
    # tiny-probability tokens from rows that asked for no top-p (when another row of the
    # batch turned the filter on).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.maximum(jnp.sum(mass_before < top_p[:, None], axis=-1), 1)
    n_keep = jnp.where(top_p < 1, n_keep, v)
    pth = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)
    cut = jnp.maximum(kth, pth)
    return jnp.where(x >= cut, x, -jnp.inf)


def target_probs(
    logits: Float[Array, "B V"],
    temperature: Float[Array, "B"],
    top_k: Int[Array, "B"],
    top_p: Float[Array, "B"],
) -> Float[Array, "B V"]:
    """The distribution a request samples from (one-hot on the argmax for greedy rows)."""
    probs = jax.nn.softmax(filter_logits(logits, temperature, top_k, top_p), axis=-1)
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=probs.dtype)
    return jnp.where((temperature > 0)[:, None], probs, onehot)


def position_keys(key: UInt32[Array, "B 2"], positions: Int[Array, "B"]) -> UInt32[Array, "B 2"]:
    """The key of each row at a sequence position: independent of batch composition."""
    return jax.vmap(jax.random.fold_in)(key, positions)


def position_uniforms(key: UInt32[Array, "B 2"], positions: Int[Array, "B ..."]) -> Float[Array, "B ..."]:
    """The uniform in [0, 1) that picks the token at each position of a row.

    Plain decoding and speculative verification draw a position's token with the same
    uniform, so a request's sampled text does not depend on whether, or how far,
    speculation ran (see ``speculative.accept_tree``).
    """
    flat = positions.reshape(positions.shape[0], -1)
    per_row = lambda k, ps: jax.vmap(lambda p: jax.random.uniform(jax.random.fold_in(k, p), ()))(ps)  # noqa: E731
    return jax.vmap(per_row)(key, flat).reshape(positions.shape)


def inverse_cdf_sample(probs: Float[Array, "N V"], u: Float[Array, "N"]) -> Int[Array, "N"]:
    """The first token whose cumulative probability exceeds ``u`` (renormalised)."""
    cdf = jnp.cumsum(probs.astype(jnp.float32), axis=-1)
    idx = jnp.sum(cdf <= u[:, None] * cdf[:, -1:], axis=-1)
    # Rounding can leave u * total at the very top: fall back to the last possible token.
    last = probs.shape[-1] - 1 - jnp.argmax((probs > 0)[:, ::-1], axis=-1)
    return jnp.minimum(idx, last).astype(jnp.int32)


def sample_tokens(
    logits: Float[Array, "B V"],
    s: SamplingArrays,
    positions: Int[Array, "B"],
    *,
    greedy_only: bool,
) -> Int[Array, "B"]:
    """Next token of each row; ``positions`` is the position the new token will take."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy_only:
        return greedy
    probs = jax.nn.softmax(filter_logits(logits, s.temperature, s.top_k, s.top_p), axis=-1)
    sampled = inverse_cdf_sample(probs, position_uniforms(s.key, positions))
    return jnp.where(s.temperature > 0, sampled, greedy)
