"""Chunked prefill: prompts go in chunks of the compiled prompt lengths, at most
``prefill_token_budget`` tokens per engine step, and the output is the one a whole
prefill gives (and transformers'), with and without a draft; a long prompt arriving
does not stall the requests already decoding."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle_jax.checkpoint.draft_io import random_draft
from eagle_jax.checkpoint.hf import load_model
from eagle_jax.serving.engine import Engine, EngineConfig
from eagle_jax.serving.scheduler import chunk_plan
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.spec.steps import SpeculativeConfig
from hf_factories import make_hf_model

CHUNKS = (8, 16)
# Across chunk boundaries: 1, chunk-1, chunk, chunk+1, two full chunks, several chunks
# with a padded tail.
LENGTHS = (1, 7, 8, 9, 16, 17, 32, 41)
NEW = 8
SPEC = SpeculativeConfig(num_steps=3)


@pytest.fixture(scope="module")
def hf_and_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("chunked_target")
    hf = make_hf_model("llama3", seed=7)
    hf.save_pretrained(path, safe_serialization=True)
    return hf, load_model(path)


def _prompts(vocab: int) -> list[list[int]]:
    return [[3 + (7 * i + 5 * n) % (vocab - 3) for i in range(n)] for n in LENGTHS]


def _transformers_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _engine(target, draft=None, **kw):
    cfg = dict(max_batch=4, max_seq_len=64, prompt_buckets=CHUNKS, sampled_steps=False, spec_policy="plain")
    cfg.update(kw)
    return Engine(target, draft, EngineConfig(**cfg), progress=False)


@given(st.integers(1, 300), st.sampled_from([(8,), (8, 16), (16, 64, 256), (64, 128, 256, 512), (5, 12)]))
@settings(max_examples=200, deadline=None)
def test_chunk_plan_covers_the_prompt_and_pads_less_than_the_smallest_chunk(length, chunks):
    plan = chunk_plan(length, chunks)
    assert all(c in chunks for c in plan)
    assert sum(plan[:-1]) < length <= sum(plan)  # every chunk but the last is full
    assert sum(plan) - length < chunks[0]


def test_chunk_plan_prefers_one_chunk_when_it_pads_little():
    assert chunk_plan(200, (64, 128, 256)) == (256,)  # 56 padding < 64: one call
    assert chunk_plan(300, (64, 128, 256)) == (256, 64)  # not 512-style padding
    assert chunk_plan(1029, (64, 128, 256, 512)) == (512, 512, 64)  # was one 2,048 bucket


def test_chunked_prefill_greedy_equals_whole_prefill_and_transformers(hf_and_target):
    hf, target = hf_and_target
    prompts = _prompts(target.config.vocab_size)
    greedy = SamplingParams(max_new_tokens=NEW)
    chunked = _engine(target)
    out = [c.token_ids for c in chunked.generate(prompts, greedy)]
    # Prompts longer than one chunk went in several: 7 of 8 prompts fit 16 at most.
    assert chunked.metrics.prefill_chunks > len(prompts) - 1
    whole = _engine(target, prompt_buckets=(64,))
    assert [c.token_ids for c in whole.generate(prompts, greedy)] == out
    assert whole.metrics.prefill_chunks <= len(prompts)
    for p, got in zip(prompts, out):
        assert got == _transformers_greedy(hf, p, NEW), len(p)


@pytest.mark.parametrize("sync", ["eager", "deferred"])
def test_chunked_prefill_with_a_draft_is_lossless(hf_and_target, sync):
    """Speculative decoding after a chunked prefill (the draft's inputs follow the
    chunks, eagerly or deferred) gives the plain greedy output token for token."""
    _, target = hf_and_target
    prompts = _prompts(target.config.vocab_size)
    greedy = SamplingParams(max_new_tokens=NEW)
    plain = [c.token_ids for c in _engine(target).generate(prompts, greedy)]
    draft = random_draft(target.config, seed=3)
    eng = _engine(target, draft, spec_policy="fixed", speculative=SPEC, draft_sync=sync)
    assert [c.token_ids for c in eng.generate(prompts, greedy)] == plain
    assert eng.metrics.spec_steps > 0


def test_chunked_prefill_sampling_matches_whole_prefill(hf_and_target):
    """Seeded sampling: the first token (sampled in the last chunk) and the rest are
    those of a whole prefill."""
    _, target = hf_and_target
    prompts = _prompts(target.config.vocab_size)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=11 + i, max_new_tokens=NEW) for i in range(len(prompts))]
    chunked = [c.token_ids for c in _engine(target, sampled_steps=True).generate(prompts, params)]
    whole = [c.token_ids for c in _engine(target, sampled_steps=True, prompt_buckets=(64,)).generate(prompts, params)]
    assert chunked == whole


def test_a_long_arrival_does_not_stall_running_requests(hf_and_target):
    """With a budget of one chunk per step, every step that carries a chunk of the long
    prompt also gives each running request a token; with a large budget the whole
    prompt goes in one step."""
    _, target = hf_and_target
    running = [[5, 6, 7], [8, 9, 10, 11]]
    long_prompt = [3 + i % 50 for i in range(50)]  # chunks 16, 16, 16, 8

    def run(budget):
        eng = _engine(target, prefill_token_budget=budget)
        ids = [eng.add_request(p, SamplingParams(max_new_tokens=40)) for p in running]
        reqs = [eng.scheduler.get(i) for i in ids]
        while any(len(r.progress.tokens) < 2 for r in reqs):
            eng.step()
        eng.add_request(long_prompt, SamplingParams(max_new_tokens=4))
        base = eng.metrics.prefill_chunks
        per_step = []  # (chunks launched, tokens each running request got) per step
        while eng.scheduler.prefilling or eng.metrics.prefill_chunks == base:
            chunks, before = eng.metrics.prefill_chunks, [len(r.progress.tokens) for r in reqs]
            eng.step()
            per_step.append((eng.metrics.prefill_chunks - chunks, [len(r.progress.tokens) - b for r, b in zip(reqs, before)]))
        eng.run_until_done()
        return per_step

    per_step = run(16)
    assert [c for c, _ in per_step] == [1, 1, 1, 1]  # one chunk a step
    # The step that launches a chunk delivers the previous step's tokens: each running
    # request gets a token at every step while the long prompt is prefilled.
    assert all(all(g >= 1 for g in got) for _, got in per_step)
    assert [c for c, _ in run(64)] == [4]  # the whole prompt at once


def test_prefill_chunks_on_the_cpu_attention_kernels_tiled_path(hf_and_target):
    """Chunks of 64 tokens: every chunk after the first attends over its prefix on the
    CPU kernel's tiled path (cpu_attention.cc), whose arithmetic is its own. Greedy output
    still equals transformers', and speculation after it equals plain decoding."""
    from eagle_jax.kernels import cpu_matmul

    hf, target = hf_and_target
    cfg = target.config
    g = cfg.num_attention_heads // cfg.num_key_value_heads
    assert cpu_matmul.prefix_attention_supported(64, g, cfg.head_dim, target.dtype, causal=True)
    prompts = [[3 + (11 * i + n) % (cfg.vocab_size - 3) for i in range(n)] for n in (64, 65, 130, 200)]
    greedy = SamplingParams(max_new_tokens=NEW)
    eng = _engine(target, prompt_buckets=(64,), max_seq_len=256)
    assert eng.table.plan.prefix_attention == "cpu", eng.table.plan
    out = [c.token_ids for c in eng.generate(prompts, greedy)]
    assert eng.metrics.prefill_chunks == 1 + 2 + 3 + 4
    for p, got in zip(prompts, out):
        assert got == _transformers_greedy(hf, p, NEW), len(p)
    spec = _engine(target, random_draft(cfg, seed=3), prompt_buckets=(64,), max_seq_len=256, spec_policy="fixed",
                   speculative=SPEC)
    assert [c.token_ids for c in spec.generate(prompts, greedy)] == out
    assert spec.metrics.spec_steps > 0


def test_the_cpu_default_chunks_step_by_32_and_stay_lossless(hf_and_target):
    """On a CPU the default chunk lengths are 64, 96 and 128 (padding costs compute
    there: real chat prompts are mostly 60-120 tokens): a 65-token prompt runs one chunk
    of 96, not 128, and prompts across 96's boundaries still decode as transformers
    does, plainly and under speculation."""
    hf, target = hf_and_target
    cfg = target.config
    lengths = (65, 96, 97, 129, 200)
    plans = {65: (96,), 96: (96,), 97: (128,), 129: (128, 64), 200: (128, 96)}
    prompts = [[3 + (13 * i + n) % (cfg.vocab_size - 3) for i in range(n)] for n in lengths]
    greedy = SamplingParams(max_new_tokens=NEW)
    eng = _engine(target, prompt_buckets=None, max_seq_len=256, max_batch=1)
    assert eng.config.prompt_buckets == (64, 96, 128)
    assert {n: chunk_plan(n, eng.config.prompt_buckets) for n in lengths} == plans
    out = [c.token_ids for c in eng.generate(prompts, greedy)]
    assert eng.metrics.prefill_chunks == sum(len(p) for p in plans.values())
    assert eng.metrics.prefill_padded_tokens == sum(sum(p) for p in plans.values())
    for p, got in zip(prompts, out):
        assert got == _transformers_greedy(hf, p, NEW), len(p)
    spec = _engine(target, random_draft(cfg, seed=3), prompt_buckets=None, max_seq_len=256, max_batch=1,
                   spec_policy="fixed", speculative=SPEC)
    assert [c.token_ids for c in spec.generate(prompts, greedy)] == out
    assert spec.metrics.spec_steps > 0
