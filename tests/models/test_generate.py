"""Plain generation: greedy parity with transformers' generate, sampling behaviour, bad input."""

import numpy as np
import pytest
import torch

from eagle_jax.checkpoint.hf import load_model
from eagle_jax.errors import InputError
from eagle_jax.serving.generate import Buckets, Generator
from eagle_jax.spec.sampling import SamplingParams
from hf_factories import make_hf_model

SMALL = Buckets(batch=(1, 4), prompt=(8, 16, 32), cache=(64, 128))


def _hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def test_greedy_matches_transformers_generate(hf_checkpoint):
    kind, hf, path = hf_checkpoint
    gen = Generator(load_model(path), buckets=SMALL)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, hf.config.vocab_size, n).tolist() for n in (5, 11, 3)]
    ours = gen.generate(prompts, SamplingParams(max_new_tokens=24))
    for p, c in zip(prompts, ours):
        ref = _hf_greedy(hf, p, 24)
        assert c.token_ids == ref, kind
        assert c.finish_reason == ("stop" if len(ref) < 24 or ref[-1] in gen.eos_ids else "length")


def _tiny(tmp_path):
    hf = make_hf_model("llama_tied", seed=3)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return hf, Generator(load_model(tmp_path), buckets=SMALL, max_seq_len=128)


def test_sampling_is_seeded_and_batch_independent(tmp_path):
    _, gen = _tiny(tmp_path)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    sp = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=123, max_new_tokens=16, ignore_eos=True)
    alone = gen.generate([prompts[0]], sp)[0].token_ids
    other = [SamplingParams(temperature=0.7, seed=s, max_new_tokens=16, ignore_eos=True) for s in (1, 2)]
    batched = gen.generate(prompts, [sp] + other)[0].token_ids
    assert alone == batched
    again = gen.generate([prompts[0]], sp)[0].token_ids
    assert again == alone
    reseeded = gen.generate([prompts[0]], SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=124, max_new_tokens=16, ignore_eos=True))[0].token_ids
    assert reseeded != alone


def test_top_k_one_is_greedy(tmp_path):
    _, gen = _tiny(tmp_path)
    greedy = gen.generate([[5, 6, 7]], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].token_ids
    k1 = gen.generate([[5, 6, 7]], SamplingParams(temperature=2.0, top_k=1, seed=9, max_new_tokens=12, ignore_eos=True))[0].token_ids
    assert greedy == k1


def test_stops_on_max_tokens_and_stop_ids(tmp_path):
    _, gen = _tiny(tmp_path)
    free = gen.generate([[5, 6, 7]], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
    assert len(free.token_ids) == 10 and free.finish_reason == "length"
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    stopped = gen.generate([[5, 6, 7]], SamplingParams(max_new_tokens=10, stop_token_ids=(stop_at,), ignore_eos=True))[0]
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"


def test_context_limit_caps_generation(tmp_path):
    _, gen = _tiny(tmp_path)
    prompt = list(range(3, 123))  # 120 tokens, context 128
    c = gen.generate([prompt], SamplingParams(max_new_tokens=50, ignore_eos=True))[0]
    assert len(c.token_ids) == 8 and c.finish_reason == "length"


@pytest.mark.parametrize(
    "prompt, message",
    [([], "prompt 0 is empty"), (list(range(3, 131)), "prompt 0 has 128 tokens; the context holds 128"), ([5, 99999], "outside the vocabulary")],
)
def test_bad_prompts(tmp_path, prompt, message):
    _, gen = _tiny(tmp_path)
    with pytest.raises(InputError, match=message):
        gen.generate([prompt], SamplingParams(max_new_tokens=4))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(seed=-1), "seed"),
        (dict(stop_strings=("",)), "stop_strings"),
    ],
)
def test_invalid_sampling_values(kwargs, field):
    with pytest.raises(InputError, match=field):
        SamplingParams(**kwargs)


def test_stop_strings_cut_the_text(tmp_path):
    from eagle_jax.checkpoint.tokenizer import Tokenizer
    from hf_factories import write_word_tokenizer

    hf = make_hf_model("llama3", seed=11)
    with torch.no_grad():  # a peakier head gives less repetitive text
        hf.lm_head.weight.mul_(8.0)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    write_word_tokenizer(tmp_path, hf.config.vocab_size)
    gen = Generator(load_model(tmp_path), Tokenizer.from_dir(tmp_path), buckets=SMALL)
    free = gen.generate([[5, 6, 7]], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    words = free.text.split()
    assert len(words) == 12
    stop = " ".join(words[3:5])  # a stop string spanning two tokens
    first = next(i for i in range(11) if words[i : i + 2] == words[3:5])
    cut = gen.generate([[5, 6, 7]], SamplingParams(max_new_tokens=12, ignore_eos=True, stop_strings=(stop,)))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]
    assert cut.token_ids == free.token_ids[: first + 2]  # up to the token completing the stop string


def test_forward_shapes_are_checked_by_beartype(hf_checkpoint):
    """The jaxtyping annotations on the model's public functions hold (checked at trace time)."""
    import jax.numpy as jnp
    from beartype import beartype
    from jaxtyping import TypeCheckError, jaxtyped

    from eagle_jax.models.llama import KVCache, causal_mask

    _, _, path = hf_checkpoint
    model = load_model(path)
    checked = jaxtyped(typechecker=beartype)(type(model).__call__)
    pos = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (2, 4))
    h, _, _ = checked(model, jnp.ones((2, 4), jnp.int32), pos, KVCache.zeros(model.config, 2, 8), pos, causal_mask(pos, 8))
    assert h.shape == (2, 4, model.config.hidden_size)
    with pytest.raises(TypeCheckError):  # positions of another batch size
        checked(model, jnp.ones((2, 4), jnp.int32), pos[:1], KVCache.zeros(model.config, 2, 8), pos, causal_mask(pos, 8))
