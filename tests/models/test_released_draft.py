"""The released SmolLM2 draft (checkpoints/smollm2-135m-instruct-eagle3): it was trained
for this exact target, it loads and fits, and on held-out prompts speculation with it
accepts more than one token per step while the output stays identical to greedy."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from eagle_jax.models.config import ModelConfig
from eagle_jax.checkpoint.draft_io import load_draft, read_draft_config
from eagle_jax.checkpoint.hf import load_model
from eagle_jax.serving.engine import Engine, EngineConfig
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.spec.steps import SpeculativeConfig
from eagle_jax.checkpoint.tokenizer import Tokenizer
from eagle_jax.train.synthetic_prompts import synthetic_prompts

DRAFT = Path(__file__).resolve().parents[2] / "checkpoints" / "smollm2-135m-instruct-eagle3"
# At release these three prompts gave a mean accept length of 2.23 (tree 3/4/8); the bar
# leaves room for float differences between machines, not for a broken draft (a random
# draft scores about 1.0).
MIN_MEAN_ACCEPT = 1.5

pytestmark = [pytest.mark.slow, pytest.mark.smollm2]


def test_released_draft_metadata_names_this_target(smollm2_dir):
    training = json.loads((DRAFT / "training.json").read_text())
    sha = hashlib.sha256((smollm2_dir / "config.json").read_bytes()).hexdigest()[:16]
    assert training["target_config_sha256"] == sha
    cfg = json.loads((DRAFT / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    # The target's default feature layers: written without ids, so SGLang, vLLM and
    # eagle-jax all feed the streams entering layers 2, 15 and 27 (issue 14).
    assert "eagle_aux_hidden_state_layer_ids" not in cfg.get("eagle_config", {})
    assert read_draft_config(DRAFT, target_cfg=ModelConfig.from_dir(smollm2_dir)).aux_layer_ids == (2, 15, 27)


def test_released_draft_accepts_on_held_out_prompts(smollm2_dir):
    target = load_model(smollm2_dir, dtype="float32")
    draft = load_draft(DRAFT, target=target, dtype="float32")
    tok = Tokenizer.from_dir(smollm2_dir)
    # Held-out topics, and not the prompts the release figures were measured on.
    questions = synthetic_prompts(1000, split="eval", seed=5)[:3]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions]
    base = dict(max_batch=4, max_seq_len=128, prompt_buckets=(64, 128), batch_buckets=(4,))
    sp = SamplingParams(max_new_tokens=48)
    plain = Engine(target, None, EngineConfig(speculative=None, **base), tok, progress=False).generate(prompts, sp)
    spec = Engine(target, draft, EngineConfig(speculative=SpeculativeConfig(num_steps=3, topk=4, num_draft_tokens=8), **base), tok, progress=False).generate(prompts, sp)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    mean = np.mean([a for c in spec for a in c.accept_lengths])
    assert mean >= MIN_MEAN_ACCEPT, mean
