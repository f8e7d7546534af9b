"""Whole speculative generation with ``kernel_impl="kernel"``: the Pallas verification
kernels (``verify_greedy``) run inside the compiled step, under Mosaic GPU's interpreter
on CPU, and the greedy output is token-identical to plain greedy decoding, for a chain
and a tree, with an oracle whose noise makes acceptance partial (multi-token accepts and
rejections both happen).

On CPU the verify forward attends through the target's prefix attention whatever
``kernel_impl`` says (the tree-attention kernel is chosen on GPUs only:
``select_tree_attention_path``); its interpreted kernel is checked alone in
tests/kernels/test_tree_attention.py, and under a mesh in tests/test_sharding.py.
"""

import jax
import numpy as np
import pytest
import torch
from jax.experimental.pallas import mosaic_gpu as plgpu

from eagle_jax.checkpoint.draft_io import random_draft
from eagle_jax.checkpoint.hf import load_model
from eagle_jax.serving.generate import Buckets, Generator, SpeculativeGenerator
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.spec.steps import SpeculativeConfig
from hf_factories import make_hf_model
from pallas_kernels import verify_greedy as verify_greedy_module

BUCKETS = Buckets(batch=(2,), prompt=(16,), cache=(64,))
NEW_TOKENS = 12
CONFIGS = {
    "chain S=3": SpeculativeConfig(num_steps=3),
    "tree S=3 k=4 T=8": SpeculativeConfig(num_steps=3, topk=4, num_draft_tokens=8),
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    hf = make_hf_model("llama3", seed=11)
    with torch.no_grad():  # a peaky head: greedy continuations that are not all one token
        hf.lm_head.weight.mul_(8.0)
    path = tmp_path_factory.mktemp("kernel_step_target")
    hf.save_pretrained(path, safe_serialization=True)
    return load_model(path)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(3, 200, n).tolist() for n in (5, 11)]


@pytest.fixture(scope="module")
def reference(target, prompts):
    """Plain greedy decoding: the expected output and the oracle's source."""
    out = Generator(target, buckets=BUCKETS).generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert all(len(o.token_ids) == NEW_TOKENS for o in out)
    return [o.token_ids for o in out]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_kernel_impl_step_is_lossless_with_partial_acceptance(target, prompts, reference, name, monkeypatch):
    cfg = CONFIGS[name]
    # The step must really be built with the Pallas kernel (traced into the compiled step).
    real_kernel, kernel_calls = verify_greedy_module.verify_greedy_kernel, []

    def kernel_spy(*args, **kwargs):
        kernel_calls.append(kwargs)
        return real_kernel(*args, **kwargs)

    monkeypatch.setattr(verify_greedy_module, "verify_greedy_kernel", kernel_spy)
    draft = random_draft(target.config, seed=5, draft_vocab_size=128)
    gen = SpeculativeGenerator(target, draft, cfg, tokenizer=None, buckets=BUCKETS, kernel_impl="kernel")
    oracle = [p + r for p, r in zip(prompts, reference)]
    out = gen.generate(
        prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True), oracle=oracle, oracle_noise=0.3
    )
    assert kernel_calls and all(c["max_depth"] == cfg.num_steps for c in kernel_calls)
    if jax.default_backend() != "gpu":
        assert all(isinstance(c["interpret"], plgpu.InterpretGPUParams) for c in kernel_calls)
    assert [o.token_ids for o in out] == reference
    accepts = [a for o in out for a in o.accept_lengths]
    assert all(1 <= a <= cfg.max_accept for a in accepts), accepts
    mean = float(np.mean(accepts))
    # Partial acceptance: some steps accept several tokens, some fewer than the most.
    assert 1 < mean < cfg.max_accept, accepts
    assert max(accepts) > 1 and min(accepts) < cfg.max_accept, accepts
