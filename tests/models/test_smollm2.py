"""The real SmolLM2-135M-Instruct: our model against transformers' own loading of the GGUF."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from eagle_jax.checkpoint.hf import load_model
from eagle_jax.serving.generate import Buckets, Generator
from eagle_jax.models.llama import KVCache, causal_mask
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.checkpoint.tokenizer import Tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.smollm2]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name three primary colours."}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "Explain gravity to a child in two sentences."}],
    [{"role": "user", "content": "Tell me a short story about a robot who learns to paint."}],
]


@pytest.fixture(scope="module")
def hf_gguf_model(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def ours(smollm2_dir):
    return load_model(smollm2_dir, dtype="float32"), Tokenizer.from_dir(smollm2_dir)


def test_logits_match_transformers_gguf_loading(ours, hf_gguf_model):
    model, tok = ours
    ids = tok.encode(tok.apply_chat_template(CHATS[1], add_generation_prompt=True))
    pos = jnp.arange(len(ids), dtype=jnp.int32)[None]
    h, _, _ = model(jnp.asarray([ids]), pos, KVCache.zeros(model.config, 1, 64), pos, causal_mask(pos, 64))
    logits = np.asarray(model.logits(h))[0]
    with torch.no_grad():
        ref = hf_gguf_model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(logits - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max() / 10)


def test_greedy_chat_continuations_match_transformers(ours, hf_gguf_model):
    model, tok = ours
    gen = Generator(model, tok, buckets=Buckets(batch=(1, 4), prompt=(64,), cache=(128,)))
    prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True)) for c in CHATS]
    # Both stop at EOS (transformers' min_new_tokens would suppress EOS, which we do not).
    out = gen.generate(prompts, SamplingParams(max_new_tokens=32))
    for p, c in zip(prompts, out):
        with torch.no_grad():
            ref = hf_gguf_model.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)
        assert c.token_ids == ref[0, len(p):].tolist()
    assert sum(len(c.token_ids) == 32 for c in out) >= 3  # at least three full 32-token continuations
    assert "Paris" in out[0].text
