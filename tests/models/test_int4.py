"""INT4 routed experts (compressed-tensors ``pack-quantized``), as Kimi-K2.5 ships them.

The checkpoints are written by the ``compressed-tensors`` library itself (an independent
writer: its scale computation, its quantizer, its packing) from a tiny random
transformers DeepseekV3; the reference is the library's own decompression, and
transformers' logits on the checkpoint with those decompressed weights."""

import json
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle_jax.checkpoint.draft_io import random_draft
from eagle_jax.checkpoint.hf import load_model
from eagle_jax.models.deepseek import DeepseekV3Config, DeepseekV3Model
from eagle_jax.errors import CheckpointError, ConfigError
from eagle_jax.serving.generate import Buckets, Generator, SpeculativeGenerator
from eagle_jax.models.llama import causal_mask
from eagle_jax.models.quant import Int4Weight, QuantConfig, dequantize, unpack_int4
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.spec.steps import SpeculativeConfig
from eagle_jax.models.target import init_from_spec
from hf_factories import make_deepseek_model, write_word_tokenizer

# A test dependency (pyproject's [test] extra): missing, these tests fail at import, not skip.
from compressed_tensors.compressors import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402

KIND = "ds_qlora_yarn_groups"  # one dense layer, then MoE layers with a shared expert
EXPERT = re.compile(r"mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
# Kimi-K2.5's layout: only routed experts packed; attention, shared experts, the dense
# layer's MLP and the head in high precision.
KIMI_IGNORE = ["lm_head", r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj.*"]
SMALL = Buckets(batch=(1, 4), prompt=(8, 16), cache=(48,))
TOL = 1e-4


def _args(strategy: str) -> QuantizationArgs:
    return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy=strategy,
                            group_size=32 if strategy == "group" else None)


def _compress(w: torch.Tensor, args: QuantizationArgs) -> dict[str, torch.Tensor]:
    """compressed-tensors' pack-quantized tensors for one [out, in] weight."""
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    if args.strategy == "group":
        g = w.reshape(w.shape[0], -1, args.group_size)
        lo, hi = g.amin(-1), g.amax(-1)
    else:
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    scale, zp = calculate_qparams(lo, hi, args)
    return PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)


def _decompress(tensors: dict[str, torch.Tensor], args: QuantizationArgs) -> torch.Tensor:
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    return PackedQuantizationCompressor.decompress(tensors, scheme)["weight"]


def quantization_config(args: QuantizationArgs, ignore=KIMI_IGNORE) -> dict:
    cfg = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                             format="pack-quantized", ignore=list(ignore), quantization_status="compressed")
    return json.loads(cfg.model_dump_json())


def write_int4(src: Path, dst: Path, args: QuantizationArgs, mutate=None) -> dict[str, torch.Tensor]:
    """``src`` (a saved float checkpoint) with its routed experts packed into ``dst``;
    returns compressed-tensors' decompression of each packed weight, by weight name."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    out, dequant = {}, {}
    for name, w in tensors.items():
        if EXPERT.search(name):
            packed = _compress(w.float(), args)
            dequant[name] = _decompress(packed, args)
            out.update({f"{name[: -len('.weight')]}.{k}": v for k, v in packed.items()})
        else:
            out[name] = w
    if mutate:
        mutate(out)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(args)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dequant


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    model = make_deepseek_model(KIND, seed=2)
    out = tmp_path_factory.mktemp("float")
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module", params=["group", "channel"])
def int4(request, float_dir, tmp_path_factory):
    """(args, packed dir, decompressed weights, transformers on the decompressed checkpoint)."""
    import transformers

    args = _args(request.param)
    packed = tmp_path_factory.mktemp(f"int4_{request.param}")
    dequant = write_int4(float_dir, packed, args)
    ref = tmp_path_factory.mktemp(f"dequant_{request.param}")
    tensors = load_file(float_dir / "model.safetensors")
    tensors.update(dequant)
    save_file(tensors, ref / "model.safetensors", metadata={"format": "pt"})
    (ref / "config.json").write_text((float_dir / "config.json").read_text())
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    return args, packed, dequant, hf


def test_unpacking_follows_the_library_layout():
    """One word per nibble position, values -8..7: what compressed-tensors' packer writes."""
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(2, 2)  # [2, 32]
    args = _args("channel")
    packed = PackedQuantizationCompressor.compress(
        {"weight": q.float(), "weight_scale": torch.ones(2, 1), "weight_zero_point": torch.zeros(2, 1)},
        QuantizationScheme(targets=["Linear"], weights=args))["weight_packed"]
    assert packed.dtype == torch.int32 and tuple(packed.shape) == (2, 4)
    np.testing.assert_array_equal(np.asarray(unpack_int4(jnp.asarray(packed.numpy()))), q.numpy())


def test_packed_experts_equal_the_library_decompression(int4):
    """Our dequantization of the loaded packs equals compressed-tensors' bit for bit; the
    parameters stay packed (int32, an eighth of float32's bytes)."""
    args, path, dequant, _ = int4
    model = load_model(path, dtype="float32")
    cfg = model.config
    assert cfg.int4_moe_layers == (1, 2) and cfg.quant.group_size == args.group_size
    for i in cfg.int4_moe_layers:
        moe = model.layers[i].mlp
        assert not hasattr(moe, "experts_gate")
        for proj in ("gate", "up", "down"):
            packed = getattr(moe, f"experts_{proj}_packed")[...]
            scale = getattr(moe, f"experts_{proj}_scale")[...]
            assert packed.dtype == jnp.int32
            want = np.stack([dequant[f"model.layers.{i}.mlp.experts.{e}.{proj}_proj.weight"].numpy()
                             for e in range(cfg.n_routed_experts)])  # [E, out, in]
            assert packed.shape == want.shape[:2] + (want.shape[2] // 8,)
            assert packed.nbytes * 8 == want.astype(np.float32).nbytes
            np.testing.assert_array_equal(np.asarray(dequantize(packed, scale)), want)
            got = Int4Weight(packed, scale)
            np.testing.assert_array_equal(np.asarray(got.full()), want.transpose(0, 2, 1))
            np.testing.assert_array_equal(np.asarray(got.take(jnp.asarray([3, 0]))), want[[3, 0]].transpose(0, 2, 1))
    assert model.layers[0].mlp.gate_proj.kernel[...].dtype == jnp.float32  # the dense layer is not packed


@pytest.mark.parametrize("moe_impl", ["gather", "blocked", "dense", "ragged"])
def test_int4_logits_match_the_dequantized_model(int4, float_dir, moe_impl):
    """Prefill and token-by-token decode, every MoE formulation, against transformers on
    the decompressed weights, at the float32 parity tolerance."""
    from flax import nnx

    _, path, _, hf = int4
    base = load_model(path, dtype="float32")
    unquantized = load_model(float_dir, dtype="float32")
    model = DeepseekV3Model(base.config, moe_impl=moe_impl)
    nnx.update(model, nnx.state(base))
    ids = np.random.default_rng(0).integers(0, base.config.vocab_size, (2, 11))
    with torch.no_grad():
        want = hf(torch.from_numpy(ids).long()).logits.float().numpy()
    b, t = ids.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cache = init_from_spec(model.cache_spec(b, 16))
    h, _, _ = model(jnp.asarray(ids), pos, cache, pos, causal_mask(pos, 16))
    np.testing.assert_allclose(np.asarray(model.logits(h)), want, rtol=TOL, atol=TOL)
    # The packs are not the float weights: quantization moves the logits far beyond TOL.
    h_float, _, _ = unquantized(jnp.asarray(ids), pos, init_from_spec(model.cache_spec(b, 16)), pos, causal_mask(pos, 16))
    assert np.abs(np.asarray(unquantized.logits(h_float)) - want).max() > 50 * TOL
    cache = init_from_spec(model.cache_spec(b, 16))
    for j in range(t):
        p = jnp.full((b, 1), j, jnp.int32)
        h, _, cache = model(jnp.asarray(ids[:, j : j + 1]), p, cache, p, causal_mask(p, 16))
        np.testing.assert_allclose(np.asarray(model.logits(h))[:, 0], want[:, j], rtol=TOL, atol=TOL)


@pytest.mark.slow
def test_int4_target_speculates_losslessly(int4):
    """Greedy chains and trees on the INT4 target: token-identical to its plain decoding."""
    _, path, _, _ = int4
    target = load_model(path)
    draft = random_draft(target.config, seed=1, draft_vocab_size=64)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, target.config.vocab_size, n).tolist() for n in (5, 8, 3, 6)]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    plain = Generator(target, buckets=SMALL, max_seq_len=48).generate(prompts, params)
    oracle = [p + c.token_ids for p, c in zip(prompts, plain)]
    for spec in (SpeculativeConfig(num_steps=3), SpeculativeConfig(num_steps=2, topk=2, num_draft_tokens=4)):
        gen = SpeculativeGenerator(target, draft, spec, buckets=SMALL, max_seq_len=48)
        assert [c.token_ids for c in gen.generate(prompts[:1], params)] == [plain[0].token_ids]
        out = gen.generate(prompts, params, oracle=oracle, oracle_noise=0.3)
        assert [c.token_ids for c in out] == [c.token_ids for c in plain]


def test_doctor_checks_an_int4_deepseek_directory_and_a_kimi_draft(int4, tmp_path):
    """Without loading weights: every packed tensor and its shape record expected, none
    unexpected; the MLA (Kimi) draft format is checked against the target."""
    import shutil

    from eagle_jax import doctor
    from eagle_jax.checkpoint.draft_io import save_draft
    from eagle_jax.models.deepseek import MLAConfig

    args, path, _, _ = int4
    model_dir = tmp_path / "model"
    shutil.copytree(path, model_dir)
    cfg = DeepseekV3Config.from_hf_dict(json.loads((model_dir / "config.json").read_text()))
    write_word_tokenizer(model_dir, cfg.vocab_size)
    mla = MLAConfig(hidden_size=cfg.hidden_size, num_attention_heads=2, kv_lora_rank=12, q_lora_rank=None,
                    qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=10, rope_theta=50000.0)
    save_draft(random_draft(cfg, seed=0, draft_vocab_size=64, mla=mla), tmp_path / "draft")
    report = doctor.collect_report(model_dir, tmp_path / "draft")
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ok"], [c["problems"] for c in report["checks"]]
    info = checks["model"]["info"]
    assert info["unexpected_tensors"] == []
    assert info["config"]["quantization"]["int4_moe_layers"] == [1, 2]
    per_moe_layer = cfg.n_routed_experts * 3 * 3  # (packed, scale, shape) x (gate, up, down)
    assert info["tensors_expected"] == info["tensors_in_files"] and info["tensors_expected"] > 2 * per_moe_layer
    assert checks["draft"]["status"] == "ok" and checks["compatibility"]["status"] == "ok"
    # A pack of the wrong width is named without loading.
    name = "model.layers.2.mlp.experts.5.up_proj.weight_packed"
    tensors = load_file(model_dir / "model.safetensors")
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    report = doctor.collect_report(model_dir, None)
    assert not report["ok"]
    assert any(name in p["message"] for c in report["checks"] for p in c["problems"])


# ----------------------------------------------------------------------------- bad input


def _bad_checkpoint(float_dir, tmp_path, mutate):
    write_int4(float_dir, tmp_path, _args("group"), mutate)
    return tmp_path


@pytest.mark.parametrize("change, message", [
    (lambda t: t.__setitem__("model.layers.1.mlp.experts.0.gate_proj.weight_packed",
                             t["model.layers.1.mlp.experts.0.gate_proj.weight_packed"][:, :4].contiguous()),
     r"tensor model.layers.1.mlp.experts.0.gate_proj.weight_packed has shape \(32, 4\), expected \(32, 8\)"),
    (lambda t: t.__setitem__("model.layers.2.mlp.experts.3.down_proj.weight_scale",
                             torch.ones(64, 2)),  # groups of 16 where config.json says 32
     r"tensor model.layers.2.mlp.experts.3.down_proj.weight_scale has shape \(64, 2\), expected \(64, 1\)"),
    (lambda t: t.__setitem__("model.layers.1.mlp.experts.7.up_proj.weight_shape", torch.tensor([32, 56])),
     r"model.layers.1.mlp.experts.7.up_proj.weight_shape records shape \(32, 56\); the model expects \(32, 64\)"),
    (lambda t: t.pop("model.layers.2.mlp.experts.1.gate_proj.weight_scale"),
     r"lacks tensor\(s\): model.layers.2.mlp.experts.1.gate_proj.weight_scale"),
    (lambda t: t.__setitem__("model.layers.1.mlp.experts.2.up_proj.weight_packed",
                             t["model.layers.1.mlp.experts.2.up_proj.weight_packed"].float()),
     r"weight_packed has dtype .*float"),
])
def test_bad_packing_is_named(float_dir, tmp_path, change, message):
    path = _bad_checkpoint(float_dir, tmp_path, change)
    with pytest.raises(CheckpointError, match=message):
        load_model(path)


def _qc(**weights):
    base = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": KIMI_IGNORE,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**base, **weights}}}}


@pytest.mark.parametrize("qc, message", [
    (_qc(num_bits=8), r"weights.num_bits=8 is not supported; supported: 4"),
    (_qc(symmetric=False), r"weights.symmetric=False is not supported"),
    (_qc(strategy="tensor"), r"weights.strategy='tensor' is not supported; supported: group, channel"),
    (_qc(actorder="group"), r"weights.actorder='group' is not supported"),
    (_qc(group_size=12), r"weights.group_size=12 must be a positive multiple of 8"),
    (_qc(group_size=48), r"group_size=48 does not divide .*in_features=64"),
    (_qc(type="float"), r"weights.type='float' is not supported"),
    ({**_qc(), "format": "int-quantized"}, r"quantization_config.format='int-quantized' is not supported"),
    ({**_qc(), "quant_method": "awq"}, r"quant_method='awq' is not supported; supported: compressed-tensors"),
    ({**_qc(), "quantization_status": "frozen"}, r"quantization_status='frozen': the checkpoint is not packed"),
    ({**_qc(), "ignore": ["lm_head"]}, r"packs model.layers.0.self_attn.q_a_proj; eagle-jax reads INT4 for routed experts only"),
    ({**_qc(), "ignore": KIMI_IGNORE + ["model.layers.2.mlp.experts.4.down_proj"]},
     r"packs some but not all experts of layer\(s\) \[2\]"),
    ({**_qc(), "ignore": KIMI_IGNORE + [r"re:.*experts.*"]}, r"packs no routed expert"),
    ({**_qc(), "config_groups": {"g": {"targets": ["Linear"], "weights": _qc()["config_groups"]["group_0"]["weights"],
                                       "input_activations": {"num_bits": 8}}}},
     r"input_activations is set: activation quantization is not supported"),
])
def test_bad_quantization_config_is_named(float_dir, qc, message):
    d = {**json.loads((float_dir / "config.json").read_text()), "quantization_config": qc}
    with pytest.raises(ConfigError, match=message):
        DeepseekV3Config.from_hf_dict(d)


def test_kimi_quantization_config_is_read_from_either_level(float_dir):
    """Kimi-K2.5 directories: tensors under ``language_model.``; the scheme at the top
    level or in text_config; ignore rules written against the prefixed names work."""
    inner = {**json.loads((float_dir / "config.json").read_text()), "model_type": "kimi_k2"}
    ignore = ["re:.*vision_tower.*", "language_model.lm_head", r"re:.*self_attn.*", r"re:.*shared_experts.*",
              r"re:language_model\.model\.layers\.0\.mlp.*"]
    qc = {**_qc(), "ignore": ignore}
    for outer in ({"architectures": ["KimiK25ForConditionalGeneration"], "text_config": inner, "quantization_config": qc},
                  {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": {**inner, "quantization_config": qc}}):
        cfg = DeepseekV3Config.from_hf_dict(outer)
        assert cfg.weight_prefix == "language_model." and cfg.int4_moe_layers == (1, 2)
        assert cfg.quant == QuantConfig(group_size=32, targets=("Linear",), ignore=tuple(ignore))
