"""The Llama-family target model (Llama 3.x, Qwen2, Qwen3, SmolLM2) as a Flax NNX module.

One forward serves prefill, decode and (later) tree verification: it writes the new
tokens' keys and values into a static KV cache at given slots, attends with a per-token
mask over the whole cache, and returns the final hidden states plus, when asked, the
residual stream entering the configured feature layers (the EAGLE-3 draft's input).

Layout choices, measured on a 2-core CPU with JAX 0.12 (SmolLM2 shapes, batch 1):
- each layer's weights are separate arrays, run by an unrolled Python loop; a step table
  on a CPU binds the ``stacked()`` form instead (``LayerStack``: one layer body in a
  ``fori_loop`` over parameters and caches stacked by layer, the CPU kernels reading
  layer i in place), which compiles a 30-layer step in a quarter of the time and runs it
  no slower; sliced out by XLA instead, the stacked weights cost ~40% at batch-1 decode;
- the KV cache is one (k, v) pair of arrays per layer, donated by the jitted callers;
- the output head is a pre-transposed ``[H, V]`` array even when tied (``x @ emb.T``
  transposes the embedding on every call); the loader fills it from the embedding;
- a step table on a CPU binds the Linear kernels and the head packed into column panels
  (``cpu_matmul``), so a verify forward of a few tokens streams each weight once.

Which attention kernels a forward runs (the CPU prefix-attention kernel, the tree-attention
kernel under a mesh) is the execution plan's (``plan=``, ``kernels.plan.ExecutionPlan``;
default ``XLA_PLAN``: XLA's own), never guessed from the parameters or the backend.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from eagle_jax.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from eagle_jax.kernels.cpu_matmul import ATTENTION_PREFILL_MIN_TOKENS, LayerOf, matmul, pack, pack_params, packable, packed_matmul
from eagle_jax.kernels.cpu_matmul import prefix_attention_state as cpu_prefix_attention_state
from eagle_jax.kernels.plan import XLA_PLAN, ExecutionPlan
from eagle_jax.models.target import ArraySpec, TargetFamily, register_target
from eagle_jax.kernels.sharded import shard_tree_attention

# ----------------------------------------------------------------------------- KV cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Per-layer key/value caches, each ``[B, S, KV, D]``; slot s holds position s."""

    k: list[Array]
    v: list[Array]

    @staticmethod
    def zeros(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> "KVCache":
        shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        # jnp.zeros, not jnp.empty: since JAX 0.11 empty is uninitialised memory, and
        # masked-out garbage can still be NaN, which poisons the softmax (0 * NaN).
        return KVCache(
            k=[jnp.zeros(shape, dtype) for _ in range(cfg.num_hidden_layers)],
            v=[jnp.zeros(shape, dtype) for _ in range(cfg.num_hidden_layers)],
        )

    @staticmethod
    def spec(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> "KVCache":
        """The abstract cache: an ``ArraySpec`` per layer for k and v, with logical axes."""
        a = ArraySpec((batch, max_len, cfg.num_key_value_heads, cfg.head_dim), jnp.dtype(dtype),
                      ("batch", "cache_seq", "kv_heads", "head_dim"))
        return KVCache(k=[a] * cfg.num_hidden_layers, v=[a] * cfg.num_hidden_layers)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StackedKVCache:
    """Every layer's keys and values in one array each, ``[B, L, S, KV, D]``: the cache of
    a target bound with its layers stacked (``LlamaModel.stacked``), whose forward loops
    over the layers and reads layer i in place (``LayerOf(k, i, axis=1)``). Batch on
    axis 0, as every cache; the slot on axis 2 (``SLOT_AXIS``, ``models.target``): a
    layer's slots stay contiguous per row, as in ``KVCache``. (With the layer after the
    slot, the attention kernel's reads of one layer strode 23 KB from slot to slot, a
    page each, and a batch-32 decode step over 1,000-token prefixes took 1.35x.)"""

    k: Array
    v: Array
    SLOT_AXIS = 2

    @staticmethod
    def spec(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> "StackedKVCache":
        a = ArraySpec((batch, cfg.num_hidden_layers, max_len, cfg.num_key_value_heads, cfg.head_dim), jnp.dtype(dtype),
                      ("batch", "layers", "cache_seq", "kv_heads", "head_dim"))
        return StackedKVCache(k=a, v=a)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[0]


def write_rows(cache: "Float[Array, 'B S ...'] | LayerOf", slots: Int[Array, "B T"],
               new: Float[Array, "B T ..."]) -> "Float[Array, 'B S ...'] | LayerOf":
    """``cache[b, slots[b, t]] = new[b, t]``; slots past the end are dropped. A layer of a
    stacked cache (``LayerOf``, axis 1) is written in place in its stack.

    Written per row (``vmap``: a scatter with the batch as a batching dimension) rather
    than as one scatter indexed by ``(row, slot)``: GSPMD partitions the former along a
    batch sharded on "data", while for the latter it all-gathers the new entries and
    the indices across "data" (measured in the compiled step's HLO)."""
    if isinstance(cache, LayerOf):
        i = cache.index
        stack = jax.vmap(lambda c, s, x: c.at[i, s].set(x.astype(c.dtype), mode="drop"))(cache.stack, slots, new)
        return dataclasses.replace(cache, stack=stack)
    return jax.vmap(lambda c, s, x: c.at[s].set(x.astype(c.dtype), mode="drop"))(cache, slots, new)


def _whole(cache: "Array | LayerOf") -> Array:
    """A layer's cache as its own array (a copy, for a stacked cache's layer): for the
    paths that do not read a stacked layer in place (tree kernel, dense masks)."""
    return cache.get() if isinstance(cache, LayerOf) else cache


def _slot_block(cache: "Array | LayerOf", start, size: int) -> Array:
    """Slots ``start .. start + size - 1`` of a layer's cache ``[B, S, KV, D]``."""
    if isinstance(cache, LayerOf):
        c = cache.stack
        block = jax.lax.dynamic_slice(c, (0, cache.index, start, 0, 0), (c.shape[0], 1, size) + c.shape[3:])
        return block[:, 0]
    return jax.lax.dynamic_slice_in_dim(cache, start, size, axis=1)


@dataclasses.dataclass(frozen=True)
class TreeAttention:
    """Attend a verify block with ``pallas_kernels.tree_attention`` instead of a dense mask:
    query t of row b sees slots ``< seq_lens[b]`` and, among ``seq_lens[b] + j``, those
    with ``tree_mask[b, t, j]``. ``impl`` is the kernel wrapper's (auto/kernel/reference)."""

    seq_lens: Array
    tree_mask: Array
    impl: str = "auto"


# ----------------------------------------------------------------------------- RoPE


@functools.lru_cache(maxsize=None)
def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """Inverse frequencies ``[head_dim // 2]`` (float32), with Hugging Face's rope scaling."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    inv = inv.astype(np.float32)
    if scaling.rope_type == "linear":
        inv = inv / scaling.factor
    elif scaling.rope_type == "llama3":
        old = scaling.original_max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        smooth = (old / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def rope_cos_sin(
    positions: Int[Array, "B T"], inv_freq: np.ndarray
) -> tuple[Float[Array, "B T D"], Float[Array, "B T D"]]:
    """cos and sin tables for the given positions, in Hugging Face's half-split layout.

    Computed once per forward: without the barrier XLA:CPU fused the sine and cosine into
    every layer's rope fusion (twice per layer, each over the doubled table), about 12 ms
    of a 218 ms 128-token SmolLM2 prefill chunk on a 2-core CPU."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    return jax.lax.optimization_barrier((jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)))


def apply_rope(
    x: Float[Array, "B T N D"], cos: Float[Array, "B T D"], sin: Float[Array, "B T D"]
) -> Float[Array, "B T N D"]:
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c, s = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * c + rotated * s


# ----------------------------------------------------------------------------- layers


class RMSNorm(nnx.Module):
    """RMS norm over the last dimension; ``axis`` is its logical axis (``target.DEFAULT_AXIS_RULES``)."""

    def __init__(self, dim: int, eps: float, dtype=jnp.float32, *, axis: str = "embed"):
        self.weight = nnx.Param(jnp.ones((dim,), dtype), logical_axes=(axis,))
        self.eps = eps

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * y.astype(x.dtype)


class Linear(nnx.Module):
    """``y = x @ kernel (+ bias)`` with the kernel stored ``[in, out]``.

    A step table on a CPU binds the kernel packed into column panels (``[P, in, nb]``,
    ``cpu_matmul.pack_params``); the product then runs through the packed-weight kernel.
    ``axes``: the logical axes (input, output) of the kernel, which the step table shards
    it by (``target.DEFAULT_AXIS_RULES``); the bias takes the output's.
    """

    def __init__(self, d_in: int, d_out: int, *, axes: tuple[str, str], bias: bool, dtype, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(0.02)
        # ``logical_axes``, not Flax's ``out_sharding``: Flax applies the latter at creation
        # (eager sharding) and expects mesh axis names; ours go through the rules first.
        self.kernel = nnx.Param(init(rngs.params(), (d_in, d_out), dtype), logical_axes=tuple(axes))
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype), logical_axes=(axes[1],)) if bias else None

    def __call__(self, x: Float[Array, "... I"]) -> Float[Array, "... O"]:
        y = matmul(x, self.kernel[...])
        if self.bias is not None:
            y = y + self.bias[...]
        return y


def masked_attention(
    q: Float[Array, "B T Hq D"],
    k: Float[Array, "B S Hkv D"],
    v: Float[Array, "B S Hkv D"],
    mask: Bool[Array, "B T S"],
    scale: float,
) -> Float[Array, "B T Hq D"]:
    """Grouped-query attention of T queries over S keys under a boolean mask (f32 softmax)."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None, :, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, hq, d)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefixMask:
    """The mask of every forward the step math runs, as structure instead of ``[B, T, S]``:
    the T new tokens of row b sit at slots ``prefix_len[b] + t``; query t sees every slot
    below ``prefix_len[b]`` and the new tokens j with ``block[b, t, j]`` (causal for
    prefill, decode and the draft extend; the tree's ancestors for verification).

    With it, attention visits only the cache blocks that hold the prefix
    (``prefix_attention``), so a step costs what its rows' lengths cost, not the cache
    length: a short request in an engine sized for long ones decodes at its own speed.
    """

    prefix_len: Int[Array, "B"]
    block: Bool[Array, "B T T"]
    # ``block`` is the causal triangle (static: known when tracing), so a kernel may
    # attend over the prefix and the new tokens in one pass (a prefill chunk on a CPU).
    is_causal: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @staticmethod
    def causal(prefix_len: Int[Array, "B"], t: int) -> "PrefixMask":
        tri = jnp.tril(jnp.ones((t, t), bool))
        return PrefixMask(prefix_len, jnp.broadcast_to(tri, (prefix_len.shape[0], t, t)), is_causal=True)

    def dense(self, max_len: int) -> Bool[Array, "B T S"]:
        """The same mask over a cache of ``max_len`` slots (for checks and the draft)."""
        t = self.block.shape[1]
        rel = jnp.arange(max_len)[None, None, :] - self.prefix_len[:, None, None]
        inside = jnp.take_along_axis(
            self.block, jnp.broadcast_to(jnp.clip(rel, 0, t - 1), (self.block.shape[0], t, max_len)), axis=2
        )
        return (rel < 0) | ((rel < t) & inside)


@dataclasses.dataclass(frozen=True, eq=False)
class StepDiagonalMask:
    """The mask of draft training's unrolled step ``step`` (``train.ttt``), as structure.

    The cache holds block 0 (``length`` slots: the keys step 0 wrote at every position of
    the sequence), then one block per later step (``rows`` slots each, at
    ``length + (s - 1) * rows``: the keys step s wrote at each query row). Query row q
    sits at sequence position ``anchors[b, q]`` and sees block-0 slots
    ``0..anchors[b, q]`` (causal) and slot q of blocks 1..step (its own earlier steps).

    ``anchors`` None: every position is a query row (``rows = length``, anchor q = q).
    Built inside the traced training step, never passed to jit. ``dense`` gives the
    equivalent boolean mask over the cache (for checks).
    """

    step: int
    length: int
    anchors: "Int[Array, 'B Q'] | None" = None

    @property
    def rows(self) -> int:
        return self.length if self.anchors is None else self.anchors.shape[1]

    def dense(self, slots: int) -> np.ndarray:
        """``[B or 1, Q, slots]`` bool."""
        n, q = self.length, self.rows
        anchors = np.arange(n)[None] if self.anchors is None else np.asarray(self.anchors)
        m = np.zeros((anchors.shape[0], q, slots), bool)
        m[:, :, :n] = np.arange(n)[None, None, :] <= anchors[:, :, None]
        for s in range(1, self.step + 1):
            m[:, :, n + (s - 1) * q:n + s * q] |= np.eye(q, dtype=bool)
        return m


def step_diagonal_attention(
    q: Float[Array, "B Q Hq D"],
    k_cache: Float[Array, "B S Hkv D"],
    v_cache: Float[Array, "B S Hkv D"],
    mask: StepDiagonalMask,
    scale: float,
) -> Float[Array, "B Q Hq D"]:
    """``masked_attention`` under ``mask.dense`` in O(Q * L + step * Q) per head instead
    of O(Q * cache): the causal block-0 scores, plus one score per earlier step on the
    diagonal, in one float32 softmax.

    Training unrolls 7 steps: over a dense mask, 6/7 of the scores of the last step
    are masked out, and the attention's share of a training step grows with
    ``step * L``; here every step costs one ``Q x L`` block.
    """
    b, nq, hq, d = q.shape
    n = mask.length
    if nq != mask.rows:
        raise ValueError(f"StepDiagonalMask of {mask.rows} rows used with {nq} queries")
    hkv = k_cache.shape[2]
    qg = q.reshape(b, nq, hkv, hq // hkv, d)
    s0 = jnp.einsum("bikgd,bjkd->bkgij", qg, k_cache[:, :n], preferred_element_type=jnp.float32) * scale
    if mask.anchors is None:
        seen = jnp.tril(jnp.ones((n, n), bool))
    else:
        seen = (jnp.arange(n)[None, None, :] <= mask.anchors[:, :, None])[:, None, None]  # [B, 1, 1, Q, L]
    s0 = jnp.where(seen, s0, -jnp.inf)
    t = mask.step
    if t == 0:
        p = jax.nn.softmax(s0, axis=-1).astype(v_cache.dtype)
        out = jnp.einsum("bkgij,bjkd->bikgd", p, v_cache[:, :n])
        return out.reshape(b, nq, hq, d)
    kd = k_cache[:, n:n + t * nq].reshape(b, t, nq, hkv, d)
    vd = v_cache[:, n:n + t * nq].reshape(b, t, nq, hkv, d)
    sd = jnp.einsum("bikgd,bsikd->bkgis", qg, kd, preferred_element_type=jnp.float32) * scale
    p = jax.nn.softmax(jnp.concatenate([s0, sd], axis=-1), axis=-1).astype(v_cache.dtype)
    out = jnp.einsum("bkgij,bjkd->bikgd", p[..., :n], v_cache[:, :n]) + jnp.einsum(
        "bkgis,bsikd->bikgd", p[..., n:], vd
    )
    return out.reshape(b, nq, hq, d)


# Cache slots per step of prefix_attention's loop (fewer when the cache is shorter).
PREFIX_BLOCK = 256


def prefix_attention(
    q: Float[Array, "B T Hq D"],
    k_new: Float[Array, "B T Hkv D"],
    v_new: Float[Array, "B T Hkv D"],
    k_cache: Float[Array, "B S Hkv D"],
    v_cache: Float[Array, "B S Hkv D"],
    mask: PrefixMask,
    scale: float,
    block: int = PREFIX_BLOCK,
    impl: str = "xla",
) -> Float[Array, "B T Hq D"]:
    """Grouped-query attention over the prefix in the cache plus the new tokens, with an
    online softmax (float32): the new tokens first (every query sees itself, so the
    running max is finite), then a loop over the cache blocks below the batch's longest
    prefix. The loop's trip count is dynamic, so the cost follows the rows' lengths.

    Dense attention over a [B, T, S] mask measured 1.6x the whole decode step at S=2048
    against S=128 for SmolLM2 on a 2-core CPU; this visits ceil(prefix / block) blocks.

    ``impl="cpu"`` attends over the prefix with ``cpu_matmul.prefix_attention_state``
    instead of the loop: each row reads only its own prefix (the loop reads every row up
    to the batch's longest), in one pass from the cache layout. Callers check
    ``ExecutionPlan.prefix_attention_for`` first.
    """
    if impl not in ("xla", "cpu"):
        raise ValueError(f"prefix_attention impl={impl!r}; valid: xla, cpu")
    b, t, hq, d = q.shape
    s_len, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    qg = q.reshape(b, t, hkv, g, d)
    if impl == "cpu" and mask.is_causal and t >= ATTENTION_PREFILL_MIN_TOKENS:
        # A prefill chunk: its keys are in the cache already (``Attention`` writes them
        # first), so the kernel attends over prefix and chunk in one pass; XLA's dense
        # in-chunk scores were about a tenth of a 128-token chunk's time.
        _, lc, ac = cpu_prefix_attention_state(qg * scale, k_cache, v_cache, mask.prefix_len, causal=True)
        out = (ac / lc[..., None]).astype(q.dtype)
        return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d)
    s = jnp.einsum("btkgd,bjkd->bkgtj", qg, k_new.astype(k_cache.dtype), preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask.block[:, None, None, :, :], s, -jnp.inf)
    m = s.max(-1)  # [B, KV, G, T]
    p = jnp.exp(s - m[..., None])
    denom = p.sum(-1)
    acc = jnp.einsum("bkgtj,bjkd->bkgtd", p.astype(v_cache.dtype), v_new.astype(v_cache.dtype), preferred_element_type=jnp.float32)
    prefix = mask.prefix_len
    if impl == "cpu":
        mc, lc, ac = cpu_prefix_attention_state(qg * scale, k_cache, v_cache, prefix)
        m_all = jnp.maximum(m, mc)  # finite: every query sees itself among the new tokens
        cn, cc = jnp.exp(m - m_all), jnp.exp(mc - m_all)  # cc = 0 where the row has no prefix
        denom = denom * cn + lc * cc
        acc = acc * cn[..., None] + ac * cc[..., None]
        out = (acc / denom[..., None]).astype(q.dtype)
        return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d)
    blk = min(block, s_len)

    def body(i, carry):
        m, denom, acc = carry
        lo = i * blk
        start = jnp.minimum(lo, s_len - blk)  # the last block may overlap the one before
        kb, vb = _slot_block(k_cache, start, blk), _slot_block(v_cache, start, blk)
        pos = start + jnp.arange(blk)
        seen = (pos[None, :] >= lo) & (pos[None, :] < prefix[:, None])  # [B, blk]
        sb = jnp.einsum("btkgd,bskd->bkgts", qg, kb, preferred_element_type=jnp.float32) * scale
        sb = jnp.where(seen[:, None, None, None, :], sb, -jnp.inf)
        m_new = jnp.maximum(m, sb.max(-1))
        corr = jnp.exp(m - m_new)
        pb = jnp.exp(sb - m_new[..., None])
        denom = denom * corr + pb.sum(-1)
        acc = acc * corr[..., None] + jnp.einsum(
            "bkgts,bskd->bkgtd", pb.astype(vb.dtype), vb, preferred_element_type=jnp.float32
        )
        return m_new, denom, acc

    n_blocks = (jnp.max(prefix) + blk - 1) // blk
    m, denom, acc = jax.lax.fori_loop(0, n_blocks, body, (m, denom, acc))
    out = (acc / denom[..., None]).astype(q.dtype)  # [B, KV, G, T, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, d_in: int | None = None):
        d_in = d_in or cfg.hidden_size
        hd, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        bias = cfg.attention_bias
        # Megatron-style tensor parallelism: q/k/v split by heads (columns), o_proj by its
        # input heads (rows), so one all-reduce joins the shards after o_proj.
        self.q_proj = Linear(d_in, nq * hd, axes=("embed", "heads"), bias=bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d_in, nkv * hd, axes=("embed", "kv_heads"), bias=bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d_in, nkv * hd, axes=("embed", "kv_heads"), bias=bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(nq * hd, cfg.hidden_size, axes=("heads", "embed"), bias=False, dtype=dtype, rngs=rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype, axis="head_dim")
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype, axis="head_dim")
        else:
            self.q_norm = self.k_norm = None
        self.num_heads, self.num_kv_heads, self.head_dim = nq, nkv, hd

    def __call__(
        self,
        x: Float[Array, "B T I"],
        cos: Float[Array, "B T D"],
        sin: Float[Array, "B T D"],
        k_cache: Float[Array, "B S KV D"],
        v_cache: Float[Array, "B S KV D"],
        cache_slots: Int[Array, "B T"],
        mask: "Bool[Array, 'B T S'] | PrefixMask | StepDiagonalMask | None",
        tree: "TreeAttention | None" = None,
        plan: ExecutionPlan = XLA_PLAN,
    ):
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Slots past the cache end (padding tokens) are dropped, never written.
        k_cache, v_cache = write_rows(k_cache, cache_slots, k), write_rows(v_cache, cache_slots, v)
        scale = 1.0 / math.sqrt(self.head_dim)
        if tree is not None:
            out = shard_tree_attention(q, _whole(k_cache), _whole(v_cache), tree.seq_lens, tree.tree_mask, scale=scale,
                                       impl=tree.impl, mesh=plan.mesh)
        elif isinstance(mask, PrefixMask):
            # The plan says whether the prefix goes to the CPU kernel (an inference table
            # on a CPU, one device) and the shape decides whether the kernel takes it.
            impl = plan.prefix_attention_for(t, self.num_heads // self.num_kv_heads, self.head_dim, k_cache.dtype,
                                             causal=mask.is_causal)
            out = prefix_attention(q, k, v, k_cache, v_cache, mask, scale, impl=impl)
        elif isinstance(mask, StepDiagonalMask):
            out = step_diagonal_attention(q, _whole(k_cache), _whole(v_cache), mask, scale)
        else:
            out = masked_attention(q, _whole(k_cache), _whole(v_cache), mask, scale)
        return self.o_proj(out.reshape(b, t, -1)), k_cache, v_cache


class MLP(nnx.Module):
    def __init__(self, hidden: int, inter: int, *, dtype, rngs: nnx.Rngs):
        # Split by the MLP width: gate/up by columns, down by rows (one all-reduce after).
        self.gate_proj = Linear(hidden, inter, axes=("embed", "mlp"), bias=False, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(hidden, inter, axes=("embed", "mlp"), bias=False, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(inter, hidden, axes=("mlp", "embed"), bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x: Float[Array, "... H"]) -> Float[Array, "... H"]:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)

    def __call__(self, h, cos, sin, k_cache, v_cache, cache_slots, mask, tree=None, plan: ExecutionPlan = XLA_PLAN):
        a, k_cache, v_cache = self.self_attn(
            self.input_layernorm(h), cos, sin, k_cache, v_cache, cache_slots, mask, tree, plan=plan
        )
        h = h + a
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, k_cache, v_cache


class LayerStack(nnx.Module):
    """A target's decoder layers bound for inference as one module: every parameter
    stacked over the layers (``[L, ...]``; the Linear kernels packed as ``[L, P, K, nb]``
    CPU panels when ``pack_dtype`` is given), run by a loop over the layer index with the
    cache stacked likewise (``StackedKVCache``).

    Why: unrolled, every graph holds L copies of the layer, and XLA compiles each; a loop
    compiles one body. SmolLM2's plain decode step (30 layers, 2-core CPU) compiled in
    0.55 s against 1.93 s unrolled. The CPU kernels read layer i of the stacked panels
    and caches in place (``LayerOf``): slicing the layer out would copy its weights on
    every step (that copy made the loop 36% slower than unrolled in the same test).
    ``LlamaModel.stacked`` builds it; the step table binds it where the plan says
    (``ExecutionPlan.layers``)."""

    def __init__(self, layers, pack_dtype: str | None = None):
        graph, _ = nnx.split(layers[0])
        packed = 0

        def stack(path, *vs):
            nonlocal packed
            arr = jnp.stack([v[...] for v in vs])
            axes = ("layers",) + tuple(vs[0].get_metadata()["logical_axes"])
            name = getattr(path[-1], "key", None)
            if pack_dtype is not None and name == "kernel" and arr.dtype == jnp.float32 and packable(arr[0]):
                arr = pack(arr.astype(pack_dtype))  # [L, K, N] -> [L, N / nb, K, nb]: panels follow N
                axes = (axes[0], axes[2], axes[1], None)
                packed += len(vs)
            return vs[0].replace(arr, logical_axes=axes)

        states = [nnx.state(layer) for layer in layers]
        self.stacked = nnx.merge(graph, jax.tree_util.tree_map_with_path(
            stack, *states, is_leaf=lambda x: isinstance(x, nnx.Variable)))
        self.num_layers = len(layers)
        self.packed = packed  # matrices packed (the start-up line's count)

    def __call__(self, h, cos, sin, cache: StackedKVCache, cache_slots, mask, tree, plan: ExecutionPlan,
                 feature_ids: "tuple[int, ...] | None"):
        """Layers 0..L-1 over ``h [B, T, H]``; returns (h, features or None, cache). The
        features (``feature_ids`` given): the residual stream entering each id (id L:
        the last layer's output), concatenated in their order, as ``decoder_stack``."""
        graph, state = nnx.split(self.stacked)
        n = self.num_layers
        # The distinct ids below L, each kept once (ids may repeat: [2, N//2, N-3] of a
        # 4-layer target is [2, 2, 1]); id L is the loop's output.
        inside = sorted({i for i in feature_ids if i < n}) if feature_ids is not None else []
        # Layer i's stream goes to row slot_of[i] of the feature buffer (row len(inside): dropped).
        slot_of = np.full(n, len(inside), np.int32)
        for j, i in enumerate(inside):
            slot_of[i] = j
        feats = jnp.zeros((len(inside),) + h.shape, h.dtype) if feature_ids is not None else None

        def layer_of(i):
            # Packed panels stay in their stack (the kernel reads layer i in place); the
            # rest (norms, biases, unpacked kernels) are sliced out.
            return nnx.merge(graph, jax.tree.map(
                lambda a: LayerOf(a, i) if a.ndim == 4 else jax.lax.dynamic_index_in_dim(a, i, keepdims=False), state))

        def body(i, carry):
            h, k, v, feats = carry
            if feats is not None:
                feats = feats.at[jnp.asarray(slot_of)[i]].set(h, mode="drop")
            h, kl, vl = layer_of(i)(h, cos, sin, LayerOf(k, i, 1), LayerOf(v, i, 1), cache_slots, mask, tree, plan=plan)
            return h, kl.stack, vl.stack, feats

        h, k, v, feats = jax.lax.fori_loop(0, n, body, (h, cache.k, cache.v, feats))
        features = None
        if feature_ids is not None:
            features = jnp.concatenate([feats[inside.index(i)] if i < n else h for i in feature_ids], axis=-1)
        return h, features, StackedKVCache(k=k, v=v)


# Source model -> {pack dtype: (weak references to its layer arrays, its stacked copy)}:
# every step table over one target shares one stacked copy, rebuilt when the layers'
# arrays change.
_STACKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


# ----------------------------------------------------------------------------- model


class LlamaModel(nnx.Module):
    """A Llama-family decoder with a static KV cache."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = cfg
        self.dtype = dtype
        self.embed_tokens = nnx.Param(
            jax.nn.initializers.normal(0.02)(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype),
            logical_axes=("vocab", "embed"),
        )
        self.layers = nnx.List(
            [DecoderLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # [H, V]; for tied models the loader copies embed_tokens.T here.
        self.lm_head = nnx.Param(
            jnp.asarray(self.embed_tokens[...].T)
            if cfg.tie_word_embeddings
            else jax.nn.initializers.normal(0.02)(rngs.params(), (cfg.hidden_size, cfg.vocab_size), dtype),
            logical_axes=("embed", "vocab"),
        )

    def embed(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T H"]:
        return jnp.take(self.embed_tokens[...], tokens, axis=0)

    def __call__(
        self,
        tokens: Int[Array, "B T"],
        positions: Int[Array, "B T"],
        cache: KVCache,
        cache_slots: Int[Array, "B T"],
        mask: Bool[Array, "B T S"] | None,
        *,
        return_features: bool = False,
        tree: "TreeAttention | None" = None,
        plan: ExecutionPlan = XLA_PLAN,
    ) -> tuple[Float[Array, "B T H"], Float[Array, "B T F"] | None, KVCache]:
        """Run T new tokens per sequence against the cache.

        Args:
          tokens: token ids.
          positions: RoPE positions of the tokens.
          cache: the KV cache (S slots); returned updated.
          cache_slots: the slot each token's key/value is written to (>= S: not written).
          mask: ``mask[b, t, s]`` is True where token t may attend to slot s, after the
            write (so a token must see its own slot); or a ``PrefixMask`` (the new tokens
            at slots ``prefix_len + t``), which attends block by block over the prefix only.
          return_features: also return the residual stream entering the feature layers,
            concatenated low..high (``F = len(feature_layer_ids) * H``).
          tree: for a verify forward, attend with the tree-attention kernel instead of
            ``mask`` (the tokens must sit at slots ``seq_len + t``; see ``TreeAttention``).
          plan: which kernels run (``kernels.plan``; default XLA's own).

        Returns:
          (final normed hidden ``[B, T, H]``, features or None, updated cache).
        """
        cfg = self.config
        cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
        if isinstance(self.layers, LayerStack):
            h, features, cache = self.layers(self.embed(tokens), cos, sin, cache, cache_slots, mask, tree, plan,
                                             tuple(cfg.feature_layer_ids) if return_features else None)
            return self.norm(h), features, cache

        def run(i, h):
            h, k, v = self.layers[i](h, cos, sin, cache.k[i], cache.v[i], cache_slots, mask, tree, plan=plan)
            return h, (k, v)

        h, features, kv = decoder_stack(self.embed(tokens), cfg.num_hidden_layers, cfg.feature_layer_ids, return_features, run)
        return self.norm(h), features, KVCache(k=[k for k, _ in kv], v=[v for _, v in kv])

    def logits(self, hidden: Float[Array, "... H"]) -> Float[Array, "... V"]:
        return head_logits(hidden, self.lm_head[...], self.embed_tokens[...], self.config.tie_word_embeddings)

    def cache_spec(self, batch: int, max_len: int) -> "KVCache | StackedKVCache":
        """The abstract KV cache (``ArraySpec`` leaves) for ``batch`` rows of ``max_len`` slots."""
        if isinstance(self.layers, LayerStack):
            return StackedKVCache.spec(self.config, batch, max_len, self.dtype)
        return KVCache.spec(self.config, batch, max_len, self.dtype)

    def stacked(self, pack_dtype: str | None = None) -> "LlamaModel":
        """This model with its layers as one ``LayerStack`` (stacked parameters run by a
        loop; kernels packed as ``pack_dtype`` CPU panels if given), sharing the other
        parameters: what an inference step table binds where its plan stacks layers.
        The copy is made once per model and pack dtype and reused while the layers'
        arrays are the same ones."""
        if isinstance(self.layers, LayerStack):
            return self
        leaves = jax.tree.leaves(nnx.state(self.layers))
        per_model = _STACKED.setdefault(self, {})
        hit = per_model.get(pack_dtype)
        # Weak references, not ids: a freed array's id can come back on a new one.
        if hit is None or len(hit[0]) != len(leaves) or any(r() is not a for r, a in zip(hit[0], leaves)):
            out = nnx.merge(*nnx.split(self))
            out.layers = LayerStack(list(self.layers), pack_dtype)
            per_model[pack_dtype] = hit = (tuple(weakref.ref(a) for a in leaves), out)
        return hit[1]

    def axis_sizes(self) -> dict[str, int]:
        """What each sharded logical axis counts (``target.TargetModel``)."""
        return llama_axis_sizes(self.config)


def decoder_stack(h, n_layers: int, feature_ids, return_features: bool, run_layer):
    """Run layers ``0..n_layers-1`` (``run_layer(i, h) -> (h, layer cache)``) and collect
    the EAGLE-3 features: the residual stream entering each of ``feature_ids`` (id N: the
    last layer's output), concatenated in their order. Every target family's forward.

    Returns (h, features ``[B, T, len(ids) * H]`` or None, the per-layer caches)."""
    feats, caches = {}, []
    for i in range(n_layers):
        if return_features and i in feature_ids:
            feats[i] = h
        with jax.named_scope(f"layer_{i}"):
            h, c = run_layer(i, h)
        caches.append(c)
    if return_features and n_layers in feature_ids:
        feats[n_layers] = h
    features = jnp.concatenate([feats[i] for i in feature_ids], axis=-1) if return_features else None
    return h, features, caches


def head_logits(hidden: Float[Array, "... H"], head, embed, tied: bool) -> Float[Array, "... V"]:
    """Output logits (float32) from the ``[H, V]`` head, packed or not; ``embed`` is the
    ``[V, H]`` embedding a tied head may contract against instead."""
    if head.ndim == 3:  # packed for the CPU kernel (a step table's binding): any row count
        return packed_matmul(hidden, head)
    if tied and math.prod(hidden.shape[:-1]) > 1:
        # Several rows (a verify forward, a batch): contracting against the [V, H]
        # embedding beats the pre-transposed [H, V] product on XLA:CPU (SmolLM2's
        # 49152 x 576 head, 2-core Xeon: 14.1 vs 15.6 ms at 8 rows, 16.5 vs 22.9 at
        # 16, 36 vs 40 at 64); one row stays a matrix-vector product over [H, V].
        return jnp.einsum("...h,vh->...v", hidden, embed).astype(jnp.float32)
    return (hidden @ head).astype(jnp.float32)


def llama_axis_sizes(cfg) -> dict[str, int]:
    """Sizes of the logical axes a Llama-shaped config (target or draft layer) splits."""
    return {"heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
            "mlp": cfg.intermediate_size, "vocab": cfg.vocab_size}


# NNX path -> (Hugging Face name, transpose?). Built per config by ``param_name_map``.
NameMap = dict[tuple, tuple[str, bool]]


def param_name_map(cfg: ModelConfig) -> NameMap:
    names: NameMap = {("embed_tokens",): ("model.embed_tokens.weight", False)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        lp = ("layers", i)
        names[lp + ("input_layernorm", "weight")] = (p + "input_layernorm.weight", False)
        names[lp + ("post_attention_layernorm", "weight")] = (p + "post_attention_layernorm.weight", False)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names[lp + ("self_attn", proj, "kernel")] = (p + f"self_attn.{proj}.weight", True)
        if cfg.attention_bias:
            for proj in ("q_proj", "k_proj", "v_proj"):
                names[lp + ("self_attn", proj, "bias")] = (p + f"self_attn.{proj}.bias", False)
        if cfg.qk_norm:
            names[lp + ("self_attn", "q_norm", "weight")] = (p + "self_attn.q_norm.weight", False)
            names[lp + ("self_attn", "k_norm", "weight")] = (p + "self_attn.k_norm.weight", False)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names[lp + ("mlp", proj, "kernel")] = (p + f"mlp.{proj}.weight", True)
    names[("norm", "weight")] = ("model.norm.weight", False)
    # A tied head is filled from the embedding; an untied one has its own tensor.
    names[("lm_head",)] = (
        ("model.embed_tokens.weight", True) if cfg.tie_word_embeddings else ("lm_head.weight", True)
    )
    return names


register_target(
    tuple(SUPPORTED_ARCHITECTURES),
    TargetFamily("llama", ModelConfig.from_hf_dict, LlamaModel, param_name_map),
)


def causal_mask(
    positions: Int[Array, "B T"], max_len: int
) -> Bool[Array, "B T S"]:
    """Plain causal mask for tokens whose slot equals their position: slot s <= position."""
    return jnp.arange(max_len)[None, None, :] <= positions[:, :, None]


def parameter_axes(state) -> list[tuple[str | None, ...]]:
    """The ``logical_axes`` metadata of every Variable of an NNX state, in flatten order;
    a parameter without them (or with the wrong count) is a programming error, named."""
    pairs, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    out = []
    for path, v in pairs:
        axes = v.get_metadata().get("logical_axes") if isinstance(v, nnx.Variable) else None
        ndim = len(v.shape) if isinstance(v, nnx.Variable) else None
        if axes is None or len(axes) != ndim:
            raise RuntimeError(
                f"model parameter {jax.tree_util.keystr(path)} (shape {getattr(v, 'shape', None)}) has logical_axes "
                f"{axes!r}; every parameter needs one logical axis name per dimension (target.DEFAULT_AXIS_RULES)"
            )
        out.append(tuple(axes))
    return out


class BoundModules:
    """Modules split once into graph definitions and flat parameter arrays.

    A jitted step takes ``params`` (tuples of arrays) and rebuilds the modules inside
    the trace with ``modules(params)``. Passing an NNX ``GraphDef`` as a static jit
    argument instead costs a deep hash on every call (milliseconds for a 30-layer
    model), which is host time on the critical path of every decode step.
    """

    def __init__(self, *modules: nnx.Module | None, pack: bool = False, pack_dtype: str = "float32"):
        # pack: bind float32 Linear kernels and heads as CPU column panels of ``pack_dtype``
        # (inference only; ``cpu_matmul``); ``packed`` counts them.
        # ``axes``: the logical axes of every leaf of ``params`` (same structure), from
        # the parameters' ``logical_axes`` metadata; the step table shards by them.
        self._graphs, self._treedefs, params, axes = [], [], [], []
        self.packed = 0
        for m in modules:
            if m is None:
                self._graphs.append(None)
                self._treedefs.append(None)
                params.append(())
                axes.append(())
                continue
            graph, state = nnx.split(m)
            names = parameter_axes(state)
            if pack:
                state, n = pack_params(state, pack_dtype)
                self.packed += n
            leaves, treedef = jax.tree.flatten(state)
            if len(leaves) != len(names):  # one array per Variable: a programming error otherwise
                raise RuntimeError(f"{type(m).__name__}: {len(leaves)} parameter arrays for {len(names)} variables")
            self._graphs.append(graph)
            self._treedefs.append(treedef)
            params.append(tuple(leaves))
            # A packed kernel [K, N] -> panels [N / nb, K, nb]: the panels follow N's axis.
            # (Packing only happens on a single-device mesh, where every axis is replicated.)
            axes.append(tuple(a[:-2] + (a[-1], a[-2], None) if leaf.ndim == len(a) + 1 else a
                              for a, leaf in zip(names, leaves)))
            if isinstance(getattr(m, "layers", None), LayerStack):  # packed when stacked
                self.packed += m.layers.packed
        self.params = tuple(params)
        self.axes = tuple(axes)

    def modules(self, params) -> list:
        return [
            None if g is None else nnx.merge(g, jax.tree.unflatten(d, p))
            for g, d, p in zip(self._graphs, self._treedefs, params)
        ]
