"""The reference loop (eagle_jax/spec/reference.py), the one a newcomer reads first, gives
the engine's tokens and accept lengths, and plain greedy decoding's tokens."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from eagle_jax import Engine, EngineConfig, SamplingParams
from eagle_jax.checkpoint.draft_io import random_draft
from eagle_jax.checkpoint.hf import load_model
from eagle_jax.spec.config import SpeculativeConfig
from eagle_jax.spec.reference import reference_generate
from hf_factories import make_hf_model

PROMPT, N = [17, 3, 92, 45, 8, 130, 61], 24
SHAPES = {"chain": SpeculativeConfig(num_steps=3), "tree": SpeculativeConfig(num_steps=3, topk=4, num_draft_tokens=8)}


def _config(**kw):
    return EngineConfig(max_batch=1, max_seq_len=64, prompt_buckets=(16,), sampled_steps=False, **kw)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    hf = make_hf_model("llama3", seed=11)
    with torch.no_grad():  # a peakier head: greedy continuations less repetitive, no near-ties
        hf.lm_head.weight.mul_(8.0)
    path = tmp_path_factory.mktemp("reference_target")
    hf.save_pretrained(path, safe_serialization=True)
    return load_model(path)


@pytest.fixture(scope="module")
def plain(target):
    eng = Engine(target, None, _config(spec_policy="plain"), progress=False)
    return eng.generate([PROMPT], SamplingParams(max_new_tokens=N, ignore_eos=True))[0].token_ids


@pytest.fixture(scope="module")
def draft(target, plain):
    """A random draft whose vocabulary maps onto the few tokens the target emits here, so
    its guesses are sometimes right: partial acceptance (a fully random one accepts
    nothing, which would leave the commit of multi-token paths untested)."""
    d = random_draft(target.config, seed=5, draft_vocab_size=128)
    seen = np.array(sorted(set(plain)))
    ids = np.arange(d.d2t[...].shape[0])
    d.d2t[...] = jnp.asarray(seen[ids % len(seen)] - ids, jnp.int32)  # draft id i -> target id i + d2t[i]
    return d


@pytest.mark.parametrize("kind", SHAPES)
def test_reference_loop_matches_engine_and_plain_greedy(target, draft, plain, kind):
    shape = SHAPES[kind]
    tokens, accepts = reference_generate(target, draft, PROMPT, N, shape)
    eng = Engine(target, draft, _config(speculative=shape, spec_policy="fixed"), progress=False)
    done = eng.generate([PROMPT], SamplingParams(max_new_tokens=N, ignore_eos=True))[0]
    assert tokens == done.token_ids == plain and len(tokens) == N
    assert accepts == done.accept_lengths  # the same steps, accepting the same number of tokens
    assert all(1 <= a <= shape.max_accept for a in accepts)
    assert 1 in accepts and max(accepts) > 1  # partial acceptance: rejected and accepted guesses
    # The prefill gives the first token, each step its accepted tokens; the last step may
    # have accepted more than the N tokens kept.
    assert sum(accepts[:-1]) + 1 < N <= sum(accepts) + 1
    if kind == "chain":  # a stop token ends the output (kept), even inside a step's tokens
        eos = tokens[N // 2]
        stopped, _ = reference_generate(target, draft, PROMPT, N, shape, eos_ids=(eos,))
        assert stopped == tokens[: tokens.index(eos) + 1]
