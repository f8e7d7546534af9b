"""INT4 weights in compressed-tensors' ``pack-quantized`` format, kept packed in memory.

Kimi-K2.5 ships its routed experts this way (symmetric INT4, groups of 32 input columns;
everything else in high precision). One quantized ``Linear`` with a ``[out, in]`` weight
is stored as three tensors:

- ``weight_packed``: int32 ``[out, in / 8]``; eight 4-bit values per word, value ``j`` of
  a word in bits ``4j .. 4j+3`` (the lowest first), each stored as ``q + 8`` (0..15) for
  ``q`` in -8..7;
- ``weight_scale``: ``[out, in / group_size]`` (``[out, 1]`` for the ``channel`` strategy);
- ``weight_shape``: ``[2]``, the original ``(out, in)``.

The weight is ``q * scale`` of the column's group. Parameters stay packed (a quarter of
bfloat16's bytes, an eighth of float32's); ``Int4Weight`` dequantizes inside the compiled
expert product, so XLA fuses the unpacking into it and no float copy outlives the step.

``QuantConfig.from_hf_dict`` reads ``config.json``'s ``quantization_config`` (at the top
level, or in a Kimi-K2.5 ``text_config``) and refuses what this reader does not do, by
field: other methods and formats, other bit widths, asymmetric or activation
quantization, activation-ordered groups.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eagle_jax.errors import ConfigError
from eagle_jax.validate import is_int

BITS = 4
PER_WORD = 32 // BITS  # values per int32 word
STRATEGIES = ("group", "channel")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """A weight-only symmetric INT4 ``pack-quantized`` scheme and which modules it covers.

    ``group_size`` is None for the ``channel`` strategy (one scale per output row).
    ``targets`` and ``ignore`` follow compressed-tensors: a module is quantized when it
    matches a target (``"Linear"``: every linear layer; ``"re:PATTERN"``: ``re.match`` on
    the module's name; else the exact name) and no ignore entry.
    """

    group_size: int | None
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()

    def quantizes(self, module: str) -> bool:
        """Whether the linear module named ``module`` (checkpoint name, no ``.weight``) is packed."""
        return any(_matches(module, t, linear=True) for t in self.targets) and not any(
            _matches(module, t, linear=False) for t in self.ignore
        )

    def scale_columns(self, in_features: int, module: str) -> int:
        """Scale columns for an ``in_features``-wide weight; a width the packing cannot hold is an error."""
        if in_features % PER_WORD:
            raise ConfigError(
                f"quantization_config: {module} has in_features={in_features}, not a multiple of {PER_WORD} "
                f"(eight 4-bit values per int32 word)"
            )
        if self.group_size is None:
            return 1
        if in_features % self.group_size:
            raise ConfigError(
                f"quantization_config: group_size={self.group_size} does not divide {module}'s "
                f"in_features={in_features}"
            )
        return in_features // self.group_size

    def packed_shapes(self, out_features: int, in_features: int, module: str) -> dict[str, tuple[int, int]]:
        """The ``weight_packed`` and ``weight_scale`` shapes of one ``[out, in]`` weight."""
        return {
            "weight_packed": (out_features, in_features // PER_WORD),
            "weight_scale": (out_features, self.scale_columns(in_features, module)),
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], where: str = "config.json") -> "QuantConfig | None":
        """The scheme in ``d``'s ``quantization_config``, or None when it has none."""
        qc = d.get("quantization_config")
        if qc is None and isinstance(d.get("text_config"), dict):
            qc = d["text_config"].get("quantization_config")
        if qc is None:
            return None
        w = f"{where}: quantization_config"
        if not isinstance(qc, dict):
            raise ConfigError(f"{w} must be an object")
        method = qc.get("quant_method")
        if method != "compressed-tensors":
            raise ConfigError(f"{w}.quant_method={method!r} is not supported; supported: compressed-tensors")
        fmt = qc.get("format")
        if fmt != "pack-quantized":
            raise ConfigError(f"{w}.format={fmt!r} is not supported; supported: pack-quantized")
        status = qc.get("quantization_status", "compressed")
        if status != "compressed":
            raise ConfigError(
                f"{w}.quantization_status={status!r}: the checkpoint is not packed; supported: compressed"
            )
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ConfigError(f"{w}.config_groups must be a non-empty object")
        sizes, targets = set(), []
        for name, g in groups.items():
            gw = f"{w}.config_groups.{name}"
            if not isinstance(g, dict):
                raise ConfigError(f"{gw} must be an object")
            if g.get("format") not in (None, "pack-quantized"):
                raise ConfigError(f"{gw}.format={g.get('format')!r} is not supported; supported: pack-quantized")
            for act in ("input_activations", "output_activations"):
                if g.get(act) is not None:
                    raise ConfigError(f"{gw}.{act} is set: activation quantization is not supported (weight-only INT4)")
            sizes.add(_weight_args(g.get("weights"), f"{gw}.weights"))
            t = g.get("targets", ["Linear"])
            if not isinstance(t, list) or not all(isinstance(x, str) for x in t):
                raise ConfigError(f"{gw}.targets must be a list of strings")
            targets += t
        if len(sizes) > 1:
            raise ConfigError(f"{w}: config_groups use different group sizes {sorted(sizes, key=str)}; supported: one")
        ignore = qc.get("ignore") or []
        if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
            raise ConfigError(f"{w}.ignore must be a list of strings")
        for t in targets + ignore:
            if t.startswith("re:"):
                try:
                    re.compile(t[3:])
                except re.error as e:
                    raise ConfigError(f"{w}: bad regular expression {t!r}: {e}") from e
        return cls(group_size=sizes.pop(), targets=tuple(targets), ignore=tuple(ignore))


def _weight_args(a: Any, w: str) -> int | None:
    if not isinstance(a, dict):
        raise ConfigError(f"{w} must be an object (weight-only quantization)")
    bits = a.get("num_bits")
    if bits != BITS:
        raise ConfigError(f"{w}.num_bits={bits!r} is not supported; supported: 4")
    if a.get("type", "int") != "int":
        raise ConfigError(f"{w}.type={a.get('type')!r} is not supported; supported: int")
    if a.get("symmetric", True) is not True:
        raise ConfigError(f"{w}.symmetric={a.get('symmetric')!r} is not supported; supported: true (no zero points)")
    if a.get("dynamic", False) not in (False, None):
        raise ConfigError(f"{w}.dynamic={a.get('dynamic')!r} is not supported; supported: false")
    if a.get("actorder") not in (None, False):
        raise ConfigError(f"{w}.actorder={a.get('actorder')!r} is not supported; supported: null (groups in column order)")
    strategy = a.get("strategy", "group")
    if strategy not in STRATEGIES:
        raise ConfigError(f"{w}.strategy={strategy!r} is not supported; supported: {', '.join(STRATEGIES)}")
    if strategy == "channel":
        return None
    g = a.get("group_size")
    if not is_int(g) or g <= 0 or g % PER_WORD:
        raise ConfigError(f"{w}.group_size={g!r} must be a positive multiple of {PER_WORD}")
    return g


def _matches(name: str, target: str, *, linear: bool) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or (linear and target == "Linear")


# ----------------------------------------------------------------------------- arrays


def unpack_int4(packed: Int[Array, "... O P"]) -> Int[Array, "... O I"]:
    """The signed 4-bit values (-8..7, int8) of ``weight_packed``; ``I = 8 P``."""
    shifts = jnp.arange(PER_WORD, dtype=jnp.int32) * BITS
    # & 0xF after the shift keeps four bits whatever an arithmetic shift brought in.
    nibbles = (packed[..., None] >> shifts) & 0xF  # [..., O, P, 8]
    return (nibbles.reshape(*packed.shape[:-1], packed.shape[-1] * PER_WORD) - 8).astype(jnp.int8)


def dequantize(packed: Int[Array, "... O P"], scale: Float[Array, "... O G"], dtype=None) -> Float[Array, "... O I"]:
    """``q * scale`` of each column's group: the ``[out, in]`` weight, in ``scale``'s dtype
    (as compressed-tensors' own decompression computes it), then cast to ``dtype``."""
    shifts = jnp.arange(PER_WORD, dtype=jnp.int32) * BITS
    # Straight to the scale's dtype (no int8 step: 10-15% faster on XLA CPU); small
    # integers convert exactly, so this equals unpack_int4(packed) * scale.
    q = ((packed[..., None] >> shifts) & 0xF).astype(scale.dtype) - 8  # [..., O, P, 8]
    out_shape = (*packed.shape[:-1], packed.shape[-1] * PER_WORD)
    w = q.reshape(*packed.shape[:-1], scale.shape[-1], -1) * scale[..., None]
    w = w.reshape(out_shape)
    return w if dtype is None else w.astype(dtype)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["packed", "scale"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Int4Weight:
    """A stack of packed ``[out, in]`` weights (one per expert), read as ``[in, out]``
    float matrices: the layout the float expert parameters have. A pytree (shard_map
    splits both arrays over the expert axis)."""

    packed: Int[Array, "E O P"]
    scale: Float[Array, "E O G"]

    def take(self, idx: Int[Array, "J"]) -> Float[Array, "J I O"]:
        """The experts ``idx`` (gathered packed: a decode step reads only those)."""
        return jnp.swapaxes(dequantize(self.packed[idx], self.scale[idx]), -1, -2)

    def full(self) -> Float[Array, "E I O"]:
        return jnp.swapaxes(dequantize(self.packed, self.scale), -1, -2)
