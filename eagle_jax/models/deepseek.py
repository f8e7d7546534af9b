"""The DeepSeek-V3 / Kimi-K2 target family: multi-head latent attention (MLA), mixture of
experts after ``first_k_dense_replace`` dense layers, YaRN RoPE.

What is computed follows transformers' ``models/deepseek_v3`` (the parity tests compare
logits with it); how it is computed differs where inference wants it to:

- **MLA with a latent cache.** Per token and layer the cache holds the normed 512-wide
  KV latent and the 64-wide rope key after RoPE (``MLACache``), 576 floats instead of
  the 2 * 128 * 192 of expanded keys and values: what SGLang's MLA backends cache.
  Attention runs in one of two forms (``mla_attention``), chosen per compiled shape by
  their FLOP counts: the *naive* form expands every cached latent into keys and values
  through ``kv_b_proj`` (cheap when the new tokens are many: prefill); the *absorbed*
  form folds ``kv_b_proj``'s key half into the query and its value half after the
  softmax, so attention reads the latents directly (cheap when the new tokens are few:
  decode and tree verification). Both are exact rewrites of the same product.
- **Exact mixture of experts** (``MoE``): every token goes to its top-k experts, with no
  capacity and no dropping. Four formulations: ``gather`` (one (token, choice) pair per
  scan step, reading its expert's matrices: what decode touches is what it reads),
  ``blocked`` (pairs sorted by expert into blocks of 16 rows, one expert read per
  block), ``ragged`` (the sorted pairs as one grouped product, ``jax.lax.ragged_dot``)
  and ``dense`` (every expert on every token, weighted by the routing: a reference).
  ``moe_impl_for`` picks per compiled shape, by the measurement in
  results/bench_moe.json on CPU. Routed experts may be INT4 packs
  (``eagle_jax.models.quant``), dequantized inside the product.
- RoPE on the rope part only; DeepSeek's checkpoints lay it out in interleaved pairs
  (``rope_interleave``), which is rotated in place of a de-interleaving copy, as
  transformers does: the output layout is de-interleaved for queries and keys alike, so
  their dot products are unchanged.

Feature layers, the cache contract and the forward signature are the target seam's
(``eagle_jax.models.target``); ``param_name_map`` maps parameters to the checkpoint's names,
one tensor per expert, stacked by the loader.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from eagle_jax.models.config import RopeScaling, _check_unsupported_fields, default_feature_layers
from eagle_jax.errors import ConfigError
from eagle_jax.models.quant import Int4Weight, QuantConfig
from eagle_jax.kernels.plan import XLA_PLAN, ExecutionPlan
from eagle_jax.validate import is_int
from eagle_jax.models.llama import MLP, Linear, PrefixMask, RMSNorm, TreeAttention, decoder_stack, head_logits, write_rows
from eagle_jax.models.target import ArraySpec, TargetFamily, register_target

ARCHITECTURES = ("DeepseekV3ForCausalLM",)
# Kimi-K2.5: a vision-language container whose text model (``text_config``, model_type
# kimi_k2) is a DeepSeek-V3; its tensors are named under ``language_model.`` and the
# vision tower's are not read.
KIMI_ARCHITECTURES = ("KimiK25ForConditionalGeneration",)
KIMI_WEIGHT_PREFIX = "language_model."
SUPPORTED_TOPK_METHODS = ("noaux_tc",)
SUPPORTED_SCORING = ("sigmoid",)
MOE_IMPLS = ("auto", "gather", "blocked", "dense", "ragged")
MOE_BLOCK = 16  # rows per block of the ``blocked`` formulation
MLA_FORMS = ("auto", "naive", "absorbed")


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class YarnRope:
    """YaRN RoPE parameters (Hugging Face ``rope_scaling`` with ``type: yarn``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """One MLA attention block: what ``MLAttention`` is built from (a DeepSeek-V3 target's
    layers, ``DeepseekV3Config.mla``, or an MLA EAGLE-3 draft's one layer)."""

    hidden_size: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float = 10000.0
    rope: YarnRope | None = None
    rope_interleave: bool = True
    attention_bias: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim) squared."""
        scale = self.qk_head_dim ** -0.5
        if self.rope is not None and self.rope.mscale_all_dim:
            m = yarn_get_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale = scale * m * m
        return scale

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], where: str = "config.json") -> "MLAConfig":
        required = ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        missing = [k for k in required if d.get(k) is None]
        if missing:
            raise ConfigError(f"{where} lacks required MLA field(s): {', '.join(missing)}")
        for k in required + ("q_lora_rank",):
            v = d.get(k)
            if v is None and k == "q_lora_rank":
                continue
            if not is_int(v) or v <= 0:
                raise ConfigError(f"{where}: {k}={v!r} must be a positive integer")
        if d["qk_rope_head_dim"] % 2:
            raise ConfigError(f"{where}: qk_rope_head_dim={d['qk_rope_head_dim']} must be even for RoPE")
        rope, theta = _rope_from_hf(d)
        return cls(
            hidden_size=d["hidden_size"], num_attention_heads=d["num_attention_heads"], kv_lora_rank=d["kv_lora_rank"],
            q_lora_rank=d.get("q_lora_rank"), qk_nope_head_dim=d["qk_nope_head_dim"], qk_rope_head_dim=d["qk_rope_head_dim"],
            v_head_dim=d["v_head_dim"], rope_theta=theta, rope=rope, rope_interleave=bool(d.get("rope_interleave", True)),
            attention_bias=bool(d.get("attention_bias", False)),
        )

    def to_hf_fields(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "hidden_size": self.hidden_size, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads, "kv_lora_rank": self.kv_lora_rank,
            "q_lora_rank": self.q_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim, "rope_theta": self.rope_theta,
            "rope_interleave": self.rope_interleave, "attention_bias": self.attention_bias,
        }
        if self.rope is not None:
            r = dataclasses.asdict(self.rope)
            d["rope_scaling"] = {"type": "yarn", **{k: v for k, v in r.items() if v is not None}}
        return d


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config:
    """A DeepSeek-V3 decoder (Kimi-K2's text model has this architecture).

    Fields mirror Hugging Face's names. ``rope`` is None for plain RoPE. ``aux_layer_ids``:
    the layers whose *input* residual stream is returned as EAGLE-3 features (default
    ``[2, N//2, N-3]``, as for the Llama family).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope: YarnRope | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "DeepseekV3ForCausalLM"
    aux_layer_ids: tuple[int, ...] | None = None
    weight_prefix: str = ""  # before every tensor name (``KIMI_WEIGHT_PREFIX`` for Kimi-K2.5)
    # The Llama-family draft helpers read these; a DeepSeek target has no such RoPE.
    rope_scaling: RopeScaling = RopeScaling()
    # INT4 routed experts (compressed-tensors pack-quantized): the scheme, and the MoE
    # layers whose experts it packs (from quantization_config's targets and ignore).
    quant: QuantConfig | None = None
    int4_moe_layers: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "max_position_embeddings"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ConfigError(f"config.json: {name}={value!r} must be a positive integer")
        if self.q_lora_rank is not None and (not is_int(self.q_lora_rank) or self.q_lora_rank <= 0):
            raise ConfigError(f"config.json: q_lora_rank={self.q_lora_rank!r} must be a positive integer or null")
        if not is_int(self.n_shared_experts) or self.n_shared_experts < 0:
            raise ConfigError(f"config.json: n_shared_experts={self.n_shared_experts} must be >= 0")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"config.json: qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE")
        if self.n_routed_experts % self.n_group:
            raise ConfigError(
                f"config.json: n_routed_experts={self.n_routed_experts} must be a multiple of n_group={self.n_group}"
            )
        per_group = self.n_routed_experts // self.n_group
        if per_group < 2:
            # Each group is scored by the sum of its two best experts (transformers' router).
            raise ConfigError(f"config.json: n_group={self.n_group} leaves {per_group} expert per group; the router needs >= 2")
        if self.topk_group > self.n_group:
            raise ConfigError(f"config.json: topk_group={self.topk_group} exceeds n_group={self.n_group}")
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ConfigError(
                f"config.json: num_experts_per_tok={self.num_experts_per_tok} exceeds the {self.topk_group * per_group} "
                f"experts in topk_group={self.topk_group} groups of {per_group}"
            )
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ConfigError(
                f"config.json: first_k_dense_replace={self.first_k_dense_replace} must be in [0, num_hidden_layers]"
            )
        if self.rms_norm_eps <= 0:
            raise ConfigError(f"config.json: rms_norm_eps={self.rms_norm_eps} must be > 0")
        for i in self.int4_moe_layers:
            if not self.is_moe_layer(i) or i >= self.num_hidden_layers or self.quant is None:
                raise ConfigError(f"int4_moe_layers={self.int4_moe_layers} has {i}, not a MoE layer with a quant scheme")
            self.quant.scale_columns(self.hidden_size, f"layer {i}'s experts (gate_proj, up_proj)")
            self.quant.scale_columns(self.moe_intermediate_size, f"layer {i}'s experts (down_proj)")
        for i in self.feature_layer_ids:
            if not 0 <= i <= self.num_hidden_layers:
                raise ConfigError(
                    f"aux_layer_ids={self.aux_layer_ids} has {i}, outside [0, {self.num_hidden_layers}]"
                )

    # The names the seam and the Llama-shaped draft helpers read.
    @property
    def feature_layer_ids(self) -> tuple[int, ...]:
        if self.aux_layer_ids is not None:
            return tuple(self.aux_layer_ids)
        return default_feature_layers(self.num_hidden_layers)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_key_value_heads(self) -> int:
        return self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.qk_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    @property
    def mla(self) -> MLAConfig:
        return MLAConfig(
            hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads, kv_lora_rank=self.kv_lora_rank,
            q_lora_rank=self.q_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim, rope_theta=self.rope_theta, rope=self.rope, rope_interleave=self.rope_interleave,
            attention_bias=self.attention_bias,
        )

    @property
    def softmax_scale(self) -> float:
        return self.mla.softmax_scale

    def replace(self, **changes: Any) -> "DeepseekV3Config":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "DeepseekV3Config":
        """From a ``config.json`` dict: a ``DeepseekV3ForCausalLM`` directory, or a Kimi-K2/K2.5
        one whose ``text_config`` is (its fields are read from there). A
        ``quantization_config`` (INT4 routed experts) is read from either level."""
        raw = d
        prefix = ""
        if isinstance(d.get("text_config"), dict):
            inner = d["text_config"]
            prefix = KIMI_WEIGHT_PREFIX
            archs = inner.get("architectures") or ["DeepseekV3ForCausalLM"]
            if inner.get("model_type") not in (None, "deepseek_v3", "kimi_k2") or archs[0] not in ARCHITECTURES:
                raise ConfigError(
                    f"config.json: text_config (model_type {inner.get('model_type')!r}, architectures {archs}) "
                    f"is not a DeepSeek-V3 text model; supported: model_type deepseek_v3 or kimi_k2"
                )
            d = {**inner, "architectures": archs}
        archs = d.get("architectures") or ["DeepseekV3ForCausalLM"]
        required = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "n_routed_experts", "num_experts_per_tok")
        missing = [k for k in required if d.get(k) is None]
        if missing:
            raise ConfigError(f"config.json lacks required field(s): {', '.join(missing)}")
        _check_unsupported_fields(d)
        topk_method = d.get("topk_method", "noaux_tc")
        if topk_method not in SUPPORTED_TOPK_METHODS:
            raise ConfigError(
                f"config.json: topk_method={topk_method!r} is not supported; supported: {', '.join(SUPPORTED_TOPK_METHODS)}"
            )
        scoring = d.get("scoring_func", "sigmoid")
        if scoring not in SUPPORTED_SCORING:
            raise ConfigError(
                f"config.json: scoring_func={scoring!r} is not supported; supported: {', '.join(SUPPORTED_SCORING)}"
            )
        freq = d.get("moe_layer_freq", 1)
        if freq != 1:
            raise ConfigError(f"config.json: moe_layer_freq={freq!r} is not supported; supported: 1 (every layer after the dense ones)")
        kv_heads = d.get("num_key_value_heads")
        if kv_heads is not None and kv_heads != d["num_attention_heads"]:
            raise ConfigError(
                f"config.json: num_key_value_heads={kv_heads} differs from num_attention_heads={d['num_attention_heads']}; "
                "MLA expands its latent into one key and value per head"
            )
        rope, theta = _rope_from_hf(d)
        eos = d.get("eos_token_id")
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        cfg = cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            moe_intermediate_size=int(d["moe_intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            kv_lora_rank=int(d["kv_lora_rank"]),
            q_lora_rank=None if d.get("q_lora_rank") is None else int(d["q_lora_rank"]),
            qk_nope_head_dim=int(d["qk_nope_head_dim"]),
            qk_rope_head_dim=int(d["qk_rope_head_dim"]),
            v_head_dim=int(d["v_head_dim"]),
            n_routed_experts=int(d["n_routed_experts"]),
            n_shared_experts=int(d.get("n_shared_experts") or 0),
            num_experts_per_tok=int(d["num_experts_per_tok"]),
            n_group=int(d.get("n_group") or 1),
            topk_group=int(d.get("topk_group") or 1),
            first_k_dense_replace=int(d.get("first_k_dense_replace") or 0),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope=rope,
            rope_interleave=bool(d.get("rope_interleave", True)),
            attention_bias=bool(d.get("attention_bias", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=archs[0],
            weight_prefix=prefix,
        )
        quant = QuantConfig.from_hf_dict(raw)
        return cfg if quant is None else cfg.replace(quant=quant, int4_moe_layers=_int4_moe_layers(cfg, quant))


def linear_modules(cfg: DeepseekV3Config) -> dict[str, int | None]:
    """Every linear module's checkpoint name (without ``.weight``) -> the MoE layer whose
    routed experts it belongs to, or None for the rest (attention, shared experts, dense
    MLPs, the head). The router is not a linear module (transformers' own class)."""
    pre = cfg.weight_prefix
    out: dict[str, int | None] = {}
    for i in range(cfg.num_hidden_layers):
        p = f"{pre}model.layers.{i}."
        q = ["q_proj"] if cfg.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
        for proj in q + ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]:
            out[f"{p}self_attn.{proj}"] = None
        for proj in ("gate_proj", "up_proj", "down_proj"):
            if cfg.is_moe_layer(i):
                for e in range(cfg.n_routed_experts):
                    out[f"{p}mlp.experts.{e}.{proj}"] = i
                if cfg.n_shared_experts:
                    out[f"{p}mlp.shared_experts.{proj}"] = None
            else:
                out[f"{p}mlp.{proj}"] = None
    out[f"{pre}lm_head"] = None
    return out


def _int4_moe_layers(cfg: DeepseekV3Config, quant: QuantConfig) -> tuple[int, ...]:
    """The MoE layers whose experts ``quant`` packs: all of a layer's experts or none, and
    nothing but routed experts (Kimi-K2.5's layout; the rest stays high precision)."""
    packed: dict[int, set[bool]] = {}
    for name, layer in linear_modules(cfg).items():
        q = quant.quantizes(name)
        if layer is None:
            if q:
                raise ConfigError(
                    f"config.json: quantization_config packs {name}; eagle-jax reads INT4 for routed experts only "
                    "(attention, shared experts, dense MLPs and the head must be in its ignore list)"
                )
            continue
        packed.setdefault(layer, set()).add(q)
    mixed = [i for i, v in packed.items() if len(v) > 1]
    if mixed:
        raise ConfigError(
            f"config.json: quantization_config packs some but not all experts of layer(s) {mixed}; "
            "supported: a MoE layer's experts all packed or all in high precision"
        )
    layers = tuple(sorted(i for i, v in packed.items() if True in v))
    if not layers:
        raise ConfigError("config.json: quantization_config packs no routed expert (check its targets and ignore)")
    return layers


def _rope_from_hf(d: dict[str, Any]) -> tuple[YarnRope | None, float]:
    rs = d.get("rope_scaling") or {}
    rp = d.get("rope_parameters") or {}  # transformers >= 5 may write this instead
    if not isinstance(rp, dict):
        raise ConfigError(f"config.json: rope_parameters={rp!r} must be an object")
    if not rs and rp.get("rope_type", "default") != "default":
        rs = rp
    theta = float(d.get("rope_theta", rp.get("rope_theta", 10000.0)))
    kind = rs.get("rope_type", rs.get("type", "default")) if rs else "default"
    if kind == "default":
        return None, theta
    if kind != "yarn":
        raise ConfigError(f"config.json: rope_scaling type {kind!r} is not supported for DeepSeek-V3; supported: yarn, default")
    orig = rs.get("original_max_position_embeddings")
    if not is_int(orig) or orig <= 0:
        raise ConfigError(f"config.json: rope_scaling.original_max_position_embeddings={orig!r} must be a positive integer")
    factor = rs.get("factor")
    if factor is None:
        factor = d.get("max_position_embeddings", 4096) / orig
    if float(factor) <= 0:
        raise ConfigError(f"config.json: rope_scaling.factor={factor!r} must be > 0")

    def opt(key):
        v = rs.get(key)
        return None if v is None else float(v)

    return YarnRope(
        factor=float(factor), original_max_position_embeddings=orig,
        beta_fast=float(rs.get("beta_fast") or 32), beta_slow=float(rs.get("beta_slow") or 1),
        mscale=opt("mscale"), mscale_all_dim=opt("mscale_all_dim"), attention_factor=opt("attention_factor"),
        truncate=bool(rs.get("truncate", True)),
    ), theta


# ----------------------------------------------------------------------------- RoPE


@functools.lru_cache(maxsize=None)
def yarn_inv_freq(dim: int, theta: float, rope: YarnRope | None) -> tuple[np.ndarray, float]:
    """Inverse frequencies ``[dim // 2]`` (float32) and the factor cos/sin are scaled by
    (YaRN's attention factor; 1 for plain RoPE), as transformers computes them."""
    pos_freqs = (theta ** (np.arange(0, dim, 2).astype(np.float32) / dim)).astype(np.float32)
    extrap = (1.0 / pos_freqs).astype(np.float32)
    if rope is None:
        return extrap, 1.0
    f = rope.factor
    interp = (1.0 / (f * pos_freqs)).astype(np.float32)
    if rope.attention_factor is not None:
        attn = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attn = yarn_get_mscale(f, rope.mscale) / yarn_get_mscale(f, rope.mscale_all_dim)
    else:
        attn = yarn_get_mscale(f)

    def corr_dim(rot):
        return (dim * math.log(rope.original_max_position_embeddings / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = corr_dim(rope.beta_fast), corr_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoids a division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrap_factor = 1 - ramp
    inv = interp * (1 - extrap_factor) + extrap * extrap_factor
    return inv.astype(np.float32), float(attn)


def rope_tables(positions: Int[Array, "B T"], cfg: "MLAConfig | DeepseekV3Config") -> tuple[Float[Array, "B T D2"], Float[Array, "B T D2"]]:
    """cos and sin ``[B, T, rope_dim / 2]`` (one per frequency), with YaRN's scaling."""
    inv, attn = yarn_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv)
    return jnp.cos(freqs) * attn, jnp.sin(freqs) * attn


def apply_rope_ds(x: Float[Array, "B T N D"], cos, sin, interleave: bool) -> Float[Array, "B T N D"]:
    """RoPE over the last dim. Interleaved: pairs (x0, x1), (x2, x3), ...; the result is
    laid out [rotated evens, rotated odds] (queries and keys alike). Otherwise the
    half-split layout."""
    c, s = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


# ----------------------------------------------------------------------------- MLA


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MLACache:
    """Per layer: the normed KV latent ``[B, S, kv_lora_rank]`` and the rope key after
    RoPE ``[B, S, qk_rope_head_dim]``; slot s holds position s."""

    latent: list[Array]
    rope_key: list[Array]

    @staticmethod
    def spec(cfg, batch: int, max_len: int, dtype=jnp.float32, layers: int | None = None) -> "MLACache":
        """``cfg``: a ``DeepseekV3Config`` (one entry per layer) or an ``MLAConfig`` with ``layers``."""
        n = cfg.num_hidden_layers if layers is None else layers
        lat = ArraySpec((batch, max_len, cfg.kv_lora_rank), jnp.dtype(dtype), ("batch", "cache_seq", "latent"))
        pe = ArraySpec((batch, max_len, cfg.qk_rope_head_dim), jnp.dtype(dtype), ("batch", "cache_seq", "head_dim"))
        return MLACache(latent=[lat] * n, rope_key=[pe] * n)


def dense_mask(mask, tree: TreeAttention | None, t: int, s: int) -> Bool[Array, "B T S"]:
    """Any mask the step math passes, as ``[B, T, S]`` booleans over the cache."""
    if tree is not None:
        rel = jnp.arange(s)[None, None, :] - tree.seq_lens[:, None, None]
        inside = jnp.take_along_axis(
            tree.tree_mask, jnp.broadcast_to(jnp.clip(rel, 0, t - 1), (tree.tree_mask.shape[0], t, s)), axis=2
        )
        return (rel < 0) | ((rel < t) & inside)
    if isinstance(mask, PrefixMask):
        return mask.dense(s)
    if mask is None or not hasattr(mask, "shape"):
        # StepDiagonalMask: draft training's unrolled steps (not implemented for an MLA draft).
        raise ConfigError(f"MLA attention takes a boolean mask, a PrefixMask or a tree, not a {type(mask).__name__} "
                          "(training an MLA draft is not supported; it can be loaded and run)")
    return mask


def mla_form(cfg: "MLAConfig | DeepseekV3Config", t: int, s: int) -> str:
    """The cheaper attention form for T new tokens over S cache slots, by multiply-adds
    per head: naive expands S latents (S * r * (nope + v)) then attends with 192/128-wide
    keys/values; absorbed moves T queries and outputs through kv_b (T * r * (nope + v))
    then attends with r + rope wide keys and r wide values."""
    r, nope, rope, v = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    naive = s * r * (nope + v) + t * s * (nope + rope + v)
    absorbed = t * r * (nope + v) + t * s * (2 * r + rope)
    return "absorbed" if absorbed < naive else "naive"


def mla_attention(
    q_nope: Float[Array, "B T N Dn"], q_pe: Float[Array, "B T N Dr"], latent: Float[Array, "B S R"],
    rope_key: Float[Array, "B S Dr"], kv_b: Float[Array, "R NDv"], mask: Bool[Array, "B T S"],
    *, nope: int, v_dim: int, scale: float, form: str,
) -> Float[Array, "B T N Dv"]:
    """Attention of T queries over the latent cache (float32 softmax).

    ``kv_b`` is ``kv_b_proj``'s kernel ``[R, N * (nope + v)]``: per head, its first
    ``nope`` columns give the key's nope part, the rest the value. ``form`` naive or
    absorbed (see ``mla_form``); both compute the same numbers up to rounding."""
    b, t, n, _ = q_nope.shape
    w = kv_b.reshape(kv_b.shape[0], n, nope + v_dim)
    w_k, w_v = w[..., :nope], w[..., nope:]
    s_pe = jnp.einsum("btnd,bsd->bnts", q_pe, rope_key, preferred_element_type=jnp.float32)
    if form == "absorbed":
        q_lat = jnp.einsum("btnd,rnd->btnr", q_nope, w_k)
        scores = jnp.einsum("btnr,bsr->bnts", q_lat, latent, preferred_element_type=jnp.float32) + s_pe
    elif form == "naive":
        k_nope = jnp.einsum("bsr,rnd->bsnd", latent, w_k)
        scores = jnp.einsum("btnd,bsnd->bnts", q_nope, k_nope, preferred_element_type=jnp.float32) + s_pe
    else:
        raise ValueError(f"MLA form {form!r}; valid: naive, absorbed")
    scores = jnp.where(mask[:, None], scores * scale, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1).astype(latent.dtype)
    if form == "absorbed":
        o_lat = jnp.einsum("bnts,bsr->btnr", p, latent)
        return jnp.einsum("btnr,rnv->btnv", o_lat, w_v)
    values = jnp.einsum("bsr,rnv->bsnv", latent, w_v)
    return jnp.einsum("bnts,bsnv->btnv", p, values)


class MLAttention(nnx.Module):
    """Multi-head latent attention with a latent cache (``MLACache``)."""

    def __init__(self, cfg: MLAConfig, *, dtype, rngs: nnx.Rngs, form: str = "auto", d_in: int | None = None):
        """``d_in``: the input width (an EAGLE-3 draft's layer reads [embedding, hidden], 2H);
        the output is ``hidden_size`` wide."""
        if form not in MLA_FORMS:
            raise ConfigError(f"MLA form {form!r}; valid: {', '.join(MLA_FORMS)}")
        h, n = d_in or cfg.hidden_size, cfg.num_attention_heads
        bias = cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(h, n * cfg.qk_head_dim, axes=("embed", "heads"), bias=False, dtype=dtype, rngs=rngs)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(h, cfg.q_lora_rank, axes=("embed", "latent"), bias=bias, dtype=dtype, rngs=rngs)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6, dtype, axis="latent")
            self.q_b_proj = Linear(cfg.q_lora_rank, n * cfg.qk_head_dim, axes=("latent", "heads"), bias=False, dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, axes=("embed", "latent"),
                                         bias=bias, dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6, dtype, axis="latent")
        # Not a Linear: attention reads it reshaped per head (absorbed form), so it is never
        # packed for the CPU kernel.
        self.kv_b = nnx.Param(
            jax.nn.initializers.normal(0.02)(rngs.params(), (cfg.kv_lora_rank, n * (cfg.qk_nope_head_dim + cfg.v_head_dim)), dtype),
            logical_axes=("latent", "heads"),
        )
        self.o_proj = Linear(n * cfg.v_head_dim, cfg.hidden_size, axes=("heads", "embed"), bias=bias, dtype=dtype, rngs=rngs)
        self.cfg = cfg
        self.form = form

    def __call__(self, x, cos, sin, latent_cache, rope_cache, cache_slots, mask, tree=None, plan: ExecutionPlan = XLA_PLAN):
        del plan  # MLA attends in XLA under a dense mask on every plan
        cfg = self.cfg
        b, t, _ = x.shape
        n, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(b, t, n, cfg.qk_head_dim)
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        kv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(kv[..., : cfg.kv_lora_rank])
        k_pe = kv[..., cfg.kv_lora_rank:][:, :, None, :]
        q_pe = apply_rope_ds(q_pe, cos, sin, cfg.rope_interleave)
        k_pe = apply_rope_ds(k_pe, cos, sin, cfg.rope_interleave)[:, :, 0, :]
        latent_cache = write_rows(latent_cache, cache_slots, latent)
        rope_cache = write_rows(rope_cache, cache_slots, k_pe)
        s = latent_cache.shape[1]
        form = mla_form(cfg, t, s) if self.form == "auto" else self.form
        out = mla_attention(
            q_nope, q_pe, latent_cache, rope_cache, self.kv_b[...], dense_mask(mask, tree, t, s),
            nope=nope, v_dim=cfg.v_head_dim, scale=cfg.softmax_scale, form=form,
        )
        return self.o_proj(out.reshape(b, t, n * cfg.v_head_dim)), latent_cache, rope_cache


# ----------------------------------------------------------------------------- MoE


def route(
    x: Float[Array, "N H"], weight: Float[Array, "E H"], bias: Float[Array, "E"], cfg: DeepseekV3Config
) -> tuple[Float[Array, "N K"], Int[Array, "N K"]]:
    """DeepSeek-V3's router (``noaux_tc``): sigmoid scores in float32; the correction bias
    is added for choosing only; groups ranked by the sum of their two best biased scores,
    the best ``topk_group`` kept; the top-k experts among them; their unbiased scores,
    normalised when ``norm_topk_prob``, times ``routed_scaling_factor``."""
    e, g = cfg.n_routed_experts, cfg.n_group
    scores = jax.nn.sigmoid(x.astype(jnp.float32) @ weight.astype(jnp.float32).T)
    choice = scores + bias.astype(jnp.float32)
    if g > 1 and cfg.topk_group < g:
        grouped = choice.reshape(-1, g, e // g)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, G]
        _, keep = jax.lax.top_k(group_scores, cfg.topk_group)
        group_mask = jnp.zeros_like(group_scores, dtype=bool).at[jnp.arange(x.shape[0])[:, None], keep].set(True)
        choice = jnp.where(jnp.repeat(group_mask, e // g, axis=1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    w = jnp.take_along_axis(scores, idx, axis=1)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor, idx


def moe_impl_for(n_tokens: int, k: int, n_experts: int, backend: str, int4: bool = False) -> str:
    """``gather`` while the (token, choice) pairs are no more than the experts (half the
    experts for INT4 packs, whose unpacking ``gather`` repeats per pair): each pair
    reads one expert's matrices, so decode reads only the experts it uses. Past that,
    experts repeat across pairs and a grouped form reads (and unpacks) each used expert
    once per block: ``blocked`` on CPU (fastest there, within 1.1x of the best
    formulation at every measured point: scripts/bench_moe.py, results/bench_moe.json;
    XLA CPU runs ``ragged_dot`` and the dense form 3-20x slower), ``ragged``
    (``jax.lax.ragged_dot``, a grouped GEMM) on accelerators, unmeasured here."""
    if n_tokens * k <= (n_experts // 2 if int4 else n_experts):
        return "gather"
    return "blocked" if backend == "cpu" else "ragged"


ExpertMatrices = Float[Array, "E In Out"] | Int4Weight


def _take(w: ExpertMatrices, idx: Int[Array, "J"]) -> Float[Array, "J In Out"]:
    return w.take(idx) if isinstance(w, Int4Weight) else w[idx]


def _full(w: ExpertMatrices) -> Float[Array, "E In Out"]:
    return w.full() if isinstance(w, Int4Weight) else w


def experts_forward(
    x: Float[Array, "N H"], w: Float[Array, "N K"], idx: Int[Array, "N K"],
    gate: ExpertMatrices, up: ExpertMatrices, down: ExpertMatrices, *, impl: str,
) -> Float[Array, "N H"]:
    """Σ_k w[n, k] * expert_{idx[n, k]}(x[n]) exactly, with SwiGLU experts.

    ``gate``/``up`` are ``[E, H, I]`` and ``down`` ``[E, I, H]`` float stacks, or the same
    as packed INT4 (``Int4Weight``), dequantized here inside the compiled step: ``gather``
    unpacks only the experts it reads."""
    n, h = x.shape
    k = idx.shape[1]
    e = (gate.packed if isinstance(gate, Int4Weight) else gate).shape[0]
    if impl == "dense":
        gate, up, down = _full(gate), _full(up), _full(down)
        combine = jnp.zeros((n, e), jnp.float32).at[jnp.arange(n)[:, None], idx].add(w)  # [N, E]
        a = jax.nn.silu(jnp.einsum("nh,ehi->nei", x, gate)) * jnp.einsum("nh,ehi->nei", x, up)
        y = jnp.einsum("nei,eih->neh", a, down)
        return jnp.einsum("neh,ne->nh", y, combine.astype(y.dtype))
    if impl == "gather":
        flat = idx.reshape(-1)
        xs = jnp.repeat(x, k, axis=0)  # [N*K, H], pair j = (token j // K, choice j % K)

        # One (token, choice) pair per iteration, reading its expert's three matrices in
        # place: a gathered [N*K, H, I] copy and a batched matrix-vector product cost XLA
        # CPU 4x more at 4+ tokens (scripts/bench_moe.py).
        def pair(_, j):
            e_j = flat[j][None]
            a = jax.nn.silu(xs[j] @ _take(gate, e_j)[0]) * (xs[j] @ _take(up, e_j)[0])
            return None, a @ _take(down, e_j)[0]

        _, y = jax.lax.scan(pair, None, jnp.arange(n * k))
        return jnp.einsum("nkh,nk->nh", y.reshape(n, k, h), w.astype(y.dtype))
    if impl == "blocked":
        return _blocked(x, w, idx, gate, up, down, e)
    if impl == "ragged":
        gate, up, down = _full(gate), _full(up), _full(down)
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        xs = jnp.repeat(x, k, axis=0)[order]
        sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
        a = jax.nn.silu(jax.lax.ragged_dot(xs, gate, sizes)) * jax.lax.ragged_dot(xs, up, sizes)
        y_sorted = jax.lax.ragged_dot(a, down, sizes)
        y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(n, k, h)
        return jnp.einsum("nkh,nk->nh", y, w.astype(y.dtype))
    raise ValueError(f"MoE impl {impl!r}; valid: {', '.join(MOE_IMPLS[1:])}")


def _blocked(x, w, idx, gate, up, down, e: int, block: int = MOE_BLOCK):
    """Grouped expert products without ``ragged_dot`` (slow on XLA CPU): the (token,
    choice) pairs sorted by expert, each expert's run padded to whole blocks of
    ``block`` rows, then one block per scan step, reading its expert's matrices once
    per block instead of once per pair. The block count is the static bound; steps past
    the last used block are skipped. Exact: padding rows are zeros and are
    never read back."""
    n, h = x.shape
    k = idx.shape[1]
    pairs = n * k
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # sorted pair r is pair order[r]
    sizes = jnp.bincount(flat, length=e)
    padded = (sizes + block - 1) // block * block
    start = jnp.cumsum(sizes) - sizes  # first sorted row of each expert
    pstart = jnp.cumsum(padded) - padded  # first padded row of each expert
    sorted_e = flat[order]
    dest = pstart[sorted_e] + jnp.arange(pairs) - start[sorted_e]  # padded row of sorted pair r
    # Σ_e ceil(size_e / block) over the (at most min(E, pairs)) experts in use.
    n_blocks = (pairs + min(e, pairs) * (block - 1)) // block
    xs = jnp.zeros((n_blocks * block, h), x.dtype).at[dest].set(jnp.repeat(x, k, axis=0)[order])
    used = jnp.sum(padded) // block
    # The expert of block b: the last expert whose padded run starts at or before it.
    block_e = jnp.clip(jnp.searchsorted(pstart + padded, jnp.arange(n_blocks) * block, side="right"), 0, e - 1)

    def step(_, b):
        def run():
            rows = jax.lax.dynamic_slice_in_dim(xs, b * block, block)
            eb = block_e[b][None]
            a = jax.nn.silu(rows @ _take(gate, eb)[0]) * (rows @ _take(up, eb)[0])
            return a @ _take(down, eb)[0]
        return None, jax.lax.cond(b < used, run, lambda: jnp.zeros((block, h), x.dtype))

    _, y = jax.lax.scan(step, None, jnp.arange(n_blocks))
    y_pairs = jnp.zeros((pairs, h), y.dtype).at[order].set(y.reshape(-1, h)[dest])
    return jnp.einsum("nkh,nk->nh", y_pairs.reshape(n, k, h), w.astype(y.dtype))


def _expert_parallel(x, w, idx, mats, impl: str, plan: ExecutionPlan) -> Float[Array, "N H"]:
    """Experts split over the mesh's ``expert`` axis (``E / shards`` per shard, the
    parameters' "experts" rule): every shard sees every token (activations are
    replicated over ``expert``), runs the (token, choice) pairs routed to its own
    experts, with the others' weights zeroed, and one all-reduce over ``expert`` sums
    the shards. Exact: each pair is computed on exactly one shard. What it saves is
    memory (each device holds its experts only) and expert reads; the formulation
    inside a shard is chosen for its local expert count. The mesh is the plan's."""
    e = (mats[0].packed if isinstance(mats[0], Int4Weight) else mats[0]).shape[0]
    local_e = e // plan.expert_shards
    k = idx.shape[1]

    def local(x, w, idx, *mats):
        first = jax.lax.axis_index("expert") * local_e
        mine = (idx >= first) & (idx < first + local_e)
        li = jnp.where(mine, idx - first, 0)
        lw = jnp.where(mine, w, 0.0)
        chosen = impl if impl != "auto" else moe_impl_for(x.shape[0], k, local_e, plan.backend,
                                                          int4=isinstance(mats[0], Int4Weight))
        return jax.lax.psum(experts_forward(x, lw, li, *mats, impl=chosen), "expert")

    spec = jax.sharding.PartitionSpec
    mat_specs = tuple(Int4Weight(spec("expert"), spec("expert")) if isinstance(m, Int4Weight) else spec("expert")
                      for m in mats)
    return jax.shard_map(local, mesh=plan.mesh, in_specs=(spec(), spec(), spec()) + mat_specs, out_specs=spec(),
                         axis_names={"expert"}, check_vma=False)(x, w, idx, *mats)


class MoE(nnx.Module):
    """Routed experts plus the shared experts (a SwiGLU MLP ``n_shared_experts`` wide).

    With ``int4`` the routed experts are held as compressed-tensors packs in their
    checkpoint layout (``experts_{gate,up,down}_packed`` int32 ``[E, out, in/8]`` and
    ``_scale`` ``[E, out, in/group]``) and dequantized inside the product."""

    def __init__(self, cfg: DeepseekV3Config, *, dtype, rngs: nnx.Rngs, impl: str = "auto", int4: bool = False):
        if impl not in MOE_IMPLS:
            raise ConfigError(f"MoE impl {impl!r}; valid: {', '.join(MOE_IMPLS)}")
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        init = jax.nn.initializers.normal(0.02)
        # The router stays float32 whatever the compute dtype (transformers keeps it so),
        # and replicated: every shard routes every token (E x H floats; split over the
        # expert axis its top-k would need a collective per layer).
        self.gate_weight = nnx.Param(init(rngs.params(), (e, h), jnp.float32), logical_axes=(None, "embed"))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((e,), jnp.float32), logical_axes=(None,))
        self.int4 = int4
        for name, d_in, d_out, axes in (("gate", h, i, ("embed", "mlp")), ("up", h, i, ("embed", "mlp")),
                                        ("down", i, h, ("mlp", "embed"))):
            if int4:
                shapes = cfg.quant.packed_shapes(d_out, d_in, f"experts' {name}_proj")
                setattr(self, f"experts_{name}_packed", nnx.Param(
                    jnp.zeros((e,) + shapes["weight_packed"], jnp.int32), logical_axes=("experts", axes[1], None)))
                setattr(self, f"experts_{name}_scale", nnx.Param(
                    jnp.ones((e,) + shapes["weight_scale"], dtype), logical_axes=("experts", axes[1], None)))
            else:
                setattr(self, f"experts_{name}", nnx.Param(
                    init(rngs.params(), (e, d_in, d_out), dtype), logical_axes=("experts",) + axes))
        self.shared = (
            MLP(h, i * cfg.n_shared_experts, dtype=dtype, rngs=rngs) if cfg.n_shared_experts else None
        )
        self.cfg = cfg
        self.impl = impl

    def __call__(self, x: Float[Array, "B T H"], plan: ExecutionPlan = XLA_PLAN) -> Float[Array, "B T H"]:
        cfg = self.cfg
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        w, idx = route(flat, self.gate_weight[...], self.e_score_correction_bias[...], cfg)
        mats = tuple(self._experts(n) for n in ("gate", "up", "down"))
        if plan.expert_shards > 1:  # the plan's mesh splits the experts
            y = _expert_parallel(flat, w, idx, mats, self.impl, plan)
        else:
            y = experts_forward(flat, w, idx, *mats, impl=self._impl(flat.shape[0], cfg.n_routed_experts, plan.backend))
        y = y.reshape(shape)
        if self.shared is not None:
            y = y + self.shared(x)
        return y

    def _impl(self, n_tokens: int, n_experts: int, backend: str) -> str:
        if self.impl != "auto":
            return self.impl
        return moe_impl_for(n_tokens, self.cfg.num_experts_per_tok, n_experts, backend, int4=self.int4)

    def _experts(self, name: str) -> ExpertMatrices:
        if self.int4:
            return Int4Weight(getattr(self, f"experts_{name}_packed")[...], getattr(self, f"experts_{name}_scale")[...])
        return getattr(self, f"experts_{name}")[...]


# ----------------------------------------------------------------------------- model


class DeepseekDecoderLayer(nnx.Module):
    def __init__(self, cfg: DeepseekV3Config, i: int, *, dtype, rngs: nnx.Rngs, moe_impl: str, mla_form: str):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = MLAttention(cfg.mla, dtype=dtype, rngs=rngs, form=mla_form)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = (
            MoE(cfg, dtype=dtype, rngs=rngs, impl=moe_impl, int4=i in cfg.int4_moe_layers) if cfg.is_moe_layer(i)
            else MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)
        )

    def __call__(self, h, cos, sin, latent, rope_key, cache_slots, mask, tree=None, plan: ExecutionPlan = XLA_PLAN):
        a, latent, rope_key = self.self_attn(self.input_layernorm(h), cos, sin, latent, rope_key, cache_slots, mask, tree)
        h = h + a
        x = self.post_attention_layernorm(h)
        h = h + (self.mlp(x, plan) if isinstance(self.mlp, MoE) else self.mlp(x))
        return h, latent, rope_key


class DeepseekV3Model(nnx.Module):
    """A DeepSeek-V3 decoder with a static latent cache (the target seam's forward).

    ``moe_impl`` and ``mla_form`` pick the formulations ("auto": by the compiled shape;
    tests force each to check them against one another)."""

    def __init__(self, cfg: DeepseekV3Config, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 moe_impl: str = "auto", mla_form: str = "auto"):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = cfg
        self.dtype = dtype
        init = jax.nn.initializers.normal(0.02)
        self.embed_tokens = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype), logical_axes=("vocab", "embed"))
        self.layers = nnx.List([
            DeepseekDecoderLayer(cfg, i, dtype=dtype, rngs=rngs, moe_impl=moe_impl, mla_form=mla_form)
            for i in range(cfg.num_hidden_layers)
        ])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = nnx.Param(
            jnp.asarray(self.embed_tokens[...].T) if cfg.tie_word_embeddings
            else init(rngs.params(), (cfg.hidden_size, cfg.vocab_size), dtype),
            logical_axes=("embed", "vocab"),
        )

    def embed(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T H"]:
        return jnp.take(self.embed_tokens[...], tokens, axis=0)

    def __call__(self, tokens, positions, cache: MLACache, cache_slots, mask, *, return_features: bool = False, tree=None,
                 plan: ExecutionPlan = XLA_PLAN):
        """As ``LlamaModel.__call__`` (the target seam), over an ``MLACache``; ``plan``
        gives the MoE layers the backend and the mesh whose ``expert`` axis splits them."""
        cfg = self.config
        cos, sin = rope_tables(positions, cfg)
        # MLA attends under a dense mask: built once here, not once per layer.
        dense = dense_mask(mask, tree, tokens.shape[1], cache.latent[0].shape[1])

        def run(i, h):
            h, lat, pe = self.layers[i](h, cos, sin, cache.latent[i], cache.rope_key[i], cache_slots, dense, plan=plan)
            return h, (lat, pe)

        h, features, c = decoder_stack(self.embed(tokens), cfg.num_hidden_layers, cfg.feature_layer_ids, return_features, run)
        return self.norm(h), features, MLACache(latent=[a for a, _ in c], rope_key=[b for _, b in c])

    def logits(self, hidden: Float[Array, "... H"]) -> Float[Array, "... V"]:
        return head_logits(hidden, self.lm_head[...], self.embed_tokens[...], self.config.tie_word_embeddings)

    def cache_spec(self, batch: int, max_len: int) -> MLACache:
        return MLACache.spec(self.config, batch, max_len, self.dtype)

    def axis_sizes(self) -> dict[str, int]:
        cfg = self.config
        widths = [cfg.intermediate_size] if cfg.first_k_dense_replace else []
        widths += [cfg.moe_intermediate_size] + ([cfg.moe_intermediate_size * cfg.n_shared_experts] if cfg.n_shared_experts else [])
        return {"heads": cfg.num_attention_heads, "kv_heads": cfg.num_attention_heads,
                "mlp": math.gcd(*widths), "vocab": cfg.vocab_size, "experts": cfg.n_routed_experts}


def param_name_map(cfg: DeepseekV3Config) -> dict:
    """NNX path -> (checkpoint name, transpose?); a tuple of names is one tensor per expert,
    stacked on a new leading axis (``target.checkpoint_shapes``)."""
    names: dict = {("embed_tokens",): ("model.embed_tokens.weight", False)}
    for i in range(cfg.num_hidden_layers):
        p, lp = f"model.layers.{i}.", ("layers", i)
        names[lp + ("input_layernorm", "weight")] = (p + "input_layernorm.weight", False)
        names[lp + ("post_attention_layernorm", "weight")] = (p + "post_attention_layernorm.weight", False)
        a, ap = lp + ("self_attn",), p + "self_attn."
        projs = ["kv_a_proj_with_mqa", "o_proj"] + (["q_proj"] if cfg.q_lora_rank is None else ["q_a_proj", "q_b_proj"])
        for proj in projs:
            names[a + (proj, "kernel")] = (ap + f"{proj}.weight", True)
        if cfg.attention_bias:
            for proj in ["kv_a_proj_with_mqa", "o_proj"] + ([] if cfg.q_lora_rank is None else ["q_a_proj"]):
                names[a + (proj, "bias")] = (ap + f"{proj}.bias", False)
        names[a + ("kv_b",)] = (ap + "kv_b_proj.weight", True)
        names[a + ("kv_a_layernorm", "weight")] = (ap + "kv_a_layernorm.weight", False)
        if cfg.q_lora_rank is not None:
            names[a + ("q_a_layernorm", "weight")] = (ap + "q_a_layernorm.weight", False)
        m, mp = lp + ("mlp",), p + "mlp."
        if cfg.is_moe_layer(i):
            names[m + ("gate_weight",)] = (mp + "gate.weight", False)
            names[m + ("e_score_correction_bias",)] = (mp + "gate.e_score_correction_bias", False)
            for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                per_expert = [f"{mp}experts.{e}.{theirs}" for e in range(cfg.n_routed_experts)]
                if i in cfg.int4_moe_layers:  # packed: kept in the checkpoint's [out, ...] layout
                    for part in ("packed", "scale"):
                        names[m + (f"experts_{ours}_{part}",)] = (tuple(f"{n}.weight_{part}" for n in per_expert), False)
                else:
                    names[m + (f"experts_{ours}",)] = (tuple(f"{n}.weight" for n in per_expert), True)
            if cfg.n_shared_experts:
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    names[m + ("shared", proj, "kernel")] = (mp + f"shared_experts.{proj}.weight", True)
        else:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names[m + (proj, "kernel")] = (mp + f"{proj}.weight", True)
    names[("norm", "weight")] = ("model.norm.weight", False)
    names[("lm_head",)] = ("model.embed_tokens.weight", True) if cfg.tie_word_embeddings else ("lm_head.weight", True)
    pre = cfg.weight_prefix

    def prefixed(name):
        return tuple(pre + n for n in name) if isinstance(name, tuple) else pre + name

    return {path: (prefixed(name), t) for path, (name, t) in names.items()}


register_target(ARCHITECTURES + KIMI_ARCHITECTURES, TargetFamily("deepseek_v3", DeepseekV3Config.from_hf_dict, DeepseekV3Model, param_name_map))
