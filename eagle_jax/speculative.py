"""EAGLE-3 speculative decoding: drafting, verification, commit and draft extend as one
static-shape jitted step per batch bucket (SGLang's "spec v2" scheme).

State carried between steps (``SpecState``), per sequence b:

- ``seq_lens[b]``: tokens committed to both KV caches (slots ``0 .. seq_lens-1``);
- ``root[b]``: the last emitted token, not yet run through the target; it is the root
  (slot 0) of the next tree;
- ``draft_hidden[b]``: the draft's pre-norm output for the row that consumed ``root``;
  its logits propose the token after ``root``.

Conventions (see ../shared/docs/eagle3-reference.md):

- The draft row at position p takes the target feature of position p and the token at
  p+1, and predicts the token at p+2. So the prompt's draft prefill pairs features
  ``f_0..f_{n-1}`` with tokens ``x_1..x_n`` (``x_n`` = the first sampled token), and a
  tree node at depth d (token at position ``seq_len + d``) is drafted from at draft
  position ``seq_len + d - 1``.
- Drafting writes the draft KV of tree nodes into scratch slots ``seq_len + (d-1)*k + j``
  (depth d, frontier j): above the committed prefix, so the draft extend after
  verification overwrites them with the accepted tokens' entries.
- Verification writes the tree's target KV at slots ``seq_len + t`` with RoPE positions
  ``seq_len + depth(t)``; the tree mask is ancestor-only. A tree step then moves the
  accepted path's KV into ``seq_len .. seq_len + accept_length - 1``; a chain needs no
  move (its path is already contiguous).
- The draft extend runs over a fixed ``num_steps + 1`` tokens per sequence (the emitted
  tokens, paired with the target features of the accepted slots) and keeps the row at
  ``accept_length - 1``; fixed width is what keeps the step free of host syncs.

The step is two phases: ``draft_phase_impl`` (draft tree, oracle substitution) and
``verify_phase_impl`` (verify, accept, commit, draft extend); ``speculative_step_impl`` is
their composition, traced as one graph. ``SpecSteps`` also compiles each phase alone, for
measuring draft and verify time separately (``EngineConfig.time_phases``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from eagle_jax.draft import Eagle3Draft, check_compatible
from eagle_jax.errors import ConfigError, InputError
from eagle_jax.generate import Buckets, PaddedBatch, RequestProgress, check_prompt, normalize_params
from eagle_jax.model import BoundModules, KVCache, LlamaModel, TreeAttention
from eagle_jax.sampling import (
    SamplingArrays,
    SamplingParams,
    inverse_cdf_sample,
    position_keys,
    position_uniforms,
    sample_tokens,
    target_probs,
)
from pallas_kernels.tree import tree_ancestor_mask, tree_links
from pallas_kernels.verify_greedy import verify_greedy
from pallas_kernels.verify_sampling import tree_speculative_sample


# How sampled (temperature > 0) requests are verified; both are exact at thresholds 1.
#  "coupled": each tree slot's next token is drawn from the target with the uniform of its
#    position (the one plain decoding would use) and the tree is walked as in greedy
#    verification against those draws. Lossless by construction, and a request's output
#    is the same with or without speculation, at any batch size.
#  "rejection": SGLang's tree speculative sampling (the Pallas kernel), with its
#    threshold_single / threshold_acc relaxations.
SAMPLING_VERIFY = ("coupled", "rejection")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Draft shape: ``num_steps`` S (tree depth), ``topk`` k, ``num_draft_tokens`` T.

    A chain is ``topk == 1`` and forces ``T = S + 1``. A tree keeps the T-1 best of
    ``k + (S-1) k^2`` scored nodes plus the root. ``sampling_verify`` picks how sampled
    requests are verified (``SAMPLING_VERIFY``); ``threshold_single``/``threshold_acc``
    are SGLang's relaxations of its rejection sampling; 1.0 (the default) is exact.
    """

    num_steps: int = 5
    topk: int = 1
    num_draft_tokens: int | None = None
    threshold_single: float = 1.0
    threshold_acc: float = 1.0
    sampling_verify: str = "coupled"

    def __post_init__(self):
        if self.sampling_verify not in SAMPLING_VERIFY:
            raise ConfigError(f"sampling_verify={self.sampling_verify!r}; valid: {', '.join(SAMPLING_VERIFY)}")
        if self.sampling_verify == "coupled" and (self.threshold_single != 1 or self.threshold_acc != 1):
            raise ConfigError(
                f"threshold_single={self.threshold_single}, threshold_acc={self.threshold_acc}: the thresholds "
                "relax SGLang's rejection sampling; set sampling_verify='rejection' to use them"
            )
        if not isinstance(self.num_steps, int) or self.num_steps < 1:
            raise ConfigError(f"num_steps={self.num_steps!r} must be an integer >= 1")
        if not isinstance(self.topk, int) or self.topk < 1:
            raise ConfigError(f"topk={self.topk!r} must be an integer >= 1")
        t = self.num_draft_tokens
        if self.topk == 1:
            if t is not None and t != self.num_steps + 1:
                raise ConfigError(
                    f"num_draft_tokens={t} with topk=1 (a chain) must be num_steps + 1 = {self.num_steps + 1}"
                )
            object.__setattr__(self, "num_draft_tokens", self.num_steps + 1)
        else:
            most = self.max_draft_tokens(self.num_steps, self.topk)
            if not isinstance(t, int) or not 2 <= t <= most:
                raise ConfigError(
                    f"num_draft_tokens={t!r} with topk={self.topk}, num_steps={self.num_steps} must be an "
                    f"integer in [2, {most}] (root + at most k + (S-1)k^2 candidates)"
                )
        for name in ("threshold_single", "threshold_acc"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ConfigError(f"{name}={v!r} must be in (0, 1] (1 = exact)")

    @staticmethod
    def max_draft_tokens(num_steps: int, topk: int) -> int:
        """The most tokens a tree can verify: the root plus k + (S-1)k^2 scored nodes."""
        return 1 + topk + (num_steps - 1) * topk**2

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def shape(self) -> str:
        """``"chain S=5"`` or ``"tree S=3 k=4 T=8"`` (for logs and tables)."""
        if self.is_chain:
            return f"chain S={self.num_steps}"
        return f"tree S={self.num_steps} k={self.topk} T={self.num_draft_tokens}"

    @property
    def max_accept(self) -> int:
        """Tokens one step can emit: S accepted drafts plus the bonus."""
        return self.num_steps + 1

    @property
    def scratch_slots(self) -> int:
        """Draft-cache slots above the prefix used by drafting's tree nodes."""
        return (self.num_steps - 1) * self.topk


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
    target_cache: KVCache
    draft_cache: KVCache
    seq_lens: Int[Array, "B"]
    root: Int[Array, "B"]
    draft_hidden: Float[Array, "B H"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Tree:
    tokens: Int[Array, "B T"]  # slot 0 = root
    parents: Int[Array, "B T"]  # root -1
    depths: Int[Array, "B T"]


# ----------------------------------------------------------------------------- drafting


def draft_tree(
    draft: Eagle3Draft,
    cache: KVCache,
    state: SpecState,
    cfg: SpeculativeConfig,
) -> tuple[Tree, KVCache]:
    """Grow the draft tree from ``state`` (SGLang's ranking by cumulative draft probability).

    Step 0 takes the top-k of the draft's distribution after the root; each later step
    runs the draft on the k frontier nodes, expands each by its top-k, and keeps the k
    best of the k*k by cumulative probability. The tree is the root plus the T-1 best
    of all scored nodes, in scoring order (so parents precede children).
    """
    s, k, t = cfg.num_steps, cfg.topk, cfg.num_draft_tokens
    b = state.root.shape[0]
    seq = state.seq_lens
    rows = jnp.arange(b)[:, None]
    probs = jax.nn.softmax(draft.logits(state.draft_hidden), axis=-1)  # [B, Vd]
    f_scores, f_ids = jax.lax.top_k(probs, k)  # frontier [B, k]
    f_tokens = draft.draft_to_target(f_ids)
    f_hidden = jnp.broadcast_to(state.draft_hidden[:, None], (b, k, state.draft_hidden.shape[-1]))
    f_flat = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))  # flat node ids
    n_scratch = max(cfg.scratch_slots, 1)
    f_anc = jnp.zeros((b, k, n_scratch), bool)  # scratch slots of each frontier node's ancestors
    all_scores, all_tokens, all_parent = [f_scores], [f_tokens], [jnp.full((b, k), -1, jnp.int32)]
    all_depth = [jnp.ones((b, k), jnp.int32)]
    s_len = cache.max_len
    base = k
    for step in range(1, s):
        # Frontier nodes have depth `step`; write them to scratch slots (step-1)*k + j.
        own = (step - 1) * k + jnp.arange(k)
        slots = seq[:, None] + own[None, :]  # [B, k]
        pos = seq[:, None] + step - 1
        pos = jnp.broadcast_to(pos, (b, k))
        anc = f_anc | jax.nn.one_hot(own, n_scratch, dtype=bool)[None]
        rel = jnp.arange(s_len)[None, None, :] - seq[:, None, None]  # [B, 1, S]
        in_scratch = (rel >= 0) & (rel < n_scratch)
        mask = (rel < 0) | (in_scratch & jnp.take_along_axis(anc, jnp.clip(rel, 0, n_scratch - 1).repeat(k, 1), axis=2))
        h, cache = draft(f_tokens, f_hidden, pos, cache, slots, mask)
        p = jax.nn.softmax(draft.logits(h), axis=-1)  # [B, k, Vd]
        c_scores, c_ids = jax.lax.top_k(p, k)  # [B, k, k]
        cum = (f_scores[:, :, None] * c_scores).reshape(b, k * k)
        c_tokens = draft.draft_to_target(c_ids).reshape(b, k * k)
        c_parent = jnp.repeat(f_flat, k, axis=1)  # parent flat id of each child
        all_scores.append(cum)
        all_tokens.append(c_tokens)
        all_parent.append(c_parent)
        all_depth.append(jnp.full((b, k * k), step + 1, jnp.int32))
        # The next frontier: the k best children.
        f_scores, pick = jax.lax.top_k(cum, k)
        src = pick // k  # which frontier node each comes from
        f_tokens = jnp.take_along_axis(c_tokens, pick, axis=1)
        f_hidden = jnp.take_along_axis(h, src[:, :, None], axis=1)
        f_anc = jnp.take_along_axis(anc, src[:, :, None], axis=1)
        f_flat = base + pick
        base += k * k
    scores = jnp.concatenate(all_scores, axis=1)  # [B, N]
    tokens = jnp.concatenate(all_tokens, axis=1)
    parent_flat = jnp.concatenate(all_parent, axis=1)
    depth = jnp.concatenate(all_depth, axis=1)
    # Keep the T-1 best; sorted by flat id, every parent precedes its children (a
    # child's cumulative score never exceeds its parent's, and top_k breaks ties by
    # the lower index, which the parent has).
    _, sel = jax.lax.top_k(scores, t - 1)
    sel = jnp.sort(sel, axis=1)
    sel_parent = jnp.take_along_axis(parent_flat, sel, axis=1)
    # Parent slot = 1 + index of the parent's flat id within `sel`; -1 -> root (slot 0).
    match = sel[:, None, :] == sel_parent[:, :, None]  # [B, T-1, T-1]
    parent_slot = jnp.where(sel_parent < 0, 0, 1 + jnp.argmax(match, axis=-1))
    tree = Tree(
        tokens=jnp.concatenate([state.root[:, None], jnp.take_along_axis(tokens, sel, axis=1)], axis=1).astype(jnp.int32),
        parents=jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), parent_slot.astype(jnp.int32)], axis=1),
        depths=jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.take_along_axis(depth, sel, axis=1)], axis=1),
    )
    del rows
    return tree, cache


def apply_oracle(
    tree: Tree,
    reference: Int[Array, "B L"],
    seq_lens: Int[Array, "B"],
    noise_u: Float[Array, "B T"],
    noise: float,
    vocab_size: int,
) -> Tree:
    """Replace draft tokens by an oracle's: the first child along the reference path gets
    the reference token (unless ``noise_u < noise``, then a wrong one).

    ``reference[b]`` is the full token sequence the target is known to produce (prompt
    plus its greedy continuation), so with ``noise = 0`` every draft is accepted: the
    oracle proposer exercises full acceptance; with noise, partial acceptance.
    """
    b, t = tree.tokens.shape
    rows = jnp.arange(b)[:, None]
    want = reference[rows, jnp.clip(seq_lens[:, None] + tree.depths, 0, reference.shape[1] - 1)]
    first_child, _ = tree_links(tree.parents)
    parent = jnp.maximum(tree.parents, 0)
    is_first = jnp.take_along_axis(first_child, parent, axis=1) == jnp.arange(t)[None, :]
    on_path = jnp.zeros((b, t), bool).at[:, 0].set(True)
    for slot in range(1, t):  # parents precede children
        on_path = on_path.at[:, slot].set(on_path[rows[:, 0], parent[:, slot]] & is_first[:, slot])
    wrong = (want + 1) % vocab_size
    tokens = jnp.where(on_path, jnp.where(noise_u < noise, wrong, want), tree.tokens)
    return Tree(tokens=tokens.at[:, 0].set(tree.tokens[:, 0]), parents=tree.parents, depths=tree.depths)


def verify_mask(seq_lens: Int[Array, "B"], tree_mask: Bool[Array, "B T T"], max_len: int) -> Bool[Array, "B T S"]:
    """Tree queries see the committed prefix plus their ancestors at slots ``seq_len + t``."""
    t = tree_mask.shape[1]
    rel = jnp.arange(max_len)[None, None, :] - seq_lens[:, None, None]  # [B, 1, S]
    in_tree = (rel >= 0) & (rel < t)
    inside = jnp.take_along_axis(tree_mask, jnp.broadcast_to(jnp.clip(rel, 0, t - 1), (tree_mask.shape[0], t, max_len)), axis=2)
    return (rel < 0) | (in_tree & inside)


def prefix_causal_mask(seq_lens: Int[Array, "B"], width: int, max_len: int) -> Bool[Array, "B W S"]:
    """Row i of a block written at ``seq_len + i`` sees slots ``<= seq_len + i``."""
    last = seq_lens[:, None] + jnp.arange(width)[None, :]
    return jnp.arange(max_len)[None, None, :] <= last[:, :, None]


# ----------------------------------------------------------------------------- step pieces


def _move_accepted_kv(cache: KVCache, seq_lens, accept_index, accept_length) -> KVCache:
    """Tree commit: KV at ``seq_len + accept_index[i]`` moves to ``seq_len + i``."""
    b, w = accept_index.shape
    rows = jnp.arange(b)[:, None]
    i = jnp.arange(w)[None, :]
    src = seq_lens[:, None] + jnp.maximum(accept_index, 0)
    dst = jnp.where(i < accept_length[:, None], seq_lens[:, None] + i, cache.max_len)  # past the end: dropped
    # accept_index[i] >= i, so reading every source before writing is safe.
    move = lambda c: c.at[rows, dst].set(c[rows, src], mode="drop")  # noqa: E731
    return KVCache(k=[move(c) for c in cache.k], v=[move(c) for c in cache.v])


def _draft_extend(draft: Eagle3Draft, cache: KVCache, tokens, features, seq_lens, keep_row):
    """Run the draft over W new (token, target feature) pairs at ``seq_len + i``.

    Returns the pre-norm output at ``keep_row`` ([B, H]) and the cache.
    """
    b, w = tokens.shape
    slots = seq_lens[:, None] + jnp.arange(w)[None, :]
    h, cache = draft(
        jnp.maximum(tokens, 0), draft.fuse(features), slots, cache, slots,
        prefix_causal_mask(seq_lens, w, cache.max_len),
    )
    return h[jnp.arange(b), keep_row], cache


def verify_tree(
    target: LlamaModel, cache: KVCache, seq_lens: Int[Array, "B"], tree: Tree, *, tree_attention_impl: str | None = None
) -> tuple[Float[Array, "B T V"], Float[Array, "B T F"], KVCache]:
    """Target forward over the tree tokens of every sequence (ancestor-only mask).

    Writes the tree's KV at slots ``seq_len + t``; returns (logits, features, cache).
    ``tree_attention_impl`` None attends with a dense ``[B, T, S]`` mask in XLA; otherwise
    with ``pallas_kernels.tree_attention`` in that mode (the GPU path).
    """
    t = tree.tokens.shape[1]
    slots = seq_lens[:, None] + jnp.arange(t)[None, :]
    tmask = tree_ancestor_mask(tree.parents)
    if tree_attention_impl is None:
        mask, ta = verify_mask(seq_lens, tmask, cache.max_len), None
    else:
        mask, ta = None, TreeAttention(seq_lens, tmask, tree_attention_impl)
    h, feats, cache = target(tree.tokens, seq_lens[:, None] + tree.depths, cache, slots, mask, return_features=True, tree=ta)
    return target.logits(h), feats, cache


def accept_tree(
    logits: Float[Array, "B T V"],
    tree: Tree,
    seq_lens: Int[Array, "B"],
    samp: SamplingArrays,
    cfg: SpeculativeConfig,
    *,
    greedy_only: bool,
    kernel_impl: str,
):
    """Greedy verification, or exact tree speculative sampling with per-row settings.

    Returns ``(accept_index [B, S+1], accept_length [B], out_tokens [B, S+1])``.
    """
    if greedy_only:
        return verify_greedy(
            tree.tokens, tree.parents, jnp.argmax(logits, -1).astype(jnp.int32),
            max_depth=cfg.num_steps, impl=kernel_impl,
        )
    b, t, v = logits.shape
    rep = lambda x: jnp.repeat(x, t, axis=0)  # noqa: E731
    # Greedy rows get one-hot probabilities, so sampling verification is exact for them too.
    probs = target_probs(logits.reshape(b * t, v), rep(samp.temperature), rep(samp.top_k), rep(samp.top_p))
    if cfg.sampling_verify == "coupled":
        # The token after slot t sits at position seq_len + depth(t) + 1.
        u = position_uniforms(samp.key, seq_lens[:, None] + tree.depths + 1)  # [B, T]
        draws = inverse_cdf_sample(probs, u.reshape(-1)).reshape(b, t)
        return verify_greedy(tree.tokens, tree.parents, draws, max_depth=cfg.num_steps, impl=kernel_impl)
    coin_key, bonus_key = _step_keys(samp, seq_lens)
    # Coins in (0, 1]: a coin of exactly 0 would accept a zero-probability child.
    coins = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, (t,)))(coin_key)
    bonus_u = jax.vmap(lambda k: jax.random.uniform(k, ()))(bonus_key)
    return tree_speculative_sample(
        tree.tokens, tree.parents, probs.reshape(b, t, v), coins, bonus_u,
        max_depth=cfg.num_steps, threshold_single=cfg.threshold_single,
        threshold_acc=cfg.threshold_acc, impl=kernel_impl,
    )


def commit_accepted(cache: KVCache, feats, seq_lens, accept_index, accept_length, cfg: SpeculativeConfig):
    """Make the accepted path contiguous in the target cache (trees only) and gather the
    target features of the accepted slots ``[B, S+1, F]`` for the draft extend."""
    if not cfg.is_chain:
        cache = _move_accepted_kv(cache, seq_lens, accept_index, accept_length)
    return cache, jnp.take_along_axis(feats, jnp.maximum(accept_index, 0)[:, :, None], axis=1)


def _step_keys(samp: SamplingArrays, seq_lens):
    """Per-row uniforms for this step, from the request's key at its position."""
    keys = position_keys(samp.key, seq_lens)
    coin_key = jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys)
    bonus_key = jax.vmap(lambda k: jax.random.fold_in(k, 2))(keys)
    return coin_key, bonus_key


def draft_phase_impl(
    target: LlamaModel, draft: Eagle3Draft, state: SpecState, samp: SamplingArrays, oracle=None, *,
    cfg: SpeculativeConfig, oracle_noise: float = 0.0,
) -> tuple[Tree, KVCache]:
    """The draft phase of a speculative step: grow the tree (``draft_tree``) and, with an
    ``oracle``, substitute its tokens (``apply_oracle``).

    Reads ``state.draft_cache``, ``state.draft_hidden``, ``state.seq_lens``, ``state.root``
    (and ``target.config`` only for the oracle's vocabulary); the target cache is untouched.

    Returns ``(tree, draft_cache)``: the ``Tree`` (``tokens``/``parents``/``depths``, each
    ``[B, T]``, slot 0 the root) and the draft cache with the tree nodes' draft KV written
    into the scratch slots above the prefix (same shapes as ``state.draft_cache``).
    """
    seq = state.seq_lens
    with jax.named_scope("draft"):
        tree, dcache = draft_tree(draft, state.draft_cache, state, cfg)
        if oracle is not None:
            noise_key = jax.vmap(lambda k: jax.random.fold_in(k, 3))(position_keys(samp.key, seq))
            noise_u = jax.vmap(lambda k: jax.random.uniform(k, (cfg.num_draft_tokens,)))(noise_key)
            tree = apply_oracle(tree, oracle, seq, noise_u, oracle_noise, target.config.vocab_size)
    return tree, dcache


def verify_phase_impl(
    target: LlamaModel, draft: Eagle3Draft, state: SpecState, tree: Tree, draft_cache: KVCache, samp: SamplingArrays, *,
    cfg: SpeculativeConfig, greedy_only: bool, max_seq_len: int, kernel_impl: str = "auto", check_finite: bool = False,
):
    """The verify phase of a speculative step: verify the tree with the target, accept,
    commit the accepted path, and run the draft extend over the emitted tokens.

    ``tree`` and ``draft_cache`` are what ``draft_phase_impl`` returned for ``state``
    (``state.draft_cache`` itself is not read). Returns what ``speculative_step_impl``
    returns: ``(state, out_tokens [B, S+1] (-1 padded), accept_length [B], finite [B] or None)``.
    """
    seq = state.seq_lens
    with jax.named_scope("verify"):
        # On GPUs the verify forward attends with the tree-attention kernel (it falls back
        # to XLA for shapes it does not support); on CPU the dense-mask XLA path is faster.
        on_gpu = jax.default_backend() == "gpu" and kernel_impl != "reference"
        logits, feats, tcache = verify_tree(
            target, state.target_cache, seq, tree, tree_attention_impl="auto" if on_gpu else None
        )
    with jax.named_scope("accept"):
        acc_index, acc_len, out = accept_tree(logits, tree, seq, samp, cfg, greedy_only=greedy_only, kernel_impl=kernel_impl)
    with jax.named_scope("commit"):
        tcache, acc_feats = commit_accepted(tcache, feats, seq, acc_index, acc_len, cfg)
    with jax.named_scope("draft_extend"):
        g, dcache = _draft_extend(draft, draft_cache, out, acc_feats, seq, acc_len - 1)
    new_state = SpecState(
        target_cache=tcache,
        draft_cache=dcache,
        # Finished rows keep running until the batch ends; clamp keeps their writes in range.
        seq_lens=jnp.minimum(seq + acc_len, max_seq_len),
        root=out[jnp.arange(out.shape[0]), acc_len - 1],
        draft_hidden=g,
    )
    return new_state, out, acc_len, _finite_rows(logits) if check_finite else None


def speculative_step_impl(
    target: LlamaModel, draft: Eagle3Draft, state: SpecState, samp: SamplingArrays, oracle=None, *,
    cfg: SpeculativeConfig, greedy_only: bool, max_seq_len: int, kernel_impl: str = "auto",
    oracle_noise: float = 0.0, check_finite: bool = False,
):
    """One speculative step: draft, verify, accept, commit, draft extend — the draft
    phase then the verify phase, traced into one graph (the default, fused step).

    ``oracle`` (``[B, L]``, optional): reference sequences that replace the draft's
    proposals (see ``apply_oracle``), for measuring the machinery at a chosen acceptance.

    Returns ``(state, out_tokens [B, S+1] (-1 padded), accept_length [B], finite)``; the
    emitted tokens of row b are ``out_tokens[b, :accept_length[b]]``; ``finite`` ([B],
    only with ``check_finite``) says whether the row's verify logits were all finite.
    """
    tree, dcache = draft_phase_impl(target, draft, state, samp, oracle, cfg=cfg, oracle_noise=oracle_noise)
    return verify_phase_impl(
        target, draft, state, tree, dcache, samp, cfg=cfg, greedy_only=greedy_only, max_seq_len=max_seq_len,
        kernel_impl=kernel_impl, check_finite=check_finite,
    )


def plain_step_impl(
    target: LlamaModel, draft: Eagle3Draft | None, state: SpecState, samp: SamplingArrays, *,
    greedy_only: bool, max_seq_len: int, check_finite: bool = False,
):
    """A non-speculative step; with a draft (not None) it keeps the draft in
    sync by a 1-token draft extend, so speculation can resume without losing acceptance.

    Returns ``(state, out_tokens [B, 1], accept_length [B] = 1, finite [B] or None)``.
    """
    seq = state.seq_lens
    pos = seq[:, None]
    h, feats, tcache = target(
        state.root[:, None], pos, state.target_cache, pos,
        prefix_causal_mask(seq, 1, state.target_cache.max_len), return_features=draft is not None,
    )
    logits = target.logits(h[:, 0])
    nxt = sample_tokens(logits, samp, seq + 1, greedy_only=greedy_only)
    g, dcache = None, None
    if draft is not None:
        g, dcache = _draft_extend(draft, state.draft_cache, nxt[:, None], feats, seq, jnp.zeros_like(seq))
    new_state = SpecState(tcache, dcache, jnp.minimum(seq + 1, max_seq_len), nxt, g)
    return new_state, nxt[:, None], jnp.ones_like(seq), _finite_rows(logits) if check_finite else None


def _finite_rows(logits: Float[Array, "B ... V"]) -> Bool[Array, "B"]:
    return jnp.all(jnp.isfinite(logits).reshape(logits.shape[0], -1), axis=-1)


def prefill_impl(
    target: LlamaModel, draft: Eagle3Draft | None, state: SpecState, tokens: Int[Array, "B P"], lengths: Int[Array, "B"],
    samp: SamplingArrays, *, greedy_only: bool,
):
    """Prefill the target and (when there is one) the draft; ``state`` holds zeroed
    caches. Returns (state, first token [B])."""
    b, p = tokens.shape
    rows = jnp.arange(b)
    zeros = jnp.zeros((b,), jnp.int32)
    h, feats, tcache = target(
        tokens, jnp.broadcast_to(jnp.arange(p), (b, p)), state.target_cache,
        jnp.broadcast_to(jnp.arange(p), (b, p)), prefix_causal_mask(zeros, p, state.target_cache.max_len),
        return_features=draft is not None,
    )
    first = sample_tokens(target.logits(h[rows, lengths - 1]), samp, lengths, greedy_only=greedy_only)
    if draft is None:
        return SpecState(tcache, None, lengths, first, None), first
    # Draft pairs f_p with x_{p+1}: shift the prompt left and put the new token at len-1.
    shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)
    shifted = shifted.at[rows, lengths - 1].set(first)
    g, dcache = _draft_extend(draft, state.draft_cache, shifted, feats, zeros, lengths - 1)
    return SpecState(tcache, dcache, lengths, first, g), first


class SpecSteps:
    """Prefill, speculative step and plain step compiled for one target/draft pair.

    The parameters are bound once (``BoundModules``); every call donates the state.
    Static per call: ``greedy_only`` and ``max_seq_len`` (ints and bools hash cheaply).

    ``speculative`` is the fused step (one graph). ``draft_phase`` then ``verify_phase``
    run the same computation as two graphs, so the host can time each phase (with a
    device sync between them, which the fused step does not pay).

    Args:
      target, draft: the models (``draft`` None: plain steps only).
      spec: the draft shape for ``speculative``.
      kernel_impl: verification kernels, "auto" / "kernel" / "reference".
      check_finite: steps also return per-row "logits were finite" flags.
    """

    def __init__(self, target: LlamaModel, draft: Eagle3Draft | None, spec: SpeculativeConfig | None, *,
                 kernel_impl: str = "auto", check_finite: bool = False):
        bound = BoundModules(target, draft)
        self.params = bound.params

        def prefill(params, state, tokens, lengths, samp, *, greedy_only):
            t, d = bound.modules(params)
            return prefill_impl(t, d, state, tokens, lengths, samp, greedy_only=greedy_only)

        def prefill_new(params, tokens, lengths, samp, *, greedy_only, max_seq_len):
            # The zeroed caches are made inside the graph: made eagerly, each array is an
            # op that queues behind the running step and stalls the host.
            t, d = bound.modules(params)
            state = new_state(t, d, spec or SpeculativeConfig(num_steps=1), tokens.shape[0], max_seq_len)
            return prefill_impl(t, d, state, tokens, lengths, samp, greedy_only=greedy_only)

        def speculative(params, state, samp, oracle=None, *, greedy_only, max_seq_len, oracle_noise=0.0):
            t, d = bound.modules(params)
            return speculative_step_impl(
                t, d, state, samp, oracle, cfg=spec, greedy_only=greedy_only, max_seq_len=max_seq_len,
                kernel_impl=kernel_impl, oracle_noise=oracle_noise, check_finite=check_finite,
            )

        def draft_phase(params, draft_cache, state, samp, oracle=None, *, oracle_noise=0.0):
            # The draft cache comes apart from the rest of the state so that only it is
            # donated: the target cache passes through this phase untouched.
            t, d = bound.modules(params)
            state = dataclasses.replace(state, draft_cache=draft_cache)
            return draft_phase_impl(t, d, state, samp, oracle, cfg=spec, oracle_noise=oracle_noise)

        def verify_phase(params, state, tree, samp, *, greedy_only, max_seq_len):
            t, d = bound.modules(params)
            return verify_phase_impl(
                t, d, state, tree, state.draft_cache, samp, cfg=spec, greedy_only=greedy_only, max_seq_len=max_seq_len,
                kernel_impl=kernel_impl, check_finite=check_finite,
            )

        def plain(params, state, samp, *, greedy_only, max_seq_len):
            t, d = bound.modules(params)
            return plain_step_impl(t, d, state, samp, greedy_only=greedy_only, max_seq_len=max_seq_len, check_finite=check_finite)

        donate = dict(donate_argnames=("state",))
        self._prefill = jax.jit(prefill, static_argnames=("greedy_only",), **donate)
        self._prefill_new = jax.jit(prefill_new, static_argnames=("greedy_only", "max_seq_len"))
        self._speculative = jax.jit(speculative, static_argnames=("greedy_only", "max_seq_len", "oracle_noise"), **donate)
        self._draft_phase = jax.jit(draft_phase, static_argnames=("oracle_noise",), donate_argnames=("draft_cache",))
        self._verify_phase = jax.jit(verify_phase, static_argnames=("greedy_only", "max_seq_len"), **donate)
        self._plain = jax.jit(plain, static_argnames=("greedy_only", "max_seq_len"), **donate)
        self.has_draft = draft is not None
        self.spec = spec

    def prefill(self, state: SpecState, tokens, lengths, samp: SamplingArrays, *, greedy_only: bool):
        """(state, first token [B])."""
        return self._prefill(self.params, state, tokens, lengths, samp, greedy_only=greedy_only)

    def prefill_new(self, tokens, lengths, samp: SamplingArrays, *, greedy_only: bool, max_seq_len: int):
        """``prefill`` into a fresh state sized for ``max_seq_len``: (state, first token [B])."""
        return self._prefill_new(self.params, tokens, lengths, samp, greedy_only=greedy_only, max_seq_len=max_seq_len)

    def speculative(self, state: SpecState, samp: SamplingArrays, oracle=None, *, greedy_only: bool, max_seq_len: int, oracle_noise: float = 0.0):
        """(state, out_tokens [B, S+1], accept_length [B], finite [B] or None)."""
        return self._speculative(self.params, state, samp, oracle, greedy_only=greedy_only, max_seq_len=max_seq_len, oracle_noise=oracle_noise)

    def draft_phase(self, state: SpecState, samp: SamplingArrays, oracle=None, *, oracle_noise: float = 0.0):
        """The first half of ``speculative``: ``(state, tree)``, where the returned state
        holds the drafted draft cache (the input state's draft cache is donated) and
        ``tree`` is the ``Tree`` ([B, T] tokens, parents, depths) to pass to ``verify_phase``."""
        rest = dataclasses.replace(state, draft_cache=None)
        tree, dcache = self._draft_phase(self.params, state.draft_cache, rest, samp, oracle, oracle_noise=oracle_noise)
        return dataclasses.replace(state, draft_cache=dcache), tree

    def verify_phase(self, state: SpecState, tree: Tree, samp: SamplingArrays, *, greedy_only: bool, max_seq_len: int):
        """The second half of ``speculative``, on ``draft_phase``'s ``(state, tree)``:
        (state, out_tokens [B, S+1], accept_length [B], finite [B] or None)."""
        return self._verify_phase(self.params, state, tree, samp, greedy_only=greedy_only, max_seq_len=max_seq_len)

    def plain(self, state: SpecState, samp: SamplingArrays, *, greedy_only: bool, max_seq_len: int):
        """(state, out_tokens [B, 1], accept_length [B] = 1, finite [B] or None)."""
        return self._plain(self.params, state, samp, greedy_only=greedy_only, max_seq_len=max_seq_len)


# ----------------------------------------------------------------------------- host API


def speculative_generate(
    target: LlamaModel,
    draft: Eagle3Draft,
    prompts: Sequence[Sequence[int]],
    spec: SpeculativeConfig = SpeculativeConfig(),
    params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    *,
    tokenizer=None,
    buckets: Buckets = Buckets(),
    max_seq_len: int | None = None,
) -> list["SpecCompletion"]:
    """One-call speculative generation for experiments: tokens, text and the accept
    length of every step per prompt (the engine drives the same compiled step)."""
    gen = SpeculativeGenerator(target, draft, spec, tokenizer, buckets=buckets, max_seq_len=max_seq_len)
    return gen.generate(prompts, params)


@dataclasses.dataclass
class SpecCompletion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    tokens_per_second: float
    accept_lengths: list[int]

    @property
    def mean_accept_length(self) -> float:
        return float(np.mean(self.accept_lengths)) if self.accept_lengths else 0.0


def new_state(target: LlamaModel, draft: Eagle3Draft | None, cfg: SpeculativeConfig, batch: int, max_seq_len: int) -> SpecState:
    """Zeroed state: target cache with room for one tree past ``max_seq_len``, draft cache
    with room for the drafting scratch slots too (no draft: no draft fields)."""
    t_len = max_seq_len + cfg.num_draft_tokens
    d_len = max_seq_len + max(cfg.num_draft_tokens, cfg.max_accept, cfg.scratch_slots + 1)
    return SpecState(
        target_cache=KVCache.zeros(target.config, batch, t_len, target.dtype),
        draft_cache=None if draft is None else KVCache.zeros(draft.config.layer_config, batch, d_len, target.dtype),
        seq_lens=jnp.zeros((batch,), jnp.int32),
        root=jnp.zeros((batch,), jnp.int32),
        draft_hidden=None if draft is None else jnp.zeros((batch, draft.config.hidden_size), target.dtype),
    )


class SpeculativeGenerator:
    """Speculative generation with a target and an EAGLE-3 draft (experiment-level API).

    Args:
      target, draft: loaded models (checked for compatibility).
      spec: the draft shape; ``None`` runs the plain step (draft kept in sync).
      tokenizer: optional, for text and stop strings.
      buckets: batch, prompt and cache buckets.
      max_seq_len: context limit.
      kernel_impl: verification kernels: "auto" (Pallas on GPU, XLA reference on CPU),
        "kernel" or "reference".
    """

    def __init__(
        self, target: LlamaModel, draft: Eagle3Draft, spec: SpeculativeConfig | None, tokenizer=None, *,
        buckets: Buckets = Buckets(), max_seq_len: int | None = None, kernel_impl: str = "auto",
    ):
        check_compatible(draft.config, target.config)
        limit = min(target.config.max_position_embeddings, buckets.cache[-1])
        if max_seq_len is not None and not 1 < max_seq_len <= limit:
            raise ConfigError(f"max_seq_len={max_seq_len} must be in [2, {limit}]")
        if kernel_impl not in ("auto", "kernel", "reference"):
            raise ConfigError(f"kernel_impl={kernel_impl!r}; valid: auto, kernel, reference")
        self.target, self.draft, self.spec = target, draft, spec
        self.tokenizer = tokenizer
        self.buckets = buckets
        self.max_seq_len = max_seq_len or limit
        self.kernel_impl = kernel_impl
        self.eos_ids = tuple(tokenizer.eos_token_ids) if tokenizer is not None else target.config.eos_token_ids
        self.steps = SpecSteps(target, draft, spec, kernel_impl=kernel_impl)
        self.draft_width = spec.num_draft_tokens if spec is not None else 1
        self._compiled: set[tuple] = set()

    def compile(self, batch: int, prompt_len: int, cache_len: int, greedy_only: bool, with_oracle: bool = False) -> None:
        """Compile prefill and the step for one shape by running them once on dummy input."""
        key = (batch, prompt_len, cache_len, greedy_only, with_oracle)
        if key in self._compiled:
            return
        samp = SamplingArrays.build([], batch)
        state = new_state(self.target, self.draft, self.spec or SpeculativeConfig(num_steps=1), batch, cache_len)
        state, _ = self.steps.prefill(
            state, jnp.zeros((batch, prompt_len), jnp.int32), jnp.ones((batch,), jnp.int32), samp, greedy_only=greedy_only
        )
        oracle = jnp.zeros((batch, cache_len + self.draft_width), jnp.int32) if with_oracle else None
        self.step(state, samp, greedy_only, cache_len, oracle)[1].block_until_ready()
        self._compiled.add(key)

    def step(self, state, samp, greedy_only, max_seq_len, oracle=None, oracle_noise=0.0):
        if self.spec is None:
            return self.steps.plain(state, samp, greedy_only=greedy_only, max_seq_len=max_seq_len)
        return self.steps.speculative(
            state, samp, oracle, greedy_only=greedy_only, max_seq_len=max_seq_len, oracle_noise=oracle_noise
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        *,
        on_text=None,
        oracle: Sequence[Sequence[int]] | None = None,
        oracle_noise: float = 0.0,
    ) -> list[SpecCompletion]:
        """Generate for every prompt (token ids).

        Args:
          oracle: per prompt, the full sequence (prompt + continuation) the target is
            known to produce greedily; its tokens replace the draft's proposals
            (``apply_oracle``), with a fraction ``oracle_noise`` made wrong.
        """
        params = normalize_params(prompts, params)
        if oracle is not None and len(oracle) != len(prompts):
            raise InputError(f"{len(prompts)} prompts but {len(oracle)} oracle sequences")
        if not 0 <= oracle_noise <= 1:
            raise InputError(f"oracle_noise={oracle_noise} must be in [0, 1]")
        for i, p in enumerate(prompts):
            check_prompt(i, p, self.max_seq_len, self.target.config.vocab_size)
        out = []
        step = self.buckets.batch[-1]
        for start in range(0, len(prompts), step):
            idx = list(range(start, min(start + step, len(prompts))))
            ref = None if oracle is None else [list(oracle[i]) for i in idx]
            out.extend(self._generate_batch([list(prompts[i]) for i in idx], [params[i] for i in idx], idx, on_text, ref, oracle_noise))
        return out

    def _generate_batch(self, prompts, params, indices, on_text, oracle, oracle_noise):
        pb = PaddedBatch.build(self.buckets, prompts, params, self.max_seq_len)
        b = pb.batch
        reqs = [
            RequestProgress(i, p, sp, self.eos_ids, min(sp.max_new_tokens, pb.cache_len - len(p)), self.tokenizer, on_text)
            for i, p, sp in zip(indices, prompts, params)
        ]
        accepts: list[list[int]] = [[] for _ in reqs]
        greedy_only = all(sp.greedy for sp in params)
        samp = SamplingArrays.build(params, b)
        self.compile(b, pb.prompt_len, pb.cache_len, greedy_only, oracle is not None)
        state = new_state(self.target, self.draft, self.spec or SpeculativeConfig(num_steps=1), b, pb.cache_len)
        ref = None
        if oracle is not None:
            width = pb.cache_len + self.draft_width
            ref_np = np.zeros((b, width), np.int32)
            for i, seq in enumerate(oracle):
                ref_np[i, : min(len(seq), width)] = seq[:width]
            ref = jnp.asarray(ref_np)
        t0 = time.perf_counter()
        state, first = self.steps.prefill(state, jnp.asarray(pb.tokens), jnp.asarray(pb.lengths), samp, greedy_only=greedy_only)
        pending = (first[:, None], jnp.ones((b,), jnp.int32))
        first_step = True
        while True:
            state, out, acc, _ = self.step(state, samp, greedy_only, pb.cache_len, ref, oracle_noise)  # dispatched before reading
            host_out, host_acc = np.asarray(pending[0]), np.asarray(pending[1])
            for i, r in enumerate(reqs):
                if r.finish_reason is not None:
                    continue
                if not first_step:
                    accepts[i].append(int(host_acc[i]))
                for tok in host_out[i, : host_acc[i]]:
                    r.push(int(tok))
                    if r.finish_reason is not None:
                        break
            first_step = False
            if all(r.finish_reason is not None for r in reqs):
                break
            pending = (out, acc)
        return [
            SpecCompletion(r.prompt, r.tokens, r.final_text(self.tokenizer), r.finish_reason,
                           len(r.tokens) / max(r.end_time - t0, 1e-9), a)
            for r, a in zip(reqs, accepts)
        ]
