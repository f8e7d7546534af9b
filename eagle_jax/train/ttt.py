"""EAGLE-3 draft training with training-time test (TTT).

The draft is unrolled ``ttt_length`` steps over every position at once, feeding its own
output back, exactly as it runs at inference (``speculative.draft_tree``):

- anchor i is the last position whose target feature the draft gets; step 0 at anchor i
  reads (fc(feature_i), token_{i+1}) at RoPE position i and predicts token_{i+2};
- step t at anchor i reads (its own step t-1 output at anchor i, token_{i+t+1}) at
  position i+t, predicts token_{i+t+2}, and attends to step-0 rows 0..i plus its own
  rows of steps 1..t (the draft KV it would have written while drafting).

The draft's layer is run unchanged on a ``ttt_length * L``-slot KV cache with that mask,
so training and inference share one implementation of the layer. The mask reaches the
attention as structure (``model.StepDiagonalMask``: a causal block plus a diagonal per
earlier step), so a step's attention costs one ``L x L`` block, not ``L x ttt_length*L``;
``attention="dense"`` keeps the boolean-mask path as the reference.

Loss at step t: cross-entropy between the draft's distribution and the target's, both
over the draft vocabulary, on positions whose predicted token is a response token and
whose target argmax lies in the draft vocabulary; total = sum_t decay^t * loss_t.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from eagle_jax.models.draft import DraftConfig, Eagle3Draft
from eagle_jax.errors import ConfigError
from eagle_jax.validate import is_number, non_negative_int, optional, positive_int
from eagle_jax.models.llama import KVCache, LlamaModel, StepDiagonalMask
from eagle_jax.train.data import FeatureSet

log = logging.getLogger(__name__)

TRAINABLE = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("embed_tokens")))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Draft training settings (validated on construction).

    ``batch_size`` sequences per step; ``epochs`` passes over the data (fractions allowed);
    ``ttt_length`` unrolled draft steps (the reference uses 7; at least the number of
    speculative steps you will run); ``step_decay`` weight ratio between consecutive steps;
    ``intermediate_size`` of the draft's MLP (None: the target's).
    """

    draft_vocab_size: int = 8192
    ttt_length: int = 7
    step_decay: float = 0.8
    learning_rate: float = 3e-4
    min_learning_rate_ratio: float = 0.1
    warmup_steps: int = 20
    batch_size: int = 8
    epochs: float = 2.0
    grad_clip: float = 0.5
    weight_decay: float = 0.0
    intermediate_size: int | None = None
    seed: int = 0

    def __post_init__(self):
        for name in ("draft_vocab_size", "ttt_length", "batch_size"):
            v = getattr(self, name)
            positive_int(name, v)
        non_negative_int("warmup_steps", self.warmup_steps)
        for name in ("learning_rate", "epochs", "grad_clip"):
            v = getattr(self, name)
            if not is_number(v) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"{name}={v!r} must be a finite number > 0")
        for name in ("step_decay", "min_learning_rate_ratio"):
            v = getattr(self, name)
            if not is_number(v) or not 0 < v <= 1:
                raise ConfigError(f"{name}={v!r} must be in (0, 1]")
        if not is_number(self.weight_decay) or self.weight_decay < 0:
            raise ConfigError(f"weight_decay={self.weight_decay!r} must be >= 0")
        optional(positive_int, "intermediate_size", self.intermediate_size)


# ----------------------------------------------------------------------------- vocabulary and init


def select_draft_vocab(data: FeatureSet, draft_vocab_size: int, vocab_size: int) -> np.ndarray:
    """The ``draft_vocab_size`` target ids most frequent among the response tokens,
    sorted ascending (ties broken by the lower id). Ids never seen fill the rest in id
    order, so the size is always exact."""
    if draft_vocab_size > vocab_size:
        raise ConfigError(f"draft_vocab_size={draft_vocab_size} exceeds the target vocabulary {vocab_size}")
    counts = np.zeros(vocab_size, np.int64)
    tokens = np.asarray(data.tokens)
    for row, p, n in zip(tokens, np.asarray(data.prompt_lengths), np.asarray(data.lengths)):
        np.add.at(counts, row[p:n], 1)
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count desc, then id asc
    return np.sort(order[:draft_vocab_size]).astype(np.int64)


def vocab_coverage(data: FeatureSet, ids: np.ndarray, vocab_size: int) -> float:
    """Fraction of response tokens inside the draft vocabulary ``ids``."""
    member = np.zeros(vocab_size, bool)
    member[ids] = True
    tokens = np.asarray(data.tokens)
    hits = total = 0
    for row, p, n in zip(tokens, np.asarray(data.prompt_lengths), np.asarray(data.lengths)):
        hits += int(member[row[p:n]].sum())
        total += int(n - p)
    return hits / max(total, 1)


def _f32_copy(x):
    """A float32 copy of a floating array (other dtypes kept): the trainer donates the
    parameters it starts from, so a draft it trains must never share an array."""
    return jnp.array(x, dtype=jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype, copy=True)


def _set_vocab(draft: Eagle3Draft, ids: np.ndarray, head: np.ndarray, vocab_size: int) -> None:
    """Give ``draft`` the draft vocabulary ``ids`` (ascending target ids): the head
    ``[H, len(ids)]`` and the id maps (``d2t`` as offsets, ``t2d`` as membership)."""
    draft.lm_head[...] = jnp.asarray(head, jnp.float32)
    draft.d2t[...] = jnp.asarray((ids - np.arange(len(ids))).astype(np.int32))
    t2d = np.zeros(vocab_size, bool)
    t2d[ids] = True
    draft.t2d[...] = jnp.asarray(t2d)


def revocab_draft(init: Eagle3Draft, target: LlamaModel, ids: np.ndarray) -> Eagle3Draft:
    """A float32 copy of ``init`` over the draft vocabulary ``ids``: every parameter but
    the head is copied; head column j is ``init``'s column of target id ``ids[j]`` when
    ``init`` has that id, else the target's head column carried into the draft's space by
    the linear map that takes the target's columns to ``init``'s on the shared ids. So a
    draft trained on other data keeps what it learned while its vocabulary follows the
    new data."""
    dcfg = dataclasses.replace(init.config, draft_vocab_size=int(len(ids)))
    draft = Eagle3Draft(dcfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    # The modules that do not depend on the vocabulary: fusion, mid layer, final norm.
    for name in ("fc", "midlayer", "norm"):
        nnx.update(getattr(draft, name), jax.tree.map(_f32_copy, nnx.state(getattr(init, name))))
    draft.embed_tokens[...] = jnp.asarray(target.embed_tokens[...], jnp.float32)
    old_ids = np.asarray(init.draft_to_target(jnp.arange(init.config.draft_vocab_size)))
    where = {int(t): j for j, t in enumerate(old_ids)}
    target_head = np.asarray(target.lm_head[...], np.float32)
    old_head = np.asarray(init.lm_head[...], np.float32)
    # Columns of ids new to the draft: the target's own columns lie in the target's hidden
    # space, not the draft's, and a few of them (rare tokens) then win the argmax
    # everywhere (measured: v1 with the new vocabulary agreed with the target on 0.07% of
    # held-out positions; with this map, 31%, where v1 in its own vocabulary has 34%). So
    # the map from the target's columns to the draft's, fitted by least squares over the
    # shared ids, carries the new ones over.
    shared = [(j, where[int(t)]) for j, t in enumerate(ids) if int(t) in where]
    head = target_head[:, ids].copy()
    if shared:
        js, ks = (np.asarray(x) for x in zip(*shared))
        src, dst = target_head[:, ids[js]], old_head[:, ks]  # [H, S] each
        if len(js) >= target_head.shape[0]:  # enough columns to fit an [H, H] map
            a = np.linalg.lstsq(src.T, dst.T, rcond=None)[0].T  # dst ~ a @ src
            head = (a @ head).astype(np.float32)
        head[:, js] = dst
    _set_vocab(draft, ids, head, target.config.vocab_size)
    return draft


def init_draft(target: LlamaModel, ids: np.ndarray, cfg: TrainConfig) -> Eagle3Draft:
    """A fresh draft for ``target`` over the draft vocabulary ``ids``.

    The embedding is the target's (shared, frozen, not saved); the head starts from the
    target's head columns for ``ids`` and the final norm from the target's, so step 0
    starts from "predict like the target's last layer"; the rest is random (seeded).
    """
    tcfg = target.config
    overrides: dict[str, Any] = {"draft_vocab_size": int(len(ids))}
    if cfg.intermediate_size is not None:
        overrides["intermediate_size"] = cfg.intermediate_size
    dcfg = DraftConfig.for_target(tcfg, **overrides)
    draft = Eagle3Draft(dcfg, dtype=jnp.float32, rngs=nnx.Rngs(cfg.seed))
    draft.embed_tokens[...] = target.embed_tokens[...].astype(jnp.float32)
    # Copies, never the target's own arrays: the trainer donates the draft's parameters.
    draft.norm.weight[...] = _f32_copy(target.norm.weight[...])
    _set_vocab(draft, ids, np.asarray(target.lm_head[...], np.float32)[:, ids], tcfg.vocab_size)
    return draft


# ----------------------------------------------------------------------------- loss


def ttt_mask(length: int, ttt_length: int) -> np.ndarray:
    """``[ttt_length, L, ttt_length * L]``: what step t's row at anchor i may attend to
    (step-0 slots 0..i and slot ``s*L + i`` of steps 1..t), as a boolean array: the
    dense form of ``StepDiagonalMask`` (the reference path, ``attention="dense"``)."""
    return np.stack([StepDiagonalMask(step=t, length=length).dense(ttt_length * length)[0] for t in range(ttt_length)])


def _gather_rows(x, idx):
    """x[b, idx[b, q]] for x [B, L, ...] and idx [B, Q] (indices already in range)."""
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def ttt_forward(
    draft: Eagle3Draft, tokens: jax.Array, features: jax.Array, *, ttt_length: int,
    attention: str = "diagonal", anchors: jax.Array | None = None,
) -> list[jax.Array]:
    """The unrolled draft: per step t, the draft's logits ``[B, Q, Vd]`` at query row q
    (anchor ``i = anchors[b, q]``) predict token ``i + t + 2`` (see the module docstring).

    Args:
      tokens: [B, L] the sequence's tokens (the true tokens are fed at every step).
      features: [B, L, F] the target's fused-layer features.
      attention: ``"diagonal"`` (``model.StepDiagonalMask``: causal step-0 block plus
        the diagonal of earlier steps, O(L^2) a step) or ``"dense"`` (the same mask as a
        ``[L, ttt_length * L]`` array, O(ttt_length * L^2) a step; the reference).
      anchors: [B, Q] (in [0, L)): the anchors to unroll from, e.g. only those whose
        predictions reach the response. Step 0 still runs at every position (its keys
        are every later query's context), but its logits and steps 1.. only at these.
        None: every position (Q = L). Only with ``attention="diagonal"``.
    """
    if attention not in ("diagonal", "dense"):
        raise ConfigError(f"attention={attention!r} must be 'diagonal' or 'dense'")
    if anchors is not None and attention != "diagonal":
        raise ConfigError("anchors (a subset of query rows) need attention='diagonal'")
    b, width = tokens.shape
    rows = width if anchors is None else anchors.shape[1]
    masks = ttt_mask(width, ttt_length) if attention == "dense" else None
    positions = jnp.broadcast_to(jnp.arange(width)[None, :], (b, width))
    dcfg = draft.config
    if dcfg.mla is not None:
        raise ConfigError("training an MLA draft (Eagle3DeepseekV2ForCausalLM) is not supported; "
                          "train a Llama-layer draft (LlamaForCausalLMEagle3) for this target")
    shape = (b, width + (ttt_length - 1) * rows, dcfg.num_key_value_heads, dcfg.head_dim)
    cache = KVCache(k=[jnp.zeros(shape, jnp.float32)], v=[jnp.zeros(shape, jnp.float32)])
    hidden = draft.fuse(features.astype(jnp.float32))
    out = []
    for t in range(ttt_length):
        # Step 0 runs at every position (block 0 of the cache holds the keys of the whole
        # sequence); later steps at the query rows, each writing its own block of slots.
        anc = positions if t == 0 or anchors is None else anchors
        pos = anc + t
        slots = positions if t == 0 else width + (t - 1) * rows + jnp.broadcast_to(jnp.arange(rows)[None, :], (b, rows))
        # The token fed at step t is token i+t+1 (0 past the end of the sequence).
        nxt = jnp.where(anc + t + 1 < width, _gather_rows(tokens, jnp.minimum(anc + t + 1, width - 1)), 0)
        if masks is not None:
            mask = jnp.broadcast_to(masks[t], (b, width, ttt_length * width))
        else:
            mask = StepDiagonalMask(step=t, length=width, anchors=None if t == 0 else anchors)
        hidden, cache = draft(nxt, hidden, pos, cache, slots, mask)
        if t == 0 and anchors is not None:
            hidden = _gather_rows(hidden, anchors)
        out.append(draft.logits(hidden))
    return out


def query_anchors(prompt_lengths: jax.Array, width: int, rows: int, ttt_length: int) -> tuple[jax.Array, jax.Array]:
    """The ``rows`` anchors of each sequence from ``prompt_length - ttt_length - 1`` (or 0) on:
    the first anchor whose last unrolled step predicts a response token (an earlier one
    predicts prompt tokens at every step, so it carries no loss). Returns (anchors
    [B, rows] clipped into [0, width), real [B, rows]: False where the clipping repeated
    an anchor)."""
    raw = jnp.maximum(prompt_lengths[:, None] - ttt_length - 1, 0) + jnp.arange(rows)[None, :]
    return jnp.minimum(raw, width - 1), raw < width


def query_rows_needed(lengths: np.ndarray, prompt_lengths: np.ndarray, ttt_length: int) -> int:
    """The fewest query rows (``query_anchors``) that keep every labelled anchor of these
    sequences: anchors ``max(prompt_length - ttt_length - 1, 0) .. length - 3``."""
    lengths, plens = np.asarray(lengths), np.asarray(prompt_lengths)
    return int(np.max(lengths - 2 - np.maximum(plens - ttt_length - 1, 0)))


def ttt_loss(
    draft: Eagle3Draft,
    target_head: jax.Array,
    batch: dict[str, jax.Array],
    *,
    ttt_length: int,
    step_decay: float,
    attention: str = "diagonal",
    query_rows: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The TTT loss of one batch.

    Args:
      draft: the draft.
      target_head: ``[Ht, Vd]`` the target's head columns of the draft vocabulary.
      batch: tokens [B, L], lengths [B], prompt_lengths [B], features [B, L, F],
        target_hidden [B, L, Ht], target_argmax [B, L].
      query_rows: unroll only from the anchors ``prompt_length - ttt_length - 1 ...``
        (``query_anchors``), this many per sequence (static). ``query_rows_needed`` of
        the batch or more gives the loss of every position: the anchors left out have no
        label at any step. None: every position.

    Returns:
      (weighted loss, {"loss": [ttt] per-step losses, "acc": [ttt] top-1 agreement with
      the target's argmax, "count": [ttt] positions counted}).
    """
    tokens = batch["tokens"]
    width = tokens.shape[1]
    lengths, plens = batch["lengths"][:, None], batch["prompt_lengths"][:, None]
    in_draft = draft.t2d[...]
    t2d_index = jnp.cumsum(in_draft) - 1  # draft id of each target id in the vocabulary
    if query_rows is None:
        anchors, real = None, jnp.ones((1, width), bool)
        anc = jnp.arange(width)[None, :]
    else:
        anchors, real = query_anchors(batch["prompt_lengths"], width, query_rows, ttt_length)
        anc = anchors
    total = 0.0
    losses, accs, counts = [], [], []
    # The target's distribution, once: step t reads it at i + t + 1 (the target's
    # prediction of token i+t+2 is made at position i+t+1).
    p_all = jax.nn.softmax(jax.lax.stop_gradient(batch["target_hidden"].astype(jnp.float32) @ target_head), axis=-1)
    steps = ttt_forward(draft, tokens, batch["features"], ttt_length=ttt_length, attention=attention, anchors=anchors)
    for t, logits in enumerate(steps):
        logp = jax.nn.log_softmax(logits, axis=-1)  # [B, Q, Vd]
        at = jnp.minimum(anc + t + 1, width - 1)
        t_argmax = _gather_rows(batch["target_argmax"], jnp.broadcast_to(at, logits.shape[:2]))
        p_target = _gather_rows(p_all, jnp.broadcast_to(at, logits.shape[:2]))
        label_pos = anc + t + 2
        valid = real & (label_pos < lengths) & (label_pos >= plens) & in_draft[t_argmax]
        w = valid.astype(jnp.float32)
        n = jnp.maximum(w.sum(), 1.0)
        ce = -(p_target * logp).sum(-1)
        loss_t = (ce * w).sum() / n
        acc_t = ((jnp.argmax(logp, -1) == t2d_index[t_argmax]) * w).sum() / n
        total = total + (step_decay ** t) * loss_t
        losses.append(loss_t)
        accs.append(acc_t)
        counts.append(w.sum())
    return total, {"loss": jnp.stack(losses), "acc": jnp.stack(accs), "count": jnp.stack(counts)}


# ----------------------------------------------------------------------------- trainer


def _length_batches(lengths: np.ndarray, batch_size: int, rng: np.random.Generator, round_to: int, max_len: int):
    """Shuffled batches of similar length: shuffle, sort within windows of 16 batches,
    split, shuffle the batches. Yields (indices, padded length)."""
    order = rng.permutation(len(lengths))
    window = batch_size * 16
    batches = []
    for lo in range(0, len(order), window):
        w = order[lo:lo + window]
        w = w[np.argsort(lengths[w], kind="stable")]
        batches += [w[i:i + batch_size] for i in range(0, len(w), batch_size)]
    for j in rng.permutation(len(batches)):
        idx = batches[j]
        yield idx, int(min(max_len, -(-int(lengths[idx].max()) // round_to) * round_to))


def _batch_arrays(data: FeatureSet, idx: np.ndarray, length: int, batch_size: int) -> dict[str, np.ndarray]:
    idx = np.sort(idx)
    pad = batch_size - len(idx)
    out = {}
    for name in ("tokens", "features", "target_hidden", "target_argmax"):
        x = np.asarray(getattr(data, name)[idx, :length])
        out[name] = np.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    # Padding rows get length 0: nothing in them is counted.
    out["lengths"] = np.pad(np.asarray(data.lengths[idx]), (0, pad))
    out["prompt_lengths"] = np.pad(np.asarray(data.prompt_lengths[idx]), (0, pad))
    return out


class DraftTrainer:
    """Trains ``draft`` on a FeatureSet with AdamW (0.9, 0.95), warm-up + cosine decay,
    global-norm clipping. The embedding and vocabulary maps stay fixed."""

    def __init__(self, draft: Eagle3Draft, target: LlamaModel, cfg: TrainConfig, total_steps: int,
                 *, attention: str = "diagonal", select_queries: bool = True, round_to: int = 64):
        self.cfg = cfg
        ids = np.asarray(draft.draft_to_target(jnp.arange(draft.config.draft_vocab_size)))
        self.target_head = jnp.asarray(np.asarray(target.lm_head[...], np.float32)[:, ids])
        self.graph, self.params, self.frozen = nnx.split(draft, TRAINABLE, ...)
        # The learning rate is computed on the host and passed to each step (AdamW is
        # scale_by_adam + decayed weights, times -lr), so the planned length of the run can
        # change while it runs: a time budget re-estimates it from the measured step time.
        self.total_steps = total_steps
        self.opt = optax.chain(
            optax.clip_by_global_norm(cfg.grad_clip),
            optax.scale_by_adam(b1=0.9, b2=0.95),
            optax.add_decayed_weights(cfg.weight_decay),
        )
        self.opt_state = self.opt.init(self.params)
        self.step_count = 0
        # attention: "dense" runs the reference mask path (see ttt_forward), for comparisons.
        kw = dict(ttt_length=cfg.ttt_length, step_decay=cfg.step_decay, attention=attention)

        # select_queries: unroll only from the anchors whose predictions reach the response
        # (ttt_loss's query_rows; the same loss, less work where prompts are long).
        if select_queries and attention != "diagonal":
            raise ConfigError("select_queries needs attention='diagonal' (pass select_queries=False with 'dense')")
        self.select_queries = select_queries
        self.round_to = round_to

        def loss_fn(params, frozen, head, batch, query_rows=None):
            return ttt_loss(nnx.merge(self.graph, params, frozen), head, batch, query_rows=query_rows, **kw)

        def train_step(params, opt_state, frozen, head, batch, lr, query_rows=None):
            (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, frozen, head, batch, query_rows)
            updates, opt_state = self.opt.update(grads, opt_state, params)
            params = optax.apply_updates(params, jax.tree.map(lambda u: -lr * u, updates))
            aux["grad_norm"] = optax.tree.norm(grads)
            return params, opt_state, loss, aux

        self._train_step = jax.jit(train_step, donate_argnums=(0, 1), static_argnames=("query_rows",))
        self._eval = jax.jit(loss_fn, static_argnames=("query_rows",))

    def schedule(self, step: int) -> float:
        """Learning rate of step ``step`` (0-based) of ``total_steps``: linear warm-up from
        0 over ``warmup_steps``, then cosine decay to ``min_learning_rate_ratio`` of the
        peak at ``total_steps`` (optax's warmup_cosine_decay_schedule, evaluated here)."""
        cfg = self.cfg
        peak, end = cfg.learning_rate, cfg.learning_rate * cfg.min_learning_rate_ratio
        warm = max(cfg.warmup_steps, 1)
        if step < warm:
            return peak * step / warm
        total = max(self.total_steps, cfg.warmup_steps + 1)
        frac = min(1.0, (step - warm) / max(total - warm, 1))
        return end + (peak - end) * 0.5 * (1.0 + math.cos(math.pi * frac))

    def query_rows(self, batch: dict[str, np.ndarray]) -> int | None:
        """Query rows for a batch: the anchors its longest response needs (``ttt_loss``),
        rounded up to ``round_to`` (one compiled graph per (width, rows)), at most the
        width; None when not selecting."""
        if not self.select_queries:
            return None
        width = batch["tokens"].shape[1]
        need = query_rows_needed(batch["lengths"], batch["prompt_lengths"], self.cfg.ttt_length)
        return min(width, max(self.round_to, -(-need // self.round_to) * self.round_to))

    @property
    def draft(self) -> Eagle3Draft:
        return nnx.merge(self.graph, self.params, self.frozen)

    def step(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        lr = np.float32(self.schedule(self.step_count))
        self.params, self.opt_state, loss, aux = self._train_step(
            self.params, self.opt_state, self.frozen, self.target_head, batch, lr, query_rows=self.query_rows(batch))
        self.step_count += 1
        return {"loss": loss, "step_loss": aux["loss"], "acc": aux["acc"], "grad_norm": aux["grad_norm"]}

    def evaluate(self, data: FeatureSet, *, round_to: int = 64) -> dict[str, np.ndarray]:
        """Per-step loss and top-1 agreement over a whole set (weighted by positions)."""
        bs = self.cfg.batch_size
        loss = acc = cnt = 0.0
        max_len = data.tokens.shape[1]
        for idx, width in _length_batches(np.asarray(data.lengths), bs, np.random.default_rng(0), round_to, max_len):
            batch = _batch_arrays(data, idx, width, bs)
            _, aux = self._eval(self.params, self.frozen, self.target_head, batch, query_rows=self.query_rows(batch))
            c = np.asarray(aux["count"])
            loss = loss + np.asarray(aux["loss"]) * c
            acc = acc + np.asarray(aux["acc"]) * c
            cnt = cnt + c
        cnt = np.maximum(cnt, 1)
        return {"loss": loss / cnt, "acc": acc / cnt}


def teacher_forced_agreement(draft: Eagle3Draft, target: LlamaModel, data: FeatureSet, steps: int) -> dict[str, Any]:
    """The draft's top-1 agreement with the target by draft step on given sequences, as
    training measures it (``ttt_loss``'s ``acc``: the true tokens fed, response positions
    whose target argmax is in the draft vocabulary), one sequence at a time.

    On the target's own greedy outputs, step 1's agreement is what a greedy chain accepts
    at depth 1, and ``expected_accept_length`` of the steps' agreements predicts the chain's
    mean accept length where the steps' errors are independent. Comparing it with the
    training-time held-out agreement separates a harder prompt distribution from a
    train/inference mismatch (the engine's draft is the unrolled one exactly:
    tests/train/test_ttt.py). Returns {"agreement": [steps], "positions": [steps]}."""
    ids = np.asarray(draft.draft_to_target(jnp.arange(draft.config.draft_vocab_size)))
    head = jnp.asarray(np.asarray(target.lm_head[...], np.float32)[:, ids])
    graph, params = nnx.split(draft)

    @jax.jit  # one graph per padded width (widths rounded up to 64)
    def run(params, batch):
        _, aux = ttt_loss(nnx.merge(graph, params), head, batch, ttt_length=steps, step_decay=1.0)
        return aux["acc"] * aux["count"], aux["count"]

    hits = np.zeros(steps)
    count = np.zeros(steps)
    for i in range(len(data)):
        width = int(-(-int(data.lengths[i]) // 64) * 64)
        batch = _batch_arrays(data, np.array([i]), min(width, data.tokens.shape[1]), 1)
        h, c = run(params, {k: jnp.asarray(v) for k, v in batch.items()})
        hits += np.asarray(h)
        count += np.asarray(c)
    return {"agreement": (hits / np.maximum(count, 1)).tolist(), "positions": count.astype(int).tolist()}


def expected_accept_length(acc: np.ndarray) -> float:
    """Chain accept length implied by per-step top-1 agreements (each step conditional
    on the previous ones being right): 1 + sum_k prod_{j<=k} acc_j."""
    out, run = 1.0, 1.0
    for a in np.asarray(acc, float):
        run *= a
        out += run
    return out


class TrainingInterrupted(Exception):
    """SIGINT or SIGTERM arrived during training: a checkpoint of the last finished step
    was saved (``step``), from which ``train_draft(..., resume=True)`` continues."""

    def __init__(self, step: int, directory: str):
        super().__init__(f"training interrupted; checkpoint of step {step} saved in {directory}")
        self.step, self.directory = step, directory


class TrainCheckpoints:
    """Resumable training state in ``directory`` with orbax-checkpoint: the trainable
    draft parameters, the optimizer state and a JSON record (step, epoch, the history so
    far, the draft vocabulary's digest). The data order needs no saving: it is replayed
    from the seed. The newest ``keep`` checkpoints are kept, so a latest one that was
    corrupted (a kill mid-write, a bad disk) leaves an older one to fall back to."""

    def __init__(self, directory, keep: int = 3):
        import orbax.checkpoint as ocp
        from pathlib import Path

        self.directory = Path(directory).resolve()
        self._ocp = ocp
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        )

    def save(self, step: int, params, opt_state, meta: dict) -> None:
        ocp = self._ocp
        if step in self.manager.all_steps():  # saved again at an epoch's end, with its evaluation
            self.manager.delete(step)
        self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state), meta=ocp.args.JsonSave(meta),
        ), force=True)
        self.manager.wait_until_finished()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps(), reverse=True)

    def restore(self, params, opt_state) -> tuple[int, Any, Any, dict]:
        """The newest checkpoint that reads back whole: (step, params, opt_state, meta),
        with ``params``/``opt_state`` as the templates. A checkpoint that fails to read is
        reported (logged, with the error) and the one before it is tried."""
        ocp = self._ocp
        errors = []
        for step in self.steps():
            try:
                got = self.manager.restore(step, args=ocp.args.Composite(
                    params=ocp.args.StandardRestore(params), opt_state=ocp.args.StandardRestore(opt_state),
                    meta=ocp.args.JsonRestore(),
                ))
                meta = dict(got["meta"])
                if int(meta.get("step", -1)) != step:
                    raise ValueError(f"its record says step {meta.get('step')!r}")
            except Exception as e:  # noqa: BLE001 -- any failure to read means: try the previous one
                log.error("checkpoint of step %d in %s cannot be read (%s: %s); trying the previous one",
                          step, self.directory, type(e).__name__, e)
                errors.append(f"step {step}: {type(e).__name__}: {e}")
                continue
            if errors:
                log.warning("resuming from step %d; newer checkpoints were unreadable: %s", step, "; ".join(errors))
            return step, _like(params, got["params"]), _like(opt_state, got["opt_state"]), meta
        detail = f" (unreadable: {'; '.join(errors)})" if errors else ""
        raise ConfigError(f"no checkpoint to resume from in {self.directory}{detail}")

    def close(self) -> None:
        self.manager.close()


def _like(template, restored):
    """``restored`` with the placement of ``template``: orbax returns arrays committed to
    their device, and a committed argument lowers to a different graph than the fresh,
    uncommitted one (a sharding annotation on each input), so a resumed run compiled its
    steps again instead of loading them from the compilation cache (5 s of a 25 s budget
    on the test's tiny draft; CI ran past its budget on it)."""
    def one(t, x):
        if isinstance(t, jax.Array) and not t.committed and isinstance(x, jax.Array) and x.committed:
            return jax.device_put(np.asarray(x))  # no device named: uncommitted, like the template
        return x

    return jax.tree.map(one, template, restored)


def _vocab_digest(ids: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()[:16]


def train_draft(
    target: LlamaModel,
    data: FeatureSet,
    cfg: TrainConfig,
    *,
    eval_data: FeatureSet | None = None,
    round_to: int = 64,
    on_log: Callable[[dict[str, Any]], None] | None = None,
    log_every: int = 10,
    init: Eagle3Draft | None = None,
    on_epoch: Callable[[int, Eagle3Draft], None] | None = None,
    checkpoint_dir=None,
    checkpoint_every: int = 0,
    resume: bool = False,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
    eval_every: int = 0,
    time_budget_s: float | None = None,
    new_vocab: bool = False,
) -> tuple[Eagle3Draft, list[dict[str, Any]]]:
    """Select the draft vocabulary, initialise and train a draft. Returns (draft, history).

    ``init``: continue from this draft (float32, made for ``target``; its vocabulary is
    kept and ``cfg.draft_vocab_size`` / ``intermediate_size`` are ignored) instead of a
    fresh one. ``history`` holds one record per logged step and one per evaluation (per
    epoch end when ``eval_data`` is given, and every ``eval_every`` steps when that is > 0:
    the points of a learning curve); ``on_log`` sees each record as it is made;
    ``on_epoch(epoch, draft)`` is called after each full pass (e.g. to save a snapshot).

    Resuming: with ``checkpoint_dir``, the state is saved every ``checkpoint_every`` steps
    (0: only at the end and on a signal), at the end, and when SIGINT or SIGTERM arrives
    (then ``TrainingInterrupted`` is raised after the save). ``resume=True`` restores the
    newest readable checkpoint there and continues: the same batches in the same order
    from the next step, so the per-step losses equal an uninterrupted run's (``on_step``
    sees every step's loss, for checking that). The history returned (and logged to
    ``on_log`` from then on) continues the saved one.

    Every train and eval record carries ``response_tokens_seen``: the response tokens
    (the positions the loss can count) of the batches trained on so far, the x axis of a
    learning curve. A resumed run recounts it from the replayed batch order.

    ``time_budget_s``: the training clock (steps, evaluations, checkpoints; across
    resumptions) ends within this many seconds. The run's length in steps is then
    planned from the measured step time (a median of the recent steps, plus the
    evaluations' share) and re-planned as it goes, so the cosine decay ends where the
    budget does; ``cfg.epochs`` stays an upper bound. When the time left would not cover
    another step plus the final evaluation and save, training stops there, evaluates and
    returns the draft as if that had been the planned end. A resumed run keeps the
    budget (its clock continues), so its later steps may differ from an uninterrupted
    run's in their learning rates.

    ``new_vocab`` (with ``init``): choose the draft vocabulary from ``data`` (at
    ``cfg.draft_vocab_size``) instead of keeping ``init``'s. Everything but the head is
    carried over; the head's columns for ids in both vocabularies come from ``init``, the
    others from the target's head through a fitted map (``revocab_draft``).
    """
    non_negative_int("eval_every", eval_every)
    if time_budget_s is not None and not (is_number(time_budget_s) and math.isfinite(time_budget_s) and time_budget_s > 0):
        raise ConfigError(f"time_budget_s={time_budget_s!r} must be a finite number > 0")
    if new_vocab and init is None:
        raise ConfigError("new_vocab=True needs an init draft (a fresh draft always chooses its vocabulary)")
    if init is not None and init.config.vocab_size != target.config.vocab_size:
        raise ConfigError(f"init draft vocab_size={init.config.vocab_size} differs from the target's {target.config.vocab_size}")
    if init is None or new_vocab:
        ids = select_draft_vocab(data, cfg.draft_vocab_size, target.config.vocab_size)
        draft = init_draft(target, ids, cfg) if init is None else revocab_draft(init, target, ids)
    else:
        ids = np.asarray(init.draft_to_target(jnp.arange(init.config.draft_vocab_size)))
        graph, state = nnx.split(init)
        draft = nnx.merge(graph, jax.tree.map(_f32_copy, state))
    coverage = vocab_coverage(data, ids, target.config.vocab_size)
    log.info("draft vocabulary: %d ids cover %.2f%% of the response tokens", len(ids), 100 * coverage)
    lengths = np.asarray(data.lengths)
    steps_per_epoch = -(-len(data) // cfg.batch_size)
    total = max(1, int(round(cfg.epochs * steps_per_epoch)))
    trainer = DraftTrainer(draft, target, cfg, total, round_to=round_to)
    history: list[dict[str, Any]] = []

    def emit(rec):
        history.append(rec)
        if on_log is not None:
            on_log(rec)

    emit({"event": "vocab", "draft_vocab_size": len(ids), "coverage": coverage})

    ckpt = TrainCheckpoints(checkpoint_dir) if checkpoint_dir is not None else None
    if resume and ckpt is None:
        raise ConfigError("resume=True needs checkpoint_dir")
    digest = _vocab_digest(ids)
    t0 = time.perf_counter()
    elapsed0 = 0.0
    closed = 0  # epochs whose end (snapshot, evaluation) is done

    def clock() -> float:
        """The training clock: seconds trained, across resumptions."""
        return elapsed0 + time.perf_counter() - t0

    if resume:
        step, trainer.params, trainer.opt_state, meta = ckpt.restore(trainer.params, trainer.opt_state)
        # Under a time budget the planned steps are the checkpoint's (re-planned as the run
        # goes on, against the budget given now: the clock continues); otherwise they
        # follow from the data and settings and must agree.
        if meta.get("sequences", len(data)) != len(data):
            raise ConfigError(f"the checkpoint in {ckpt.directory} trained on {meta['sequences']} sequences, this data has "
                              f"{len(data)} (a growing set's finished shards change the batch order: start a new run, "
                              f"--init-from the draft)")
        if meta.get("vocab_sha256") != digest or (meta.get("time_budget_s") is None and meta.get("total_steps") != total):
            raise ConfigError(
                f"the checkpoint in {ckpt.directory} was made with other data or settings (draft vocabulary "
                f"{meta.get('vocab_sha256')} vs {digest}, {meta.get('total_steps')} vs {total} total steps)"
            )
        if time_budget_s is not None:
            trainer.total_steps = min(total, int(meta["total_steps"]))
        trainer.step_count = step
        history[:] = list(meta["history"])
        elapsed0 = float(meta.get("elapsed_s", 0.0))
        closed = int(meta.get("epochs_closed", 0))
        log.info("resumed at step %d of %d from %s", step, total, ckpt.directory)
        if on_log is not None:
            on_log({"event": "resume", "step": step, "history": list(history)})

    def save(epoch: int, closed: int) -> None:
        ckpt.save(trainer.step_count, trainer.params, trainer.opt_state, {
            "step": trainer.step_count, "epoch": epoch, "epochs_closed": closed, "total_steps": trainer.total_steps,
            "vocab_sha256": digest, "time_budget_s": time_budget_s, "sequences": len(data), "history": history,
            "elapsed_s": clock(),
        })

    # SIGINT / SIGTERM: finish the step in flight, save, and stop.
    import signal

    stop = []
    handlers = {}
    if ckpt is not None:
        def on_signal(signum, frame):
            stop.append(signum)

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                handlers[sig] = signal.signal(sig, on_signal)
            except ValueError:  # not the main thread: signals cannot be caught here
                pass
    rng = np.random.default_rng(cfg.seed)
    max_len = data.tokens.shape[1]
    response = lengths - np.asarray(data.prompt_lengths)
    epoch = 0
    done_before = trainer.step_count
    seen = 0  # response tokens of the batches trained on

    # Time budget: the recent steps' durations (their median ignores the steps that
    # compiled a new width), and what the end costs (the last evaluation, a save).
    recent: list[float] = []
    end_cost = {"eval": 0.0, "save": 0.0}

    def plan(now: float) -> bool:
        """Re-plan ``trainer.total_steps`` for the time left; False when no further
        step fits before the final evaluation and save."""
        if time_budget_s is None or not recent:
            return True
        step_s = float(np.median(recent))
        if eval_data is not None and eval_every:
            step_s += end_cost["eval"] / eval_every  # the mid-run evaluations' share
        left = time_budget_s - now - end_cost["eval"] - end_cost["save"] - 2 * step_s
        if left < 0:
            return False
        # At least one more step while time is left, never past cfg.epochs (the cap; a
        # floor of step_count + 1 alone once ran a 2-epoch run for 1,061 epochs).
        trainer.total_steps = min(total, trainer.step_count + max(1, int(left / step_s)))
        return True

    def evaluate() -> None:
        e0 = time.perf_counter()
        ev = trainer.evaluate(eval_data, round_to=round_to)
        end_cost["eval"] = time.perf_counter() - e0
        emit({
            "event": "eval", "step": trainer.step_count, "epoch": trainer.step_count / steps_per_epoch,
            "response_tokens_seen": seen,
            "loss": [round(float(x), 4) for x in ev["loss"]], "acc": [round(float(x), 4) for x in ev["acc"]],
            "expected_accept_length": expected_accept_length(ev["acc"]),
            "elapsed_s": clock(),
        })

    if time_budget_s is not None:
        # Until steps are measured the plan is the whole of cfg.epochs.
        if clock() >= time_budget_s:
            raise ConfigError(f"the time budget of {time_budget_s:.0f} s is already spent ({clock():.0f} s trained)")
        if eval_data is not None and not resume:
            # The starting point of the learning curve, and the measured cost of the final
            # evaluation the plan keeps time for.
            evaluate()
    out_of_time = False
    compiled: set = set()  # step shapes run so far: a new one compiles, and is not timed

    def go_on() -> bool:
        """Whether another step runs: re-plans first, so a budget can also lengthen the run."""
        nonlocal out_of_time
        if not out_of_time and not plan(clock()):
            # Out of time: the last step is done; the schedule ends here.
            trainer.total_steps = trainer.step_count
            out_of_time = True
        return trainer.step_count < trainer.total_steps

    try:
        while go_on():
            # The epoch's batches come from the one seeded generator, epoch after epoch, so
            # a resumed run replays the order and skips what the checkpoint had done.
            batches = list(_length_batches(lengths, cfg.batch_size, rng, round_to, max_len))
            skip = max(0, done_before - epoch * steps_per_epoch)
            seen += sum(int(response[idx].sum()) for idx, _ in batches[:skip])
            for idx, width in batches[skip:]:
                if not go_on():
                    break
                batch = _batch_arrays(data, idx, width, cfg.batch_size)
                s0 = time.perf_counter()
                out = trainer.step(batch)
                if time_budget_s is not None:
                    # Only a budget waits for each step (its time is what the plan needs);
                    # otherwise the next batch is read while this one runs.
                    float(out["loss"])
                    shape = (width, trainer.query_rows(batch))
                    if shape in compiled:
                        recent.append(time.perf_counter() - s0)
                        del recent[:-50]
                    compiled.add(shape)
                seen += int(response[idx].sum())
                if on_step is not None:
                    on_step(trainer.step_count, out)
                if trainer.step_count % log_every == 0 or trainer.step_count == trainer.total_steps:
                    emit({
                        "event": "train", "step": trainer.step_count, "epoch": trainer.step_count / steps_per_epoch,
                        "response_tokens_seen": seen, "loss": float(out["loss"]), "step_loss": [round(float(x), 4) for x in out["step_loss"]], "acc": [round(float(a), 4) for a in out["acc"]],
                        "grad_norm": float(out["grad_norm"]), "lr": float(trainer.schedule(trainer.step_count)),
                        "elapsed_s": clock(),
                    })
                # Mid-epoch points of the learning curve (an epoch's end is evaluated below).
                if (eval_data is not None and eval_every and trainer.step_count % eval_every == 0
                        and trainer.step_count % steps_per_epoch != 0 and trainer.step_count != trainer.total_steps):
                    evaluate()
                if ckpt is not None and stop:
                    save(epoch, closed)
                    raise TrainingInterrupted(trainer.step_count, str(ckpt.directory))
                if ckpt is not None and checkpoint_every and trainer.step_count % checkpoint_every == 0:
                    c0 = time.perf_counter()
                    save(epoch, closed)
                    end_cost["save"] = time.perf_counter() - c0
            epoch += 1
            if epoch <= closed:  # its end (snapshot, evaluation) was done before the checkpoint
                continue
            if on_epoch is not None and trainer.step_count % steps_per_epoch == 0:
                on_epoch(epoch, trainer.draft)
            if eval_data is not None:
                evaluate()
            closed = epoch
            if ckpt is not None and checkpoint_every:
                save(epoch, closed)
        if ckpt is not None:
            save(epoch, closed)
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
        if ckpt is not None:
            ckpt.close()
    return trainer.draft, history
