"""Draft training data: the target's own responses to chat prompts, then the target's
features over each (prompt, response) sequence.

Two stages, each with a file format a researcher can inspect or replace:

1. ``regenerate`` -> ``conversations.jsonl``: one JSON object per line,
   ``{"prompt_ids": [...], "response_ids": [...], "finish_reason": ..., "temperature": ...}``.
   The target answers every prompt itself (EAGLE-3's recipe: the draft learns the target's
   distribution, not a dataset's).
2. ``extract_features`` -> a ``FeatureSet``: per sequence the tokens, a loss mask (True on
   response tokens), the target's fused-layer features and its final normed hidden state
   (from which training recomputes the target's distribution over the draft vocabulary),
   and the target's argmax. Saved as ``.npy`` files (no pickle) by ``FeatureSet.save``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.errors import InputError
from eagle_jax.model import BoundModules, KVCache, LlamaModel, causal_mask
from eagle_jax.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Conversation:
    prompt_ids: list[int]
    response_ids: list[int]
    finish_reason: str = "stop"
    temperature: float = 0.0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def read_conversations(path: Path, vocab_size: int | None = None) -> list[Conversation]:
    """Read ``conversations.jsonl``; errors name the line. Token ids are range-checked
    against ``vocab_size`` when given."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                conv = Conversation(
                    prompt_ids=[int(t) for t in obj["prompt_ids"]],
                    response_ids=[int(t) for t in obj["response_ids"]],
                    finish_reason=str(obj.get("finish_reason", "stop")),
                    temperature=float(obj.get("temperature", 0.0)),
                )
            except (ValueError, KeyError, TypeError) as e:
                raise InputError(f"{path}:{n}: not a conversation record ({e})") from e
            if not conv.prompt_ids or not conv.response_ids:
                raise InputError(f"{path}:{n}: empty prompt_ids or response_ids")
            if vocab_size is not None:
                bad = [t for t in conv.prompt_ids + conv.response_ids if not 0 <= t < vocab_size]
                if bad:
                    raise InputError(f"{path}:{n}: token id {bad[0]} outside [0, {vocab_size})")
            out.append(conv)
    if not out:
        raise InputError(f"{path}: no conversations")
    return out


def write_conversations(path: Path, convs: Iterable[Conversation]) -> None:
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for c in convs:
            f.write(c.to_json() + "\n")
    tmp.replace(path)


def regenerate(
    engine,
    prompts: Sequence,
    *,
    max_new_tokens: int,
    sampled_fraction: float = 0.25,
    temperature: float = 0.7,
    seed: int = 0,
    chunk: int = 256,
    on_progress=None,
) -> list[Conversation]:
    """Have the target (a plain ``Engine``) answer every prompt.

    A ``sampled_fraction`` of the prompts (chosen deterministically) are answered at
    ``temperature`` with per-prompt seeds, the rest greedily: greedy answers are what
    greedy speculation must predict, sampled ones add variety.
    """
    rng = np.random.default_rng(seed)
    sampled = rng.random(len(prompts)) < sampled_fraction
    params = [
        SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed * 1_000_003 + i)
        if s else SamplingParams(max_new_tokens=max_new_tokens)
        for i, s in enumerate(sampled)
    ]
    out: list[Conversation] = []
    t0 = time.perf_counter()
    n_tok = 0
    for lo in range(0, len(prompts), chunk):
        comps = engine.generate(list(prompts[lo:lo + chunk]), params[lo:lo + chunk])
        for c, p in zip(comps, params[lo:lo + chunk]):
            if c.token_ids:
                out.append(Conversation(list(c.prompt_token_ids), list(c.token_ids), c.finish_reason, p.temperature))
            n_tok += len(c.token_ids)
        if on_progress is not None:
            on_progress(len(out), len(prompts), n_tok, time.perf_counter() - t0)
    return out


# ----------------------------------------------------------------------------- features

FEATURE_FILES = ("tokens", "lengths", "prompt_lengths", "features", "target_hidden", "target_argmax")


@dataclasses.dataclass
class FeatureSet:
    """The target's view of N training sequences, padded to L.

    tokens [N, L] int32; lengths [N]; prompt_lengths [N] (tokens before the response);
    features [N, L, F] float16 (the target's fused-layer features, F = 3 * Ht);
    target_hidden [N, L, Ht] float16 (final normed hidden; ``@ lm_head`` gives the target's
    logits); target_argmax [N, L] int32 (the target's greedy next token at each position).
    """

    tokens: np.ndarray
    lengths: np.ndarray
    prompt_lengths: np.ndarray
    features: np.ndarray
    target_hidden: np.ndarray
    target_argmax: np.ndarray

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        for name in FEATURE_FILES:
            np.save(path / f"{name}.npy", getattr(self, name), allow_pickle=False)

    @classmethod
    def load(cls, path: str | Path, *, mmap: bool = True) -> "FeatureSet":
        """Read a saved set (never unpickling); shapes are checked against each other."""
        path = Path(path)
        missing = [n for n in FEATURE_FILES if not (path / f"{n}.npy").is_file()]
        if missing:
            raise InputError(f"{path} is not a feature set: missing {', '.join(m + '.npy' for m in missing)}")
        arrs = {n: np.load(path / f"{n}.npy", mmap_mode="r" if mmap else None, allow_pickle=False) for n in FEATURE_FILES}
        fs = cls(**arrs)
        fs.check()
        return fs

    def check(self) -> None:
        n, width = self.tokens.shape
        want = {
            "lengths": (n,), "prompt_lengths": (n,), "target_argmax": (n, width),
        }
        for name, shape in want.items():
            if getattr(self, name).shape != shape:
                raise InputError(f"feature set {name} has shape {getattr(self, name).shape}, expected {shape}")
        for name in ("features", "target_hidden"):
            if getattr(self, name).shape[:2] != (n, width):
                raise InputError(f"feature set {name} has shape {getattr(self, name).shape}, expected ({n}, {width}, ...)")
        lengths, plens = np.asarray(self.lengths), np.asarray(self.prompt_lengths)
        if (lengths < 2).any() or (lengths > width).any() or (plens < 1).any() or (plens >= lengths).any():
            raise InputError(f"feature set lengths must satisfy 1 <= prompt_length < length <= {width}")


def _forward_fn(target: LlamaModel):
    bound = BoundModules(target)

    @jax.jit
    def run(params, tokens):
        (model,) = bound.modules(params)
        b, width = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(width), (b, width))
        cache = KVCache.zeros(model.config, b, width)
        h, feats, _ = model(tokens, pos, cache, pos, causal_mask(pos, width), return_features=True)
        return h, feats, jnp.argmax(model.logits(h), axis=-1).astype(jnp.int32)

    return lambda tokens: run(bound.params, tokens)


def extract_features(
    target: LlamaModel,
    convs: Sequence[Conversation],
    *,
    max_len: int,
    batch_size: int = 8,
    on_progress=None,
) -> FeatureSet:
    """Run the target over every (prompt + response) sequence, truncated to ``max_len``.

    Features and hidden states are stored as float16; a value outside float16's range
    raises instead of silently becoming inf.
    """
    if target.config.feature_layer_ids is None:
        raise InputError("the target has no feature layers configured")
    n = len(convs)
    seqs = [(c.prompt_ids + c.response_ids)[:max_len] for c in convs]
    plens = np.array([len(c.prompt_ids) for c in convs], np.int32)
    lengths = np.array([len(s) for s in seqs], np.int32)
    if (plens >= lengths).any():
        i = int(np.argmax(plens >= lengths))
        raise InputError(f"conversation {i}: prompt of {plens[i]} tokens leaves no response within max_len={max_len}")
    tokens = np.zeros((n, max_len), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    h_dim = target.config.hidden_size
    f_dim = len(target.config.feature_layer_ids) * h_dim
    feats = np.zeros((n, max_len, f_dim), np.float16)
    hid = np.zeros((n, max_len, h_dim), np.float16)
    amax = np.zeros((n, max_len), np.int32)
    run = _forward_fn(target)
    f16_max = float(np.finfo(np.float16).max)
    t0 = time.perf_counter()
    for lo in range(0, n, batch_size):
        chunk = tokens[lo:lo + batch_size]
        pad = batch_size - chunk.shape[0]
        h, f, a = run(jnp.asarray(np.pad(chunk, ((0, pad), (0, 0)))))
        h, f, a = (np.asarray(x)[: batch_size - pad] for x in (h, f, a))
        for name, x in (("features", f), ("target_hidden", h)):
            if not np.isfinite(x).all() or np.abs(x).max() >= f16_max:
                raise InputError(f"target {name} of sequences {lo}..{lo + len(chunk) - 1} do not fit float16")
        feats[lo:lo + len(chunk)] = f
        hid[lo:lo + len(chunk)] = h
        amax[lo:lo + len(chunk)] = a
        if on_progress is not None:
            on_progress(min(lo + batch_size, n), n, time.perf_counter() - t0)
    return FeatureSet(tokens, lengths, plens, feats, hid, amax)
