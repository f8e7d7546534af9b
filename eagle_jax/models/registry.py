"""The target families this package ships, by checkpoint ``architectures`` name.

Importing this module imports every built-in family (each registers itself into
``eagle_jax.models.target``'s table on import), so a lookup here sees them all. It sits
above the families, and ``target`` below them, so the imports run one way."""

from __future__ import annotations

from pathlib import Path

import eagle_jax.models.deepseek  # noqa: F401  (registers DeepseekV3ForCausalLM, KimiK2...)
import eagle_jax.models.llama  # noqa: F401  (registers LlamaForCausalLM)
from eagle_jax.errors import ConfigError
from eagle_jax.models.config import read_config_json
from eagle_jax.models.target import _FAMILIES, TargetFamily


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(_FAMILIES))


def family_for(config_dict: dict, where: str = "config.json") -> TargetFamily:
    """The implementation for a config.json dict, by its ``architectures[0]``."""
    archs = config_dict.get("architectures") or ["LlamaForCausalLM"]
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ConfigError(f"{where}: 'architectures' must be a list of names, got {archs!r}")
    fam = _FAMILIES.get(archs[0])
    if fam is None:
        raise ConfigError(
            f"{where}: architecture {archs[0]!r} is not supported; supported: {', '.join(sorted(_FAMILIES))}"
        )
    return fam


def read_target_config(path, kind: str = "checkpoint"):
    """The frozen config of the target checkpoint in directory ``path``, read by the
    implementation its config.json names (any registered family): what every command
    sizes its context and features by, never one family's own config class."""
    raw = read_config_json(path, kind)
    return family_for(raw, str(Path(path) / "config.json")).config_from_hf(raw)
