"""EAGLE-3 draft: parity with a torch forward, checkpoint format, layer-id conventions, errors.

Reference checkpoints are written here with torch + safetensors.torch in the released key
layout, independently of ``save_draft``.
"""

import json

import beartype
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from eagle_jax.checkpoint.draft_io import (
    draft_config_from_hf,
    load_draft,
    random_draft,
    save_draft,
    to_input_layer_ids,
)
from eagle_jax.models.config import ModelConfig
from eagle_jax.models.draft import DraftConfig, Eagle3Draft, check_compatible
from eagle_jax.errors import CheckpointError, ConfigError
from eagle_jax.models.llama import KVCache, LlamaModel, causal_mask

TOL = 1e-4
H, HEADS, KV, HD, INTER = 64, 4, 2, 16, 128
V, VD, N = 300, 128, 4
# The target's RoPE differs from every draft's here, so using the wrong one would show.
TARGET_CFG = ModelConfig(
    vocab_size=V,
    hidden_size=H,
    intermediate_size=INTER,
    num_hidden_layers=N,
    num_attention_heads=HEADS,
    num_key_value_heads=KV,
    head_dim=HD,
    rope_theta=50000.0,
)
# Entering-layer ids of the target's default features, and the same layers as SpecForge
# writes them for SGLang ("output of layer k").
DEFAULT_IDS = [2, N // 2, N - 3]
SPECFORGE_IDS = [1, N // 2 - 1, N - 4]


@pytest.fixture(scope="module")
def target():
    return LlamaModel(TARGET_CFG, rngs=nnx.Rngs(0))


# ----------------------------------------------------------------------------- reference files


def reference_checkpoint(seed=0, *, embed=True, style="eagle3", ids=SPECFORGE_IDS, ht=H, vocab=V):
    """(tensors, config.json dict) in the released layout, PyTorch [out, in] weights.

    style "eagle3": SpecForge/SGLang config (LlamaForCausalLMEagle3, eagle_config with
    ``ids`` in SGLang's convention, by default the target's default layers, rope_theta
    20000); "reference": the EAGLE repo's training config (LlamaForCausalLM,
    no eagle_config, no rope_theta).
    """
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return 0.05 * torch.randn(*shape, generator=g)

    def norm():
        return 1.0 + 0.1 * torch.randn(H, generator=g)

    t = {
        "fc.weight": w(H, len(ids) * ht),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": w(HEADS * HD, 2 * H),
        "midlayer.self_attn.k_proj.weight": w(KV * HD, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(KV * HD, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, HEADS * HD),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.mlp.gate_proj.weight": w(INTER, H),
        "midlayer.mlp.up_proj.weight": w(INTER, H),
        "midlayer.mlp.down_proj.weight": w(H, INTER),
        "norm.weight": norm(),
        "lm_head.weight": w(VD, H),
    }
    used = torch.sort(torch.randperm(vocab, generator=g)[:VD]).values
    t["d2t"] = used - torch.arange(VD)  # int64 offsets
    t["t2d"] = torch.zeros(vocab, dtype=torch.bool)
    t["t2d"][used] = True
    if embed:
        t["embed_tokens.weight"] = w(vocab, H)
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3" if style == "eagle3" else "LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HD,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048,
        "vocab_size": vocab,
        "draft_vocab_size": VD,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if style == "eagle3":
        cfg["rope_theta"] = 20000.0
        cfg["target_hidden_size"] = ht
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids), "use_aux_hidden_state": True}
    return t, cfg


def write_checkpoint(path, tensors, cfg):
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg))
    return path


class TorchEagle3:
    """The EAGLE-3 draft layer in torch, from transformers' Llama blocks with 2H-wide q/k/v."""

    def __init__(self, t, cfg, embed):
        lc = transformers.LlamaConfig(
            hidden_size=H,
            intermediate_size=INTER,
            num_attention_heads=HEADS,
            num_key_value_heads=KV,
            head_dim=HD,
            num_hidden_layers=1,
            vocab_size=V,
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_theta=cfg.get("rope_theta", 10000.0),
        )
        lc._attn_implementation = "eager"
        self.layer = LlamaDecoderLayer(lc, layer_idx=0).eval()
        attn = self.layer.self_attn
        attn.q_proj = torch.nn.Linear(2 * H, HEADS * HD, bias=False)
        attn.k_proj = torch.nn.Linear(2 * H, KV * HD, bias=False)
        attn.v_proj = torch.nn.Linear(2 * H, KV * HD, bias=False)
        prefix = "midlayer."
        self.layer.load_state_dict(
            {k[len(prefix):]: v for k, v in t.items() if k.startswith(prefix) and "hidden_norm" not in k}
        )
        self.hidden_norm = LlamaRMSNorm(H, lc.rms_norm_eps)
        self.hidden_norm.weight.data = t["midlayer.hidden_norm.weight"]
        self.norm = LlamaRMSNorm(H, lc.rms_norm_eps)
        self.norm.weight.data = t["norm.weight"]
        self.rotary = LlamaRotaryEmbedding(lc)
        self.t, self.embed = t, embed

    @torch.no_grad()
    def fuse(self, feats):
        return feats @ self.t["fc.weight"].T

    @torch.no_grad()
    def __call__(self, tokens, hidden):
        """Whole-sequence causal forward from position 0: (pre-norm h, logits)."""
        b, n = tokens.shape
        pos = torch.arange(n)[None].expand(b, n)
        cos_sin = self.rotary(hidden, pos)
        mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
        residual = hidden
        x = torch.cat([self.layer.input_layernorm(self.embed[tokens]), self.hidden_norm(hidden)], -1)
        a, _ = self.layer.self_attn(x, position_embeddings=cos_sin, attention_mask=mask)
        h = residual + a
        h = h + self.layer.mlp(self.layer.post_attention_layernorm(h))
        return h, self.norm(h) @ self.t["lm_head.weight"].T


def run_draft(draft, tokens, hidden, start, cache):
    """One draft call on tokens at positions start.. (slot = position): (h, logits, cache)."""
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(start, start + t, dtype=jnp.int32), (b, t))
    h, cache = draft(jnp.asarray(tokens), hidden, pos, cache, pos, causal_mask(pos, cache.max_len))
    return h, np.asarray(draft.logits(h)), cache


# ----------------------------------------------------------------------------- (a) parity


@pytest.mark.parametrize("style,embed", [("eagle3", True), ("reference", False)])
def test_logits_match_torch_reference(tmp_path, target, style, embed):
    t, cfg = reference_checkpoint(1, embed=embed, style=style)
    draft = load_draft(write_checkpoint(tmp_path, t, cfg), target=target)
    if not embed:
        assert draft.embed_tokens[...] is target.embed_tokens[...]  # shared, not copied
    emb = t["embed_tokens.weight"] if embed else torch.from_numpy(np.array(target.embed_tokens[...]))
    ref = TorchEagle3(t, cfg, emb)
    assert draft.config.rope_theta == cfg.get("rope_theta", 10000.0)

    rng = np.random.default_rng(2)
    tokens = rng.integers(0, V, (2, 7))
    feats = rng.standard_normal((2, 6, 3 * H)).astype(np.float32)
    # Step 1: six tokens paired with the fused target features.
    h1, logits1, cache = run_draft(draft, tokens[:, :6], draft.fuse(jnp.asarray(feats)), 0, KVCache.zeros(draft.config, 2, 8))
    ref_h1, ref_logits1 = ref(torch.from_numpy(tokens[:, :6]), ref.fuse(torch.from_numpy(feats)))
    assert np.abs(logits1 - ref_logits1.numpy()).max() <= TOL
    assert np.abs(np.asarray(h1) - ref_h1.numpy()).max() <= TOL
    # Step 2: one token through the cache, fed the draft's own last output.
    _, logits2, _ = run_draft(draft, tokens[:, 6:], h1[:, -1:], 6, cache)
    hidden7 = torch.cat([ref.fuse(torch.from_numpy(feats)), ref_h1[:, -1:]], 1)
    _, ref_logits7 = ref(torch.from_numpy(tokens), hidden7)
    assert np.abs(logits2[:, 0] - ref_logits7[:, 6].numpy()).max() <= TOL


def test_vocab_maps_loaded(tmp_path, target):
    t, cfg = reference_checkpoint(3)
    draft = load_draft(write_checkpoint(tmp_path, t, cfg), target=target)
    used = (t["d2t"] + torch.arange(VD)).numpy()
    assert draft.d2t[...].dtype == jnp.int32 and draft.t2d[...].dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(draft.draft_to_target(jnp.arange(VD))), used)
    np.testing.assert_array_equal(np.asarray(draft.t2d[...]), t["t2d"].numpy())
    trainable = dict(nnx.to_flat_state(nnx.state(draft, nnx.Param)))
    assert ("d2t",) not in trainable and ("t2d",) not in trainable and ("lm_head",) in trainable


def test_shapes_typecheck_with_beartype():
    draft = random_draft(TARGET_CFG, seed=0, draft_vocab_size=VD)
    checked = {
        name: jaxtyping.jaxtyped(typechecker=beartype.beartype)(getattr(Eagle3Draft, name))
        for name in ("fuse", "__call__", "logits")
    }
    pos = jnp.arange(3, dtype=jnp.int32)[None]
    hidden = checked["fuse"](draft, jnp.zeros((1, 3, 3 * H)))
    h, _ = checked["__call__"](
        draft, jnp.zeros((1, 3), jnp.int32), hidden, pos, KVCache.zeros(draft.config, 1, 4), pos, causal_mask(pos, 4)
    )
    assert checked["logits"](draft, h).shape == (1, 3, VD)


def test_norm_before_residual_variant():
    """vLLM's variant on h equals the default on hidden_norm(h) when that norm is idempotent."""
    draft = random_draft(TARGET_CFG, seed=0, draft_vocab_size=VD)
    draft.midlayer.hidden_norm.weight.set_value(jnp.ones((H,)))
    variant = Eagle3Draft(draft.config.replace(norm_before_residual=True))
    nnx.update(variant, nnx.state(draft))
    tokens = np.array([[5, 9]])
    hidden = 3.0 * jnp.asarray(np.random.default_rng(0).standard_normal((1, 2, H)), jnp.float32)
    h_variant, _, _ = run_draft(variant, tokens, hidden, 0, KVCache.zeros(draft.config, 1, 4))
    normed = draft.midlayer.hidden_norm(hidden)
    h_default, _, _ = run_draft(draft, tokens, normed, 0, KVCache.zeros(draft.config, 1, 4))
    np.testing.assert_allclose(np.asarray(h_variant), np.asarray(h_default), atol=1e-5)
    h_plain, _, _ = run_draft(draft, tokens, hidden, 0, KVCache.zeros(draft.config, 1, 4))
    assert np.abs(np.asarray(h_plain - h_variant)).max() > 0.1


# ----------------------------------------------------------------------------- (b) round trip


def test_save_load_round_trip_matches_reference_layout(tmp_path, target):
    draft = random_draft(TARGET_CFG, seed=4, draft_vocab_size=VD)
    save_draft(draft, tmp_path / "ours")
    loaded = load_draft(tmp_path / "ours", target=target)
    tokens = np.random.default_rng(5).integers(0, V, (2, 5))
    feats = jnp.asarray(np.random.default_rng(6).standard_normal((2, 5, 3 * H)), jnp.float32)
    outs = [run_draft(d, tokens, d.fuse(feats), 0, KVCache.zeros(d.config, 2, 8))[1] for d in (draft, loaded)]
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(np.asarray(loaded.d2t[...]), np.asarray(draft.d2t[...]))
    assert loaded.config == draft.config

    ref_dir = write_checkpoint(tmp_path / "ref", *reference_checkpoint(0, embed=True))

    def layout(path):
        with safe_open(path / "model.safetensors", framework="numpy") as f:
            return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}

    assert layout(tmp_path / "ours") == layout(ref_dir)
    assert layout(ref_dir)["d2t"][0] == "I64" and layout(ref_dir)["t2d"][0] == "BOOL"
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    # The target's default layers: no ids, so SGLang, vLLM and eagle-jax all use them.
    assert cfg["eagle_config"] == {"use_aux_hidden_state": True}
    assert (cfg["draft_vocab_size"], cfg["vocab_size"], cfg["target_hidden_size"]) == (VD, V, H)
    assert cfg["torch_dtype"] == "float32" and cfg["tie_word_embeddings"] is False


def test_save_without_embedding_and_bfloat16(tmp_path, target):
    t, cfg = reference_checkpoint(7, embed=False)
    draft = load_draft(write_checkpoint(tmp_path / "ref", t, cfg), target=target, dtype="bfloat16")
    save_draft(draft, tmp_path / "out")
    with safe_open(tmp_path / "out" / "model.safetensors", framework="numpy") as f:
        keys = set(f.keys())
        assert f.get_slice("fc.weight").get_dtype() == "BF16"
    assert keys == set(t)  # no embed_tokens.weight written
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    again = load_draft(tmp_path / "out", target=target, dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(again.lm_head[...]), np.asarray(draft.lm_head[...]))


# ----------------------------------------------------------------------------- (c) conventions


@pytest.mark.parametrize(
    "ids,convention,expected",
    [
        ([1, 3, 4], "auto", (2, 4, 5)),  # SpecForge's [1, N//2-1, N-4] for N = 8: outputs
        ([2, 4, 5], "auto", (3, 5, 6)),  # SGLang adds 1 to every explicit id, whatever the first
        ([2, 4, 5], "output", (3, 5, 6)),
        ([1, 3, 4], "input", (1, 3, 4)),  # vLLM: as written
    ],
)
def test_layer_id_conventions(ids, convention, expected):
    assert to_input_layer_ids(ids, convention) == expected
    target8 = TARGET_CFG.replace(num_hidden_layers=8)
    _, cfg = reference_checkpoint(0, ids=ids)
    draft_cfg = draft_config_from_hf(cfg, layer_id_convention=convention)
    assert draft_cfg.aux_layer_ids == expected
    if expected == (2, 4, 5):
        check_compatible(draft_cfg, target8)


def test_specforge_ids_load_as_default_inputs(tmp_path, target):
    path = write_checkpoint(tmp_path, *reference_checkpoint(0, ids=SPECFORGE_IDS))
    assert load_draft(path, target=target).config.aux_layer_ids == tuple(DEFAULT_IDS)
    with pytest.raises(ConfigError, match="aux_layer_ids"):
        load_draft(path, target=target, layer_id_convention="input")  # (1, 1, 0) != target's


def test_missing_eagle_config_uses_target_default(tmp_path, target):
    path = write_checkpoint(tmp_path, *reference_checkpoint(0, style="reference", embed=True))
    assert load_draft(path, target=target).config.aux_layer_ids == tuple(DEFAULT_IDS)
    with pytest.raises(ConfigError, match="eagle_aux_hidden_state_layer_ids"):
        load_draft(path)


def test_bad_convention_name():
    with pytest.raises(ConfigError, match="layer_id_convention='outputs'"):
        to_input_layer_ids([1, 2, 3], "outputs")


# ----------------------------------------------------------------------------- (d) bad inputs


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_draft(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        load_draft(tmp_path / "empty")


def test_pickle_weights_refused(tmp_path):
    _, cfg = reference_checkpoint(0)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="pickle"):
        load_draft(tmp_path)


def test_missing_tensor(tmp_path, target):
    t, cfg = reference_checkpoint(0)
    del t["midlayer.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"midlayer\.mlp\.up_proj\.weight"):
        load_draft(write_checkpoint(tmp_path, t, cfg), target=target)


def test_shape_mismatch(tmp_path, target):
    t, cfg = reference_checkpoint(0)
    t["midlayer.self_attn.k_proj.weight"] = torch.zeros(KV * HD, H)  # H-wide, not 2H
    with pytest.raises(CheckpointError, match=r"k_proj\.weight has shape \(32, 64\), expected \(32, 128\)"):
        load_draft(write_checkpoint(tmp_path, t, cfg), target=target)


def test_no_embedding_needs_target(tmp_path):
    path = write_checkpoint(tmp_path, *reference_checkpoint(0, embed=False))
    with pytest.raises(CheckpointError, match="embed_tokens"):
        load_draft(path)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(ht=32), "target_hidden_size=32"),
        (dict(vocab=299), "vocab_size=299"),
        (dict(ids=[1, 1]), r"2 aux_layer_ids \(2, 2\)"),
        (dict(ids=[1, 1, 9]), r"config\.json: eagle_config\.eagle_aux_hidden_state_layer_ids=\[1, 1, 9\] has 9, outside the valid range \[0, 3\]"),
    ],
)
def test_incompatible_with_target(tmp_path, target, kwargs, match):
    path = write_checkpoint(tmp_path, *reference_checkpoint(0, **kwargs))
    with pytest.raises(ConfigError, match=match):
        load_draft(path, target=target)


def test_d2t_out_of_range(tmp_path, target):
    t, cfg = reference_checkpoint(0)
    t["d2t"][-1] = 2**40  # would wrap to a plausible id if read as int32
    with pytest.raises(CheckpointError, match=f"d2t maps draft id {VD - 1}"):
        load_draft(write_checkpoint(tmp_path, t, cfg), target=target)


def test_t2d_count_mismatch(tmp_path, target):
    t, cfg = reference_checkpoint(0)
    t["t2d"][:] = True
    with pytest.raises(CheckpointError, match=f"t2d marks {V} target ids, expected draft_vocab_size={VD}"):
        load_draft(write_checkpoint(tmp_path, t, cfg), target=target)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(draft_vocab_size=V + 1), "draft_vocab_size=301"),
        (dict(num_key_value_heads=3), "num_key_value_heads=3"),
        (dict(aux_layer_ids=()), "aux_layer_ids"),
        (dict(hidden_size=0), "hidden_size=0"),
    ],
)
def test_config_validation(overrides, match):
    with pytest.raises(ConfigError, match=match):
        DraftConfig.for_target(TARGET_CFG, **overrides)


def test_for_target_defaults():
    cfg = DraftConfig.for_target(TARGET_CFG)
    assert cfg.draft_vocab_size == V and cfg.aux_layer_ids == TARGET_CFG.feature_layer_ids
    assert cfg.fc_in_features == 3 * H and not cfg.has_embed_tokens
    check_compatible(cfg, TARGET_CFG)


def test_save_converts_dtype_and_refuses_float16_overflow(tmp_path, target):
    t, cfg = reference_checkpoint(7, embed=False)
    draft = load_draft(write_checkpoint(tmp_path / "ref", t, cfg), target=target)
    save_draft(draft, tmp_path / "f16", dtype="float16")
    with safe_open(tmp_path / "f16" / "model.safetensors", framework="numpy") as f:
        assert f.get_slice("fc.weight").get_dtype() == "F16"
        assert f.get_slice("d2t").get_dtype() == "I64"
    assert json.loads((tmp_path / "f16" / "config.json").read_text())["torch_dtype"] == "float16"
    again = load_draft(tmp_path / "f16", target=target)  # read back as float32
    np.testing.assert_allclose(np.asarray(again.fc.kernel[...]), np.asarray(draft.fc.kernel[...]), rtol=1e-3, atol=1e-6)
    draft.fc.kernel[...] = draft.fc.kernel[...].at[0, 0].set(1e6)
    with pytest.raises(ConfigError, match="fc.weight does not fit float16"):
        save_draft(draft, tmp_path / "bad", dtype="float16")
    with pytest.raises(ConfigError, match="save dtype='int8'"):
        save_draft(draft, tmp_path / "bad", dtype="int8")
