"""EAGLE-3 speculative decoding in one readable loop: start reading here.

``reference_generate`` runs ONE request, greedy, with no batching, bucketing, policy
or streaming. It calls the real step functions of ``eagle_jax.spec.steps`` in order, so
every phase of a speculative step shows up in one place:

    prefill   target over the prompt, then draft over the prompt   ``prefill_impl``
    draft     grow a chain/tree of guesses from the draft          ``draft_tree``
    verify    ONE target forward over every tree token              ``verify_tree``
    accept    keep the longest path the target agrees with         ``accept_tree``
    commit    make that path contiguous in the target KV cache      ``commit_accepted``
    extend    run the draft over the tokens just emitted            ``_draft_extend``

What serves requests is the same math at scale: ``steps.speculative_step_impl`` chains
these calls (as ``draft_phase_impl`` then ``verify_phase_impl``) for a batch of rows,
with sampled rows, the GPU tree-attention kernel and deferred draft syncing;
``runtime.step_table`` compiles it for every batch bucket ahead of time; and
``serving.engine`` is the host loop around it (continuous batching, stop checks, the
policy that decides when to speculate). ``tests/test_reference.py`` checks this loop
gives the engine's tokens and plain greedy decoding's.

The bookkeeping to know (``steps.SpecState``): ``seq_lens`` tokens are committed to both
KV caches; ``root`` is the last emitted token, which the target has NOT run yet (it is
slot 0 of the next tree); ``draft_hidden`` is the draft's output for the row that
consumed ``root``, whose logits give the draft's first guess.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.models.draft import Eagle3Draft
from eagle_jax.models.target import TargetModel
from eagle_jax.spec.config import SpeculativeConfig
from eagle_jax.spec.sampling import SamplingArrays, SamplingParams
from eagle_jax.spec.steps import (
    SpecState,
    _draft_extend,
    accept_tree,
    commit_accepted,
    draft_tree,
    new_state,
    prefill_impl,
    verify_tree,
)


def reference_step(target: TargetModel, draft: Eagle3Draft, state: SpecState, samp: SamplingArrays, shape: SpeculativeConfig):
    """One greedy speculative step on ``state`` (``samp``: greedy rows, temperature 0):
    ``(state, out_tokens [B, S+1], accept_length [B])``. The emitted tokens of row b are
    ``out_tokens[b, :accept_length[b]]`` (always >= 1)."""
    seq = state.seq_lens

    # 1. DRAFT. From draft_hidden, the draft proposes top-k tokens, runs on them, proposes
    #    again, ... num_steps times, keeping the num_draft_tokens - 1 best guesses by
    #    cumulative probability (a chain: k=1, one guess per step). The draft's KV for the
    #    guesses goes into scratch slots above the committed prefix of the draft cache.
    tree, draft_cache = draft_tree(draft, state.draft_cache, state, shape)

    # 2. VERIFY. One target forward over all T tree tokens (root + guesses) at once: each
    #    token attends to the committed prefix and its own ancestors only. This is the
    #    whole trick: T positions checked for about the price of one decode step (it
    #    reads the weights once). Writes their KV at slots seq_len .. seq_len + T - 1.
    logits, features, target_cache = verify_tree(target, state.target_cache, seq, tree)

    # 3. ACCEPT. Walk down from the root: a child is accepted when it is the target's
    #    argmax after its parent. The accepted guesses plus the target's own next token
    #    after the last of them (the "bonus") are emitted, so a step emits >= 1 token,
    #    exactly what plain greedy decoding would have produced.
    accept_index, accept_length, out = accept_tree(logits, tree, seq, samp, shape, greedy_only=True)

    # 4. COMMIT. The root and the accepted guesses are now committed tokens. Their KV is
    #    already in the target cache, but at their tree slots: a tree moves it to
    #    seq_len .. seq_len + accept_length - 1 (a chain's path is already contiguous).
    #    Rejected slots above that are simply overwritten next step. Also gathers the
    #    target features of the accepted slots: the draft's input for the next step.
    target_cache, accepted_features = commit_accepted(target_cache, features, seq, accept_index, accept_length, shape)

    # 5. DRAFT EXTEND. Run the draft over the emitted tokens paired with the target's
    #    features (the draft at position p reads the target feature at p and the token at
    #    p+1), overwriting its scratch slots; keep its output for the last emitted token,
    #    the next step's draft_hidden. Fixed width (S+1 tokens): no host sync needed.
    draft_hidden, draft_cache = _draft_extend(draft, draft_cache, out, accepted_features, seq, accept_length - 1)

    # The last emitted token becomes the next root (the target has not run it yet). (The
    # batched step also clamps seq_lens to max_seq_len, as finished rows keep running
    # there; this loop just stops.)
    root = out[jnp.arange(out.shape[0]), accept_length - 1]
    state = dataclasses.replace(state, target_cache=target_cache, draft_cache=draft_cache,
                                seq_lens=seq + accept_length, root=root, draft_hidden=draft_hidden)
    return state, out, accept_length


def reference_generate(
    target: TargetModel, draft: Eagle3Draft, prompt_ids: Sequence[int], max_new_tokens: int,
    shape: SpeculativeConfig, *, eos_ids: Sequence[int] = (),
) -> tuple[list[int], list[int]]:
    """Greedy speculative decoding of one prompt: ``(new tokens, accept length per step)``.

    Stops after ``max_new_tokens`` tokens or on a token of ``eos_ids`` (kept in the
    output). The accept lengths are the speculative steps' own (each >= 1, as the engine
    reports them): the first token comes from the prefill, and the last step may have
    accepted more than the output keeps. Compiles its two graphs on every call (it is a
    reference, not a server).
    """
    prompt_len = len(prompt_ids)
    # Cache room: the prompt, the new tokens, and one tree past them (new_state adds that).
    state = new_state(target, draft, shape, batch=1, max_seq_len=prompt_len + max_new_tokens)

    # Split the modules into a graph and arrays so the arrays are jit arguments (closing
    # over the modules would bake every weight into the compiled graph as a constant).
    graph, params = nnx.split((target, draft))
    greedy = SamplingArrays.build([SamplingParams()], 1)  # temperature 0: argmax everywhere

    @jax.jit
    def prefill(params, state, tokens, lengths):
        # Target over the prompt (its KV and first token), then the draft over the prompt
        # shifted by one (target feature f_p with token x_{p+1}), ending on the new token.
        t, d = nnx.merge(graph, params)
        return prefill_impl(t, d, state, tokens, lengths, greedy, greedy_only=True)

    @jax.jit
    def step(params, state):
        t, d = nnx.merge(graph, params)
        return reference_step(t, d, state, greedy, shape)

    # PREFILL: the first new token comes from the target's last prompt position.
    prompt = jnp.asarray([list(prompt_ids)], jnp.int32)
    state, first = prefill(params, state, prompt, jnp.asarray([prompt_len], jnp.int32))
    tokens, accept_lengths = [int(first[0])], []

    # DECODE: speculative steps until enough tokens or an EOS.
    eos = set(eos_ids)
    while len(tokens) < max_new_tokens and tokens[-1] not in eos:
        state, out, accept_length = step(params, state)
        n = int(accept_length[0])  # the host waits for the device here, once per step
        accept_lengths.append(n)
        for tok in np.asarray(out[0, :n]).tolist():
            tokens.append(tok)
            if len(tokens) == max_new_tokens or tok in eos:
                break
    return tokens, accept_lengths
