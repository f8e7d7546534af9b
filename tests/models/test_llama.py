"""Logit parity of LlamaModel with Hugging Face transformers on small random checkpoints."""

import jax.numpy as jnp
import numpy as np
import torch

from eagle_jax.checkpoint.hf import load_model
from eagle_jax.models.llama import KVCache, causal_mask

TOL = 1e-4


def _hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(ids).long()).logits.float().numpy()


def _prefill(model, ids: np.ndarray, max_len: int):
    b, t = ids.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cache = KVCache.zeros(model.config, b, max_len)
    h, _, cache = model(jnp.asarray(ids), pos, cache, pos, causal_mask(pos, max_len))
    return np.asarray(model.logits(h)), cache


def test_prefill_logits_match_transformers(hf_checkpoint):
    kind, hf, path = hf_checkpoint
    ours = load_model(path, dtype="float32")
    ids = np.random.default_rng(1).integers(0, hf.config.vocab_size, (2, 17))
    logits, _ = _prefill(ours, ids, 32)
    ref = _hf_logits(hf, ids)
    assert np.abs(logits - ref).max() <= TOL, kind


def test_decode_token_by_token_matches_transformers(hf_checkpoint):
    kind, hf, path = hf_checkpoint
    ours = load_model(path, dtype="float32")
    ids = np.random.default_rng(2).integers(0, hf.config.vocab_size, (2, 12))
    ref = _hf_logits(hf, ids)
    max_len = 16
    _, cache = _prefill(ours, ids[:, :4], max_len)
    for t in range(4, ids.shape[1]):
        pos = jnp.full((2, 1), t, jnp.int32)
        h, _, cache = ours(jnp.asarray(ids[:, t : t + 1]), pos, cache, pos, causal_mask(pos, max_len))
        step = np.asarray(ours.logits(h))[:, 0]
        assert np.abs(step - ref[:, t]).max() <= TOL, (kind, t)


def test_features_are_layer_inputs(hf_checkpoint):
    """Features = residual stream entering layers [2, N//2, N-3] = HF hidden_states[i]."""
    kind, hf, path = hf_checkpoint
    ours = load_model(path, dtype="float32")
    ids = np.random.default_rng(3).integers(0, hf.config.vocab_size, (1, 9))
    pos = jnp.arange(9, dtype=jnp.int32)[None]
    _, feats, _ = ours(jnp.asarray(ids), pos, KVCache.zeros(ours.config, 1, 16), pos, causal_mask(pos, 16), return_features=True)
    with torch.no_grad():
        hs = hf(torch.from_numpy(ids).long(), output_hidden_states=True).hidden_states
    n = hf.config.num_hidden_layers
    assert ours.config.feature_layer_ids == (2, n // 2, n - 3)
    ref = np.concatenate([hs[i].numpy() for i in (2, n // 2, n - 3)], axis=-1)
    assert feats.shape == ref.shape
    assert np.abs(np.asarray(feats) - ref).max() <= TOL
