"""Loading what an engine serves: a target and its draft from checkpoint directories
(or checked when given as loaded modules), and the target's tokenizer."""

from __future__ import annotations

from pathlib import Path

from eagle_jax.checkpoint.draft_io import load_draft, read_draft_config
from eagle_jax.checkpoint.hf import load_model
from eagle_jax.checkpoint.tokenizer import Tokenizer
from eagle_jax.errors import ConfigError
from eagle_jax.models.draft import Eagle3Draft
from eagle_jax.models.registry import read_target_config
from eagle_jax.models.target import TargetModel


def load_models(target, draft, dtype, mesh=None):
    """The target and draft, each loaded from its directory when given as a path (the
    target built to return the feature layers the draft reads; on a mesh of several
    devices each parameter read straight into its shards), or checked when given loaded."""
    if isinstance(target, (str, Path)):
        path = Path(target)
        cfg = None
        if isinstance(draft, (str, Path)):
            # The draft says which target layers feed it; build the target to return those.
            tcfg = read_target_config(path)
            dcfg = read_draft_config(draft, target_cfg=tcfg)
            cfg = tcfg.replace(aux_layer_ids=dcfg.aux_layer_ids)
        # On a mesh of several devices each parameter is read straight into its shards.
        target = load_model(path, dtype=dtype, config=cfg, mesh=mesh)
    if isinstance(draft, (str, Path)):
        draft = load_draft(draft, target=target, dtype=dtype)
    if not isinstance(target, TargetModel):
        raise ConfigError(f"target must be a target model (eagle_jax.models.target.TargetModel) or a checkpoint path, got {type(target).__name__}")
    if draft is not None and not isinstance(draft, Eagle3Draft):
        raise ConfigError(f"draft must be an Eagle3Draft, a checkpoint path or None, got {type(draft).__name__}")
    return target, draft


def tokenizer_for(target_path, tokenizer):
    """``tokenizer``, else the target directory's (None for a target given loaded)."""
    if tokenizer is not None or not isinstance(target_path, (str, Path)):
        return tokenizer
    return Tokenizer.from_dir(target_path)
