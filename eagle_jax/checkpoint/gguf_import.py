"""Convert a llama.cpp GGUF file into a Hugging Face-layout model directory.

``import_gguf(path, out_dir)`` writes what ``transformers`` (and ``eagle_jax.checkpoint``)
expect to find in a model directory:

- ``config.json`` built with :class:`eagle_jax.models.config.ModelConfig` from the GGUF metadata;
- ``model.safetensors``: every weight dequantized to float32 under its Hugging Face name,
  with llama.cpp's rotary row permutation of ``q_proj``/``k_proj`` undone;
- ``tokenizer.json`` and ``tokenizer_config.json``: the byte-level BPE tokenizer stored in
  the metadata, built the way ``transformers`` builds it when it loads the same file with
  ``AutoTokenizer.from_pretrained(dir, gguf_file=name)``;
- ``generation_config.json`` with the bos/eos ids.

Supported: GGUF architectures ``llama``, ``qwen2`` and ``qwen3`` with a ``gpt2`` (byte-level
BPE) tokenizer, and every tensor type the ``gguf`` package can dequantize.

The output is written into a temporary sibling directory and renamed into place at the
end, so a failed import never leaves a half-written model behind.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eagle_jax.models.config import ModelConfig, RopeScaling
from eagle_jax.errors import CheckpointError, ConfigError
from eagle_jax.validate import is_int

# GGUF ``general.architecture`` -> Hugging Face architecture class name.
SUPPORTED_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_TOKENIZER_MODELS = ("gpt2",)

# Per-layer tensors: llama.cpp name (after ``blk.N.``) -> Hugging Face name (after
# ``model.layers.N.``). Every architecture has these.
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Extra per-layer tensors: Qwen2 has q/k/v biases, Qwen3 a RMSNorm over each q and k head.
_QWEN2_LAYER_TENSORS = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
_QWEN3_LAYER_TENSORS = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# llama.cpp writes ``rope_freqs.weight`` for Llama 3.1-style RoPE scaling; it becomes
# config (``rope_scaling``), not a weight.
_ROPE_FREQS = "rope_freqs.weight"

# Token types in ``tokenizer.ggml.token_type`` (llama.cpp's ``llama_token_type``).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Split regexes for ``tokenizer.ggml.pre`` values whose vocabulary was trained with a
# pre-tokenizer other than GPT-2's; the same table transformers uses when it loads a GGUF
# (a ``pre`` not listed, e.g. SmolLM2's "smollm", keeps the plain GPT-2 ByteLevel split).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
         "lfm2", "dbrx", "smaug-bpe"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_SPLIT),
}


# --------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------


def import_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Convert ``gguf_path`` into a Hugging Face-layout model directory ``out_dir``.

    Returns the output directory. Raises :class:`CheckpointError` for a missing,
    truncated or corrupt file, an unsupported architecture, tokenizer or tensor type, a
    missing or unexpected tensor, or a tensor of the wrong shape; and when ``out_dir``
    exists and is not empty, unless ``overwrite`` is true. Nothing is written to
    ``out_dir`` unless the whole conversion succeeds.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    _check_output_dir(out_dir, overwrite)

    reader = open_gguf(gguf_path)
    meta = GGUFMetadata(reader, gguf_path)
    config = config_from_metadata(meta, {t.name: t for t in reader.tensors})
    # The tokenizer first: it is cheap, and its errors should not wait for dequantization.
    tokenizer_json, tokenizer_config = build_tokenizer_files(meta, config)
    tensors = convert_tensors(reader, config, gguf_path)
    generation_config = _generation_config(meta)

    config_dict = config.to_hf_dict()
    if (pad := meta.get("tokenizer.ggml.padding_token_id")) is not None:
        config_dict["pad_token_id"] = int(pad)

    def write_all(tmp: Path) -> None:
        _write_json(tmp / "config.json", config_dict)
        _write_safetensors(tmp / "model.safetensors", tensors)
        (tmp / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        _write_json(tmp / "generation_config.json", generation_config)

    _write_dir_atomically(out_dir, write_all)
    return out_dir


# --------------------------------------------------------------------------------------
# Reading the file
# --------------------------------------------------------------------------------------


def open_gguf(path: Path):
    """A ``gguf.GGUFReader`` for ``path``; every reader failure becomes a CheckpointError."""
    from gguf import GGUFReader

    if not path.exists():
        raise CheckpointError(f"GGUF file {path} not found")
    if not path.is_file():
        raise CheckpointError(f"GGUF path {path} is not a file")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise CheckpointError(f"GGUF file {path} cannot be read: {e}") from e
    if magic != b"GGUF":
        raise CheckpointError(
            f"{path} is not a GGUF file: it starts with {magic!r}, not the magic b'GGUF'"
        )
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/... on bad bytes
        size = path.stat().st_size
        raise CheckpointError(
            f"{path} ({size} bytes) is truncated or corrupt: the GGUF reader failed with "
            f"{type(e).__name__}: {e}"
        ) from e


class GGUFMetadata:
    """Typed access to a GGUF file's key/value metadata."""

    def __init__(self, reader, path: Path):
        self._fields = reader.fields
        self.path = path

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key`` as a Python value (float32 values rounded to their
        shortest decimal form, so 1e-5 stays 1e-5 rather than 9.9999997e-06)."""
        from gguf import GGUFValueType

        field = self._fields.get(key)
        if field is None:
            return default
        try:
            value = field.contents()
        except Exception as e:
            raise CheckpointError(f"{self.path}: metadata key {key!r} is unreadable: {e}") from e
        if field.types and field.types[0] == GGUFValueType.FLOAT32:
            value = float(str(np.float32(value)))
        return value

    def require(self, key: str) -> Any:
        """The value of ``key``; a CheckpointError naming the key when absent."""
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"{self.path}: required metadata key {key!r} is missing")
        return value

    def integer(self, key: str, default: int | None = None) -> int:
        """An integer hyperparameter. Some files give one value per layer; that is
        accepted when all layers agree (this importer has no per-layer shapes)."""
        value = self.get(key, default)
        if value is None:
            raise CheckpointError(f"{self.path}: required metadata key {key!r} is missing")
        if isinstance(value, list):
            if not value or len(set(value)) != 1:
                raise CheckpointError(
                    f"{self.path}: metadata {key!r} varies per layer ({value}); not supported"
                )
            value = value[0]
        if not is_int(value):
            raise CheckpointError(f"{self.path}: metadata {key!r}={value!r} is not an integer")
        return value


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------


def config_from_metadata(meta: GGUFMetadata, tensors: dict[str, Any]) -> ModelConfig:
    """The :class:`ModelConfig` the file's ``<arch>.*`` metadata describes (``tensors``, the
    reader's tensors by name, tell whether embeddings are tied and hold ``rope_freqs``)."""
    arch = meta.require("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise CheckpointError(
            f"{meta.path}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    key = lambda name: f"{arch}.{name}"  # noqa: E731
    hidden = meta.integer(key("embedding_length"))
    heads = meta.integer(key("attention.head_count"))
    if heads <= 0:
        raise CheckpointError(f"{meta.path}: {key('attention.head_count')}={heads} must be positive")
    kv_heads = meta.integer(key("attention.head_count_kv"), heads)
    head_dim = meta.integer(key("attention.key_length"), hidden // heads)
    value_dim = meta.integer(key("attention.value_length"), head_dim)
    rope_dim = meta.integer(key("rope.dimension_count"), head_dim)
    if value_dim != head_dim or rope_dim != head_dim:
        raise CheckpointError(
            f"{meta.path}: key_length={head_dim}, value_length={value_dim}, "
            f"rope.dimension_count={rope_dim}: only equal key/value/rotary head sizes are supported"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    if key("vocab_size") not in meta and tokens is None:
        raise CheckpointError(
            f"{meta.path}: cannot tell the vocabulary size: neither {key('vocab_size')!r} "
            "nor 'tokenizer.ggml.tokens' is present"
        )
    vocab = meta.integer(key("vocab_size"), len(tokens) if tokens is not None else None)
    theta = float(meta.get(key("rope.freq_base"), 10000.0))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    try:
        return ModelConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=meta.integer(key("feed_forward_length")),
            num_hidden_layers=meta.integer(key("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(meta.get(key("attention.layer_norm_rms_epsilon"), 1e-5)),
            rope_theta=theta,
            rope_scaling=_rope_scaling(meta, arch, head_dim, theta, tensors.get(_ROPE_FREQS)),
            max_position_embeddings=meta.integer(key("context_length"), 2048),
            # llama.cpp writes ``output.weight`` only when it differs from the embedding.
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
            architecture=SUPPORTED_GGUF_ARCHITECTURES[arch],
        )
    except ConfigError as e:
        raise CheckpointError(f"{meta.path}: metadata describes an invalid model: {e}") from e


def _rope_scaling(meta: GGUFMetadata, arch: str, head_dim: int, theta: float, rope_freqs) -> RopeScaling:
    """RoPE scaling from ``<arch>.rope.scaling.*`` (linear) or a ``rope_freqs`` tensor
    (Llama 3.1 style); the default when the file states neither."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind is None and (old := meta.get(f"{arch}.rope.scale_linear")) is not None:
        kind, factor = "linear", old  # the key older llama.cpp versions wrote
    if kind in (None, "none") or (kind == "linear" and float(factor or 1.0) == 1.0):
        if rope_freqs is not None:
            factors = dequantize_tensor(rope_freqs, meta.path)
            return llama3_rope_from_factors(factors, head_dim, theta, meta.path)
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(rope_type="linear", factor=float(factor))
    raise CheckpointError(
        f"{meta.path}: RoPE scaling type {kind!r} ({arch}.rope.scaling.type) is not supported; "
        "supported: none, linear, and Llama 3 scaling via rope_freqs.weight"
    )


def llama3_rope_factors(scaling: RopeScaling, head_dim: int, theta: float) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores in ``rope_freqs.weight`` for a Llama 3
    RoPE scaling: 1 for short wavelengths, ``factor`` for long ones, a smooth ramp between."""
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(scaling.factor)
        else:
            smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor
            )
            out.append(1.0 / ((1 - smooth) / scaling.factor + smooth))
    return np.asarray(out, dtype=np.float32)


def llama3_rope_from_factors(factors: np.ndarray, head_dim: int, theta: float, path: Path) -> RopeScaling:
    """Recover Llama 3 RoPE scaling parameters from llama.cpp's ``rope_freqs.weight``.

    The file stores only the resulting divisors. Every Llama 3.x release uses
    low_freq_factor=1, high_freq_factor=4, original context 8192 and varies the factor
    (the largest divisor), so those are tried and checked against the stored values.
    """
    factors = np.asarray(factors, dtype=np.float32).reshape(-1)
    if factors.shape != (head_dim // 2,):
        raise CheckpointError(
            f"{path}: tensor {_ROPE_FREQS!r} has shape {factors.shape}, expected ({head_dim // 2},)"
        )
    guess = RopeScaling(
        rope_type="llama3",
        factor=float(factors.max()),
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    if not np.allclose(llama3_rope_factors(guess, head_dim, theta), factors, rtol=1e-4, atol=1e-6):
        raise CheckpointError(
            f"{path}: tensor {_ROPE_FREQS!r} holds RoPE factors that do not follow the Llama 3 "
            "schedule (low_freq_factor=1, high_freq_factor=4, original context 8192); unsupported"
        )
    return guess


# --------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One tensor the model needs: its GGUF name, HF name and HF (numpy) shape."""

    gguf_name: str
    hf_name: str
    shape: tuple[int, ...]
    optional: bool = False


def expected_tensors(config: ModelConfig) -> list[TensorSpec]:
    """Every tensor a GGUF of this config holds, with its Hugging Face name and shape."""
    h, v, i = config.hidden_size, config.vocab_size, config.intermediate_size
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    layer_shapes = {
        "attn_norm.weight": (h,),
        "attn_q.weight": (q_rows, h),
        "attn_k.weight": (kv_rows, h),
        "attn_v.weight": (kv_rows, h),
        "attn_output.weight": (h, q_rows),
        "ffn_norm.weight": (h,),
        "ffn_gate.weight": (i, h),
        "ffn_up.weight": (i, h),
        "ffn_down.weight": (h, i),
        "attn_q.bias": (q_rows,),
        "attn_k.bias": (kv_rows,),
        "attn_v.bias": (kv_rows,),
        "attn_q_norm.weight": (config.head_dim,),
        "attn_k_norm.weight": (config.head_dim,),
    }
    layer_names = dict(_LAYER_TENSORS)
    if config.attention_bias:
        layer_names |= _QWEN2_LAYER_TENSORS
    if config.qk_norm:
        layer_names |= _QWEN3_LAYER_TENSORS

    specs = [TensorSpec("token_embd.weight", "model.embed_tokens.weight", (v, h))]
    for n in range(config.num_hidden_layers):
        for gguf_leaf, hf_leaf in layer_names.items():
            specs.append(
                TensorSpec(f"blk.{n}.{gguf_leaf}", f"model.layers.{n}.{hf_leaf}", layer_shapes[gguf_leaf])
            )
    specs.append(TensorSpec("output_norm.weight", "model.norm.weight", (h,)))
    if not config.tie_word_embeddings:
        specs.append(TensorSpec("output.weight", "lm_head.weight", (v, h)))
    return specs


def convert_tensors(reader, config: ModelConfig, path: Path) -> dict[str, np.ndarray]:
    """All weights as float32 arrays under their Hugging Face names, checked for presence
    and shape, with llama.cpp's Q/K permutation undone for the llama architecture."""
    by_name = {t.name: t for t in reader.tensors}
    specs = expected_tensors(config)
    known = {s.gguf_name for s in specs} | {_ROPE_FREQS}
    unexpected = sorted(set(by_name) - known)
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
        raise CheckpointError(
            f"{path}: unexpected tensor(s) for a {config.architecture} model: {shown}"
        )
    out: dict[str, np.ndarray] = {}
    for spec in specs:
        tensor = by_name.get(spec.gguf_name)
        if tensor is None:
            raise CheckpointError(
                f"{path}: missing tensor {spec.gguf_name!r} (Hugging Face {spec.hf_name!r}, "
                f"expected shape {spec.shape})"
            )
        array = dequantize_tensor(tensor, path)
        if array.shape != spec.shape:
            raise CheckpointError(
                f"{path}: tensor {spec.gguf_name!r} ({spec.hf_name!r}) has shape "
                f"{tuple(array.shape)}, expected {spec.shape}"
            )
        if config.architecture == "LlamaForCausalLM":
            array = _undo_llama_rotary_permutation(spec.gguf_name, array, config)
        out[spec.hf_name] = np.ascontiguousarray(array, dtype=np.float32)
    return out


def dequantize_tensor(tensor, path: Path) -> np.ndarray:
    """The tensor's values as float32 in numpy (row-major, Hugging Face) order.

    GGUF lists dimensions fastest-first (``ne[0]`` is the row length); the reader already
    reverses them into numpy order, and for block-quantized types gives rows of bytes that
    ``gguf.quants.dequantize`` expands back to ``ne[0]`` values per row.
    """
    from gguf import GGMLQuantizationType, quants

    qtype = tensor.tensor_type
    if qtype == GGMLQuantizationType.F64:
        return np.asarray(tensor.data, dtype=np.float32)
    try:
        values = quants.dequantize(tensor.data, qtype)
    except NotImplementedError as e:
        raise CheckpointError(
            f"{path}: tensor {tensor.name!r} has type {qtype.name}, which cannot be dequantized; "
            f"supported: {', '.join(supported_tensor_types())}"
        ) from e
    expected = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if values.shape != expected:
        raise CheckpointError(
            f"{path}: tensor {tensor.name!r} ({qtype.name}) dequantized to shape {values.shape}, "
            f"expected {expected} from its header"
        )
    return values.astype(np.float32, copy=False)


def supported_tensor_types() -> list[str]:
    """Names of the GGML tensor types this importer can turn into float32."""
    from gguf import GGMLQuantizationType, quants

    names = ["F32", "F16", "F64"]
    for qtype in GGMLQuantizationType:
        if qtype.name in names:
            continue
        try:
            quants.dequantize(np.zeros((0,), dtype=np.uint8), qtype)
        except NotImplementedError:
            continue
        except Exception:  # implemented, but an empty input is not a valid block row
            pass
        names.append(qtype.name)
    return names


def llama_rotary_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's conversion of a Hugging Face q/k projection (rows = heads x head_dim) to
    its interleaved rotary layout: within each head, row ``j`` of the first half goes to
    ``2j`` and row ``j`` of the second half to ``2j+1``."""
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, d, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_rotary_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of :func:`llama_rotary_permute` (what transformers' GGUF loader does)."""
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, d, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _undo_llama_rotary_permutation(gguf_name: str, w: np.ndarray, config: ModelConfig) -> np.ndarray:
    # llama.cpp permutes only q (by the query head count) and k (by the KV head count).
    if gguf_name.endswith(".attn_q.weight"):
        return llama_rotary_unpermute(w, config.num_attention_heads)
    if gguf_name.endswith(".attn_k.weight"):
        return llama_rotary_unpermute(w, config.num_key_value_heads)
    return w


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used to spell byte-level BPE tokens."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def build_tokenizer_files(meta: GGUFMetadata, config: ModelConfig) -> tuple[str, dict[str, Any]]:
    """``tokenizer.json`` (as a string) and ``tokenizer_config.json`` (as a dict) for the
    tokenizer stored in the metadata."""
    model = meta.get("tokenizer.ggml.model")
    if model not in SUPPORTED_TOKENIZER_MODELS:
        raise CheckpointError(
            f"{meta.path}: tokenizer model {model!r} (tokenizer.ggml.model) is not supported; "
            f"supported: {', '.join(SUPPORTED_TOKENIZER_MODELS)}"
        )
    tokens = meta.require("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges") or []
    token_types = meta.get("tokenizer.ggml.token_type") or []
    backend = build_byte_level_tokenizer(
        tokens, merges, token_types, pre=meta.get("tokenizer.ggml.pre")
    )

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        if idx is None:
            return None
        if not 0 <= int(idx) < len(tokens):
            raise CheckpointError(
                f"{meta.path}: tokenizer.ggml.{key}={idx} is outside the vocabulary (size {len(tokens)})"
            )
        return tokens[int(idx)]

    # A byte-level GGUF adds no BOS unless it says so (transformers' rule too).
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    specials = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
    }
    _set_post_processor(backend, specials, add_bos, add_eos)

    tokenizer_config: dict[str, Any] = {
        # Loads tokenizer.json as is, both here and with transformers' AutoTokenizer.
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{k: v for k, v in specials.items() if v is not None},
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings,
    }
    if (template := meta.get("tokenizer.chat_template")) is not None:
        tokenizer_config["chat_template"] = template
    return backend.to_str(), tokenizer_config


def build_byte_level_tokenizer(tokens: list[str], merges: list[str], token_types: list[int], pre: str | None):
    """A ``tokenizers.Tokenizer`` for a GGUF ``gpt2`` vocabulary, built as transformers
    builds it: GPT-2 BPE and ByteLevel decoder, control tokens added as special tokens,
    user-defined ones as plain added tokens, and the split regex the ``pre`` name implies."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    alphabet = set(bytes_to_unicode().values())
    spell = bytes_to_unicode()
    # A token outside the byte alphabet (llama.cpp sometimes stores specials in plain
    # UTF-8) is respelled byte by byte, so the BPE model can still reach it.
    vocab = {
        (t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ")) for m in merges]
    backend = Tokenizer(
        BPE(
            vocab=vocab,
            merges=pairs,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()

    # Control tokens spelled outside the byte alphabet are llama.cpp mislabels; adding them
    # would grow the vocabulary past the model's, so (like transformers) they are skipped.
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, token_types)
        if kind == _TOKEN_TYPE_CONTROL and set(t) <= alphabet
    ]
    if control:
        backend.add_special_tokens(control)
    user_defined = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, token_types)
        if kind == _TOKEN_TYPE_USER_DEFINED and t in vocab
    ]
    if user_defined:
        backend.add_tokens(user_defined)

    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return backend


def _set_post_processor(backend, specials: dict[str, str | None], add_bos: bool, add_eos: bool) -> None:
    """The TemplateProcessing transformers installs: BOS/EOS around each sequence only
    when the file asks for them (and the token exists)."""
    from tokenizers import processors

    bos, eos = specials["bos_token"], specials["eos_token"]
    add_bos = add_bos and bos is not None
    add_eos = add_eos and eos is not None
    single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
    pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
    special_tokens = []
    if add_bos:
        special_tokens.append((bos, backend.token_to_id(bos)))
    if add_eos:
        special_tokens.append((eos, backend.token_to_id(eos)))
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=special_tokens
    )


def _generation_config(meta: GGUFMetadata) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for hf_key, gguf_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        if (value := meta.get(f"tokenizer.ggml.{gguf_key}")) is not None:
            out[hf_key] = int(value)
    return out


# --------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------


def _check_output_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"output path {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise CheckpointError(
            f"output directory {out_dir} exists and is not empty; pass overwrite=True to replace it"
        )


def _write_dir_atomically(out_dir: Path, write: Callable[[Path], None]) -> None:
    """Run ``write`` on a fresh temporary sibling of ``out_dir``, then swap it into place.

    The old directory (if any) is moved aside first and deleted only after the new one is
    in place, so an interrupted import leaves either the old or the new directory.
    """
    parent = out_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=parent))
    old = None
    try:
        write(tmp)
        _apply_umask_permissions(tmp)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=parent))
            os.replace(out_dir, old / "dir")
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out_dir.exists():
            os.replace(old / "dir", out_dir)  # put the previous directory back
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _apply_umask_permissions(directory: Path) -> None:
    """Give the directory and its files the usual umask permissions: ``mkdtemp`` makes the
    directory owner-only, and the output should be as readable as any other file."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for path in directory.iterdir():
        os.chmod(path, 0o666 & ~umask)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    # "format": "pt" lets transformers load the file without a warning.
    save_file(tensors, str(path), metadata={"format": "pt"})
