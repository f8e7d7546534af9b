"""The oracle proposer (``steps.Proposer``): measures the speculative machinery at a
chosen acceptance, outside every production signature.

Each request's proposer row is its reference sequence (prompt plus the continuation
the target is known to produce greedily; ``Engine(proposer=..., proposer_rows=...)``);
the oracle substitutes its tokens for the draft's along the tree's first-child path, a
fraction ``noise`` made wrong. With noise 0 every draft is accepted; with noise, partial
acceptance.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eagle_jax.spec.sampling import SamplingArrays, position_keys
from eagle_jax.spec.steps import Proposer, SpecState, Tree
from pallas_kernels.tree import tree_links


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


@dataclasses.dataclass(frozen=True)
class OracleProposer(Proposer):
    """Replace draft tokens by each row's reference tokens (its proposer row, of
    ``row_width`` ids: the longest prompt plus continuation it may need), wrong with
    probability ``noise`` (keyed by request seed and position, so runs are reproducible)."""

    noise: float = 0.0
    vocab_size: int = 0

    def __post_init__(self):
        if not 0 <= self.noise <= 1:
            raise ValueError(f"oracle noise={self.noise} must be in [0, 1]")
        if self.row_width < 1:
            raise ValueError(f"the oracle reads a reference row per request: row_width={self.row_width} must be >= 1")

    def propose(self, tree: Tree, state: SpecState, samp: SamplingArrays, rows) -> Tree:
        t = tree.tokens.shape[1]
        noise_key = jax.vmap(lambda k: jax.random.fold_in(k, 3))(position_keys(samp.key, state.seq_lens))
        noise_u = jax.vmap(lambda k: jax.random.uniform(k, (t,)))(noise_key)
        return apply_oracle(tree, rows, state.seq_lens, noise_u, self.noise, self.vocab_size)

    def describe(self) -> str:
        return f"oracle (noise {self.noise:g}; measurement only)"
