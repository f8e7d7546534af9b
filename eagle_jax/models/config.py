"""Model configuration: a frozen, validated, hashable description of a Llama-family target.

Built from a Hugging Face ``config.json`` (``ModelConfig.from_hf_dict``). Hashable so it
can be a static argument of jitted functions.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from eagle_jax.errors import CheckpointError, ConfigError
from eagle_jax.validate import is_int

# Architectures whose decoder we implement. Qwen2 adds q/k/v biases, Qwen3 adds q/k
# RMSNorm; everything else is the Llama decoder.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def read_config_json(path: str | Path, kind: str) -> dict[str, Any]:
    """The JSON object in ``path/config.json``; ``kind`` names the directory in errors."""
    path = Path(path)
    cfg_path = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(f"{kind} directory {path} does not exist")
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path} not found: a {kind} directory needs config.json")
    try:
        d = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON: {e}") from e
    if not isinstance(d, dict):
        raise CheckpointError(f"{cfg_path} must hold a JSON object")
    return d


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default feature layers for N layers: the streams entering ``[2, N//2, N-3]``
    (clamped for N < 3). Every target family and the draft format share this rule."""
    n = num_layers
    return (min(2, n - 1), n // 2, max(n - 3, 0))


SUPPORTED_ACTIVATIONS = ("silu", "swish")  # the same function under two names


def _check_unsupported_fields(d: dict[str, Any]) -> None:
    """Refuse config.json fields that change the computation in ways this decoder does not
    implement, naming the field: silently dropping one gives a model that loads and is
    wrong."""
    act = d.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ConfigError(f"config.json: hidden_act={act!r} is not supported; supported: silu")
    window = d.get("sliding_window")
    if window is not None and d.get("use_sliding_window", True):
        ctx = d.get("max_position_embeddings", 2048)
        if not is_int(window) or window < ctx:
            raise ConfigError(
                f"config.json: sliding_window={window!r} (with use_sliding_window not false) is not supported: "
                f"this decoder attends over the whole context (max_position_embeddings={ctx}); supported: "
                "sliding_window null, use_sliding_window false, or a window >= max_position_embeddings"
            )
    rs = d.get("rope_scaling")
    if rs is not None and not isinstance(rs, dict):
        raise ConfigError(f"config.json: rope_scaling={rs!r} must be an object or null")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (Hugging Face ``rope_scaling``)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"config.json: rope_scaling.rope_type={self.rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.factor <= 0:
            raise ConfigError(f"rope_scaling.factor={self.factor} must be > 0")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder.

    Fields mirror Hugging Face's names. ``aux_layer_ids`` are the layers whose *input*
    residual stream is returned as EAGLE-3 features (default ``[2, N//2, N-3]``).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"
    aux_layer_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rms_norm_eps <= 0:
            raise ConfigError(f"rms_norm_eps={self.rms_norm_eps} must be > 0")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"architecture {self.architecture!r} is not supported; "
                f"valid: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for i in self.feature_layer_ids:
            if not 0 <= i <= self.num_hidden_layers:
                raise ConfigError(
                    f"aux_layer_ids={self.aux_layer_ids} has {i}, outside "
                    f"[0, {self.num_hidden_layers}] (num_hidden_layers={self.num_hidden_layers})"
                )

    @property
    def feature_layer_ids(self) -> tuple[int, ...]:
        """Layers whose input residual stream feeds the EAGLE-3 draft (low, mid, high)."""
        if self.aux_layer_ids is not None:
            return tuple(self.aux_layer_ids)
        return default_feature_layers(self.num_hidden_layers)

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"architecture {arch!r} is not supported; valid: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"config.json lacks required field(s): {', '.join(missing)}")
        _check_unsupported_fields(d)
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        rs = d.get("rope_scaling") or {}
        # transformers >= 5 may put rope_theta inside rope_parameters.
        rp = d.get("rope_parameters") or {}
        if not rs and rp.get("rope_type", "default") != "default":
            rs = rp
        rope_type = rs.get("rope_type", rs.get("type", "default")) if rs else "default"
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(rs.get("factor", 1.0)),
            low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
        )
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        if family == "qwen2":
            bias = True
        else:
            bias = bool(d.get("attention_bias", False))
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(heads),
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6 if family != "llama" else 1e-5)),
            rope_theta=float(d.get("rope_theta", rp.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bias,
            qk_norm=family == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        return cls.from_hf_dict(read_config_json(path, "checkpoint"))

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face config.json for this model (used by the GGUF importer)."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[
                SUPPORTED_ARCHITECTURES[self.architecture]
            ],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.rope_scaling.rope_type != "default":
            d["rope_scaling"] = dataclasses.asdict(self.rope_scaling)
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = (
                self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
            )
        return d
