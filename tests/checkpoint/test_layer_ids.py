"""Feature-layer ids in draft config.json: what eagle-jax writes, SGLang captures the same
streams eagle-jax feeds the draft (SGLang adds 1 to every explicit id; without ids both use
the streams entering [2, N//2, N-3]); vLLM-style files are read as written with "input"."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle_jax.checkpoint.draft_io import (
    default_aux_layer_ids,
    describe_feature_layers,
    draft_config_from_hf,
    draft_config_to_hf,
    random_draft,
    read_draft_config,
    save_draft,
)
from eagle_jax.models.config import ModelConfig
from eagle_jax.models.draft import DraftConfig, Eagle3Draft
from eagle_jax.errors import ConfigError
from eagle_jax.models.llama import KVCache, LlamaModel, causal_mask, rope_cos_sin, rope_inv_freq

N = 8
TARGET_CFG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=N,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
)
DEFAULT = (2, N // 2, N - 3)
# Not the default, and including the last layer's output (entering "layer N").
OTHER = (1, 3, N)
FIELD = "eagle_aux_hidden_state_layer_ids"


def saved(tmp_path, entering_ids, name="draft"):
    """A random draft for TARGET_CFG on ``entering_ids``, written by save_draft; its directory."""
    target_cfg = TARGET_CFG.replace(aux_layer_ids=entering_ids)
    path = tmp_path / name
    save_draft(random_draft(target_cfg, seed=0), path)
    return path


def file_ids(path):
    """The ids in config.json as written (None when the field is absent)."""
    return json.loads((path / "config.json").read_text())["eagle_config"].get(FIELD)


def config_with_ids(ids):
    """A draft config.json dict for TARGET_CFG carrying ``ids`` as written by someone else."""
    d = draft_config_to_hf(DraftConfig.for_target(TARGET_CFG), jnp.float32)
    d["eagle_config"][FIELD] = list(ids)
    return d


# ----------------------------------------------------------------------------- write, read back


@pytest.mark.parametrize("entering,written", [(DEFAULT, None), (OTHER, [0, 2, N - 1])])
def test_save_then_read_gives_the_same_layers(tmp_path, entering, written):
    path = saved(tmp_path, entering)
    # Default layers: no ids (every runtime agrees); others: SGLang's "output of layer k".
    assert file_ids(path) == written
    assert read_draft_config(path, target_cfg=TARGET_CFG).aux_layer_ids == entering


def test_unknown_target_depth_writes_ids_even_for_the_default(tmp_path):
    # Without the target's N the writer cannot know the ids are its default, so it writes them.
    cfg = DraftConfig.for_target(TARGET_CFG, has_embed_tokens=True, target_num_hidden_layers=None)
    save_draft(Eagle3Draft(cfg), tmp_path)
    assert file_ids(tmp_path) == [i - 1 for i in DEFAULT]
    assert read_draft_config(tmp_path).aux_layer_ids == DEFAULT  # no target needed now


def test_layers_that_cannot_be_written_leave_no_files(tmp_path):
    # Entering layer 0 (the embeddings) has no "output of layer k" id.
    with pytest.raises(ConfigError, match="include 0"):
        save_draft(Eagle3Draft(DraftConfig.for_target(TARGET_CFG, aux_layer_ids=(0, 3, 5))), tmp_path / "zero")
    # SGLang/vLLM hand over captured streams in layer order, once each.
    with pytest.raises(ConfigError, match="not strictly increasing"):
        save_draft(Eagle3Draft(DraftConfig.for_target(TARGET_CFG, aux_layer_ids=(5, 3, 4))), tmp_path / "order")
    assert not (tmp_path / "zero").exists() and not (tmp_path / "order").exists()


# ----------------------------------------------------------------------------- reading others' files


@pytest.mark.parametrize("n", [8, 30, 61])
def test_specforge_ids_read_as_the_default(n):
    target_cfg = TARGET_CFG.replace(num_hidden_layers=n)
    d = config_with_ids([1, n // 2 - 1, n - 4])  # e.g. [1, 29, 57] for a 61-layer target
    dcfg = draft_config_from_hf(d, target_cfg=target_cfg)
    assert dcfg.aux_layer_ids == (2, n // 2, n - 3) == default_aux_layer_ids(target_cfg)


def test_auto_adds_one_to_every_id_and_input_reads_vllm_ids_as_written():
    d = config_with_ids([2, 4, N])  # a vLLM file: entering layers 2, 4 and N
    assert draft_config_from_hf(d, target_cfg=TARGET_CFG, layer_id_convention="input").aux_layer_ids == (2, 4, N)
    assert draft_config_from_hf(config_with_ids([2, 4, 5]), target_cfg=TARGET_CFG).aux_layer_ids == (3, 5, 6)
    # Read with SGLang's rule, id N would be the output of a layer the target lacks.
    with pytest.raises(ConfigError, match=r"x\.json: eagle_config\.eagle_aux_hidden_state_layer_ids=\[2, 4, 8\] "
                                          r"has 8, outside the valid range \[0, 7\].*'input'"):
        draft_config_from_hf(d, target_cfg=TARGET_CFG, source="x.json")
    with pytest.raises(ConfigError, match=r"has 9, outside the valid range \[0, 8\]"):
        draft_config_from_hf(config_with_ids([2, 4, 9]), target_cfg=TARGET_CFG, layer_id_convention="input")


@pytest.mark.parametrize("ids", [[-1, 3, 5], [True, 3, 5], [], "2,4,5"])
def test_malformed_ids_are_refused_naming_the_field(tmp_path, ids):
    path = saved(tmp_path, OTHER)
    cfg = json.loads((path / "config.json").read_text())
    cfg["eagle_config"][FIELD] = ids
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=rf"{path / 'config.json'}: eagle_config\.{FIELD}=.* must be a non-empty list"):
        read_draft_config(path)


# ----------------------------------------------------------------------------- SGLang's capture


def sglang_features(model, path, tokens):
    """What SGLang hands the draft for the file at ``path``: walking the target's layers, layer
    i's input is appended when ``i in layers_to_capture`` (``[id + 1 for id in ids]``, or
    ``[2, N//2, N-3]`` when the file has no ids), as in ``set_eagle3_layers_to_capture``."""
    ids = file_ids(path)
    n = model.config.num_hidden_layers
    capture = [2, n // 2, n - 3] if ids is None else [i + 1 for i in ids]
    cfg = model.config
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    cache = KVCache.zeros(cfg, b, t)
    mask = causal_mask(positions, t)
    h = model.embed(tokens)
    captured = []
    for i, layer in enumerate(model.layers):
        if i in capture:
            captured.append(h)
        h, _, _ = layer(h, cos, sin, cache.k[i], cache.v[i], positions, mask)
    assert len(captured) == len(capture), "SGLang would capture a layer the target lacks"
    return jnp.concatenate(captured, axis=-1)


def eagle_jax_features(model, entering_ids, tokens):
    """The features eagle-jax feeds the draft: LlamaModel(return_features=True) on those layers."""
    cfg = model.config.replace(aux_layer_ids=tuple(entering_ids))
    target = LlamaModel(cfg, rngs=nnx.Rngs(1))
    nnx.update(target, nnx.state(model))
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    _, feats, _ = target(tokens, positions, KVCache.zeros(cfg, b, t), positions, causal_mask(positions, t), return_features=True)
    return feats


@pytest.mark.parametrize("entering", [DEFAULT, (3, 4, 6)])
def test_sglang_captures_what_eagle_jax_feeds_the_draft(tmp_path, entering):
    model = LlamaModel(TARGET_CFG, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, TARGET_CFG.vocab_size, (2, 6)))
    path = saved(tmp_path, entering)
    read = read_draft_config(path, target_cfg=TARGET_CFG).aux_layer_ids
    ours = eagle_jax_features(model, read, tokens)
    np.testing.assert_allclose(np.asarray(sglang_features(model, path, tokens)), np.asarray(ours), rtol=1e-6, atol=1e-6)
    # Neighbouring layers differ, so one layer off would show here.
    shifted = eagle_jax_features(model, [i + 1 for i in read], tokens)
    assert np.abs(np.asarray(shifted - ours)).max() > 1e-2


# ----------------------------------------------------------------------------- description


def test_describe_feature_layers():
    assert describe_feature_layers((2, 15, 27), 30) == "entering target layers 2, 15, 27 (default [2, N//2, N-3], N=30)"
    assert describe_feature_layers([3, 16, 30], 30) == (
        "entering target layers 3, 16, 30 (not the default 2, 15, 27 for N=30); "
        "30 is the last layer's output before the final norm"
    )
    with pytest.raises(ConfigError, match=r"\[0, 30\]"):
        describe_feature_layers([3, 16, 31], 30)


def test_default_rule_matches_the_model():
    # describe_feature_layers and the writer restate ModelConfig's default rule.
    for n in range(1, 41):
        cfg = TARGET_CFG.replace(num_hidden_layers=n)
        assert "(default " in describe_feature_layers(cfg.feature_layer_ids, n), n
        assert FIELD not in draft_config_to_hf(DraftConfig.for_target(cfg), jnp.float32)["eagle_config"], n
