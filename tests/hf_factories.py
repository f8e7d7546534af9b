"""Small random Hugging Face checkpoints for tests (Llama with Llama-3 rope scaling, Qwen2, Qwen3)."""

import torch
import transformers

TINY = dict(
    vocab_size=211,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)


def _llama():
    return transformers.LlamaConfig(
        **TINY,
        rope_theta=50000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        tie_word_embeddings=False,
    ), transformers.LlamaForCausalLM


def _llama_tied():
    return transformers.LlamaConfig(**TINY, rope_theta=10000.0, tie_word_embeddings=True), transformers.LlamaForCausalLM


def _qwen2():
    return transformers.Qwen2Config(**TINY, rope_theta=1e6, tie_word_embeddings=False), transformers.Qwen2ForCausalLM


def _qwen3():
    return (
        transformers.Qwen3Config(**TINY, head_dim=24, rope_theta=1e6, tie_word_embeddings=True),
        transformers.Qwen3ForCausalLM,
    )


ARCHS = {"llama3": _llama, "llama_tied": _llama_tied, "qwen2": _qwen2, "qwen3": _qwen3}


def make_hf_model(kind: str, seed: int = 0):
    cfg, cls = ARCHS[kind]()
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    # Random init leaves norms at 1 and biases at 0: perturb them so the parity test
    # would catch a norm or bias that is loaded into the wrong place.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model




def write_word_tokenizer(directory, vocab_size: int, eos_id: int = 2) -> None:
    """A word-level tokenizer for a tiny model: token i is the word ``w{i}``."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()  # joins words with spaces
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"unk_token": "w0", "eos_token": f"w{eos_id}"}))


# ----------------------------------------------------------------------------- DeepSeek-V3

DS_TINY = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
    v_head_dim=12, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, routed_scaling_factor=2.5,
    max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1,
            mscale=1.0, mscale_all_dim=1.0)

# Each variant covers what the issue asks the parity tests to: q_lora and no q_lora,
# n_group > 1 with topk_group < n_group, dense-then-MoE layers, YaRN, both RoPE layouts.
DEEPSEEK = {
    # Kimi-K2-like: q_lora, YaRN, one dense layer then MoE, grouped routing.
    "ds_qlora_yarn_groups": dict(q_lora_rank=24, n_group=4, topk_group=2, first_k_dense_replace=1,
                                 rope_parameters=dict(rope_theta=50000.0, **YARN)),
    # DeepSeek-V2-Lite-like: no q_lora, plain RoPE, every layer MoE, one group, no shared expert.
    "ds_plain": dict(q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=0, n_shared_experts=0,
                     norm_topk_prob=False, rope_interleave=False),
}


def make_deepseek_model(kind: str, seed: int = 0):
    """A random ``DeepseekV3ForCausalLM``; norms, biases, router weights and the router's
    correction bias are perturbed so that a misplaced one changes the logits (and routing
    is decided by the weights, not by ties)."""
    cfg = transformers.DeepseekV3Config(**{**DS_TINY, **DEEPSEEK[kind]})
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return model


def write_tiny_eval_models(root):
    """A tiny target with a chat template, a draft for it, and a two-prompt suite, in ``root``.

    Random weights would make the draft's guesses all wrong, leaving the accept paths
    untested. So both models see only one coordinate of their final hidden state (norm
    weight zero elsewhere), and both heads turn its sign into token a or token b: the
    target's sign and the draft's agree on some steps and not on others.
    """
    import json

    import jax.numpy as jnp
    import numpy as np

    from eagle_jax.checkpoint.draft_io import random_draft, save_draft
    from eagle_jax.models.config import ModelConfig

    hf = make_hf_model("llama3", seed=3)
    target = root / "target"
    hf.save_pretrained(target, safe_serialization=True)
    draft_model = random_draft(ModelConfig.from_dir(target), seed=0, draft_vocab_size=150)
    d2t = np.asarray(draft_model.d2t[...])
    in_draft = [(i, i + int(d2t[i])) for i in range(len(d2t)) if i + int(d2t[i]) > 2]  # skip EOS (w2)
    (ia, a), (ib, b) = in_draft[0], in_draft[1]
    with torch.no_grad():
        hf.model.norm.weight.zero_()
        hf.model.norm.weight[0] = 1.0
        hf.lm_head.weight.zero_()
        hf.lm_head.weight[a, 0], hf.lm_head.weight[b, 0] = 10.0, -10.0
    hf.save_pretrained(target, safe_serialization=True)
    write_word_tokenizer(target, hf.config.vocab_size)
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (target / "tokenizer_config.json").write_text(json.dumps(cfg))
    h = draft_model.config.hidden_size
    draft_model.norm.weight.set_value(jnp.zeros((h,)).at[0].set(1.0))
    draft_model.lm_head.set_value(jnp.zeros_like(draft_model.lm_head[...]).at[0, ia].set(10.0).at[0, ib].set(-10.0))
    draft = root / "draft"
    save_draft(draft_model, draft)
    suite = root / "tiny.jsonl"
    suite.write_text(
        '{"id": "p1", "messages": [{"role": "user", "content": "w5 w9 w13 w40"}]}\n'
        "\n"
        '{"id": "p2", "prompt": "w7 w8 w100"}\n'
    )
    return {"target": target, "draft": draft, "suite": suite, "root": root}


# ----------------------------------------------------------------------------- every family

# One tiny random checkpoint per registered target architecture, for the command-line
# tests: name -> architectures[0] it writes.
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k25": "KimiK25ForConditionalGeneration",
}


def _family_hf_model(name: str, seed: int):
    if name == "mistral":
        torch.manual_seed(seed)
        cfg = transformers.MistralConfig(**TINY, head_dim=16, rope_theta=1e4, sliding_window=None, tie_word_embeddings=False)
        return transformers.MistralForCausalLM(cfg).eval()
    if name in ("deepseek_v3", "kimi_k25"):
        return make_deepseek_model("ds_qlora_yarn_groups", seed)
    return make_hf_model({"llama": "llama3", "qwen2": "qwen2", "qwen3": "qwen3"}[name], seed)


def write_family_checkpoint(name: str, directory, seed: int = 0):
    """A tiny random checkpoint of family ``name`` (a key of ``FAMILIES``) with a word
    tokenizer in ``directory``; returns the transformers model whose weights it holds (for
    Kimi-K2.5, the DeepSeek-V3 text model, stored the way a Kimi-K2.5 directory stores it:
    config under ``text_config``, tensors under ``language_model.``)."""
    import json
    from pathlib import Path

    directory = Path(directory)
    hf = _family_hf_model(name, seed)
    hf.save_pretrained(directory, safe_serialization=True)
    if name == "kimi_k25":
        from safetensors.torch import load_file, save_file

        inner = {**json.loads((directory / "config.json").read_text()), "model_type": "kimi_k2"}
        outer = {"architectures": [FAMILIES[name]], "model_type": "kimi_k25", "text_config": inner}
        (directory / "config.json").write_text(json.dumps(outer, indent=2))
        tensors = load_file(directory / "model.safetensors")
        save_file({f"language_model.{k}": v for k, v in tensors.items()}, directory / "model.safetensors",
                  metadata={"format": "pt"})
    eos = hf.config.eos_token_id
    write_word_tokenizer(directory, hf.config.vocab_size, eos_id=2 if eos is None else int(eos))
    return hf
