"""GGUF import: tiny random models written to GGUF here (as llama.cpp's converter writes
them) come back exactly (F32) or within quantization error, and load into transformers with
the original logits; the real SmolLM2 GGUF imports to what transformers' own GGUF loader
builds; every kind of bad input gets a CheckpointError that names the problem."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file

from eagle_jax.checkpoint import import_gguf
from eagle_jax.checkpoint.gguf_import import supported_tensor_types
from eagle_jax.models.config import ModelConfig
from eagle_jax.errors import CheckpointError

# ----------------------------------------------------------------------------------------
# Writing tiny GGUFs the way llama.cpp's convert_hf_to_gguf.py does
# ----------------------------------------------------------------------------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<think>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_alphabet() -> list[str]:
    """GPT-2's byte-level spelling of the 256 bytes, written out independently of the importer."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int]]:
    """Specials (control), the 256 byte tokens (normal), merged tokens, a user-defined token."""
    merged = ["Ġt", "he", "Ġthe", "in"]
    tokens = SPECIALS + byte_alphabet() + merged + USER_DEFINED
    types = [3] * len(SPECIALS) + [1] * (256 + len(merged)) + [4] * len(USER_DEFINED)
    return tokens, types


VOCAB = len(tiny_vocab()[0])  # 264


@dataclasses.dataclass
class Variant:
    """One tiny model: its transformers config and how its tensors are stored."""

    name: str
    arch: str  # GGUF architecture
    hf_config: transformers.PretrainedConfig
    qtype: dict[str, Q] = dataclasses.field(default_factory=dict)  # GGUF name suffix -> type
    exact: bool = True  # all weight matrices stored as F32


def _base(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16384,
        rms_norm_eps=1e-5,
        # Larger than the default 0.02 so attention is far from uniform and the logits
        # depend on Q/K layout (at 0.02, skipping the Q/K un-permutation moves them < 1%).
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    )
    return base | kw


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

VARIANTS = {
    # F32, untied, Llama 3.1-style RoPE scaling (llama.cpp stores it as rope_freqs.weight).
    "llama_f32": Variant(
        "llama_f32",
        "llama",
        transformers.LlamaConfig(**_base(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False)),
    ),
    # Tied embeddings; matrices Q8_0, the MLP Q4_1, o_proj F16 (norms stay F32, as llama.cpp keeps them).
    "llama_quant": Variant(
        "llama_quant",
        "llama",
        transformers.LlamaConfig(**_base(rope_theta=10000.0, tie_word_embeddings=True)),
        qtype={
            "token_embd.weight": Q.Q8_0,
            "attn_q.weight": Q.Q8_0,
            "attn_k.weight": Q.Q8_0,
            "attn_v.weight": Q.Q8_0,
            "attn_output.weight": Q.F16,
            "ffn_gate.weight": Q.Q4_1,
            "ffn_up.weight": Q.Q4_1,
            "ffn_down.weight": Q.Q4_1,
        },
        exact=False,
    ),
    "qwen2_f32": Variant(
        "qwen2_f32", "qwen2", transformers.Qwen2Config(**_base(rope_theta=1e6, tie_word_embeddings=False))
    ),
    "qwen3_f32": Variant(
        "qwen3_f32",
        "qwen3",
        transformers.Qwen3Config(**_base(head_dim=24, rope_theta=1e6, tie_word_embeddings=True)),
    ),
}

# Hugging Face leaf name -> llama.cpp leaf name.
HF_TO_GGUF_LEAF = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, leaf = hf_name.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF_LEAF[leaf]}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: regroup each head's rows from the
    rotate-half layout (first half, second half) into interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(theta: float, head_dim: int, rope: dict) -> np.ndarray:
    """What llama.cpp's LlamaModel.generate_extra_tensors stores in rope_freqs.weight."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / theta ** (i / head_dim))
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def make_model(variant: Variant, seed: int = 0):
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM}[variant.arch]
    torch.manual_seed(seed)
    model = cls(variant.hf_config).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: perturb them so misplacement shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def gguf_tensors(model, arch: str) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp names, Q/K permuted for llama (not for Qwen)."""
    cfg = model.config
    out = {}
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = t.detach().float().numpy().copy()
        name = gguf_name(hf_name)
        if arch == "llama" and name.endswith("attn_q.weight"):
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("attn_k.weight"):
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        out[name] = w
    return out


@dataclasses.dataclass
class TokenizerMeta:
    pre: str | None = None
    add_bos: bool | None = None
    model: str = "gpt2"


def write_gguf(
    path: Path,
    cfg,
    arch: str,
    tensors: dict[str, np.ndarray],
    qtype: dict[str, Q] | None = None,
    tok: TokenizerMeta = TokenizerMeta(),
    extra_kv: dict | None = None,
) -> Path:
    """A GGUF file with llama.cpp's metadata keys for ``cfg`` and ``tensors`` stored in the
    types ``qtype`` names (by name suffix; F32 otherwise)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    tokens, types = tiny_vocab()
    w.add_tokenizer_model(tok.model)
    if tok.pre is not None:
        w.add_tokenizer_pre(tok.pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    if tok.add_bos is not None:
        w.add_add_bos_token(tok.add_bos)
    w.add_chat_template(CHATML)
    for key, value in (extra_kv or {}).items():
        (w.add_string if isinstance(value, str) else w.add_float32)(key, value)
    for name, arr in tensors.items():
        kind = next((q for suffix, q in (qtype or {}).items() if name.endswith(suffix)), Q.F32)
        if arr.dtype != np.float32 or kind == Q.F32:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@dataclasses.dataclass
class TinyCase:
    variant: Variant
    model: torch.nn.Module
    gguf_path: Path
    tensors: dict[str, np.ndarray]  # as written (llama.cpp names and layout, before quantization)


def build_case(variant: Variant, directory: Path) -> TinyCase:
    model = make_model(variant)
    tensors = gguf_tensors(model, variant.arch)
    cfg = model.config
    if (cfg.rope_parameters or {}).get("rope_type") == "llama3":
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        tensors["rope_freqs.weight"] = llama3_rope_freqs(cfg.rope_parameters["rope_theta"], head_dim, LLAMA3_ROPE)
    path = write_gguf(directory / f"{variant.name}.gguf", cfg, variant.arch, tensors, variant.qtype)
    return TinyCase(variant, model, path, tensors)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_gguf")


@pytest.fixture(scope="module")
def llama_case(tiny_dir) -> TinyCase:
    return build_case(VARIANTS["llama_f32"], tiny_dir)


# ----------------------------------------------------------------------------------------
# (a) tiny models: weights and logits round-trip
# ----------------------------------------------------------------------------------------


def _logits(model, ids: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return model(ids).logits.float().numpy()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_tiny_model_round_trip(name, tiny_dir):
    case = build_case(VARIANTS[name], tiny_dir)
    out = import_gguf(case.gguf_path, tiny_dir / f"{name}_hf")
    cfg = case.model.config

    # config.json describes the same model.
    ours = ModelConfig.from_dir(out)
    assert ours.hidden_size == cfg.hidden_size and ours.num_hidden_layers == cfg.num_hidden_layers
    assert ours.num_key_value_heads == cfg.num_key_value_heads and ours.vocab_size == cfg.vocab_size
    assert ours.tie_word_embeddings == cfg.tie_word_embeddings
    assert ours.rms_norm_eps == cfg.rms_norm_eps
    assert ours.rope_theta == cfg.rope_parameters["rope_theta"]
    if name == "llama_f32":
        assert ours.rope_scaling.rope_type == "llama3" and ours.rope_scaling.factor == 8.0
    if name == "qwen3_f32":
        assert ours.head_dim == 24 and ours.qk_norm

    # Weights: exact for F32; for quantized types, exactly the dequantized stored values
    # (put back in Hugging Face layout by the test's own inverse permutation) and within
    # the type's error bound of the original.
    imported = load_file(out / "model.safetensors")
    original = {k: v.float().numpy() for k, v in case.model.state_dict().items()}
    if cfg.tie_word_embeddings:
        original.pop("lm_head.weight")
    assert set(imported) == set(original)
    expected = {}
    for hf_name, want in original.items():
        got = imported[hf_name]
        assert got.dtype == np.float32 and got.shape == want.shape, hf_name
        kind = _stored_type(case.variant, hf_name)
        if kind == Q.F32:
            expected[hf_name] = want
        else:
            stored = case.tensors[gguf_name(hf_name)]
            dequant = gguf.quants.dequantize(gguf.quants.quantize(stored, kind), kind)
            expected[hf_name] = dequant[_inverse_permutation(hf_name, cfg, case.variant.arch)]
            bound = {
                Q.Q8_0: np.abs(want).max() / 127,  # one quantization step of the largest block
                Q.Q4_1: (want.max() - want.min()) / 15,
                Q.F16: np.abs(want).max() * 2**-10,
            }[kind]
            assert np.abs(got - want).max() <= bound, hf_name
        np.testing.assert_array_equal(got, expected[hf_name], err_msg=hf_name)

    # transformers loads the directory and computes the logits of a model holding the
    # expected weights (the original model itself when every tensor is F32).
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded) is type(case.model)
    reference = make_model(case.variant)
    reference.load_state_dict({k: torch.from_numpy(v) for k, v in expected.items()}, strict=False)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    got_logits = _logits(loaded, ids)
    np.testing.assert_allclose(got_logits, _logits(reference, ids), atol=1e-5, rtol=0)
    if case.variant.exact:
        np.testing.assert_allclose(got_logits, _logits(case.model, ids), atol=1e-5, rtol=0)
    else:
        # Against the unquantized original, Q8_0/Q4_1 move these logits by ~15% of their
        # largest magnitude (measured); the bound leaves 2x room.
        want_logits = _logits(case.model, ids)
        assert np.abs(got_logits - want_logits).max() <= 0.3 * np.abs(want_logits).max()


def _stored_type(variant: Variant, hf_name: str) -> Q:
    return next((q for s, q in variant.qtype.items() if gguf_name(hf_name).endswith(s)), Q.F32)


def _inverse_permutation(hf_name: str, cfg, arch: str):
    """Row indices taking a tensor from llama.cpp's layout back to Hugging Face's."""
    name = gguf_name(hf_name)
    if arch != "llama" or not (name.endswith("attn_q.weight") or name.endswith("attn_k.weight")):
        return slice(None)
    heads = cfg.num_attention_heads if name.endswith("attn_q.weight") else cfg.num_key_value_heads
    rows = np.arange(heads * (cfg.hidden_size // cfg.num_attention_heads))
    return np.argsort(llama_cpp_permute(rows, heads))


def test_tokenizer_files_of_tiny_model(llama_case, tmp_path):
    out = import_gguf(llama_case.gguf_path, tmp_path / "out")
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert tc["bos_token"] == "<|im_start|>" and tc["eos_token"] == "<|im_end|>"
    assert tc["pad_token"] == "<|endoftext|>" and tc["chat_template"] == CHATML
    assert tc["model_max_length"] == 16384 and tc["add_bos_token"] is False
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


@pytest.mark.parametrize(
    "tok",
    [TokenizerMeta(), TokenizerMeta(pre="llama-bpe", add_bos=True), TokenizerMeta(pre="qwen2")],
    ids=["gpt2-default", "llama-bpe+bos", "qwen2"],
)
def test_tiny_tokenizer_json_equals_transformers(tok, llama_case, tmp_path):
    """tokenizer.json is exactly the backend transformers builds from the same GGUF
    (pre-tokenizer, decoder, post-processor with BOS when asked, added tokens)."""
    cfg = llama_case.model.config
    path = write_gguf(tmp_path / "tok.gguf", cfg, "llama", llama_case.tensors, tok=tok)
    out = import_gguf(path, tmp_path / "out")
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tok.gguf")
    assert json.loads((out / "tokenizer.json").read_text()) == json.loads(ref.backend_tokenizer.to_str())
    text = "the <think> thin\n\t12345 Ünïcödé 東京 🙂"
    ours = transformers.AutoTokenizer.from_pretrained(out)
    assert ours(text)["input_ids"] == ref(text)["input_ids"]


def test_linear_rope_scaling_metadata(llama_case, tmp_path):
    cfg = llama_case.model.config
    tensors = dict(llama_case.tensors)
    tensors.pop("rope_freqs.weight")
    path = write_gguf(
        tmp_path / "lin.gguf", cfg, "llama", tensors,
        extra_kv={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0},
    )
    out = import_gguf(path, tmp_path / "out")
    rs = json.loads((out / "config.json").read_text())["rope_scaling"]
    assert rs["rope_type"] == "linear" and rs["factor"] == 2.0


# ----------------------------------------------------------------------------------------
# (b) the real SmolLM2 GGUF against transformers' own GGUF loader
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_fresh_import(smollm2_gguf, tmp_path_factory) -> Path:
    """Imported with the current code (smollm2_dir may be a previously imported checkpoint)."""
    return import_gguf(smollm2_gguf, tmp_path_factory.mktemp("smollm2_fresh") / "model")


@pytest.fixture(scope="module")
def smollm2_hf_gguf_model(smollm2_gguf):
    """transformers' LlamaForCausalLM loaded from the GGUF itself (dequantized to float32)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()


@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_logits_match_transformers_gguf_loader(
    smollm2_fresh_import, smollm2_hf_gguf_model, smollm2_hf_tokenizer
):
    ours = transformers.LlamaForCausalLM.from_pretrained(smollm2_fresh_import, dtype=torch.float32).eval()
    msgs = [{"role": "user", "content": "Why is the sky blue? Réponds en une phrase."}]
    ids = smollm2_hf_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    ids = torch.tensor([ids])
    diff = np.abs(_logits(ours, ids) - _logits(smollm2_hf_gguf_model, ids)).max()
    assert diff <= 1e-4


@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_config_and_tokenizer_json(smollm2_fresh_import, smollm2_hf_tokenizer):
    cfg = ModelConfig.from_dir(smollm2_fresh_import)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        30, 576, 9, 3,
    )
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert cfg.rms_norm_eps == 1e-5 and cfg.max_position_embeddings == 8192
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    ours = json.loads((smollm2_fresh_import / "tokenizer.json").read_text())
    assert ours == json.loads(smollm2_hf_tokenizer.backend_tokenizer.to_str())


# ----------------------------------------------------------------------------------------
# (d) bad input: each gets a CheckpointError that names the problem
# ----------------------------------------------------------------------------------------


def _assert_no_output(out: Path):
    assert not out.exists()
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert leftovers == []


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(CheckpointError, match="not found") as e:
        import_gguf(missing, tmp_path / "out")
    assert str(missing) in str(e.value)
    _assert_no_output(tmp_path / "out")


@pytest.mark.parametrize("keep", [10, 100, 2000, -100])
def test_truncated_file(keep, llama_case, tmp_path):
    data = llama_case.gguf_path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as e:
        import_gguf(cut, tmp_path / "out")
    assert str(cut) in str(e.value)
    _assert_no_output(tmp_path / "out")


def test_garbage_bytes(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(CheckpointError, match="not a GGUF file") as e:
        import_gguf(junk, tmp_path / "out")
    assert str(junk) in str(e.value)


def test_garbage_after_magic(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        import_gguf(junk, tmp_path / "out")


def test_unsupported_architecture(llama_case, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", llama_case.model.config, "mamba", {"token_embd.weight": np.zeros((4, 64), np.float32)})
    with pytest.raises(CheckpointError, match="'mamba' is not supported") as e:
        import_gguf(path, tmp_path / "out")
    assert "llama, qwen2, qwen3" in str(e.value)


def test_unsupported_tensor_type(llama_case, tmp_path):
    tensors = dict(llama_case.tensors)
    tensors["blk.0.attn_q.weight"] = tensors["blk.0.attn_q.weight"].astype(np.int32)
    path = write_gguf(tmp_path / "i32.gguf", llama_case.model.config, "llama", tensors)
    with pytest.raises(CheckpointError, match=r"'blk\.0\.attn_q\.weight' has type I32") as e:
        import_gguf(path, tmp_path / "out")
    assert "Q4_1" in str(e.value)  # lists what is supported
    _assert_no_output(tmp_path / "out")


def test_supported_tensor_types_cover_common_quantizations():
    names = supported_tensor_types()
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"} <= set(names)
    assert "I32" not in names and "Q8_1" not in names


def test_missing_tensor(llama_case, tmp_path):
    tensors = {k: v for k, v in llama_case.tensors.items() if k != "blk.1.ffn_up.weight"}
    path = write_gguf(tmp_path / "m.gguf", llama_case.model.config, "llama", tensors)
    with pytest.raises(CheckpointError, match=r"missing tensor 'blk\.1\.ffn_up\.weight'") as e:
        import_gguf(path, tmp_path / "out")
    assert "model.layers.1.mlp.up_proj.weight" in str(e.value)
    _assert_no_output(tmp_path / "out")


def test_unexpected_tensor(llama_case, tmp_path):
    tensors = dict(llama_case.tensors, **{"blk.0.mystery.weight": np.zeros((64,), np.float32)})
    path = write_gguf(tmp_path / "m.gguf", llama_case.model.config, "llama", tensors)
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\).*blk\.0\.mystery\.weight"):
        import_gguf(path, tmp_path / "out")


def test_shape_mismatch(llama_case, tmp_path):
    tensors = dict(llama_case.tensors)
    tensors["blk.0.attn_k.weight"] = np.zeros((40, 64), np.float32)
    path = write_gguf(tmp_path / "m.gguf", llama_case.model.config, "llama", tensors)
    with pytest.raises(CheckpointError, match=r"'blk\.0\.attn_k\.weight'.*shape \(40, 64\), expected \(32, 64\)"):
        import_gguf(path, tmp_path / "out")
    _assert_no_output(tmp_path / "out")


def test_unsupported_tokenizer_model(llama_case, tmp_path):
    path = write_gguf(
        tmp_path / "m.gguf", llama_case.model.config, "llama", llama_case.tensors, tok=TokenizerMeta(model="bert")
    )
    with pytest.raises(CheckpointError, match="tokenizer model 'bert'.*supported: gpt2"):
        import_gguf(path, tmp_path / "out")


def test_unsupported_rope_scaling(llama_case, tmp_path):
    tensors = {k: v for k, v in llama_case.tensors.items() if k != "rope_freqs.weight"}
    path = write_gguf(
        tmp_path / "m.gguf", llama_case.model.config, "llama", tensors,
        extra_kv={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0},
    )
    with pytest.raises(CheckpointError, match="RoPE scaling type 'yarn'"):
        import_gguf(path, tmp_path / "out")


def test_refuses_non_empty_output_dir_unless_overwrite(llama_case, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(CheckpointError, match="not empty; pass overwrite=True"):
        import_gguf(llama_case.gguf_path, out)
    assert (out / "keep.txt").read_text() == "precious"
    import_gguf(llama_case.gguf_path, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary directories left


def _precious_dir(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    return out


def test_overwrite_failing_while_writing_keeps_old_dir(llama_case, tmp_path, monkeypatch):
    """The GGUF converts, then writing the new files fails (a full disk, say) after some
    were written: the old directory is untouched and the partial one is removed."""
    from eagle_jax.checkpoint import gguf_import

    out = _precious_dir(tmp_path)
    written = []

    def disk_full(path, tensors):
        written.append(path)
        path.write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf_import, "_write_safetensors", disk_full)
    with pytest.raises(OSError, match="No space left"):
        import_gguf(llama_case.gguf_path, out, overwrite=True)
    assert len(written) == 1 and written[0].parent != out  # it got as far as writing, elsewhere
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary directory left


def test_overwrite_failing_at_the_swap_restores_old_dir(llama_case, tmp_path, monkeypatch):
    """The new directory is complete and the old one already moved aside when the final
    rename fails: the old directory is moved back (the restore branch), nothing is left over."""
    from eagle_jax.checkpoint import gguf_import

    out = _precious_dir(tmp_path)
    real_replace = gguf_import.os.replace
    calls = []

    def replace(src, dst):
        calls.append((Path(src), Path(dst)))
        if Path(dst) == out and Path(src).name.startswith(".out.tmp-"):
            # The old directory must already be out of the way when the new one moves in.
            assert not out.exists()
            raise OSError(5, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(gguf_import.os, "replace", replace)
    with pytest.raises(OSError, match="Input/output error"):
        import_gguf(llama_case.gguf_path, out, overwrite=True)
    # Old moved aside, new refused, old moved back.
    assert [(src.name.startswith(".out.tmp-"), dst.name) for src, dst in calls] == [
        (False, "dir"), (True, "out"), (False, "out"),
    ]
    assert calls[0][0] == out and calls[2] == (calls[0][1], out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # old-/tmp- directories removed


def test_empty_existing_dir_is_filled(llama_case, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    import_gguf(llama_case.gguf_path, out)
    assert {p.name for p in out.iterdir()} == {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
    }
