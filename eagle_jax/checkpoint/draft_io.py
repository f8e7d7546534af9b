"""Read and write EAGLE-3 draft checkpoints (config.json + model.safetensors).

The format is the released one (SpecForge, SGLang, vLLM): tensors ``fc.weight``,
``midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight``,
``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``,
``norm.weight``, ``lm_head.weight`` (PyTorch ``[out, in]``), ``d2t`` (int64 offsets),
``t2d`` (bool) and an optional ``embed_tokens.weight`` (absent: the target's embedding is
used, as the same array). Tensors are read with ``safetensors`` only, never pickle.

Feature-layer ids (``eagle_config.eagle_aux_hidden_state_layer_ids``). In memory
(``DraftConfig.aux_layer_ids``) id k is the residual stream *entering* target layer k
(k = N: the last layer's output before the final norm). Runtimes read the field in two
ways, so a file's ids mean different layers depending on who reads it:

- SGLang adds 1 to *every* explicit id ("for the ith layer, it takes the output of the
  (i-1)th layer as aux hidden state"): file id k is the *output* of layer k, the stream
  entering layer k+1. SpecForge writes this convention (``[1, N//2-1, N-4]``).
- vLLM uses the ids as written: file id k is the stream entering layer k.
- Without the field, both (and this project) use the streams entering ``[2, N//2, N-3]``.

Writing (``draft_config_to_hf``): the field is omitted when the draft uses its target's
default layers (``DraftConfig.target_num_hidden_layers`` says which target that is), the
one case every runtime reads alike; otherwise it is written in SGLang's convention
(entering ids minus one), which vLLM reads one layer shallower. The embedding stream
(entering layer 0) has no SGLang id and cannot be written. File id N-1 (the last layer's
output) is legal, but SGLang's Llama loop only captures inputs of layers 0..N-1.

Reading: ``layer_id_convention`` says how to read explicit ids:

- ``"auto"`` (default) and its synonym ``"output"``: SGLang's rule, 1 is added to every
  id; with a target, file ids must lie in ``[0, N-1]``.
- ``"input"``: the ids as written, for files written for vLLM; ids in ``[0, N]``.

A config without the field (the reference training config, or a draft on its target's
default layers) gets the target's default, so loading it needs ``target``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from eagle_jax.checkpoint.hf import NameMap, read_tensors, resolve_dtype, safetensors_files
from eagle_jax.models.config import ModelConfig, default_feature_layers, read_config_json
from eagle_jax.models.draft import DraftConfig, Eagle3Draft, check_compatible
from eagle_jax.errors import CheckpointError, ConfigError
from eagle_jax.validate import is_int, one_of
from eagle_jax.models.llama import LlamaModel

log = logging.getLogger(__name__)

ARCHITECTURES = ("LlamaForCausalLMEagle3", "LlamaForCausalLM")
# A one-MLA-layer draft (vLLM's deepseek_eagle3; released for Kimi-K2.5): the same
# tensors but the attention's, which are MLA's (q_a/q_b or q, kv_a_proj_with_mqa, norms,
# kv_b_proj, o_proj), reading [embedding, hidden] like the Llama layer's.
MLA_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")
LAYER_ID_CONVENTIONS = ("auto", "input", "output")
# Tensors that are not NNX parameters: the vocabulary maps (index arrays, read separately).
D2T, T2D, EMBED = "d2t", "t2d", "embed_tokens.weight"


# ----------------------------------------------------------------------------- config


def to_input_layer_ids(
    ids: list[int] | tuple[int, ...],
    convention: str,
    *,
    num_layers: int | None = None,
    source: str = "draft config.json",
) -> tuple[int, ...]:
    """Translate a file's aux-layer ids to this project's "entering layer k" ids.

    Args:
      ids: ``eagle_config.eagle_aux_hidden_state_layer_ids`` as read from the file.
      convention: "auto"/"output" (SGLang: id k is the output of layer k, so +1) or
        "input" (vLLM: as written).
      num_layers: the target's N; when given, ids outside the convention's range raise.
      source: the file named in errors.

    Returns:
      the entering-layer ids, one per file id.
    """
    if convention not in LAYER_ID_CONVENTIONS:
        raise ConfigError(
            f"layer_id_convention={convention!r} is not supported; valid: {', '.join(LAYER_ID_CONVENTIONS)}"
        )
    field = "eagle_config.eagle_aux_hidden_state_layer_ids"
    # bool is an int subclass: `true` in the JSON must not read as layer 1.
    if (
        not isinstance(ids, (list, tuple))
        or not ids
        or not all(is_int(i) and i >= 0 for i in ids)
    ):
        raise ConfigError(f"{source}: {field}={ids!r} must be a non-empty list of layer ids >= 0")
    shift = convention != "input"
    if num_layers is not None:
        top = num_layers - 1 if shift else num_layers
        bad = [i for i in ids if i > top]
        if bad:
            meaning = (
                "read with SGLang's rule as 'output of target layer k' (layer_id_convention="
                f"{convention!r}; pass 'input' for a file written for vLLM)"
                if shift
                else "read as 'entering target layer k' (layer_id_convention='input')"
            )
            raise ConfigError(
                f"{source}: {field}={list(ids)} has {bad[0]}, outside the valid range [0, {top}] "
                f"for a target with num_hidden_layers={num_layers}; ids are {meaning}"
            )
    return tuple(i + 1 if shift else i for i in ids)


def to_file_layer_ids(cfg: DraftConfig) -> list[int] | None:
    """The ``eagle_aux_hidden_state_layer_ids`` to write for ``cfg``; None: omit the field.

    None when the draft uses its target's default layers (every runtime then captures the
    same streams); otherwise SGLang's "output of layer k" ids, entering ids minus one.
    """
    ids = cfg.aux_layer_ids
    n = cfg.target_num_hidden_layers
    if n is not None and ids == _default_ids(n):
        return None
    if 0 in ids:
        raise ConfigError(
            f"draft aux_layer_ids={ids} include 0, the stream entering layer 0 (the embeddings): "
            "SGLang's convention ('output of layer k') has no id for it, so it cannot be written"
        )
    if any(a >= b for a, b in zip(ids, ids[1:])):
        # SGLang and vLLM test "is layer i listed" while walking the layers, so they hand
        # the draft each listed stream once, in layer order; this project concatenates in
        # the listed order. Only increasing ids mean the same features to both.
        raise ConfigError(
            f"draft aux_layer_ids={ids} are not strictly increasing: SGLang and vLLM would feed "
            "the draft these streams in layer order, once each, so they cannot be written"
        )
    return [i - 1 for i in ids]


def _default_ids(num_layers: int) -> tuple[int, ...]:
    """``ModelConfig.feature_layer_ids``'s default rule for N layers (N >= 3: ``[2, N//2, N-3]``)."""
    return default_feature_layers(num_layers)


def describe_feature_layers(entering_ids: list[int] | tuple[int, ...], num_layers: int) -> str:
    """Say which target streams feed a draft, for logs and ``doctor``.

    Args:
      entering_ids: the draft's feature layers in this project's convention
        (``DraftConfig.aux_layer_ids``: id k is the stream entering target layer k).
      num_layers: the target's N.

    Returns:
      e.g. "entering target layers 2, 15, 27 (default [2, N//2, N-3], N=30)".
    """
    if not is_int(num_layers) or num_layers <= 0:
        raise ConfigError(f"num_layers={num_layers!r} must be a positive integer")
    ids = tuple(entering_ids)
    bad = [i for i in ids if not (is_int(i) and 0 <= i <= num_layers)]
    if not ids or bad:
        raise ConfigError(f"feature layers {list(ids)} must be non-empty ids in [0, {num_layers}]")
    text = "entering target layers " + ", ".join(map(str, ids))
    default = _default_ids(num_layers)
    if ids == default:
        rule = "[2, N//2, N-3]" if num_layers >= 3 else "rule"
        text += f" (default {rule}, N={num_layers})"
    else:
        text += f" (not the default {', '.join(map(str, default))} for N={num_layers})"
    if num_layers in ids:
        text += f"; {num_layers} is the last layer's output before the final norm"
    return text


def default_aux_layer_ids(target_cfg: ModelConfig) -> tuple[int, ...]:
    """The default feature layers ``(2, N//2, N-3)`` of a target, whatever it is configured with."""
    return target_cfg.replace(aux_layer_ids=None).feature_layer_ids


def draft_config_from_hf(
    d: dict[str, Any],
    *,
    target_cfg: ModelConfig | None = None,
    layer_id_convention: str = "auto",
    has_embed_tokens: bool = False,
    source: str = "draft config.json",
) -> DraftConfig:
    """A DraftConfig from a draft's config.json (see the module docstring for layer ids).

    ``target_cfg`` supplies the default feature layers when the file has none, bounds the
    file's ids and is recorded as ``target_num_hidden_layers``; ``source`` names the file
    in errors.
    """
    arch = (d.get("architectures") or [ARCHITECTURES[0]])[0]
    if arch not in ARCHITECTURES + MLA_ARCHITECTURES:
        raise ConfigError(
            f"draft architecture {arch!r} is not supported; valid: {', '.join(ARCHITECTURES + MLA_ARCHITECTURES)}"
        )
    layers = d.get("num_hidden_layers", 1)
    if layers != 1:
        raise ConfigError(f"draft num_hidden_layers={layers!r} is not supported; valid: 1")
    if arch in MLA_ARCHITECTURES:
        return _mla_draft_config(d, target_cfg, layer_id_convention, has_embed_tokens, source)
    # The draft layer is a Llama layer: parse sizes, norm epsilon and RoPE (with HF defaults,
    # e.g. rope_theta 10000 when absent) exactly as for a Llama target.
    base = ModelConfig.from_hf_dict({**d, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1})
    return DraftConfig(
        hidden_size=base.hidden_size,
        intermediate_size=base.intermediate_size,
        num_attention_heads=base.num_attention_heads,
        num_key_value_heads=base.num_key_value_heads,
        head_dim=base.head_dim,
        vocab_size=base.vocab_size,
        draft_vocab_size=int(d.get("draft_vocab_size") or base.vocab_size),
        target_hidden_size=int(d.get("target_hidden_size") or base.hidden_size),
        aux_layer_ids=_aux_layer_ids(d, target_cfg, layer_id_convention, source),
        rms_norm_eps=base.rms_norm_eps,
        rope_theta=base.rope_theta,
        rope_scaling=base.rope_scaling,
        max_position_embeddings=base.max_position_embeddings,
        has_embed_tokens=has_embed_tokens,
        norm_before_residual=bool(d.get("norm_before_residual", False)),
        target_num_hidden_layers=target_cfg.num_hidden_layers if target_cfg is not None else None,
    )


def _mla_draft_config(d, target_cfg, convention, has_embed_tokens, source) -> DraftConfig:
    from eagle_jax.models.deepseek import MLAConfig

    for field in ("fc_norm", "norm_output"):  # vLLM variants not implemented here
        if d.get(field):
            raise ConfigError(f"{source}: {field}={d[field]!r} is not supported; supported: false")
    for field in ("vocab_size", "intermediate_size"):
        if not isinstance(d.get(field), int) or d[field] <= 0:
            raise ConfigError(f"{source}: {field}={d.get(field)!r} must be a positive integer")
    mla = MLAConfig.from_hf_dict(d, source)
    heads = mla.num_attention_heads
    return DraftConfig(
        hidden_size=mla.hidden_size,
        intermediate_size=d["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=mla.qk_rope_head_dim,  # unused by an MLA layer (its sizes are in ``mla``)
        vocab_size=d["vocab_size"],
        draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
        target_hidden_size=int(d.get("target_hidden_size") or mla.hidden_size),
        aux_layer_ids=_aux_layer_ids(d, target_cfg, convention, source),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        has_embed_tokens=has_embed_tokens,
        norm_before_residual=bool(d.get("norm_before_residual", False)),
        target_num_hidden_layers=target_cfg.num_hidden_layers if target_cfg is not None else None,
        mla=mla,
    )


def _aux_layer_ids(
    d: dict[str, Any], target_cfg: ModelConfig | None, convention: str, source: str
) -> tuple[int, ...]:
    eagle = d.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        raise ConfigError(f"{source}: eagle_config={eagle!r} must be an object")
    if eagle.get("use_aux_hidden_state") is False:
        raise ConfigError(f"{source}: eagle_config.use_aux_hidden_state=false: not an EAGLE-3 draft; valid: true")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        n = target_cfg.num_hidden_layers if target_cfg is not None else None
        return to_input_layer_ids(ids, convention, num_layers=n, source=source)
    if target_cfg is None:
        raise ConfigError(
            f"{source} has no eagle_config.eagle_aux_hidden_state_layer_ids (the draft uses its "
            "target's default feature layers [2, N//2, N-3]); pass the target so N is known"
        )
    return default_aux_layer_ids(target_cfg)


def draft_config_to_hf(cfg: DraftConfig, dtype: jnp.dtype) -> dict[str, Any]:
    """The released config.json of a draft (aux ids per ``to_file_layer_ids``)."""
    if cfg.mla is not None:
        d = {
            "architectures": [MLA_ARCHITECTURES[0]], "model_type": "deepseek_v3", **cfg.mla.to_hf_fields(),
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1, "rms_norm_eps": cfg.rms_norm_eps,
            "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
            "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
            "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": jnp.dtype(dtype).name,
            "eagle_config": {"use_aux_hidden_state": True},
        }
        file_ids = to_file_layer_ids(cfg)
        if file_ids is not None:
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": file_ids, **d["eagle_config"]}
        if cfg.norm_before_residual:
            d["norm_before_residual"] = True
        return d
    d: dict[str, Any] = {
        "architectures": [ARCHITECTURES[0]],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": jnp.dtype(dtype).name,
        "eagle_config": {"use_aux_hidden_state": True},
    }
    file_ids = to_file_layer_ids(cfg)
    if file_ids is not None:
        d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": file_ids, **d["eagle_config"]}
    if cfg.rope_scaling.rope_type != "default":
        d["rope_scaling"] = dataclasses.asdict(cfg.rope_scaling)
    if cfg.norm_before_residual:  # vLLM's field; absent means False everywhere
        d["norm_before_residual"] = True
    return d


def _read_config_json(path: Path) -> dict[str, Any]:
    return read_config_json(path, "draft checkpoint")


def _tensor_files(path: Path) -> dict[str, Path]:
    if not any(path.glob("*.safetensors*")) and any(path.glob("*.bin")):
        raise CheckpointError(
            f"{path} holds only PyTorch .bin weights, which are pickles and are not loaded; "
            "convert them to model.safetensors"
        )
    return safetensors_files(path)


def read_draft_config(
    path: str | Path, *, target_cfg: ModelConfig | None = None, layer_id_convention: str = "auto"
) -> DraftConfig:
    """The DraftConfig of a draft directory (e.g. to build the target with its feature layers)."""
    path = Path(path)
    d = _read_config_json(path)
    has_embed = EMBED in _tensor_files(path)
    return draft_config_from_hf(
        d,
        target_cfg=target_cfg,
        layer_id_convention=layer_id_convention,
        has_embed_tokens=has_embed,
        source=str(path / "config.json"),
    )


# ----------------------------------------------------------------------------- tensors


def draft_name_map(cfg: DraftConfig) -> NameMap:
    """NNX path -> (checkpoint tensor name, transpose?) for the draft's float parameters."""
    names: NameMap = {("fc", "kernel"): ("fc.weight", True)}
    for norm in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        names[("midlayer", norm, "weight")] = (f"midlayer.{norm}.weight", False)
    if cfg.mla is None:
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names[("midlayer", "self_attn", proj, "kernel")] = (f"midlayer.self_attn.{proj}.weight", True)
    else:
        mla, a = cfg.mla, ("midlayer", "self_attn")
        projs = ["kv_a_proj_with_mqa", "o_proj"] + (["q_proj"] if mla.q_lora_rank is None else ["q_a_proj", "q_b_proj"])
        for proj in projs:
            names[a + (proj, "kernel")] = (f"midlayer.self_attn.{proj}.weight", True)
        if mla.attention_bias:
            for proj in ["kv_a_proj_with_mqa", "o_proj"] + ([] if mla.q_lora_rank is None else ["q_a_proj"]):
                names[a + (proj, "bias")] = (f"midlayer.self_attn.{proj}.bias", False)
        names[a + ("kv_b",)] = ("midlayer.self_attn.kv_b_proj.weight", True)
        names[a + ("kv_a_layernorm", "weight")] = ("midlayer.self_attn.kv_a_layernorm.weight", False)
        if mla.q_lora_rank is not None:
            names[a + ("q_a_layernorm", "weight")] = ("midlayer.self_attn.q_a_layernorm.weight", False)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        names[("midlayer", "mlp", proj, "kernel")] = (f"midlayer.mlp.{proj}.weight", True)
    names[("norm", "weight")] = ("norm.weight", False)
    names[("lm_head",)] = ("lm_head.weight", True)
    if cfg.has_embed_tokens:
        names[("embed_tokens",)] = (EMBED, False)
    return names


def _read_vocab_maps(files: dict[str, Path], cfg: DraftConfig) -> tuple[np.ndarray, np.ndarray]:
    """Read and validate ``d2t [Vd]`` (offsets) and ``t2d [V]`` (membership)."""
    vd, v = cfg.draft_vocab_size, cfg.vocab_size
    if D2T not in files and T2D not in files and vd == v:
        return np.zeros(vd, np.int64), np.ones(v, bool)  # full vocabulary: identity map
    wanted = {D2T: (vd,), T2D: (v,)}
    missing = [n for n in wanted if n not in files]
    if missing:
        raise CheckpointError(f"draft checkpoint lacks tensor(s): {', '.join(missing)}")
    out = {}
    for name, shape in wanted.items():
        # numpy, not read_tensors' flax framework: with 64-bit JAX off, that would silently
        # narrow int64 offsets to int32 and wrap bad values into plausible ones.
        try:
            with safe_open(files[name], framework="numpy") as f:
                arr = f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{files[name]} is corrupt or truncated: {e}") from e
        if arr.shape != shape:
            raise CheckpointError(f"{files[name].name}: tensor {name} has shape {arr.shape}, expected {shape}")
        out[name] = arr
    d2t, t2d = out[D2T], out[T2D]
    if not np.issubdtype(d2t.dtype, np.integer):
        raise CheckpointError(f"tensor d2t has dtype {d2t.dtype}, expected an integer type (int64)")
    if not (t2d.dtype == bool or np.issubdtype(t2d.dtype, np.integer)):
        raise CheckpointError(f"tensor t2d has dtype {t2d.dtype}, expected bool")
    _check_vocab_maps(d2t, t2d.astype(bool), cfg)
    return d2t, t2d.astype(bool)


def _check_vocab_maps(d2t: np.ndarray, t2d: np.ndarray, cfg: DraftConfig) -> None:
    vd, v = cfg.draft_vocab_size, cfg.vocab_size
    target = np.arange(vd, dtype=np.int64) + d2t.astype(np.int64)
    bad = np.flatnonzero((target < 0) | (target >= v))
    if bad.size:
        i = int(bad[0])
        raise CheckpointError(
            f"tensor d2t maps draft id {i} to target id {int(target[i])}, outside [0, {v}) "
            f"({bad.size} draft ids out of range)"
        )
    count = int(t2d.sum())
    if count != vd:
        raise CheckpointError(f"tensor t2d marks {count} target ids, expected draft_vocab_size={vd}")
    if np.unique(target).size != vd or not t2d[target].all():
        raise CheckpointError("tensors d2t and t2d disagree on which target ids form the draft vocabulary")


# ----------------------------------------------------------------------------- load / save


def load_draft(
    path: str | Path,
    *,
    target: LlamaModel | None = None,
    dtype: str | jnp.dtype | None = None,
    layer_id_convention: str = "auto",
) -> Eagle3Draft:
    """Load an EAGLE-3 draft directory.

    Args:
      path: directory with config.json and model.safetensors (or a sharded index).
      target: the target model; checked for compatibility, and its embedding is shared
        when the draft has none. Required when the draft has no embedding or its config
        has no aux-layer ids.
      dtype: parameter dtype; default float32 on CPU, bfloat16 on GPU.
      layer_id_convention: how to read the file's aux-layer ids: "auto"/"output" (SGLang's
        rule, +1 to every id) or "input" (as written, for files written for vLLM).
    """
    path = Path(path)
    d = _read_config_json(path)
    files = _tensor_files(path)
    cfg = draft_config_from_hf(
        d,
        target_cfg=target.config if target is not None else None,
        layer_id_convention=layer_id_convention,
        has_embed_tokens=EMBED in files,
        source=str(path / "config.json"),
    )
    if target is not None:
        check_compatible(cfg, target.config)
    elif not cfg.has_embed_tokens:
        raise CheckpointError(f"draft in {path} has no {EMBED}: pass target= to use the target's embedding")
    dtype = resolve_dtype(dtype)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Eagle3Draft(cfg, dtype=dtype)))
    flat = dict(nnx.to_flat_state(state))
    names = draft_name_map(cfg)
    unmapped = [p for p in flat if p not in names and p not in {("embed_tokens",), ("d2t",), ("t2d",)}]
    if unmapped:  # a programming error: the map must cover the model
        raise RuntimeError(f"no checkpoint name for draft parameter(s) {unmapped}")
    wanted = {}
    for p, (name, transpose) in names.items():
        shape = tuple(flat[p].shape)
        wanted[name] = shape[::-1] if transpose else shape
    tensors = read_tensors(files, wanted)
    d2t, t2d = _read_vocab_maps(files, cfg)
    for p, (name, transpose) in names.items():
        arr = tensors[name].T if transpose else tensors[name]
        flat[p].set_value(jnp.asarray(np.ascontiguousarray(arr), dtype=dtype))
    if not cfg.has_embed_tokens:
        # The same array as the target's (no copy) unless the dtypes differ.
        flat[("embed_tokens",)].set_value(target.embed_tokens[...].astype(dtype))
    flat[("d2t",)].set_value(jnp.asarray(d2t.astype(np.int32)))
    flat[("t2d",)].set_value(jnp.asarray(t2d))
    draft = nnx.merge(graphdef, nnx.from_flat_state(flat))
    layers = (
        describe_feature_layers(cfg.aux_layer_ids, target.config.num_hidden_layers)
        if target is not None
        else f"entering target layers {', '.join(map(str, cfg.aux_layer_ids))}"
    )
    log.info(
        "loaded draft %s (H=%d, Vd=%d, features %s, dtype %s)",
        path, cfg.hidden_size, cfg.draft_vocab_size, layers, jnp.dtype(dtype).name,
    )
    return draft


def save_draft(draft: Eagle3Draft, path: str | Path, *, dtype: str | None = None) -> None:
    """Write ``draft`` as config.json + model.safetensors in the released layout.

    ``embed_tokens.weight`` is written only when ``draft.config.has_embed_tokens``. The
    feature-layer ids are omitted on the target's default layers and otherwise written in
    SGLang's convention (``to_file_layer_ids``).
    ``dtype`` ("float32", "float16" or "bfloat16"; None: as held) converts the float
    tensors; a value outside float16's range raises rather than becoming inf.
    """
    one_of("save dtype", dtype, (None, "float32", "float16", "bfloat16"))
    path = Path(path)
    cfg = draft.config
    # Built first: a draft whose layers cannot be written must not leave tensors behind.
    config = draft_config_to_hf(cfg, jnp.dtype(dtype) if dtype is not None else draft.fc.kernel[...].dtype)
    path.mkdir(parents=True, exist_ok=True)
    flat = dict(nnx.to_flat_state(nnx.state(draft)))
    tensors: dict[str, np.ndarray] = {}
    for p, (name, transpose) in draft_name_map(cfg).items():
        arr = np.asarray(flat[p][...])
        if dtype is not None:
            if dtype == "float16" and np.abs(arr.astype(np.float32)).max() >= np.finfo(np.float16).max:
                raise ConfigError(f"draft tensor {name} does not fit float16; save it as float32")
            arr = arr.astype(jnp.dtype(dtype))
        tensors[name] = np.ascontiguousarray(arr.T if transpose else arr)
    tensors[D2T] = np.asarray(draft.d2t[...]).astype(np.int64)
    tensors[T2D] = np.asarray(draft.t2d[...]).astype(bool)
    # "format": "pt" is what transformers and SGLang expect in a PyTorch-layout file.
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def random_draft(
    target_cfg: ModelConfig, *, seed: int, draft_vocab_size: int | None = None, mla=None, dtype=jnp.float32
) -> Eagle3Draft:
    """A random draft for ``target_cfg`` (own embedding; ``dtype`` float32 unless given)
    for tests and step timings; ``mla`` (a ``deepseek.MLAConfig``) makes its layer an MLA one.

    Norm weights are perturbed away from 1 so a misplaced norm shows; the draft
    vocabulary is a random sorted subset of the target's.
    """
    overrides: dict[str, Any] = {"has_embed_tokens": True, "mla": mla}
    if draft_vocab_size is not None:
        overrides["draft_vocab_size"] = draft_vocab_size
    cfg = DraftConfig.for_target(target_cfg, **overrides)
    draft = Eagle3Draft(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
    key = jax.random.key(seed)
    for i, norm in enumerate(
        (draft.midlayer.hidden_norm, draft.midlayer.input_layernorm, draft.midlayer.post_attention_layernorm, draft.norm)
    ):
        noise = jax.random.normal(jax.random.fold_in(key, i), norm.weight.shape)
        norm.weight.set_value((1.0 + 0.1 * noise).astype(norm.weight.dtype))
    rng = np.random.default_rng(seed)
    ids = np.sort(rng.choice(cfg.vocab_size, cfg.draft_vocab_size, replace=False))
    draft.d2t.set_value(jnp.asarray(ids - np.arange(cfg.draft_vocab_size), jnp.int32))
    draft.t2d.set_value(jnp.asarray(np.isin(np.arange(cfg.vocab_size), ids)))
    return draft
