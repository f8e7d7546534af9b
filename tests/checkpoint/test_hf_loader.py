"""Loading Hugging Face directories: every bad checkpoint fails with a message naming the problem."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from eagle_jax.checkpoint.hf import load_model
from eagle_jax.models.config import ModelConfig
from eagle_jax.errors import CheckpointError, ConfigError
from hf_factories import make_hf_model


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("good")
    make_hf_model("llama_tied").save_pretrained(path, safe_serialization=True)
    return path


def _copy(good_dir, tmp_path, tensors=None, config=None):
    cfg = json.loads((good_dir / "config.json").read_text())
    if config:
        cfg.update(config)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    t = load_file(good_dir / "model.safetensors")
    if tensors:
        tensors(t)
    save_file(t, tmp_path / "model.safetensors")
    return tmp_path


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_model(tmp_path)


def test_corrupt_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(tmp_path)


def test_unsupported_architecture(good_dir, tmp_path):
    _copy(good_dir, tmp_path, config={"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        load_model(tmp_path)


def test_missing_tensor_is_named(good_dir, tmp_path):
    _copy(good_dir, tmp_path, tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path)


def test_shape_mismatch_names_tensor_and_shapes(good_dir, tmp_path):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:-1]

    _copy(good_dir, tmp_path, tensors=shrink)
    with pytest.raises(CheckpointError, match=r"k_proj\.weight has shape \(31, 64\), expected \(32, 64\)"):
        load_model(tmp_path)


def test_truncated_safetensors(good_dir, tmp_path):
    _copy(good_dir, tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(tmp_path)


def test_no_weights(good_dir, tmp_path):
    (tmp_path / "config.json").write_text((good_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(tmp_path)


def test_sharded_index_rejects_paths_outside_the_directory(good_dir, tmp_path):
    _copy(good_dir, tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001-of-00001.safetensors")
    index = {"weight_map": {"model.norm.weight": "../../etc/passwd"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="invalid shard"):
        load_model(tmp_path)


def test_sharded_checkpoint_loads(good_dir, tmp_path):
    t = load_file(good_dir / "model.safetensors")
    names = sorted(t)
    half = len(names) // 2
    save_file({n: t[n] for n in names[:half]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({n: t[n] for n in names[half:]}, tmp_path / "model-00002-of-00002.safetensors")
    wm = {n: ("model-00001-of-00002.safetensors" if i < half else "model-00002-of-00002.safetensors") for i, n in enumerate(names)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    (tmp_path / "config.json").write_text((good_dir / "config.json").read_text())
    a, b = load_model(good_dir), load_model(tmp_path)
    np.testing.assert_array_equal(np.asarray(a.layers[3].mlp.down_proj.kernel[...]), np.asarray(b.layers[3].mlp.down_proj.kernel[...]))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_attention_heads", 3, "multiple of num_key_value_heads"),
        ("hidden_size", 0, "hidden_size=0"),
        ("rms_norm_eps", -1.0, "rms_norm_eps"),
    ],
)
def test_invalid_config_fields(field, value, message):
    d = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)
    d[field] = value
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(d)


def test_unsupported_rope_scaling():
    d = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
             rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError, match="yarn"):
        ModelConfig.from_hf_dict(d)
