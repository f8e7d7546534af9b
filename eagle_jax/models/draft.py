"""The EAGLE-3 draft model: one Llama decoder layer over [token embedding, hidden state].

The draft sees, per position, the embedding of the next token and a hidden state: at the
first step the target's fused features (``fuse``: three residual-stream snapshots of the
target, ``[B, T, 3*Ht] -> [B, T, H]``), afterwards its own previous output. Its layer
attends with a 2H-wide input (``concat([input_layernorm(embed), hidden_norm(h)])``,
embedding first, as in every public implementation) and predicts over a reduced draft
vocabulary of ``Vd`` target tokens; ``d2t`` maps draft ids back to target ids.

Feature-layer ids (``DraftConfig.aux_layer_ids``) use this project's one convention: id k
is the residual stream *entering* target layer k, the same as
``ModelConfig.feature_layer_ids``. Checkpoint readers translate other conventions
(see ``eagle_jax.checkpoint.draft_io``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from eagle_jax.models.config import ModelConfig, RopeScaling
from eagle_jax.kernels.cpu_matmul import matmul
from eagle_jax.kernels.plan import XLA_PLAN, ExecutionPlan
from eagle_jax.errors import ConfigError
from eagle_jax.validate import flag, is_int
from eagle_jax.models.llama import MLP, Attention, KVCache, Linear, RMSNorm, rope_cos_sin, rope_inv_freq

# The reference draft vocabulary (EAGLE-3 paper, SpecForge, released Llama 3 drafts).
DEFAULT_DRAFT_VOCAB = 32000


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """A one-layer EAGLE-3 draft. Hashable, so it can be static in jitted functions.

    ``vocab_size`` is the target's vocabulary V, ``draft_vocab_size`` the draft head's Vd,
    ``target_hidden_size`` the target's hidden size Ht (fc takes ``len(aux_layer_ids) * Ht``).
    ``has_embed_tokens``: the draft carries its own embedding; when False it uses the
    target's (and then ``hidden_size`` must equal the target's). ``norm_before_residual``
    is vLLM's variant that takes the residual after ``hidden_norm``.
    ``target_num_hidden_layers``: the target's N when known (built for or loaded with a
    target); a writer needs it to tell the target's default feature layers, whose ids it
    omits, from others.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # Hugging Face's default; the reference config omits it
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 2048
    has_embed_tokens: bool = False
    norm_before_residual: bool = False
    target_num_hidden_layers: int | None = None
    # An MLA draft layer (the Kimi-K2.5 ``Eagle3DeepseekV2ForCausalLM`` format): its
    # attention is this MLA block reading [embedding, hidden], with a latent cache;
    # None: the Llama layer (``num_attention_heads``, ``head_dim``, ... describe it).
    mla: Any = None

    def __post_init__(self):
        # Lists (e.g. from JSON) would make the config unhashable.
        if isinstance(self.aux_layer_ids, list):
            object.__setattr__(self, "aux_layer_ids", tuple(self.aux_layer_ids))
        if self.mla is not None:
            # An MLA layer's attention sizes and RoPE are its own (``mla``); the Llama
            # fields are set from them, so two descriptions of one draft compare equal.
            if self.mla.hidden_size != self.hidden_size:
                raise ConfigError(f"draft mla.hidden_size={self.mla.hidden_size} differs from hidden_size={self.hidden_size}")
            for name, value in (("num_attention_heads", self.mla.num_attention_heads),
                                ("num_key_value_heads", self.mla.num_attention_heads),
                                ("head_dim", self.mla.qk_rope_head_dim), ("rope_theta", self.mla.rope_theta),
                                ("rope_scaling", RopeScaling())):
                object.__setattr__(self, name, value)
        positive = (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "draft_vocab_size",
            "target_hidden_size",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ConfigError(f"draft {name}={value!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"draft num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"draft head_dim={self.head_dim} must be even for RoPE")
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(
                f"draft draft_vocab_size={self.draft_vocab_size} must be <= vocab_size={self.vocab_size}"
            )
        for name in ("rms_norm_eps", "rope_theta"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"draft {name}={getattr(self, name)!r} must be > 0")
        if not isinstance(self.rope_scaling, RopeScaling):
            raise ConfigError(f"draft rope_scaling={self.rope_scaling!r} must be a RopeScaling")
        ids = self.aux_layer_ids
        if (
            not isinstance(ids, tuple)
            or not ids
            or not all(is_int(i) and i >= 0 for i in ids)
        ):
            raise ConfigError(
                f"draft aux_layer_ids={ids!r} must be a non-empty tuple of target layer ids >= 0"
            )
        for name in ("has_embed_tokens", "norm_before_residual"):
            flag(f"draft {name}", getattr(self, name))
        n = self.target_num_hidden_layers
        if n is not None:
            if not is_int(n) or n <= 0:
                raise ConfigError(f"draft target_num_hidden_layers={n!r} must be a positive integer or None")
            if max(ids) > n:
                raise ConfigError(
                    f"draft aux_layer_ids={ids} has {max(ids)}, outside [0, {n}] for "
                    f"target_num_hidden_layers={n}"
                )

    @property
    def num_hidden_layers(self) -> int:
        """Always 1; lets ``KVCache.zeros(draft_cfg, ...)`` size the draft's cache."""
        return 1

    @property
    def fc_in_features(self) -> int:
        return len(self.aux_layer_ids) * self.target_hidden_size

    @property
    def layer_config(self) -> ModelConfig:
        """The decoder-layer description the shared Attention/MLP blocks are built from."""
        return ModelConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
        )

    def replace(self, **changes: Any) -> "DraftConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def for_target(cls, target_cfg: ModelConfig, **overrides: Any) -> "DraftConfig":
        """A one-layer draft shaped like the target's layers (for tests and training).

        Same hidden size, heads, head size, norm epsilon and RoPE as the target, features
        from the target's ``feature_layer_ids``, ``draft_vocab_size = min(V, 32000)``, the
        target's embedding and layer count. ``overrides`` replace any field.
        """
        fields: dict[str, Any] = dict(
            hidden_size=target_cfg.hidden_size,
            intermediate_size=target_cfg.intermediate_size,
            num_attention_heads=target_cfg.num_attention_heads,
            num_key_value_heads=target_cfg.num_key_value_heads,
            head_dim=target_cfg.head_dim,
            vocab_size=target_cfg.vocab_size,
            draft_vocab_size=min(target_cfg.vocab_size, DEFAULT_DRAFT_VOCAB),
            target_hidden_size=target_cfg.hidden_size,
            aux_layer_ids=tuple(target_cfg.feature_layer_ids),
            rms_norm_eps=target_cfg.rms_norm_eps,
            rope_theta=target_cfg.rope_theta,
            rope_scaling=target_cfg.rope_scaling,
            max_position_embeddings=target_cfg.max_position_embeddings,
            target_num_hidden_layers=target_cfg.num_hidden_layers,
        )
        fields.update(overrides)
        return cls(**fields)


def check_compatible(draft_cfg: DraftConfig, target_cfg: ModelConfig) -> None:
    """Raise ConfigError naming the first way the draft cannot run on this target.

    Checks the target hidden size and vocabulary, that a draft without its own embedding
    has the target's width, and that the target is configured to return exactly the
    draft's feature layers (same ids, not merely the same count: a draft fed the wrong
    layers runs and silently drafts badly).
    """
    n = target_cfg.num_hidden_layers
    if draft_cfg.target_hidden_size != target_cfg.hidden_size:
        raise ConfigError(
            f"draft target_hidden_size={draft_cfg.target_hidden_size} does not match the "
            f"target's hidden_size={target_cfg.hidden_size}"
        )
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ConfigError(
            f"draft vocab_size={draft_cfg.vocab_size} does not match the target's "
            f"vocab_size={target_cfg.vocab_size}"
        )
    if not draft_cfg.has_embed_tokens and draft_cfg.hidden_size != target_cfg.hidden_size:
        raise ConfigError(
            f"draft has no embed_tokens and its hidden_size={draft_cfg.hidden_size} differs from "
            f"the target's hidden_size={target_cfg.hidden_size}, so it cannot use the target's embedding"
        )
    bad = [i for i in draft_cfg.aux_layer_ids if i > n]
    if bad:
        raise ConfigError(
            f"draft aux_layer_ids={draft_cfg.aux_layer_ids} has {bad[0]}, outside [0, {n}] "
            f"for a target with num_hidden_layers={n}"
        )
    target_ids = tuple(target_cfg.feature_layer_ids)
    if len(draft_cfg.aux_layer_ids) != len(target_ids):
        raise ConfigError(
            f"draft fc takes {draft_cfg.fc_in_features} features = {len(draft_cfg.aux_layer_ids)} "
            f"aux_layer_ids {draft_cfg.aux_layer_ids} x {draft_cfg.target_hidden_size}, but the "
            f"target yields {len(target_ids)} feature layers {target_ids}"
        )
    if draft_cfg.aux_layer_ids != target_ids:
        raise ConfigError(
            f"draft aux_layer_ids={draft_cfg.aux_layer_ids} differ from the target's "
            f"feature_layer_ids={target_ids}; build the target with "
            f"ModelConfig.replace(aux_layer_ids={draft_cfg.aux_layer_ids})"
        )


class Buffer(nnx.Variable):
    """Non-trainable state that travels with the module (vocabulary maps)."""


class Eagle3MidLayer(nnx.Module):
    """The draft's decoder layer; attention reads ``[embedding, hidden]`` (2H wide)."""

    def __init__(self, cfg: DraftConfig, *, dtype, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        if cfg.mla is not None:
            from eagle_jax.models.deepseek import MLAttention

            self.self_attn = MLAttention(cfg.mla, dtype=dtype, rngs=rngs, d_in=2 * h)
        else:
            self.self_attn = Attention(cfg.layer_config, dtype=dtype, rngs=rngs, d_in=2 * h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(h, cfg.intermediate_size, dtype=dtype, rngs=rngs)
        self.norm_before_residual = cfg.norm_before_residual

    def __call__(self, emb, hidden, cos, sin, k_cache, v_cache, cache_slots, mask, plan: ExecutionPlan = XLA_PLAN):
        if self.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = self.hidden_norm(hidden)
        x = jnp.concatenate([self.input_layernorm(emb), hidden], axis=-1)  # [B, T, 2H]
        a, k_cache, v_cache = self.self_attn(x, cos, sin, k_cache, v_cache, cache_slots, mask, plan=plan)
        h = residual + a
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, k_cache, v_cache


class Eagle3Draft(nnx.Module):
    """EAGLE-3 draft: ``fc`` fusion, one mid layer, final norm, reduced-vocabulary head."""

    def __init__(self, cfg: DraftConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        init = jax.nn.initializers.normal(0.02)
        h, v, vd = cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size
        self.config = cfg
        self.fc = Linear(cfg.fc_in_features, h, axes=("features", "embed"), bias=False, dtype=dtype, rngs=rngs)
        self.midlayer = Eagle3MidLayer(cfg, dtype=dtype, rngs=rngs)
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        # Logical axes like the target's (the step table runs the draft replicated today:
        # ``sharding.replicated_rules``).
        self.lm_head = nnx.Param(init(rngs.params(), (h, vd), dtype), logical_axes=("embed", "draft_vocab"))  # [H, Vd]
        self.embed_tokens = nnx.Param(init(rngs.params(), (v, h), dtype), logical_axes=("vocab", "embed"))  # [V, H]
        # Identity map until a checkpoint says otherwise: draft id i is target id i.
        self.d2t = Buffer(jnp.zeros((vd,), jnp.int32), logical_axes=("draft_vocab",))
        self.t2d = Buffer(jnp.arange(v) < vd, logical_axes=("vocab",))

    def axis_sizes(self) -> dict[str, int]:
        """What each logical axis the draft may split counts (``draft_sharding="model"``;
        an MLA layer's heads are mirrored in ``num_attention_heads``)."""
        cfg = self.config
        return {"heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "mlp": cfg.intermediate_size,
                "vocab": cfg.vocab_size, "draft_vocab": cfg.draft_vocab_size}

    def fuse(self, features: Float[Array, "B T F"]) -> Float[Array, "B T H"]:
        """Project the concatenated target features (``F = len(aux) * Ht``) to the draft width."""
        return self.fc(features)

    def __call__(
        self,
        tokens: Int[Array, "B T"],
        hidden: Float[Array, "B T H"],
        positions: Int[Array, "B T"],
        cache: KVCache,
        cache_slots: Int[Array, "B T"],
        mask: Bool[Array, "B T S"],
        *,
        plan: ExecutionPlan = XLA_PLAN,
    ) -> tuple[Float[Array, "B T H"], KVCache]:
        """One draft step over T tokens.

        Args:
          tokens: target-vocabulary ids of the tokens being drafted from.
          hidden: the hidden state paired with each token (``fuse(features)`` or the
            draft's own previous output).
          positions: RoPE positions.
          cache: the draft's one-layer KV cache (S slots); returned updated.
          cache_slots: slot each token's key/value is written to (>= S: not written).
          mask: ``mask[b, t, s]`` True where token t may attend to slot s (after the write).
          plan: which kernels run (``kernels.plan``; default XLA's own).

        Returns:
          (pre-norm output ``[B, T, H]``, the input of the next draft step and of
          ``logits``; the updated cache).
        """
        cfg = self.config
        emb = jnp.take(self.embed_tokens[...], tokens, axis=0)
        if cfg.mla is not None:
            from eagle_jax.models.deepseek import MLACache, rope_tables

            cos, sin = rope_tables(positions, cfg.mla)
            h, lat, pe = self.midlayer(emb, hidden, cos, sin, cache.latent[0], cache.rope_key[0], cache_slots, mask, plan=plan)
            return h, MLACache(latent=[lat], rope_key=[pe])
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        cos, sin = rope_cos_sin(positions, inv_freq)
        h, k, v = self.midlayer(emb, hidden, cos, sin, cache.k[0], cache.v[0], cache_slots, mask, plan=plan)
        return h, KVCache(k=[k], v=[v])

    def cache_spec(self, batch: int, max_len: int, dtype) -> Any:
        """The abstract one-layer draft cache: KV for a Llama layer, the latent for MLA."""
        if self.config.mla is not None:
            from eagle_jax.models.deepseek import MLACache

            return MLACache.spec(self.config.mla, batch, max_len, dtype, layers=1)
        return KVCache.spec(self.config.layer_config, batch, max_len, dtype)

    def logits(self, h: Float[Array, "... H"]) -> Float[Array, "... Vd"]:
        """Draft-vocabulary logits (float32) of a pre-norm draft output."""
        return matmul(self.norm(h), self.lm_head[...]).astype(jnp.float32)

    def draft_to_target(self, ids: Int[Array, "..."]) -> Int[Array, "..."]:
        """Map draft-vocabulary ids to target-vocabulary ids."""
        return ids + self.d2t[...][ids]

