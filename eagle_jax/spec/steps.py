"""EAGLE-3 speculative decoding: drafting, verification, commit and draft extend as one
static-shape jitted step per batch bucket (SGLang's "spec v2" scheme).

State carried between steps (``SpecState``), per sequence b:

- ``seq_lens[b]``: tokens committed to both KV caches (slots ``0 .. seq_lens-1``);
- ``root[b]``: the last emitted token, not yet run through the target; it is the root
  (slot 0) of the next tree;
- ``draft_hidden[b]``: the draft's pre-norm output for the row that consumed ``root``;
  its logits propose the token after ``root``.

Conventions (those of the EAGLE-3 reference code and SGLang; docs/architecture.md):

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

Which kernels a step runs (verify kernels, tree attention, the CPU prefix-attention
kernel, the mesh the Pallas kernels run ``shard_map`` over) is the execution plan's:
every step function takes ``plan=`` (``kernels.plan.ExecutionPlan``, resolved once by
``runtime.plan.resolve_plan``; default ``XLA_PLAN``) and hands it to the forwards.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from eagle_jax.models.draft import Eagle3Draft
from eagle_jax.spec.config import DRAFT_SYNC_MODES, SAMPLING_VERIFY, SpeculativeConfig  # noqa: F401  (re-exported)
from eagle_jax.models.llama import KVCache, PrefixMask, TreeAttention, write_rows
from eagle_jax.kernels.plan import XLA_PLAN, ExecutionPlan
from eagle_jax.kernels.sharded import shard_rows
from eagle_jax.validate import is_int
from eagle_jax.models.target import ArraySpec, TargetModel, cache_len, slot_axis
from eagle_jax.spec.sampling import (
    SamplingArrays,
    inverse_cdf_sample,
    position_keys,
    position_uniforms,
    sample_tokens,
    target_probs,
)
from pallas_kernels.tree import tree_ancestor_mask
from pallas_kernels.verify_greedy import verify_greedy
from pallas_kernels.verify_sampling import tree_speculative_sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
    target_cache: KVCache
    draft_cache: KVCache
    seq_lens: Int[Array, "B"]
    root: Int[Array, "B"]
    draft_hidden: Float[Array, "B H"]
    # Deferred draft sync (``DraftSync``; all three None when the draft is kept in sync
    # eagerly): ``draft_len[b]`` positions have their draft KV written (the draft is in
    # sync when it equals ``seq_lens[b]``; ``draft_hidden`` is valid only then), and
    # position p < seq_len of row b waits with its draft input: the fused target feature
    # ``pending_hidden[b, p]`` (``draft.fuse`` of f_p) and the token x_{p+1}
    # ``pending_tokens[b, p]``. Prefill and plain steps write them instead of running the
    # draft; the next speculative step catches up first (``catch_up_draft``).
    draft_len: Int[Array, "B"] | None = None
    pending_hidden: Float[Array, "B L H"] | None = None
    pending_tokens: Int[Array, "B L"] | None = None

    @property
    def deferred(self) -> bool:
        return self.draft_len is not None


@dataclasses.dataclass(frozen=True)
class DraftSync:
    """How the draft follows the target on steps that do not speculate.

    - ``eager``: prefill runs the draft over the prompt and every plain step runs a
      1-token draft extend, so the draft is always ready (no extra memory).
    - ``deferred``: prefill and plain steps only store the draft's inputs (one fused
      feature of the draft's width and one token per position, ``[B, L, H]`` more
      state); the next speculative step first runs the draft over what is pending, in
      tiles of ``rows`` rows x ``width`` positions. A request that never speculates
      never pays for the draft, and a catch-up of n positions costs the FLOPs of the n
      extends it replaces while reading the draft's weights once per tile, not per token.
    """

    mode: str = "eager"
    rows: int = 8
    width: int = 16

    def __post_init__(self):
        if self.mode not in DRAFT_SYNC_MODES:
            raise ValueError(f"draft sync mode {self.mode!r}; valid: {', '.join(DRAFT_SYNC_MODES)}")
        if not (is_int(self.rows) and self.rows >= 1 and is_int(self.width) and self.width >= 1):
            raise ValueError(f"draft sync tile rows={self.rows!r} x width={self.width!r}: both integers >= 1")

    @property
    def deferred(self) -> bool:
        return self.mode == "deferred"


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
    plan: ExecutionPlan = XLA_PLAN,
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
    s_len = cache_len(cache)
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
        h, cache = draft(f_tokens, f_hidden, pos, cache, slots, mask, plan=plan)
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


def verify_mask(seq_lens: Int[Array, "B"], tree_mask: Bool[Array, "B T T"], max_len: int | None = None) -> PrefixMask:
    """Tree queries see the committed prefix plus their ancestors at slots ``seq_len + t``."""
    del max_len  # the structure does not depend on the cache length
    return PrefixMask(seq_lens, tree_mask)


def prefix_causal_mask(seq_lens: Int[Array, "B"], width: int, max_len: int | None = None) -> PrefixMask:
    """Row i of a block written at ``seq_len + i`` sees slots ``<= seq_len + i``."""
    del max_len
    return PrefixMask.causal(seq_lens, width)


# ----------------------------------------------------------------------------- step pieces


def _move_accepted_kv(cache, seq_lens, accept_index, accept_length):
    """Tree commit: the entry at slot ``seq_len + accept_index[i]`` moves to ``seq_len + i``,
    in every leaf of the target's cache (each ``[B, S, ...]``, the cache contract, or
    ``[B, L, S, ...]`` for a stacked one: ``target.slot_axis``)."""
    b, w = accept_index.shape
    rows = jnp.arange(b)[:, None]
    i = jnp.arange(w)[None, :]
    src = seq_lens[:, None] + jnp.maximum(accept_index, 0)
    dst = jnp.where(i < accept_length[:, None], seq_lens[:, None] + i, cache_len(cache))  # past the end: dropped
    # accept_index[i] >= i, so reading every source before writing is safe. Axes between
    # the row and the slot (a stacked cache's layers) move whole.
    between = (slice(None),) * (slot_axis(cache) - 1)
    return jax.tree.map(lambda c: c.at[(rows, *between, dst)].set(c[(rows, *between, src)], mode="drop"), cache)


def _draft_extend(draft: Eagle3Draft, cache: KVCache, tokens, features, seq_lens, keep_row, plan: ExecutionPlan = XLA_PLAN):
    """Run the draft over W new (token, target feature) pairs at ``seq_len + i``.

    Returns the pre-norm output at ``keep_row`` ([B, H]) and the cache.
    """
    b, w = tokens.shape
    slots = seq_lens[:, None] + jnp.arange(w)[None, :]
    h, cache = draft(
        jnp.maximum(tokens, 0), draft.fuse(features), slots, cache, slots,
        prefix_causal_mask(seq_lens, w, cache_len(cache)), plan=plan,
    )
    return h[jnp.arange(b), keep_row], cache


def _store_pending(state: SpecState, fused: Float[Array, "B W H"], tokens: Int[Array, "B W"], start: Int[Array, "B"]) -> tuple:
    """``pending_hidden/pending_tokens[b, start[b] + i] = fused/tokens[b, i]`` (positions
    past the buffer dropped): the draft inputs a deferred sync keeps for later."""
    w = tokens.shape[1]
    slots = start[:, None] + jnp.arange(w)[None, :]
    return (write_rows(state.pending_hidden, slots, fused), write_rows(state.pending_tokens, slots, tokens))


def catch_up_draft(draft: Eagle3Draft, state: SpecState, sync: DraftSync, plan: ExecutionPlan = XLA_PLAN) -> SpecState:
    """Run the draft over every pending position (``draft_len <= p < seq_len``), so the
    draft cache and ``draft_hidden`` are what eager syncing would have left. A no-op
    (one comparison) when nothing is pending; an eager state is returned as is.

    Loops on the device while any row is behind: each round takes the ``sync.rows`` rows
    furthest behind and runs the draft over their next ``sync.width`` positions (a row's
    positions past its ``seq_len`` compute but write nothing), so one freshly admitted
    request in a full batch costs its own positions, not the batch's."""
    if not state.deferred:
        return state
    b = state.seq_lens.shape[0]
    r, w = min(sync.rows, b), sync.width
    buf_len = state.pending_tokens.shape[1]
    big = cache_len(state.draft_cache)  # slots past the cache: writes dropped

    def behind(c):
        dlen, seq = c[2], state.seq_lens
        return jnp.any(dlen < seq)

    def round_(c):
        dcache, g, dlen = c
        _, rows = jax.lax.top_k(state.seq_lens - dlen, r)  # distinct rows, furthest behind first
        start = dlen[rows]
        n = jnp.clip(state.seq_lens[rows] - start, 0, w)
        pos = start[:, None] + jnp.arange(w)[None, :]
        take = jnp.clip(pos, 0, buf_len - 1)
        toks = jnp.take_along_axis(state.pending_tokens[rows], take, axis=1)
        hid = jnp.take_along_axis(state.pending_hidden[rows], take[:, :, None], axis=1)
        slots = jnp.where(jnp.arange(w)[None, :] < n[:, None], pos, big)
        sub = jax.tree.map(lambda x: x[rows], dcache)
        h, sub = draft(jnp.maximum(toks, 0), hid, pos, sub, slots, prefix_causal_mask(start, w, big), plan=plan)
        dcache = jax.tree.map(lambda x, y: x.at[rows].set(y), dcache, sub)
        last = h[jnp.arange(r), jnp.maximum(n - 1, 0)]
        g = g.at[rows].set(jnp.where((n > 0)[:, None], last.astype(g.dtype), g[rows]))
        return dcache, g, dlen.at[rows].add(n)

    with jax.named_scope("draft_catch_up"):
        dcache, g, dlen = jax.lax.while_loop(behind, round_, (state.draft_cache, state.draft_hidden, state.draft_len))
    return dataclasses.replace(state, draft_cache=dcache, draft_hidden=g, draft_len=dlen)


def verify_tree(
    target: TargetModel, cache, seq_lens: Int[Array, "B"], tree: Tree, *, plan: ExecutionPlan = XLA_PLAN
) -> tuple[Float[Array, "B T V"], Float[Array, "B T F"], object]:
    """Target forward over the tree tokens of every sequence (ancestor-only mask).

    Writes the tree's KV at slots ``seq_len + t``; returns (logits, features, cache).
    ``plan.tree_attention`` None attends through the target's ``PrefixMask`` path (the tree
    block under its ancestor mask, then the cached prefix block by block or in the CPU
    kernel, as ``plan.prefix_attention_for`` says); otherwise with
    ``pallas_kernels.tree_attention`` in that mode (the GPU path: on the H200 the block
    loop made an 8B plain step 2.3x a chain S=1 verify step, results/gpu/).
    """
    t = tree.tokens.shape[1]
    slots = seq_lens[:, None] + jnp.arange(t)[None, :]
    tmask = tree_ancestor_mask(tree.parents)
    if plan.tree_attention is None:
        mask, ta = verify_mask(seq_lens, tmask, cache_len(cache)), None
    else:
        mask, ta = None, TreeAttention(seq_lens, tmask, plan.tree_attention)
    h, feats, cache = target(tree.tokens, seq_lens[:, None] + tree.depths, cache, slots, mask, return_features=True, tree=ta,
                             plan=plan)
    return target.logits(h), feats, cache


def accept_tree(
    logits: Float[Array, "B T V"],
    tree: Tree,
    seq_lens: Int[Array, "B"],
    samp: SamplingArrays,
    cfg: SpeculativeConfig,
    *,
    greedy_only: bool,
    plan: ExecutionPlan = XLA_PLAN,
):
    """Greedy verification, or exact tree speculative sampling with per-row settings, with
    ``plan.verify_kernel`` (per device of ``plan.mesh`` on its rows).

    Returns ``(accept_index [B, S+1], accept_length [B], out_tokens [B, S+1])``.
    """

    def greedy(tokens, parents, picks):  # the verify kernel, per device on its rows under a mesh
        return verify_greedy(tokens, parents, picks, max_depth=cfg.num_steps, impl=plan.verify_kernel)

    if greedy_only:
        return shard_rows(greedy, tree.tokens, tree.parents, jnp.argmax(logits, -1).astype(jnp.int32), mesh=plan.mesh)
    b, t, v = logits.shape
    rep = lambda x: jnp.repeat(x, t, axis=0)  # noqa: E731
    # Greedy rows get one-hot probabilities, so sampling verification is exact for them too.
    probs = target_probs(logits.reshape(b * t, v), rep(samp.temperature), rep(samp.top_k), rep(samp.top_p))
    if cfg.sampling_verify == "coupled":
        # The token after slot t sits at position seq_len + depth(t) + 1.
        u = position_uniforms(samp.key, seq_lens[:, None] + tree.depths + 1)  # [B, T]
        draws = inverse_cdf_sample(probs, u.reshape(-1)).reshape(b, t)
        return shard_rows(greedy, tree.tokens, tree.parents, draws, mesh=plan.mesh)
    coin_key, bonus_key = _step_keys(samp, seq_lens)
    # Coins in (0, 1]: a coin of exactly 0 would accept a zero-probability child.
    coins = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, (t,)))(coin_key)
    bonus_u = jax.vmap(lambda k: jax.random.uniform(k, ()))(bonus_key)
    def sample(tokens, parents, probs, coins, bonus_u):
        return tree_speculative_sample(
            tokens, parents, probs, coins, bonus_u, max_depth=cfg.num_steps,
            threshold_single=cfg.threshold_single, threshold_acc=cfg.threshold_acc, impl=plan.verify_kernel,
        )

    # Per device on its rows under a mesh; the probabilities are gathered over the vocabulary.
    return shard_rows(sample, tree.tokens, tree.parents, probs.reshape(b, t, v), coins, bonus_u, mesh=plan.mesh)


def commit_accepted(cache, feats, seq_lens, accept_index, accept_length, cfg: SpeculativeConfig):
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


@dataclasses.dataclass(frozen=True)
class Proposer:
    """What proposes the tokens a speculative step verifies.

    The base is EAGLE-3: the draft's tree as ``draft_tree`` grew it (``EAGLE3``). A
    subclass may rewrite that tree before verification, e.g. the oracle of
    ``eagle_jax.spec.oracle``, which measures the machinery at a chosen acceptance.
    ``row_width`` > 0: ``propose`` reads ``rows`` ([B, row_width] int32, one row per
    request, kept by the engine beside the state and moved with its rows); 0: none.
    Frozen and hashable: a proposer is part of the compiled graphs.
    """

    row_width: int = 0

    def propose(self, tree: "Tree", state: SpecState, samp: SamplingArrays, rows: Int[Array, "B W"] | None) -> "Tree":
        return tree

    def describe(self) -> str:
        return "EAGLE-3 draft"


EAGLE3 = Proposer()


def draft_phase_impl(
    target: TargetModel, draft: Eagle3Draft, state: SpecState, samp: SamplingArrays, *,
    cfg: SpeculativeConfig, proposer: Proposer = EAGLE3, rows: Int[Array, "B W"] | None = None,
    sync: DraftSync = DraftSync(), plan: ExecutionPlan = XLA_PLAN,
) -> tuple[Tree, KVCache]:
    """The draft phase of a speculative step: catch the draft up on what a deferred sync
    left pending (``catch_up_draft``; nothing for an eager state), grow the tree
    (``draft_tree``), then hand it to the ``proposer`` (EAGLE-3 keeps it as it is;
    ``rows``: the proposer's per-row data).

    Reads ``state.draft_cache``, ``state.draft_hidden``, ``state.seq_lens``, ``state.root``
    (and a deferred state's pending inputs); the target cache is untouched.

    Returns ``(tree, draft_cache)``: the ``Tree`` (``tokens``/``parents``/``depths``, each
    ``[B, T]``, slot 0 the root) and the draft cache with the tree nodes' draft KV written
    into the scratch slots above the prefix (same shapes as ``state.draft_cache``).
    """
    del target  # the draft phase never runs the target; the argument keeps phases uniform
    state = catch_up_draft(draft, state, sync, plan)
    with jax.named_scope("draft"):
        tree, dcache = draft_tree(draft, state.draft_cache, state, cfg, plan)
        tree = proposer.propose(tree, state, samp, rows)
    return tree, dcache


def verify_phase_impl(
    target: TargetModel, draft: Eagle3Draft, state: SpecState, tree: Tree, draft_cache: KVCache, samp: SamplingArrays, *,
    cfg: SpeculativeConfig, greedy_only: bool, max_seq_len: int, check_finite: bool = False,
    plan: ExecutionPlan = XLA_PLAN,
):
    """The verify phase of a speculative step: verify the tree with the target, accept,
    commit the accepted path, and run the draft extend over the emitted tokens.

    ``tree`` and ``draft_cache`` are what ``draft_phase_impl`` returned for ``state``
    (``state.draft_cache`` itself is not read). Returns what ``speculative_step_impl``
    returns: ``(state, out_tokens [B, S+1] (-1 padded), accept_length [B], finite [B] or None)``.
    """
    seq = state.seq_lens
    with jax.named_scope("verify"):
        # plan.tree_attention: the tree-attention kernel on GPUs, the target's prefix
        # attention elsewhere (StepTable.verify_attention_path says which).
        logits, feats, tcache = verify_tree(target, state.target_cache, seq, tree, plan=plan)
    with jax.named_scope("accept"):
        acc_index, acc_len, out = accept_tree(logits, tree, seq, samp, cfg, greedy_only=greedy_only, plan=plan)
    with jax.named_scope("commit"):
        tcache, acc_feats = commit_accepted(tcache, feats, seq, acc_index, acc_len, cfg)
    with jax.named_scope("draft_extend"):
        g, dcache = _draft_extend(draft, draft_cache, out, acc_feats, seq, acc_len - 1, plan)
    new_seq = jnp.minimum(seq + acc_len, max_seq_len)  # finished rows keep running; the clamp keeps writes in range
    new_state = dataclasses.replace(
        state,
        target_cache=tcache,
        draft_cache=dcache,
        seq_lens=new_seq,
        root=out[jnp.arange(out.shape[0]), acc_len - 1],
        draft_hidden=g,
        # The draft phase caught up and the extend above covered the emitted tokens.
        draft_len=new_seq if state.deferred else None,
    )
    return new_state, out, acc_len, _finite_rows(logits) if check_finite else None


def speculative_step_impl(
    target: TargetModel, draft: Eagle3Draft, state: SpecState, samp: SamplingArrays, *,
    cfg: SpeculativeConfig, greedy_only: bool, max_seq_len: int,
    check_finite: bool = False, proposer: Proposer = EAGLE3, rows: Int[Array, "B W"] | None = None,
    sync: DraftSync = DraftSync(), plan: ExecutionPlan = XLA_PLAN,
):
    """One speculative step: draft, verify, accept, commit, draft extend — the draft
    phase then the verify phase, traced into one graph (the default, fused step).
    A deferred state first catches the draft up (``catch_up_draft``).

    Returns ``(state, out_tokens [B, S+1] (-1 padded), accept_length [B], finite)``; the
    emitted tokens of row b are ``out_tokens[b, :accept_length[b]]``; ``finite`` ([B],
    only with ``check_finite``) says whether the row's verify logits were all finite.
    """
    tree, dcache = draft_phase_impl(target, draft, state, samp, cfg=cfg, proposer=proposer, rows=rows, sync=sync, plan=plan)
    return verify_phase_impl(
        target, draft, state, tree, dcache, samp, cfg=cfg, greedy_only=greedy_only, max_seq_len=max_seq_len,
        check_finite=check_finite, plan=plan,
    )


def plain_step_impl(
    target: TargetModel, draft: Eagle3Draft | None, state: SpecState, samp: SamplingArrays, *,
    greedy_only: bool, max_seq_len: int, check_finite: bool = False, plan: ExecutionPlan = XLA_PLAN,
):
    """A non-speculative step; with a draft (not None) it keeps the draft in
    sync by a 1-token draft extend, so speculation can resume without losing acceptance,
    or, for a deferred state, only stores that extend's input (``SpecState.draft_len``).
    ``plan.tree_attention`` None attends through the target's ``PrefixMask`` path, else
    through the tree-attention kernel with a one-slot tree, as the verify forward does.

    Returns ``(state, out_tokens [B, 1], accept_length [B] = 1, finite [B] or None)``.
    """
    seq = state.seq_lens
    pos = seq[:, None]
    if plan.tree_attention is None:
        mask, ta = prefix_causal_mask(seq, 1, cache_len(state.target_cache)), None
    else:
        mask, ta = None, TreeAttention(seq, jnp.ones((seq.shape[0], 1, 1), bool), plan.tree_attention)
    h, feats, tcache = target(
        state.root[:, None], pos, state.target_cache, pos, mask, return_features=draft is not None, tree=ta, plan=plan,
    )
    logits = target.logits(h[:, 0])
    nxt = sample_tokens(logits, samp, seq + 1, greedy_only=greedy_only)
    new_seq = jnp.minimum(seq + 1, max_seq_len)
    if draft is None:
        new_state = dataclasses.replace(state, target_cache=tcache, seq_lens=new_seq, root=nxt)
    elif state.deferred:
        ph, pt = _store_pending(state, draft.fuse(feats), nxt[:, None], seq)
        new_state = dataclasses.replace(state, target_cache=tcache, seq_lens=new_seq, root=nxt, pending_hidden=ph, pending_tokens=pt)
    else:
        g, dcache = _draft_extend(draft, state.draft_cache, nxt[:, None], feats, seq, jnp.zeros_like(seq), plan)
        new_state = dataclasses.replace(state, target_cache=tcache, draft_cache=dcache, seq_lens=new_seq, root=nxt, draft_hidden=g)
    return new_state, nxt[:, None], jnp.ones_like(seq), _finite_rows(logits) if check_finite else None


def _finite_rows(logits: Float[Array, "B ... V"]) -> Bool[Array, "B"]:
    return jnp.all(jnp.isfinite(logits).reshape(logits.shape[0], -1), axis=-1)


def prefill_impl(
    target: TargetModel, draft: Eagle3Draft | None, state: SpecState, tokens: Int[Array, "B C"], lengths: Int[Array, "B"],
    samp: SamplingArrays, *, greedy_only: bool, plan: ExecutionPlan = XLA_PLAN,
    start: Int[Array, "B"] | None = None, next_tokens: Int[Array, "B"] | None = None,
):
    """Prefill one chunk of each row's prompt: ``tokens[b]`` are prompt positions
    ``start[b] .. start[b] + C - 1`` (right-padded past ``lengths[b]``, the whole prompt's
    length), written into the target's cache (and the draft's, or its pending inputs) at
    those positions; ``state`` holds the chunks before (``start`` None: a whole prompt
    from position 0 into zeroed caches). ``next_tokens[b]``: the prompt token after the
    chunk (the draft pairs the feature at the chunk's last position with it); ignored
    where the prompt ends inside the chunk.

    A row whose prompt ends in this chunk (``lengths <= start + C``) gets its first token
    (sampled at position ``lengths``) as ``root`` and is ready to decode; the others
    stand at ``seq_lens = start + C`` for the next chunk. Padding positions write cache
    slots past the prompt, which no query sees before a later step overwrites them.

    Returns ``(state, first token [B])`` (meaningful only for rows that ended)."""
    b, c = tokens.shape
    rows = jnp.arange(b)
    start = jnp.zeros((b,), jnp.int32) if start is None else start
    pos = start[:, None] + jnp.arange(c)[None, :]
    h, feats, tcache = target(
        tokens, pos, state.target_cache, pos, prefix_causal_mask(start, c, cache_len(state.target_cache)),
        return_features=draft is not None, plan=plan,
    )
    ends = lengths <= start + c  # the prompt's last position is in this chunk
    last = jnp.clip(lengths - 1 - start, 0, c - 1)  # its index in the chunk (where it ends)
    first = sample_tokens(target.logits(h[rows, last]), samp, lengths, greedy_only=greedy_only)
    seq = jnp.where(ends, lengths, start + c)
    state = dataclasses.replace(state, target_cache=tcache, seq_lens=seq, root=jnp.where(ends, first, 0))
    if draft is None:
        return state, first
    # Draft pairs f_p with x_{p+1}: the chunk shifted left, then the next chunk's first
    # token, and the new token at the prompt's last position.
    after = jnp.zeros((b,), tokens.dtype) if next_tokens is None else next_tokens.astype(tokens.dtype)
    shifted = jnp.concatenate([tokens[:, 1:], after[:, None]], axis=1)
    shifted = jnp.where(ends[:, None] & (jnp.arange(c)[None, :] == last[:, None]), first[:, None].astype(tokens.dtype), shifted)
    if state.deferred:  # the draft runs over the prompt at the first speculative step, if any
        ph, pt = _store_pending(state, draft.fuse(feats), shifted, start)
        return dataclasses.replace(state, draft_len=jnp.zeros_like(start), pending_hidden=ph, pending_tokens=pt), first
    g, dcache = _draft_extend(draft, state.draft_cache, shifted, feats, start, last, plan)
    return dataclasses.replace(state, draft_cache=dcache, draft_hidden=g), first


def state_spec(
    target: TargetModel, draft: Eagle3Draft | None, shapes: "list[SpeculativeConfig]", batch: int, max_seq_len: int,
    *, cache_align: int = 1, deferred: bool = False,
) -> SpecState:
    """The abstract step state (``ArraySpec`` leaves) for ``batch`` rows, sized for the
    largest of ``shapes`` so every compiled step shares one state layout.

    The target cache holds ``max_seq_len`` plus one tree of the widest shape, rounded up
    to ``cache_align`` slots (the tree-attention kernel's block, on GPUs); the draft cache
    also holds the drafting scratch slots. ``deferred`` (with a draft) adds the
    deferred sync's ``draft_len`` and pending inputs, ``max_seq_len`` positions each."""
    shapes = list(shapes) or [SpeculativeConfig(num_steps=1)]
    t_len = max_seq_len + max(c.num_draft_tokens for c in shapes)
    t_len = -(-t_len // cache_align) * cache_align
    d_len = max_seq_len + max(max(c.num_draft_tokens, c.max_accept, c.scratch_slots + 1) for c in shapes)
    dtype = jnp.dtype(target.dtype)
    return SpecState(
        target_cache=target.cache_spec(batch, t_len),
        draft_cache=None if draft is None else draft.cache_spec(batch, d_len, dtype),
        seq_lens=ArraySpec((batch,), jnp.dtype(jnp.int32), ("batch",)),
        root=ArraySpec((batch,), jnp.dtype(jnp.int32), ("batch",)),
        draft_hidden=None if draft is None else ArraySpec((batch, draft.config.hidden_size), dtype, ("batch", "embed")),
        **(_deferred_spec(draft, batch, max_seq_len, dtype) if deferred and draft is not None else {}),
    )


def _deferred_spec(draft: Eagle3Draft, batch: int, max_seq_len: int, dtype) -> dict:
    return dict(
        draft_len=ArraySpec((batch,), jnp.dtype(jnp.int32), ("batch",)),
        pending_hidden=ArraySpec((batch, max_seq_len, draft.config.hidden_size), dtype, ("batch", "cache_seq", "embed")),
        pending_tokens=ArraySpec((batch, max_seq_len), jnp.dtype(jnp.int32), ("batch", "cache_seq")),
    )


def new_state(target: TargetModel, draft: Eagle3Draft | None, cfg: SpeculativeConfig, batch: int, max_seq_len: int) -> SpecState:
    """A zeroed state for one shape (eager arrays; the step table builds its own inside
    compiled graphs). For tests and training code that drive the step math directly."""
    from eagle_jax.models.target import init_from_spec

    return init_from_spec(state_spec(target, draft, [cfg], batch, max_seq_len))
