"""The runtime seams: the target registry and its config errors, the speculation policies,
the step table's cache sizing for the tree-attention kernel, batched prefill, request
timing and the end of a streamed request."""

import json
import threading
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle_jax.defaults import enable_compilation_cache
from eagle_jax.checkpoint.draft_io import random_draft
from eagle_jax.checkpoint.hf import load_model
from eagle_jax.models.config import ModelConfig
from eagle_jax.serving.engine import Engine, EngineConfig
from eagle_jax.errors import ConfigError
from eagle_jax.serving.generate import Buckets, Generator
from eagle_jax.models.llama import LlamaModel
from eagle_jax.serving.policy import FixedPolicy, PlainPolicy, SpeculationPolicy, ThresholdPolicy
from eagle_jax.serving.requests import RequestProgress
from eagle_jax.runtime.step_table import CompileAfterBuildError, StepTable, _GraphJob
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.spec.config import SpeculativeConfig, parse_shape
from eagle_jax.models.registry import supported_architectures
from eagle_jax.models.target import TargetModel
from hf_factories import make_hf_model

SPEC = SpeculativeConfig(num_steps=3)
TREE = SpeculativeConfig(num_steps=3, topk=4, num_draft_tokens=8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("runtime_target")
    make_hf_model("llama3", seed=3).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def target(model_dir):
    return load_model(model_dir)


@pytest.fixture(scope="module")
def draft(target):
    return random_draft(target.config, seed=1, draft_vocab_size=128)


def _greedy(n):
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


# ----------------------------------------------------------------------------- target seam


def test_llama_model_is_a_target_with_an_abstract_cache(target):
    assert isinstance(target, TargetModel)
    spec = target.cache_spec(3, 40)
    leaves = jax.tree.leaves(spec, is_leaf=lambda x: hasattr(x, "axes"))
    assert len(leaves) == 2 * target.config.num_hidden_layers
    for leaf in leaves:
        assert leaf.shape == (3, 40, target.config.num_key_value_heads, target.config.head_dim)
        assert leaf.axes == ("batch", "cache_seq", "kv_heads", "head_dim")
    assert set(supported_architectures()) >= {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"architectures": ["MixtralForCausalLM"]}, r"config.json: architecture 'MixtralForCausalLM' is not supported; supported: .*DeepseekV3ForCausalLM.*LlamaForCausalLM"),
        ({"hidden_act": "gelu"}, r"config.json: hidden_act='gelu' is not supported; supported: silu"),
        ({"sliding_window": 64}, r"config.json: sliding_window=64 .* is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"config.json: rope_scaling.rope_type='yarn' is not supported; supported: default, linear, llama3"),
    ],
)
def test_unsupported_config_fields_are_named(tmp_path, model_dir, change, message):
    d = json.loads((model_dir / "config.json").read_text())
    d.update(change)
    (tmp_path / "config.json").write_text(json.dumps(d))
    (tmp_path / "model.safetensors").symlink_to(model_dir / "model.safetensors")
    with pytest.raises(ConfigError, match=message):
        load_model(tmp_path)


def test_sliding_window_that_never_applies_is_accepted(tmp_path, model_dir):
    d = json.loads((model_dir / "config.json").read_text())
    for extra in ({"sliding_window": 4096, "use_sliding_window": False}, {"sliding_window": None}):
        cfg = ModelConfig.from_hf_dict({**d, **extra})
        assert cfg.num_hidden_layers == d["num_hidden_layers"]


# ----------------------------------------------------------------------------- policies


def test_threshold_policy_keeps_the_cutoff_with_hysteresis():
    p = ThresholdPolicy(SPEC, threshold=2, hysteresis=3)
    buckets = [1, 1, 4, 4, 2, 2, 2, 2, 1, 8, 1]
    # The first step speculates at once; above 2 it goes off; back on after 3 steps at or below.
    want = [SPEC, SPEC, None, None, None, None, SPEC, SPEC, SPEC, None, None]
    assert [p.choose(b) for b in buckets] == want
    assert p.runs_plain and p.shapes == (SPEC,)
    assert ThresholdPolicy(SPEC, threshold=None).runs_plain is False
    assert all(ThresholdPolicy(SPEC, None).choose(b) == SPEC for b in (1, 64))
    assert FixedPolicy(TREE).choose(64) == TREE and PlainPolicy().choose(1) is None
    with pytest.raises(ConfigError, match="threshold"):
        ThresholdPolicy(SPEC, threshold=-1)


def test_shape_strings_round_trip():
    for c in (SPEC, TREE, SpeculativeConfig(num_steps=5, topk=10, num_draft_tokens=60)):
        assert parse_shape(c.shape) == c
    with pytest.raises(ConfigError, match="not 'chain S=<n>'"):
        parse_shape("tree S=3")
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        parse_shape("tree S=2 k=2 T=99")


class _Cycle(SpeculationPolicy):
    """A policy that switches among plain, a chain and a tree every step."""

    def __init__(self):
        self.shapes, self.runs_plain, self.seen, self._i = (SPEC, TREE), True, [], 0

    def choose(self, bucket):
        shape = (None, SPEC, TREE)[self._i % 3]
        self._i += 1
        return shape

    def observe(self, bucket, shape, accept_lengths, step_s):
        self.seen.append((bucket, shape, accept_lengths.tolist()))

    def describe(self):
        return "cycle"


@pytest.mark.parametrize("sync", ["eager", "deferred"])
def test_policy_switching_shapes_mid_request_is_lossless_and_observed(target, draft, sync):
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    ref = Generator(target, buckets=Buckets(batch=(4,), prompt=(16,), cache=(64,))).generate(prompts, _greedy(30))
    policy = _Cycle()
    eng = Engine(target, draft, EngineConfig(sampled_steps=False, max_batch=4, max_seq_len=64, prompt_buckets=(16,), speculative=SPEC,
                                             draft_sync=sync), policy=policy, progress=False)
    assert eng.table.draft_sync.mode == sync
    out = eng.generate(prompts, _greedy(30))
    assert [c.token_ids for c in out] == [r.token_ids for r in ref]
    shapes_seen = {s for _, s, _ in policy.seen}
    assert shapes_seen == {None, SPEC, TREE}
    assert all(all(a == 1 for a in acc) for _, s, acc in policy.seen if s is None)
    by_bucket = eng.metrics.summary()["steps_by_bucket"]
    assert {k.split(": ")[1] for k in by_bucket} == {"plain", SPEC.shape, TREE.shape}


@pytest.mark.parametrize("sync", ["eager", "deferred"])
def test_switching_shapes_keeps_seeded_sampling_and_compiles_nothing(target, draft, sync):
    """Sampled requests under a policy that switches every step: each request's tokens
    equal plain decoding's with the same seeds (coupled verification draws with the
    uniforms plain decoding uses), and switching among every compiled step compiles nothing."""
    from eagle_jax.serving.engine import compile_count

    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    params = [SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0.9, top_p=0.95, seed=s) for s in (1, 2, 3)]
    cfg = dict(max_batch=4, max_seq_len=64, batch_buckets=(4,), prompt_buckets=(16,))
    plain = Engine(target, None, EngineConfig(speculative=None, **cfg), progress=False).generate(prompts, params)
    eng = Engine(target, draft, EngineConfig(speculative=SPEC, draft_sync=sync, **cfg), policy=_Cycle(), progress=False)
    before = compile_count()
    out = eng.generate(prompts, params)
    assert compile_count() == before
    assert [c.token_ids for c in out] == [c.token_ids for c in plain]
    assert {s for _, s, _ in eng.policy.seen} == {None, SPEC, TREE}


def test_a_policy_choosing_an_unlisted_shape_is_a_clear_error(target, draft):
    class Liar(_Cycle):
        def choose(self, bucket):
            return SpeculativeConfig(num_steps=2)

    eng = Engine(target, draft, EngineConfig(sampled_steps=False, max_batch=1, max_seq_len=32, prompt_buckets=(16,), speculative=SPEC),
                 policy=Liar(), progress=False)
    eng.add_request([5, 6], _greedy(4))
    with pytest.raises(ConfigError, match="chose 'chain S=2' at batch bucket 1, which it did not list"):
        eng.run_until_done()


# ----------------------------------------------------------------------------- step table


def _bf16_target():
    cfg = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
    return LlamaModel(cfg, dtype=jnp.bfloat16)


def test_gpu_tables_size_the_cache_for_the_tree_attention_kernel(monkeypatch):
    """On a GPU the target cache is rounded up to the kernel's 64-slot block, so the
    selection (pallas_kernels.tree_attention.select_tree_attention_path) takes the
    kernel; unrounded, it falls back and says why. No GPU needed: the table is not built."""
    target = _bf16_target()
    draft = random_draft(target.config, seed=0, draft_vocab_size=64)
    kw = dict(shapes=(TREE,), batch_buckets=(1,), prompt_buckets=(64,), max_seq_len=256)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    on_gpu = StepTable(target, draft, **kw)
    assert on_gpu.target_cache_len == 320  # 256 + 8 rounded up to a multiple of 64
    assert "Pallas tree-attention kernel" in on_gpu.verify_attention_path()
    assert on_gpu.verify_attention_path().startswith("plain step: Pallas tree-attention kernel")
    unaligned = StepTable(target, draft, cache_align=1, **kw)
    assert unaligned.target_cache_len == 264
    path = unaligned.verify_attention_path()
    assert "XLA reference" in path and "multiple of block_k=64" in path
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    on_cpu = StepTable(target, draft, **kw)
    assert on_cpu.target_cache_len == 264
    # bfloat16: nothing is packed, so the prefix attends in XLA.
    assert on_cpu.verify_attention_path() == f"tree block in XLA, {TREE.shape}: prefix in XLA block by block (cpu)"


def test_the_start_up_line_names_the_verify_attention_the_graph_runs(target, draft):
    """On CPU (float32, packed weights) the line says the prefix goes to the CPU
    attention kernel exactly when the verify forward calls it (lowered on the table's own
    packed parameters): a tree whose T * G queries the kernel takes, and one too wide."""
    from eagle_jax.kernels import cpu_matmul
    from eagle_jax.models.llama import BoundModules, KVCache
    from eagle_jax.spec.steps import Tree, verify_tree

    wide = SpeculativeConfig(num_steps=4, topk=8, num_draft_tokens=cpu_matmul.ATTENTION_MAX_QUERIES)
    t = StepTable(target, draft, shapes=(TREE, wide), batch_buckets=(1,), prompt_buckets=(16,), max_seq_len=128,
                  sampled=False)
    path = t.verify_attention_path()
    assert t._bound.packed > 0 and path.endswith("(cpu)"), path
    bound = BoundModules(target, pack=True)
    for shape, on_kernel in ((TREE, True), (wide, False)):
        n = shape.num_draft_tokens
        tree = Tree(tokens=jnp.zeros((1, n), jnp.int32), parents=jnp.arange(-1, n - 1, dtype=jnp.int32)[None],
                    depths=jnp.arange(n, dtype=jnp.int32)[None])

        def verify(params, cache, tree=tree):
            (tm,) = bound.modules(params)
            return verify_tree(tm, cache, jnp.asarray([5], jnp.int32), tree, plan=t.plan)

        text = jax.jit(verify).lower(bound.params, KVCache.zeros(target.config, 1, 128 + n)).as_text()
        assert (cpu_matmul.ATTENTION_TARGET in text) == on_kernel, shape.shape
        want = "prefix in the CPU attention kernel" if on_kernel else "prefix in XLA block by block"
        assert f"{shape.shape}: {want}" in path, path


def test_aligned_cache_is_lossless(target, draft):
    """The GPU sizing (cache rounded up to 64 slots) changes nothing in the output."""
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    ref = Generator(target, buckets=Buckets(batch=(2,), prompt=(16,), cache=(64,))).generate(prompts, _greedy(20))
    eng = Engine(target, draft, EngineConfig(sampled_steps=False, max_batch=2, max_seq_len=64, prompt_buckets=(16,), speculative=TREE,
                                             cache_align=64), progress=False)
    assert eng.table.target_cache_len == 128
    assert [c.token_ids for c in eng.generate(prompts, _greedy(20))] == [r.token_ids for r in ref]


def test_requests_admitted_together_share_one_prefill(target, draft, monkeypatch):
    eng = Engine(target, draft, EngineConfig(sampled_steps=False, max_batch=4, max_seq_len=64, prompt_buckets=(16, 64), speculative=SPEC),
                 progress=False)
    assert eng.table.prefill_batches[16] == (1, 2, 4) and eng.table.prefill_batches[64] == (1, 2, 4)
    calls = []
    real = eng.table.prefill_chunk
    monkeypatch.setattr(eng.table, "prefill_chunk", lambda state, tokens, *a: calls.append(tokens.shape) or real(state, tokens, *a))
    prompts = [[5, 6, 7], [8, 9], [10] * 20, [11, 12, 13, 14]]
    out = eng.generate(prompts, _greedy(6))
    # Three short prompts: one call of 2 and one of 1 (the largest compiled sizes that fit);
    # the long one in its own chunk (20 tokens: 16 + 4 would pad less than 64 does, but a
    # 64-chunk pads by more than the smallest chunk, so 16 then 16).
    assert sorted(calls) == [(1, 16), (1, 16), (1, 16), (2, 16)]
    ref = Generator(target, buckets=Buckets(batch=(4,), prompt=(32,), cache=(64,))).generate(prompts, _greedy(6))
    assert [c.token_ids for c in out] == [r.token_ids for r in ref]


def test_prompt_longer_than_the_largest_bucket_goes_in_chunks(target):
    """No refusal and no truncation below max_seq_len: the prompt is prefilled in chunks,
    with the output of one whole prefill."""
    cfg = EngineConfig(sampled_steps=False, max_batch=1, max_seq_len=64, prompt_buckets=(16,), speculative=None)
    eng = Engine(target, None, cfg, progress=False)
    prompt = list(range(3, 23))
    [c] = eng.generate([prompt], [_greedy(4)])
    assert not c.truncated_prompt and c.prompt_token_ids == prompt
    assert eng.metrics.prefill_chunks == 2 and eng.metrics.prefill_tokens == 20
    ref = Generator(target, buckets=Buckets(batch=(1,), prompt=(32,), cache=(64,))).generate([prompt], _greedy(4))
    assert c.token_ids == ref[0].token_ids


# ----------------------------------------------------------------------------- requests


def test_request_timing_separates_queueing_from_decoding(target):
    """Batch 1, three requests at once: the later ones queue, so their tokens/s counted
    from arrival falls, while the decode rate (after the first token) does not."""
    eng = Engine(target, None, EngineConfig(sampled_steps=False, max_batch=1, max_seq_len=64, prompt_buckets=(16,), speculative=None), progress=False)
    out = eng.generate([[5, 6, 7]] * 3, _greedy(40))
    q = [c.queue_s for c in out]
    assert q[0] < q[1] < q[2]
    for c in out:
        assert c.ttft_s >= c.queue_s
        assert c.decode_tokens_per_second is not None and c.decode_tokens_per_second > 0
        t = c.timing()
        assert set(t) == {"queue_s", "ttft_s", "decode_tokens_per_second", "tokens_per_second"}
    # Identical work: the last request waited for both others to decode (40 steps each),
    # so its from-arrival rate is below its decode rate, and below the first request's.
    # Only orderings, which hold however loaded the machine: no ratio of measured rates.
    assert out[2].tokens_per_second < out[2].decode_tokens_per_second
    assert out[2].tokens_per_second < out[0].tokens_per_second


class _ByteTokenizer:
    """Token i is byte i; decoding is UTF-8 with replacement, like a byte-level BPE."""

    eos_token_ids = ()

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")

    def stream_decoder(self):
        from eagle_jax.checkpoint.tokenizer import StreamDecoder

        return StreamDecoder(self)


def test_stream_gets_the_text_held_back_at_the_end():
    """A request that ends inside a multi-byte character: the held-back text reaches
    on_text, so the streamed text equals the final text."""
    tok = _ByteTokenizer()
    got = []
    prog = RequestProgress(0, [1], SamplingParams(max_new_tokens=3), (), 3, tok, lambda i, d: got.append(d))
    for b in "h".encode() + "é".encode()[:1] + b"!":  # 'h', half of 'é', then '!'
        prog.push(b)
    # The cut character is decoded as U+FFFD once later bytes show it is invalid.
    assert "".join(got) == prog.final_text(tok) == "h\ufffd!"
    got.clear()
    prog = RequestProgress(0, [1], SamplingParams(max_new_tokens=2), (), 2, tok, lambda i, d: got.append(d))
    for b in "h".encode() + "é".encode()[:1]:  # the request ends on the half character
        prog.push(b)
    assert prog.finish_reason == "length"
    assert "".join(got) == prog.final_text(tok) == "h\ufffd"


def test_engine_stream_ends_with_the_flushed_text(target, monkeypatch):
    """Through the engine: Engine.stream yields the flushed tail too."""
    import eagle_jax.serving.requests as requests_mod

    eng = Engine(target, None, EngineConfig(sampled_steps=False, max_batch=1, max_seq_len=32, prompt_buckets=(16,), speculative=None),
                 tokenizer=_ByteTokenizer(), progress=False)
    flushed = []
    real = requests_mod.RequestProgress._finish

    def spy(self, reason):
        real(self, reason)
        flushed.append(self.text)

    monkeypatch.setattr(requests_mod.RequestProgress, "_finish", spy)
    deltas = list(eng.stream([5, 6, 7], _greedy(12)))
    [c] = eng.generate([[5, 6, 7]], [_greedy(12)])
    assert "".join(deltas) == c.text == flushed[0]


def test_cli_prompt_buckets_follow_the_longest_prompt():
    """Each prompt is prefilled in chunks of powers of two up to the largest chunk (and,
    on a CPU, 96 between 64 and 128): a file of 40-token questions and 1,000-token
    documents keeps a 64-token chunk for the questions, and the documents go in chunks
    of at most default_max_chunk(): 128 on a CPU (measured: larger chunks prefill no
    faster there), 512 elsewhere."""
    from eagle_jax.runtime.plan import default_chunk_step, default_max_chunk, prompt_buckets_for
    from eagle_jax.serving.engine import EngineConfig

    assert default_max_chunk("cpu") == 128 and default_max_chunk("gpu") == default_max_chunk("tpu") == 512
    assert default_max_chunk() == 128  # the tests run on a CPU
    assert prompt_buckets_for(40, 2048) == (64,)
    # On a CPU a chunk's padding costs compute: a step of 32 in the first octave.
    assert default_chunk_step("cpu") == 32 and default_chunk_step("gpu") is None
    assert prompt_buckets_for(70, 2048) == prompt_buckets_for(1000, 2048) == (64, 96, 128)
    assert EngineConfig(max_seq_len=2048).prompt_buckets == (64, 96, 128)
    assert EngineConfig(max_seq_len=100).prompt_buckets == (64, 100)  # no 96: a step below 100
    assert prompt_buckets_for(1000, 2048, step=0) == (64, 128)  # a GPU's
    assert prompt_buckets_for(1000, 2048, step=16) == (64, 80, 96, 112, 128)
    assert prompt_buckets_for(1000, 2048, max_chunk=1024) == (64, 96, 128, 256, 512, 1024)
    assert prompt_buckets_for(1000, 2048, max_chunk=1024, step=0) == (64, 128, 256, 512, 1024)
    assert prompt_buckets_for(1500, 384, max_chunk=512) == (64, 96, 128, 256, 384)
    assert prompt_buckets_for(1500, 100) == (64, 100)
    assert prompt_buckets_for(10, 16) == (16,)


@pytest.mark.parametrize("s_len, block", [(40, 16), (37, 16), (12, 256), (64, 64)])
def test_prefix_attention_equals_dense_masked_attention(s_len, block):
    """The block-by-block attention over the prefix (what every step runs) against dense
    attention under the same mask written out as [B, T, S]: causal and tree blocks,
    ragged prefixes (0, mid-block, at a block edge, the whole cache) and a cache length
    that is no multiple of the block (the last block overlaps)."""
    from eagle_jax.models.llama import PrefixMask, masked_attention, prefix_attention
    from pallas_kernels.tree import tree_ancestor_mask

    rng = np.random.default_rng(s_len + block)
    b, t, hq, hkv, d = 4, 5, 4, 2, 8
    prefix = np.array([0, min(16, s_len - t), min(17, s_len - t), s_len - t], np.int32)
    k_cache = jnp.asarray(rng.standard_normal((b, s_len, hkv, d)), jnp.float32)
    v_cache = jnp.asarray(rng.standard_normal((b, s_len, hkv, d)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.float32)
    k_new = jnp.asarray(rng.standard_normal((b, t, hkv, d)), jnp.float32)
    v_new = jnp.asarray(rng.standard_normal((b, t, hkv, d)), jnp.float32)
    rows = jnp.arange(b)[:, None]
    slots = jnp.asarray(prefix)[:, None] + jnp.arange(t)[None, :]
    k_full = k_cache.at[rows, slots].set(k_new)
    v_full = v_cache.at[rows, slots].set(v_new)
    parents = jnp.asarray([[-1, 0, 0, 1, 2]] * b, jnp.int32)
    for mask in (PrefixMask.causal(jnp.asarray(prefix), t), PrefixMask(jnp.asarray(prefix), tree_ancestor_mask(parents))):
        want = masked_attention(q, k_full, v_full, mask.dense(s_len), 0.3)
        got = prefix_attention(q, k_new, v_new, k_full, v_full, mask, 0.3, block=block)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def _cache_entries() -> set:
    return set(Path(jax.config.jax_compilation_cache_dir).glob("*-cache"))


def _prefill_first_token(table: StepTable) -> list[int]:
    tokens = np.zeros((1, 8), np.int32)
    tokens[0, :5] = [3, 9, 27, 81, 17]
    _, first = table.prefill(table.device_put_rows(tokens), table.device_put_rows(np.array([5], np.int32)),
                             table.sampling([SamplingParams()], 1))
    return np.asarray(first).tolist()


def test_enable_compilation_cache_keeps_a_directory_already_configured(monkeypatch):
    """The CLI's enable_compilation_cache leaves a configured cache directory alone (here the
    test session's): JAX opens its cache once per process, so a moved setting would name a
    directory nothing is written to (an in-process CLI test once did that to later tests)."""
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    configured = jax.config.jax_compilation_cache_dir
    assert configured
    enable_compilation_cache()
    assert jax.config.jax_compilation_cache_dir == configured


def test_a_corrupt_persistent_cache_entry_is_compiled_again_with_a_warning(monkeypatch):
    """Every executable a table wrote to the persistent cache is overwritten with junk: a
    second table of the same configuration warns for each, compiles it again (no cache
    hit counted), and computes what the first one did; nothing crashes. (JAX's cache
    alone: the executable cache, read first, is off.)"""
    monkeypatch.setenv("EAGLE_JAX_EXECUTABLE_CACHE", "off")
    cfg = ModelConfig(vocab_size=101, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=64)  # sizes no other test uses
    target = LlamaModel(cfg)
    kw = dict(shapes=(), batch_buckets=(1,), prompt_buckets=(8,), max_seq_len=16)
    before = _cache_entries()
    first = StepTable(target, None, **kw)
    first.build()
    written = _cache_entries() - before
    assert len(written) >= first.report.graphs - first.report.cache_hits > 0
    try:
        for path in written:
            path.write_bytes(b"not an executable")
        second = StepTable(target, None, **kw)
        with pytest.warns(UserWarning, match="Error reading persistent compilation cache entry"):
            report = second.build()
        assert report.cache_hits == 0
        assert _prefill_first_token(second) == _prefill_first_token(first)
    finally:  # JAX does not overwrite an entry it could not read: leave none for later tests
        for path in written:
            path.unlink(missing_ok=True)


def test_another_model_shape_misses_the_persistent_cache():
    """The cache is keyed by the graphs: a table over a target of other sizes compiles its
    own (no hit), while one over the same sizes with other weights reads every graph back
    (the weights are arguments, not constants, so the same executable serves both)."""
    base = dict(vocab_size=103, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    kw = dict(shapes=(), batch_buckets=(1,), prompt_buckets=(8,), max_seq_len=16)
    StepTable(LlamaModel(ModelConfig(**base)), None, **kw).build()
    other_weights = StepTable(LlamaModel(ModelConfig(**base), rngs=nnx.Rngs(7)), None, **kw).build()
    assert other_weights.cache_hits == other_weights.graphs
    wider = StepTable(LlamaModel(ModelConfig(**{**base, "intermediate_size": 96})), None, **kw).build()
    assert wider.cache_hits < wider.graphs
    model_graphs = [t for t in wider.timings if t.name.startswith(("prefill", "plain"))]
    assert model_graphs and not any(t.cache_hit for t in model_graphs)


def test_build_report_splits_each_graph_and_counts_persistent_cache_hits(monkeypatch):
    """Every graph's start-up time is split into trace, lower and compile; a second table
    of the same configuration reads every executable back from the persistent cache (the
    test session sets one up: conftest.py), counted by JAX's own cache-hit events. (JAX's
    cache alone: the executable cache, read first, is off.)"""
    monkeypatch.setenv("EAGLE_JAX_EXECUTABLE_CACHE", "off")
    cfg = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=128)
    target = LlamaModel(cfg)
    kw = dict(shapes=(), batch_buckets=(1, 2), prompt_buckets=(8,), max_seq_len=32)
    first = StepTable(target, None, **kw).build()
    second = StepTable(target, None, **kw).build()
    for report in (first, second):
        assert [t.name for t in report.timings] == report.names
        assert all(t.trace_s >= 0 and t.lower_s > 0 and t.compile_s > 0 for t in report.timings)
    assert second.cache_hits == second.graphs
    assert f"0 of {second.graphs} loaded untraced from the executable cache, {second.graphs} from JAX's persistent cache" in second.describe()
    assert second.slowest(2).count(" s (trace ") == 2


def test_graphs_compiled_on_several_threads_compute_what_one_thread_compiles(monkeypatch):
    """build(workers=3) traces in order on one thread and compiles on three: the report
    lists every graph in order, each with its own split, and the table computes what a
    table built one graph at a time does (prefill and the plain step)."""
    monkeypatch.setenv("EAGLE_JAX_EXECUTABLE_CACHE", "off")  # compiled, not loaded, by both tables
    cfg = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=64)  # sizes no other test uses
    target = LlamaModel(cfg)
    kw = dict(shapes=(), batch_buckets=(1, 2), prompt_buckets=(8,), max_seq_len=16)
    serial, parallel = StepTable(target, None, **kw), StepTable(target, None, **kw)
    threads = set()
    compile_ = _GraphJob.compile

    def spy(lowered):
        threads.add(threading.current_thread().name)
        return compile_(lowered)

    monkeypatch.setattr(_GraphJob, "compile", staticmethod(spy))
    one = serial.build(workers=1)
    threads_one, threads = threads, set()
    three = parallel.build(workers=3)
    assert len(threads_one) == 1 and len(threads) > 1  # the pool's threads, not only one
    assert one.names == three.names and [t.name for t in three.timings] == three.names
    assert set(parallel._graphs) == set(serial._graphs)
    assert _prefill_first_token(parallel) == _prefill_first_token(serial)
    state, samp = parallel.zeros(2), parallel.sampling([SamplingParams()] * 2, 2)
    out_p = parallel.step(state, samp, None, greedy=True)
    out_s = serial.step(serial.zeros(2), serial.sampling([SamplingParams()] * 2, 2), None, greedy=True)
    np.testing.assert_array_equal(np.asarray(out_p[1]), np.asarray(out_s[1]))


def test_a_compile_that_fails_on_a_worker_thread_is_raised_naming_its_graph(monkeypatch):
    """An error in one of the concurrent compiles reaches build() with the graph named,
    after the compiles in flight have finished; the table keeps no report (not built)."""
    monkeypatch.setenv("EAGLE_JAX_EXECUTABLE_CACHE", "off")
    cfg = ModelConfig(vocab_size=89, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    table = StepTable(LlamaModel(cfg), None, shapes=(), batch_buckets=(1, 2), prompt_buckets=(8,), max_seq_len=16)
    names = [name for name, _, _ in table._define()]
    calls = []
    compile_ = _GraphJob.compile

    def third_fails(lowered):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("XLA ran out of something")
        return compile_(lowered)

    monkeypatch.setattr(_GraphJob, "compile", staticmethod(third_fails))
    with pytest.raises(RuntimeError, match="XLA ran out of something") as info:
        table.build(workers=2)
    assert f"while compiling the {names[2]} graph at start-up" in "\n".join(info.value.__notes__)
    assert table.report is None
    keys = [key for _, key, _ in table._define()]
    assert not any(key in table._graphs for key in keys[2:])  # nothing stored from the failed one on


def _exe_table(vocab: int, **over) -> StepTable:
    cfg = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    # A context no other test uses (vocab - 20): the state-only graphs (zeros, insert,
    # resize) do not depend on the vocabulary, and one JAX's cache already holds would
    # not be stored (see runtime.executable_cache).
    return StepTable(LlamaModel(cfg), None, **{**dict(shapes=(), batch_buckets=(1, 2), prompt_buckets=(8,),
                                                      max_seq_len=vocab - 20), **over})


def test_a_second_table_loads_every_graph_from_the_executable_cache_untraced(monkeypatch):
    """The executable cache (runtime.executable_cache, on wherever JAX's cache is: the test
    session's here): a first table stores every graph; a second of the same configuration
    loads every one without tracing or lowering (the report says so, graph by graph) and
    computes what the first does; the start-up line counts them, and its memory figures
    come from the cache (no loaded executable is analysed again: 20 ms a graph)."""
    first = _exe_table(83)
    a = first.build()
    assert first.executable_cache is not None and a.loaded == 0 and first.executable_cache.written == a.graphs
    second = _exe_table(83)
    analysed = []
    real = jax.stages.Compiled.memory_analysis
    monkeypatch.setattr(jax.stages.Compiled, "memory_analysis", lambda self: analysed.append(1) or real(self))
    b = second.build()
    assert analysed == []
    assert a.max_temp_bytes > 0 and (b.max_temp_bytes, b.code_bytes) == (a.max_temp_bytes, a.code_bytes)
    assert b.loaded == b.cache_hits == b.graphs
    assert all(t.loaded and t.trace_s == 0 and t.lower_s == 0 for t in b.timings)
    assert f"{b.graphs} of {b.graphs} loaded untraced from the executable cache" in b.describe()
    assert _prefill_first_token(second) == _prefill_first_token(first)
    outs = []
    for table in (first, second):
        out = table.step(table.zeros(2), table.sampling([SamplingParams()] * 2, 2), None, greedy=True)
        outs.append(np.asarray(out[1]))
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("change", ["model", "versions", "sources", "shapes"])
def test_a_changed_model_version_source_or_shape_misses_the_executable_cache(monkeypatch, change):
    """What a graph depends on keys its cached executable: another model config, another
    jax/jaxlib/flax version, a change to any source file, or another signature (a
    different batch bucket) each miss, and the graphs are traced and compiled again."""
    from eagle_jax.runtime import executable_cache

    first = _exe_table(79).build()
    if change == "versions":
        monkeypatch.setattr(executable_cache, "_versions", lambda: {"jax": "0.0.0", "jaxlib": "0.0.0", "flax": "0"})
    if change == "sources":
        monkeypatch.setattr(executable_cache, "source_digest", lambda: "0" * 64)
    again = (_exe_table(71) if change == "model" else
             _exe_table(79, batch_buckets=(4,)) if change == "shapes" else _exe_table(79)).build()
    changed = [t for t in again.timings if t.name not in first.names]  # batch 4's graphs
    if change == "shapes":  # the batch-1 graphs both tables hold are the same programs: loaded
        assert changed and {t.name for t in again.timings if t.loaded} == {t.name for t in again.timings} - {t.name for t in changed}
    else:
        assert again.loaded == 0 and not changed
        changed = again.timings
    assert not any(t.loaded for t in changed) and all(t.trace_s > 0 for t in changed)


def test_an_unreadable_executable_cache_entry_is_compiled_again_with_a_warning():
    """Every stored executable is overwritten with junk: the next table warns for each,
    removes it, compiles it again (traced; JAX's own cache has it, so it is not stored
    again), and computes what the first did; a later table does not warn again."""
    first = _exe_table(73)
    first.build()
    files = sorted(first.executable_cache.dir.glob("*.exe"))
    assert len(files) == first.report.graphs
    for f in files:
        f.write_bytes(b"not an executable")
    second = _exe_table(73)
    with pytest.warns(UserWarning, match="could not be loaded .* compiling it again"):
        report = second.build()
    assert report.loaded == 0 and all(t.trace_s > 0 for t in report.timings)
    assert _prefill_first_token(second) == _prefill_first_token(first)
    assert not any(f.exists() for f in files)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _exe_table(73).build()


def test_an_executable_that_calls_back_into_python_is_not_stored(tmp_path):
    """A graph that calls back into Python (the Pallas interpreter on CPU does, as does
    jax.pure_callback) holds closures of this process: storing it is declined (no file,
    no error) rather than failing the build or leaving an entry that cannot run."""
    from eagle_jax.runtime.executable_cache import ExecutableCache

    scale = np.float32(3.0)

    def host(x):  # a local function, as the interpreter's callbacks are
        return np.asarray(x) * scale

    def f(x):
        return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x) + 1

    x = jnp.arange(4, dtype=jnp.float32)
    compiled = jax.jit(f).lower(x).compile()
    cache = ExecutableCache(tmp_path, {"test": "callbacks"})
    assert cache.store(cache.key(("cb",), "sig"), compiled, "callback graph") is False
    assert cache.written == 0 and not list(tmp_path.rglob("*.exe"))
    np.testing.assert_allclose(np.asarray(compiled(x)), np.arange(4) * 3.0 + 1)


def test_the_executable_cache_is_off_on_request_and_keeps_to_its_size(monkeypatch):
    """EAGLE_JAX_EXECUTABLE_CACHE=off: nothing is stored or loaded. Over the size limit the
    least recently used tables are dropped, never the one just built."""
    monkeypatch.setenv("EAGLE_JAX_EXECUTABLE_CACHE", "off")
    off = _exe_table(67)
    assert off.executable_cache is None and off.build().loaded == 0
    monkeypatch.delenv("EAGLE_JAX_EXECUTABLE_CACHE")
    older = _exe_table(61)
    older.build()
    monkeypatch.setenv("EAGLE_JAX_EXECUTABLE_CACHE_MB", "0")
    newest = _exe_table(59)
    newest.build()
    assert not older.executable_cache.dir.exists() and newest.executable_cache.dir.is_dir()


def test_tables_whose_state_differs_only_by_their_shapes_do_not_share_a_cached_zeros_graph(target, draft):
    """The zeroed-state graph takes no argument: its output follows the largest speculative
    shape. Two tables that differ only in their shapes must not load each other's (the
    executable cache's manifest holds the state specs): the second table's zeros feed its
    own speculative step."""
    kw = dict(batch_buckets=(1,), prompt_buckets=(16,), max_seq_len=40, plain=False, sampled=False)
    small = SpeculativeConfig(num_steps=1)
    StepTable(target, draft, shapes=(small,), **kw).build()
    table = StepTable(target, draft, shapes=(TREE,), **kw)
    table.build()
    state = table.zeros(1)
    assert [x.shape for x in jax.tree.leaves(state)] == [s.shape for s in jax.tree.leaves(table._specs[1])]
    out = table.step(state, table.sampling([SamplingParams()], 1), TREE, greedy=True)
    assert np.asarray(out[1]).shape[0] == 1


def test_a_second_engine_of_the_same_configuration_loads_every_graph_untraced(target, draft):
    """Issue 32's test, through the engine's own report: a second Engine with the same
    target, draft and configuration loads every executable from the executable cache
    (none traced, none compiled by XLA) and decodes the same tokens."""
    from eagle_jax.serving.engine import compile_count

    cfg = EngineConfig(speculative=SPEC, max_batch=2, max_seq_len=44, batch_buckets=(2,), prompt_buckets=(16,),
                       sampled_steps=False)  # a context no other test uses: compiled here, so stored
    first = Engine(target, draft, cfg, progress=False)
    assert first.table.report.loaded == 0
    compiles = compile_count()
    second = Engine(target, draft, cfg, progress=False)
    report = second.table.report
    assert report.loaded == report.graphs > 0 and compile_count() == compiles
    assert all(t.trace_s == 0 and t.lower_s == 0 for t in report.timings)
    prompts, params = [[5, 6, 7], [9, 10]], [_greedy(12)] * 2
    assert [c.token_ids for c in second.generate(prompts, params)] == [c.token_ids for c in first.generate(prompts, params)]


def test_a_resize_between_distant_buckets_goes_bucket_by_bucket():
    """The table compiles resize graphs between neighbouring buckets only; a resize
    further off chains them and gives what one gather would: row i of the new state is
    row rows[i] of the old, growing and shrinking, over one bucket or several."""
    cfg = ModelConfig(vocab_size=89, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=32)
    t = StepTable(LlamaModel(cfg), None, shapes=(), batch_buckets=(1, 2, 4, 8), prompt_buckets=(8,), max_seq_len=16,
                  sampled=False)
    t.build()
    gathers = sorted(k[1:] for k in t._graphs if k[0] == "gather")
    assert gathers == [(1, 2), (2, 1), (2, 4), (4, 2), (4, 8), (8, 4)]

    def state_of(b: int):
        # Every leaf of row r holds r + 1 (seq_lens too), so a row's origin is readable.
        st = t.zeros(b)
        return jax.tree.map(lambda x: (jnp.arange(b) + 1).reshape((b,) + (1,) * (x.ndim - 1)).astype(x.dtype)
                            * jnp.ones_like(x), st)

    for b, rows in ((8, [6]), (8, [3, 1]), (8, [5, 2, 7, 0]), (4, [3]), (1, [0] * 8), (2, [1, 0, 0, 0, 0, 0, 0, 0]),
                    (2, [1, 0, 0, 0]), (1, [0, 0]), (4, [2, 3, 1, 0, 0, 0, 0, 0])):
        src = state_of(b)
        got = t.gather(src, rows)
        want = jax.tree.map(lambda x: np.take(np.asarray(x), rows, axis=0), src)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(g), w)
    for b, n in ((4, 3), (4, 4)):  # not a bucket; not a change
        with pytest.raises(CompileAfterBuildError, match=f"resize {b}->{n}"):
            t.gather(state_of(b), list(range(n)))
