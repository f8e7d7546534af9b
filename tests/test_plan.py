"""The execution plan (``eagle_jax.kernels.plan``), resolved once (``runtime.plan``):
which kernels it names on a CPU and (without a GPU, by asking for backend="gpu") on a
GPU, its start-up text, and that the forwards and step functions follow it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from eagle_jax.errors import ConfigError
from eagle_jax.kernels import cpu_matmul
from eagle_jax.kernels.plan import XLA_PLAN, ExecutionPlan, check_kernel_impl
from eagle_jax.runtime.plan import resolve_plan, xla_plan
from eagle_jax.runtime.sharding import check_draft_sharding

PACKAGE = Path(__file__).resolve().parents[1] / "eagle_jax"


def _kernel_available() -> bool:
    return cpu_matmul.status("cpu")[0]


needs_kernel = pytest.mark.skipif(not _kernel_available(), reason="the CPU kernel library does not build here")


# ----------------------------------------------------------------------------- resolving


@needs_kernel
def test_cpu_plan_names_the_packed_kernels_and_xla_paths():
    p = resolve_plan(backend="cpu")
    assert (p.backend, p.kernel_impl, p.verify_kernel, p.tree_attention) == ("cpu", "auto", "reference", None)
    assert (p.matmul, p.prefix_attention, p.mesh, p.devices, p.cache_align) == ("packed", "cpu", None, 1, 1)
    assert p.matmul_note == cpu_matmul.status("cpu")[1]
    assert p.layers == "stacked"
    stacked = "; target layers stacked (one loop body over stacked parameters and caches)"
    assert p.describe() == f"kernels auto; matrix products: {p.matmul_note}, 0 matrices packed{stacked}"
    assert p.describe("tree block in XLA") == (
        f"kernels auto; verify attention tree block in XLA; matrix products: {p.matmul_note}, 0 matrices packed{stacked}")
    assert dataclasses.replace(p, packed=30).matmul_path.endswith(", 30 matrices packed")


def test_cpu_plan_follows_the_environment(monkeypatch):
    monkeypatch.setenv("EAGLE_JAX_CPU_MATMUL", "xla")
    p = resolve_plan(backend="cpu")
    assert (p.matmul, p.prefix_attention) == ("xla", "xla")
    assert p.describe() == ("kernels auto; matrix products: XLA dot (EAGLE_JAX_CPU_MATMUL=xla); target layers stacked "
                            "(one loop body over stacked parameters and caches)")
    monkeypatch.setenv("EAGLE_JAX_CPU_MATMUL", "auto")
    monkeypatch.setenv("EAGLE_JAX_CPU_ATTENTION", "xla")
    p = resolve_plan(backend="cpu")
    assert p.prefix_attention == "xla"
    assert p.matmul == ("packed" if _kernel_available() else "xla")


def test_layers_stack_on_a_cpu_and_follow_the_environment(monkeypatch):
    assert resolve_plan(backend="cpu").layers == "stacked"
    assert resolve_plan(backend="gpu", compute_capability="9.0").layers == "unrolled"
    mesh = AbstractMesh((1, 2, 4), ("data", "expert", "model"))
    assert resolve_plan(backend="cpu", mesh=mesh).layers == "unrolled"  # the GPU's tensor-parallel graphs
    monkeypatch.setenv("EAGLE_JAX_LAYERS", "unrolled")
    assert resolve_plan(backend="cpu").layers == "unrolled"
    monkeypatch.setenv("EAGLE_JAX_LAYERS", "stacked")
    assert resolve_plan(backend="gpu", compute_capability="9.0").layers == "stacked"
    monkeypatch.setenv("EAGLE_JAX_LAYERS", "scan")
    with pytest.raises(ConfigError, match="EAGLE_JAX_LAYERS='scan' must be one of auto, unrolled, stacked"):
        resolve_plan(backend="cpu")
    with pytest.raises(ValueError, match="layers"):
        ExecutionPlan(layers="scanned")


def test_gpu_rules_without_a_gpu():
    p = resolve_plan(backend="gpu", compute_capability="9.0")
    assert (p.verify_kernel, p.tree_attention, p.matmul, p.prefix_attention) == ("kernel", "auto", "xla", "xla")
    assert p.matmul_note == "XLA dot (gpu)" and p.cache_align == 64 and p.compute_capability == "9.0"
    assert p.describe() == "kernels auto; matrix products: XLA dot (gpu); target layers unrolled"
    ref = resolve_plan(backend="gpu", kernel_impl="reference")
    assert (ref.verify_kernel, ref.tree_attention) == ("reference", None)
    forced = resolve_plan(backend="gpu", kernel_impl="kernel")
    assert (forced.verify_kernel, forced.tree_attention) == ("kernel", "auto")
    # kernel_impl="kernel" off a GPU: the verify kernels interpreted, attention on the prefix path.
    cpu = resolve_plan(backend="cpu", kernel_impl="kernel")
    assert (cpu.verify_kernel, cpu.tree_attention) == ("kernel", None)


def test_a_mesh_of_several_devices_turns_the_cpu_kernels_off_and_shards_the_pallas_ones():
    mesh = AbstractMesh((1, 2, 4), ("data", "expert", "model"))
    p = resolve_plan(backend="cpu", mesh=mesh)
    assert (p.matmul, p.prefix_attention, p.devices, p.expert_shards) == ("xla", "xla", 8, 2)
    assert p.mesh is mesh
    assert p.kernel_path == "auto (Pallas kernels under shard_map over 8 devices)"
    assert p.matmul_path == "XLA dot and prefix attention in XLA (the CPU kernels are single-device; mesh of 8)"
    assert resolve_plan(backend="cpu", mesh=mesh, kernel_impl="reference").kernel_path == "reference"
    one = AbstractMesh((1, 1, 1), ("data", "expert", "model"))
    assert resolve_plan(backend="cpu", mesh=one).mesh is None  # one device: no shard_map


def test_defaults_and_checks():
    assert XLA_PLAN == ExecutionPlan()
    assert (XLA_PLAN.matmul, XLA_PLAN.prefix_attention, XLA_PLAN.tree_attention, XLA_PLAN.mesh) == ("xla", "xla", None, None)
    assert XLA_PLAN.describe() == "kernels auto; matrix products: XLA dot; target layers unrolled"
    assert xla_plan("gpu") == ExecutionPlan(backend="gpu")
    assert check_kernel_impl("kernel") == "kernel"
    for bad in ("fast", True, None):
        with pytest.raises(ConfigError, match=re.escape(f"kernel_impl={bad!r}; valid: auto, kernel, reference")):
            check_kernel_impl(bad)
        with pytest.raises(ConfigError, match="kernel_impl="):
            resolve_plan(kernel_impl=bad)
    assert check_draft_sharding("model") == "model"
    with pytest.raises(ConfigError, match=re.escape("draft_sharding='tensor'; valid: replicated, model")):
        check_draft_sharding("tensor")
    with pytest.raises(ConfigError, match="matmul='fast'; valid: xla, packed"):
        ExecutionPlan(matmul="fast")


def test_the_backend_is_asked_in_one_place():
    """Only runtime/plan.py asks the backend which kernels to run; the checkpoint's default
    dtype and the doctor's and environment's reports keep their own question."""
    allowed = {"runtime/plan.py", "checkpoint/hf.py", "doctor.py", "environment.py"}
    askers = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if "default_backend()" in p.read_text()}
    assert askers <= allowed, askers - allowed
    assert "get_abstract_mesh" not in "".join(p.read_text() for p in PACKAGE.rglob("*.py"))


def test_importing_the_package_leaves_the_backend_alone():
    """No import asks the backend (an EngineConfig() default argument did, through the
    backend's default prefill chunk): a multi-process run must call
    jax.distributed.initialize before anything initialises the XLA backend."""
    import subprocess
    import sys

    code = ("import jax._src.xla_bridge as xb\n"
            "import eagle_jax, eagle_jax.cli, eagle_jax.serving.engine, eagle_jax.runtime.sharding\n"
            "from eagle_jax import Engine, EngineConfig, SamplingParams\n"
            "assert not xb.backends_are_initialized(), 'an import initialised the backend'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_verify_attention_text():
    cpu = dataclasses.replace(XLA_PLAN, matmul="packed", prefix_attention="cpu")
    shapes = [("chain S=3", 4), ("tree S=3 k=8 T=64", 64)]
    text = cpu.verify_attention(4, (1, 264, 2, 64), jnp.float32, shapes, plain=True)
    assert text == ("tree block in XLA, chain S=3: prefix in the CPU attention kernel; "
                    "tree S=3 k=8 T=64: prefix in XLA block by block (cpu)")
    assert XLA_PLAN.verify_attention(4, (1, 264, 2, 64), jnp.float32, shapes[:1], plain=True) == (
        "tree block in XLA, chain S=3: prefix in XLA block by block (cpu)")
    assert XLA_PLAN.verify_attention(4, (1, 264, 2, 64), jnp.float32, [], plain=True) == "no verify (plain only)"
    assert XLA_PLAN.verify_attention(4, (1, 264, 96), jnp.float32, shapes, plain=True).startswith("XLA (cache leaves")
    gpu = resolve_plan(backend="gpu", compute_capability="9.0")
    text = gpu.verify_attention(4, (1, 320, 2, 64), jnp.bfloat16, shapes[:1], plain=True)
    assert text.startswith("plain step: Pallas tree-attention kernel") and "chain S=3: Pallas tree-attention kernel" in text
    unaligned = gpu.verify_attention(4, (1, 264, 2, 64), jnp.bfloat16, shapes[:1], plain=False)
    assert unaligned.startswith("chain S=3: XLA reference") and "multiple of block_k=64" in unaligned
    ref = resolve_plan(backend="gpu", kernel_impl="reference")
    assert ref.verify_attention(4, (1, 320, 2, 64), jnp.bfloat16, shapes[:1], plain=True).endswith("(kernel_impl=reference)")


def test_prefix_attention_for_is_the_plans_and_the_shapes():
    cpu = dataclasses.replace(XLA_PLAN, matmul="packed", prefix_attention="cpu")
    assert cpu.prefix_attention_for(4, 2, 64, jnp.float32) == "cpu"
    assert cpu.prefix_attention_for(4, 2, 64, jnp.bfloat16) == "xla"
    assert cpu.prefix_attention_for(40, 2, 64, jnp.float32) == "xla"  # 80 queries per KV head
    assert cpu.prefix_attention_for(64, 2, 64, jnp.float32) == "xla"  # a tree of 64: XLA's loop, as before
    assert cpu.prefix_attention_for(64, 2, 64, jnp.float32, causal=True) == "cpu"  # a prefill chunk
    assert cpu.prefix_attention_for(40, 2, 64, jnp.float32, causal=True) == "xla"  # narrower than a chunk
    assert XLA_PLAN.prefix_attention_for(4, 2, 64, jnp.float32) == "xla"


# ----------------------------------------------------------------------------- following it


def _tiny():
    from eagle_jax.checkpoint.draft_io import random_draft
    from eagle_jax.models.config import ModelConfig
    from eagle_jax.models.llama import LlamaModel

    cfg = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      tie_word_embeddings=True)
    target = LlamaModel(cfg)
    return target, random_draft(cfg, seed=0, draft_vocab_size=128)


@needs_kernel
def test_forward_logits_match_under_the_xla_plan_and_the_cpu_kernel_plan():
    from eagle_jax.models.llama import BoundModules, KVCache, PrefixMask

    target, _ = _tiny()
    cfg = target.config
    rng = np.random.default_rng(5)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 10)), jnp.int32)
    new = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 3)), jnp.int32)
    plens = jnp.asarray([10, 4], jnp.int32)
    plan = resolve_plan(backend="cpu")
    packed, plain = BoundModules(target, pack=True), BoundModules(target)

    def run(bound, params, plan):
        (t,) = bound.modules(params)
        cache = KVCache.zeros(cfg, 2, 32)
        pos0 = jnp.broadcast_to(jnp.arange(10), (2, 10))
        _, _, cache = t(prompt, pos0, cache, pos0, PrefixMask.causal(jnp.zeros(2, jnp.int32), 10), plan=plan)
        pos = plens[:, None] + jnp.arange(3)[None]
        h, _, _ = t(new, pos, cache, pos, PrefixMask.causal(plens, 3), plan=plan)
        return t.logits(h)

    runs = {"xla": (plain, XLA_PLAN), "xla packed": (packed, XLA_PLAN), "cpu kernels": (packed, plan)}
    texts = {name: jax.jit(lambda p, b=b, pl=pl: run(b, p, pl)).lower(b.params).as_text() for name, (b, pl) in runs.items()}
    assert [cpu_matmul.ATTENTION_TARGET in texts[n] for n in runs] == [False, False, True]
    assert [cpu_matmul.TARGET in texts[n] for n in runs] == [False, True, True]
    logits = {name: np.asarray(jax.jit(lambda p, b=b, pl=pl: run(b, p, pl))(b.params)) for name, (b, pl) in runs.items()}
    for name in ("xla packed", "cpu kernels"):
        np.testing.assert_allclose(logits[name], logits["xla"], rtol=1e-4, atol=1e-4, err_msg=name)


def test_step_functions_take_the_plan():
    """prefill, a speculative step (its two phases) and a plain step under XLA_PLAN and
    under the plan a CPU table resolves (packed weights, the prefix-attention kernel):
    the same tokens and accept lengths."""
    from eagle_jax.models.llama import BoundModules
    from eagle_jax.spec.config import SpeculativeConfig
    from eagle_jax.spec.sampling import SamplingArrays, SamplingParams
    from eagle_jax.spec.steps import new_state, plain_step_impl, prefill_impl, speculative_step_impl

    target, draft = _tiny()
    cfg = SpeculativeConfig(num_steps=2, topk=2, num_draft_tokens=4)
    b = 2
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(3, 256, (b, 8)), jnp.int32)
    lengths = jnp.asarray([8, 5], jnp.int32)
    samp = SamplingArrays.build([SamplingParams()] * b, b)
    plan = resolve_plan(backend="cpu")
    outs = {}
    for name, pl in (("xla", XLA_PLAN), ("resolved", plan)):
        bound = BoundModules(target, draft, pack=pl.matmul == "packed")

        @jax.jit
        def run(params, pl=pl, bound=bound):
            t, d = bound.modules(params)
            st, first = prefill_impl(t, d, new_state(t, d, cfg, b, 48), tokens, lengths, samp, greedy_only=True, plan=pl)
            st, out, acc, _ = speculative_step_impl(t, d, st, samp, cfg=cfg, greedy_only=True, max_seq_len=40, plan=pl)
            st, nxt, _, _ = plain_step_impl(t, d, st, samp, greedy_only=True, max_seq_len=40, plan=pl)
            return first, out, acc, nxt, st.seq_lens

        outs[name] = [np.asarray(x) for x in run(bound.params)]
    for a, r in zip(outs["xla"], outs["resolved"]):
        np.testing.assert_array_equal(a, r)
