"""Tree-masked attention for the verify forward.

The tree's own keys/values are already in the cache at positions ``seq_lens[b] + j``
(``j = 0..T-1``). Query ``t`` sees key position ``s`` iff ``s < seq_lens[b]`` (the
verified prefix) or ``0 <= s - seq_lens[b] < T`` and ``tree_mask[b, t, s - seq_lens[b]]``
(its tree ancestors and itself). GQA: query head ``h`` uses kv head ``h // (Hq // Hkv)``.
Softmax in float32. A query that sees no key at all gets a zero output (the plain
softmax would give NaN); in the verify forward every query sees at least itself.

Kernel: Mosaic GPU via ``plgpu.kernel`` (see ``pallas_kernels._common`` for why not
``pl.pallas_call``, which lowers through the deprecated Triton backend), flash style:
one program (one warpgroup) per (batch, kv head, 64-row tile), where the rows are the
``T * G`` queries of the ``G = Hq / Hkv`` query heads sharing that kv head (so K/V are
read once per kv head). It loops over key blocks up to ``seq_lens[b] + T`` only,
double-buffering K/V blocks into shared memory with TMA, and keeps an online softmax.
Both products run on the tensor cores with WGMMA, which is what constrains the
kernel: 16-bit inputs (bf16/f16), a head dim that is a multiple of 64 and key blocks of
64 or 128 (WGMMA's K dimension must be a multiple of 64 with 128-byte swizzle), and
rows padded to 64 (one warpgroup's WGMMA M). The probabilities go through shared
memory for the P@V product (Mosaic GPU's interpreter only takes SMEM operands). The
tree mask enters as per-row bit words (bit ``j`` = sees tree slot ``j``), so the
in-kernel mask is shifts and compares, no gather.

Which path ``impl="auto"`` takes is decided by ``select_tree_attention_path``, a pure
function of the backend, the shapes and dtypes (callers such as the engine use it to size
their caches and to log the path): the compiled kernel on a Hopper GPU (WGMMA is sm_90
only) when the shapes are supported, the reference (XLA) otherwise. With the default
``block_k=64`` the shapes need a cache length ``S`` that is a multiple of 64, a head dim
that is a multiple of 64, bf16/f16 for q and the caches alike, and ``Hq % Hkv == 0``; the
number of tree tokens ``T`` is free (rows are padded to 64).
"""

from __future__ import annotations

import functools
from typing import Literal, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels import _common
from pallas_kernels._common import Impl, mgpu_kernel, on_gpu, round_up

__all__ = [
    "BLOCK_ROWS",
    "TreeAttentionPath",
    "kernel_unsupported_reason",
    "kernel_unsupported_reason_for",
    "select_tree_attention_path",
    "tree_attention",
    "tree_attention_kernel",
    "tree_attention_reference",
]
BLOCK_ROWS = 64  # WGMMA M for one warpgroup
_MASK_INIT = -1e30  # finite running max, so exp(m_old - m_new) never sees inf - inf
_BITS = 32


def tree_attention_reference(
    q: Float[Array, "B T Hq D"],
    k_cache: Float[Array, "B S Hkv D"],
    v_cache: Float[Array, "B S Hkv D"],
    seq_lens: Int[Array, " B"],
    tree_mask: Bool[Array, "B T T"],
    *,
    scale: float,
) -> Float[Array, "B T Hq D"]:
    """Plain masked softmax attention in float32."""
    b, t, hq, d = q.shape
    s_len, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    qf = q.astype(jnp.float32).reshape(b, t, hkv, g, d)
    scores = jnp.einsum("bthgd,bshd->bhgts", qf, k_cache.astype(jnp.float32)) * scale
    pos = jnp.arange(s_len, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
    j = pos - seq_lens[:, None, None]
    in_tree = (j >= 0) & (j < t)
    tree_vis = jnp.take_along_axis(tree_mask, jnp.clip(j, 0, t - 1).repeat(t, axis=1), axis=2)
    visible = (pos < seq_lens[:, None, None]) | (in_tree & tree_vis)  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(visible.any(-1)[:, None, None, :, None], probs, 0.0)
    out = jnp.einsum("bhgts,bshd->bthgd", probs, v_cache.astype(jnp.float32))
    return out.reshape(b, t, hq, d).astype(q.dtype)


def _row_bit_words(tree_mask: Bool[Array, "B T T"], g: int, rows: int) -> Int[Array, "B W R"]:
    """Pack each query row's tree visibility into int32 words: bit j of word w = slot 32w+j.

    Row ``r`` is query ``t = r // g`` (rows are ``t``-major over the ``g`` heads of a kv
    head); padding rows past ``T * g`` see nothing in the tree.
    """
    b, t, _ = tree_mask.shape
    n_words = -(-t // _BITS)
    m = jnp.pad(tree_mask, ((0, 0), (0, 0), (0, n_words * _BITS - t))).astype(jnp.uint32)
    weights = jnp.left_shift(jnp.uint32(1), jnp.arange(_BITS, dtype=jnp.uint32))
    words = (m.reshape(b, t, n_words, _BITS) * weights).sum(-1, dtype=jnp.uint32)  # [B, T, W]
    words = lax.bitcast_convert_type(words, jnp.int32)
    words = jnp.repeat(words, g, axis=1)  # [B, T*g, W]
    words = jnp.pad(words, ((0, 0), (0, rows - t * g), (0, 0)))
    return words.transpose(0, 2, 1)  # rows last: one contiguous vector per word


def _attention_body(*, t: int, s_len: int, block_k: int, head_dim: int, n_words: int, dtype, scale: float):
    """Kernel body for one (batch, kv head, row tile) program."""
    bm = BLOCK_ROWS

    def body(q_ref, k_ref, v_ref, len_ref, bits_ref, o_ref, q_smem, k_smem, v_smem, p_smem, barriers):
        q_bar, k_bar, v_bar = barriers
        b, h, r = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("r")
        seq_len = len_ref[b]
        # Keys past seq_len + T are never visible: stop there (at least one block).
        n_blocks = jnp.clip((seq_len + t + block_k - 1) // block_k, 1, s_len // block_k)

        def fetch(i, slot):
            window = (b, pl.ds(i * block_k, block_k), h)
            plgpu.copy_gmem_to_smem(k_ref.at[window], k_smem.at[slot], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[window], v_smem.at[slot], v_bar.at[slot])

        rows = pl.ds(r * bm, bm)
        plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_smem, q_bar)
        fetch(0, 0)
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        words = [plgpu.load(bits_ref.at[b, w, rows], layout=row_layout, optimized=False) for w in range(n_words)]
        plgpu.barrier_wait(q_bar)

        def visible(i):
            """[bm, block_k] mask of the keys of block i that each row may see."""
            pos = plgpu.broadcasted_iota(jnp.int32, (bm, block_k), 1, layout=plgpu.Layout.WGMMA) + i * block_k
            j = pos - seq_len
            vis = pos < seq_len
            for w, word in enumerate(words):
                shift = j - _BITS * w
                in_word = (shift >= 0) & (shift < _BITS) & (j < t)
                row_word = lax.broadcast_in_dim(word, (bm, block_k), [0])
                bit = lax.shift_right_logical(row_word, jnp.clip(shift, 0, _BITS - 1)) & 1
                vis = vis | (in_word & (bit == 1))
            return vis

        def step(i, carry):
            acc, m_i, l_i = carry
            slot = lax.rem(i, 2)

            @pl.when(i + 1 < n_blocks)
            def _prefetch():  # the other slot was consumed by iteration i - 1
                fetch(i + 1, 1 - slot)

            plgpu.barrier_wait(k_bar.at[slot])

            def qk_product(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
                return acc_ref[...]

            scores = pl.run_scoped(qk_product, plgpu.ACC((bm, block_k), jnp.float32)) * scale
            scores = jnp.where(visible(i), scores, -jnp.inf)
            m_new = jnp.maximum(m_i, scores.max(axis=1))
            alpha = jnp.exp(m_i - m_new)
            p = jnp.exp(scores - lax.broadcast_in_dim(m_new, scores.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p_smem[...] = p.astype(dtype)
            plgpu.commit_smem()  # make the generic stores visible to WGMMA
            plgpu.barrier_wait(v_bar.at[slot])

            def pv_product(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                return acc_ref[...]

            acc = acc + pl.run_scoped(pv_product, plgpu.ACC((bm, head_dim), jnp.float32))
            return acc, m_new, l_i

        m0 = plgpu.layout_cast(jnp.full((bm,), _MASK_INIT, jnp.float32), row_layout)
        l0 = plgpu.layout_cast(jnp.full((bm,), 0.0, jnp.float32), row_layout)
        acc0 = plgpu.layout_cast(jnp.full((bm, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)
        acc, _, l_i = lax.fori_loop(0, n_blocks, step, (acc0, m0, l0))
        l_safe = jnp.where(l_i > 0, l_i, 1.0)  # rows that saw nothing stay 0
        q_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, h, rows])
        plgpu.wait_smem_to_gmem(0)

    return body


def kernel_unsupported_reason_for(
    q_shape: Sequence[int], kv_shape: Sequence[int], dtype, kv_dtype=None, *, block_k: int = 64
) -> str | None:
    """Why the kernel cannot take queries ``[B, T, Hq, D]`` of ``dtype`` over caches
    ``[B, S, Hkv, D]`` of ``kv_dtype`` (default: ``dtype``), ``None`` when it can."""
    dtype = jnp.dtype(dtype)
    kv_dtype = dtype if kv_dtype is None else jnp.dtype(kv_dtype)
    if len(q_shape) != 4 or len(kv_shape) != 4:
        return f"q shape {tuple(q_shape)} / cache shape {tuple(kv_shape)}: expected [B, T, Hq, D] / [B, S, Hkv, D]"
    (b, _, hq, d), (kb, s_len, hkv, kd) = q_shape, kv_shape
    if dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {dtype}: the WGMMA kernel takes bf16/f16"
    if kv_dtype != dtype:
        return f"q is {dtype} but the caches are {kv_dtype}: q, k_cache and v_cache must share a dtype"
    if (b, d) != (kb, kd):
        return f"q shape {tuple(q_shape)} and cache shape {tuple(kv_shape)} disagree on batch or head dim"
    if d % 64:
        return f"head dim {d} must be a multiple of 64 (128-byte swizzle)"
    if block_k % 64 or block_k > 128:
        return f"block_k={block_k} must be 64 or 128"
    if s_len % block_k:
        return f"cache length {s_len} must be a multiple of block_k={block_k}"
    if hq % hkv:
        return f"Hq={hq} must be a multiple of Hkv={hkv}"
    return None


def kernel_unsupported_reason(q, k_cache, v_cache, *, block_k: int) -> str | None:
    """Why the kernel cannot take these arrays (``None`` when it can)."""
    if k_cache.shape != v_cache.shape:
        return f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ in shape"
    if k_cache.dtype != v_cache.dtype:
        return f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}: they must share a dtype"
    return kernel_unsupported_reason_for(q.shape, k_cache.shape, q.dtype, k_cache.dtype, block_k=block_k)


TreeAttentionPath = Literal["kernel", "reference"]


def select_tree_attention_path(
    impl: Impl,
    backend: str,
    q_shape: Sequence[int],
    kv_shape: Sequence[int],
    dtype,
    kv_dtype=None,
    *,
    block_k: int = 64,
    compute_capability: str | None = None,
) -> tuple[TreeAttentionPath, str]:
    """Which implementation ``tree_attention`` runs, and why: ``(path, reason)``.

    A pure function of its arguments (no device is queried), so a caller can decide
    before tracing, e.g. size its KV cache so that the kernel applies and log the path.

    Args:
      impl: ``"auto"``, ``"kernel"`` or ``"reference"``.
      backend: ``jax.default_backend()`` (``"gpu"``, ``"cpu"``, ``"tpu"``).
      q_shape: ``[B, T, Hq, D]``; kv_shape: ``[B, S, Hkv, D]`` (the whole cache).
      dtype, kv_dtype: of q and of the caches (``kv_dtype`` None: same as ``dtype``).
      block_k: keys per kernel step (64 or 128).
      compute_capability: the GPU's, e.g. ``"9.0"`` (``device.compute_capability``);
        None when unknown (then a GPU is taken to be able to run WGMMA).

    Returns:
      ``("kernel", reason)`` or ``("reference", reason)``. ``"auto"`` takes the kernel
      only on a GPU of compute capability 9.x whose shapes the kernel supports; ``"kernel"``
      always takes it (interpreted off GPU) and raises ``ValueError`` when the shapes are
      unsupported.
    """
    if impl not in ("auto", "kernel", "reference"):
        raise ValueError(f"impl={impl!r}; expected 'auto', 'kernel' or 'reference'")
    if impl == "reference":
        return "reference", "impl='reference'"
    unsupported = kernel_unsupported_reason_for(q_shape, kv_shape, dtype, kv_dtype, block_k=block_k)
    if impl == "kernel":
        if unsupported:
            raise ValueError(f"tree_attention kernel: {unsupported}")
        if backend == "gpu":
            return "kernel", "impl='kernel' (compiled)"
        return "kernel", f"impl='kernel' on backend {backend!r}: the Mosaic GPU interpreter (unless interpret=False)"
    if backend != "gpu":
        return "reference", f"backend {backend!r}: the kernel compiles for GPUs only"
    if compute_capability is not None and not compute_capability.startswith("9."):
        return "reference", f"compute capability {compute_capability}: the kernel's WGMMA needs sm_90 (Hopper)"
    if unsupported:
        return "reference", f"kernel does not support these shapes: {unsupported}"
    return "kernel", "GPU and shapes the kernel supports"


def _gpu_compute_capability() -> str | None:
    """The default device's compute capability (``None`` off CUDA or when not reported)."""
    return getattr(jax.devices()[0], "compute_capability", None) if on_gpu() else None


def tree_attention_kernel(
    q: Float[Array, "B T Hq D"],
    k_cache: Float[Array, "B S Hkv D"],
    v_cache: Float[Array, "B S Hkv D"],
    seq_lens: Int[Array, " B"],
    tree_mask: Bool[Array, "B T T"],
    *,
    scale: float,
    block_k: int = 64,
    interpret=None,
) -> Float[Array, "B T Hq D"]:
    """The Pallas (Mosaic GPU) kernel; ``interpret`` is ``None`` or ``InterpretGPUParams``."""
    if reason := kernel_unsupported_reason(q, k_cache, v_cache, block_k=block_k):
        raise ValueError(f"tree_attention kernel: {reason}")
    b, t, hq, d = q.shape
    s_len, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    rows = round_up(t * g, BLOCK_ROWS)
    # [B, T, Hkv, G, D] -> [B, Hkv, T*G, D]: a kv head's queries form one row block.
    q_rows = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, d)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - t * g), (0, 0)))
    words = _row_bit_words(tree_mask, g, rows)
    tiled = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    scratch = (
        plgpu.SMEM((BLOCK_ROWS, d), q.dtype, **tiled),  # q, then the output tile
        plgpu.SMEM((2, block_k, d), q.dtype, **tiled),  # K, double-buffered
        plgpu.SMEM((2, block_k, d), q.dtype, **tiled),  # V, double-buffered
        plgpu.SMEM((BLOCK_ROWS, block_k), q.dtype, **tiled),  # probabilities for P@V
        (plgpu.Barrier(num_barriers=1), plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2)),
    )
    body = _attention_body(
        t=t, s_len=s_len, block_k=block_k, head_dim=d, n_words=words.shape[1], dtype=q.dtype, scale=float(scale)
    )
    call = mgpu_kernel(
        body,
        (jax.ShapeDtypeStruct((b, hkv, rows, d), q.dtype),),
        grid=(b, hkv, rows // BLOCK_ROWS),
        grid_names=("b", "h", "r"),
        scratch=scratch,
        interpret=interpret,
    )
    (out,) = call(q_rows, k_cache, v_cache, seq_lens.astype(jnp.int32), words)
    out = out[:, :, : t * g].reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, hq, d)


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "compiler_params"))
def _compiled_kernel(q, k_cache, v_cache, seq_lens, tree_mask, *, scale: float, block_k: int, compiler_params):
    """The natively compiled kernel as a jitted function of its own. JAX lowers a jitted
    call once per signature within a module and calls that function from every call
    site, where the kernel inlined is lowered (Mosaic GPU's passes) at every site: a
    verify forward calls it once per layer, and on the H200 an 8B model's 32-layer
    speculative step compiled in 30-46 s against the plain step's 8 (results/gpu/).
    Lowering 8 calls for CUDA on a CPU: 5.4 s inlined, 1.0 s through this function.
    ``compiler_params`` is ``_common.COMPILER_PARAMS`` (which ``mgpu_kernel`` reads), part
    of the cache key so that a change of lowering semantics is traced anew."""
    del compiler_params
    return tree_attention_kernel(q, k_cache, v_cache, seq_lens, tree_mask, scale=scale, block_k=block_k)


def tree_attention(
    q: Float[Array, "B T Hq D"],
    k_cache: Float[Array, "B S Hkv D"],
    v_cache: Float[Array, "B S Hkv D"],
    seq_lens: Int[Array, " B"],
    tree_mask: Bool[Array, "B T T"],
    *,
    scale: float,
    block_k: int = 64,
    impl: Impl = "auto",
    interpret: bool | None = None,
) -> Float[Array, "B T Hq D"]:
    """Attention of the ``T`` tree queries over the cache (prefix + the tree itself).

    Args:
      q: ``[B, T, Hq, D]`` queries of the tree slots.
      k_cache, v_cache: ``[B, S, Hkv, D]``, the tree's own K/V already written at
        ``seq_lens[b] + j``; ``seq_lens[b] + T <= S``; one shape and dtype.
      seq_lens: ``[B]`` verified prefix lengths.
      tree_mask: ``[B, T, T]`` ``tree_mask[b, t, j]``: query ``t`` sees tree slot ``j``.
      scale: softmax scale (usually ``D ** -0.5``).
      block_k: keys per kernel step (64 or 128; ``S`` must be a multiple).
      impl: ``"auto"``, ``"kernel"`` or ``"reference"``, resolved by
        ``select_tree_attention_path``; interpret: as in ``verify_greedy``.

    Returns:
      ``[B, T, Hq, D]`` in ``q.dtype``.
    """
    args = (q, k_cache, v_cache, seq_lens, tree_mask)
    # The path is chosen on k_cache; the kernel raises ValueError if v_cache differs from it.
    path, _ = select_tree_attention_path(
        impl, jax.default_backend(), q.shape, k_cache.shape, q.dtype, k_cache.dtype,
        block_k=block_k, compute_capability=_gpu_compute_capability(),
    )
    if path == "reference":
        return tree_attention_reference(*args, scale=scale)
    if interpret is None:
        interpret = not on_gpu()
    if not interpret:
        return _compiled_kernel(*args, scale=float(scale), block_k=block_k, compiler_params=_common.COMPILER_PARAMS)
    return tree_attention_kernel(*args, scale=scale, block_k=block_k, interpret=plgpu.InterpretGPUParams())
