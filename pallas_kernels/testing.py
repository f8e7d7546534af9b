"""Test helpers: random draft trees, plain-Python walks, a CUDA-lowering check.

The Python walks transliterate SGLang's verification loops over first-child /
next-sibling links, one sequence at a time, as a third implementation that the jnp
references and the kernels are checked against.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np


class RandomTrees(NamedTuple):
    """A batch of random trees: ``parents``, ``candidates`` ``[B, T]`` int32."""

    parents: np.ndarray
    candidates: np.ndarray


def random_tree(
    rng: np.random.Generator, num_slots: int, max_depth: int, vocab: int, *, pad_prob: float = 0.3
) -> tuple[np.ndarray, np.ndarray]:
    """One valid tree of ``num_slots`` slots: ``(parents [T], candidates [T])``.

    Slot 0 is the root (parent -1). Each other slot is padding (parent -2) with
    probability ``pad_prob`` (padding may sit between tree slots), else it hangs under
    a random earlier non-padding slot of depth ``< max_depth``. Tokens are uniform in
    ``[0, vocab)``, so a small vocab gives duplicate siblings (ties).
    """
    parents = np.full(num_slots, -2, np.int32)
    depth = np.full(num_slots, -1, np.int32)
    parents[0], depth[0] = -1, 0
    for t in range(1, num_slots):
        if rng.random() < pad_prob:
            continue
        options = np.flatnonzero((depth >= 0) & (depth < max_depth) & (np.arange(num_slots) < t))
        if options.size == 0:
            continue
        p = int(rng.choice(options))
        parents[t], depth[t] = p, depth[p] + 1
    candidates = rng.integers(0, vocab, num_slots).astype(np.int32)
    return parents, candidates


def random_trees(
    rng: np.random.Generator, batch: int, num_slots: int, max_depth: int, vocab: int, *, pad_prob: float = 0.3
) -> RandomTrees:
    """``batch`` independent trees from ``random_tree``."""
    trees = [random_tree(rng, num_slots, max_depth, vocab, pad_prob=pad_prob) for _ in range(batch)]
    return RandomTrees(np.stack([p for p, _ in trees]), np.stack([c for _, c in trees]))


def chain_parents(num_slots: int) -> np.ndarray:
    """``[T]`` parents of a chain: slot t hangs under t - 1."""
    return np.arange(-1, num_slots - 1, dtype=np.int32)


def children(parents: np.ndarray, node: int) -> list[int]:
    """Children of ``node`` in slot order (the order verification tries them)."""
    return [int(c) for c in np.flatnonzero(parents == node)]


def greedy_walk(parents, candidates, target_argmax, max_depth: int) -> tuple[list[int], list[int]]:
    """One sequence: ``(accepted slots incl. root, emitted tokens incl. bonus)``."""
    path, tokens = [0], []
    while len(path) <= max_depth:
        last = path[-1]
        nxt = next((c for c in children(parents, last) if candidates[c] == target_argmax[last]), None)
        if nxt is None:
            break
        path.append(nxt)
        tokens.append(int(candidates[nxt]))
    tokens.append(int(target_argmax[path[-1]]))
    return path, tokens


def sampling_walk(
    parents, child_probs, coins, max_depth: int, threshold_single: float = 1.0, threshold_acc: float = 1.0
) -> tuple[list[int], list[int]]:
    """One sequence, SGLang's loop in float32: ``(accepted slots incl. root, rejected slots)``."""
    f32 = np.float32
    thr_acc = max(f32(threshold_acc), f32(1e-9))
    path, rejected = [0], []
    while len(path) <= max_depth:
        last = path[-1]
        coin, prob_acc, accepted = f32(coins[last]), f32(0.0), None
        rejected = []
        for c in children(parents, last):
            p = f32(child_probs[c])
            prob_acc = f32(prob_acc + p)
            if coin <= f32(prob_acc / thr_acc) or p >= f32(threshold_single):
                accepted = c
                break
            rejected.append(c)
        if accepted is None:
            break
        path.append(accepted)
        rejected = []
    return path, rejected


def assert_lowers_to_mosaic_gpu(fn, *args) -> None:
    """``fn`` (calling a kernel with ``interpret=False``) lowers for CUDA, also on a
    CPU-only machine, to a module holding the Mosaic GPU custom call."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.custom_call @mosaic_gpu" in text, text[:2000]
