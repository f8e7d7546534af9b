"""The packed-weight CPU matmul (eagle_jax/kernels/cpu_matmul.cc through the XLA FFI).

It must build here (the machine has a C++ compiler; a failed build is a test failure,
not a skip), agree with XLA's dot, give each row the same bits whatever the other rows
in the call, and leave a model's outputs unchanged when a step table binds packed
weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.kernels import cpu_matmul
from eagle_jax.errors import ConfigError


def x86_flags() -> set[str] | None:
    """The CPU's x86 feature flags (/proc/cpuinfo), or None off x86 or without the file."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    line = next((l for l in lines if l.startswith("flags")), None)
    return set(line.split(":", 1)[-1].split()) if line is not None else None


def test_builds_and_reports():
    use, line = cpu_matmul.status("cpu")
    assert use, line
    assert "packed-weight CPU kernel" in line
    assert cpu_matmul.panel_width() in (16, 64)
    flags = x86_flags()
    if flags is not None and cpu_matmul.march() == "native":  # the code path is the best one this x86 CPU has
        isa = "AVX-512" if "avx512f" in flags else "AVX2" if {"avx2", "fma"} <= flags else "generic vectors"
        assert f"({isa}, " in line, line
    assert cpu_matmul.status("gpu") == (False, "XLA dot (gpu)")


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 13, 16, 33, 200])
def test_matches_xla_dot(rows):
    nb = cpu_matmul.panel_width()
    rng = np.random.default_rng(rows)
    k, n = 96, 3 * nb
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    wp = cpu_matmul.pack(w)
    assert wp.shape == (3, k, nb)
    np.testing.assert_array_equal(np.asarray(cpu_matmul.unpack(wp)), w)
    got = np.asarray(jax.jit(cpu_matmul.packed_matmul)(jnp.asarray(x), wp))
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 64])
def test_bfloat16_panels_match_the_same_math_in_jnp(rows):
    """bfloat16 panels (``pack_params(dtype="bfloat16")``): the float32 product of the
    rounded weights, widened exactly in registers: a jnp reference of that math, to
    float32 rounding (the sum's order differs)."""
    nb = cpu_matmul.panel_width()
    rng = np.random.default_rng(100 + rows)
    k, n = 200, 3 * nb
    w = jnp.asarray(rng.standard_normal((k, n)).astype(np.float32)).astype(jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
    wp = cpu_matmul.pack(w)
    assert wp.dtype == jnp.bfloat16 and wp.shape == (3, k, nb)
    got = np.asarray(jax.jit(cpu_matmul.packed_matmul)(x, wp))
    assert got.dtype == np.float32
    want = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    # Not the float32 weights' product: the weights were rounded (a check that the
    # bfloat16 bits were read as such, not reinterpreted).
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert np.max(np.abs(got - exact)) < 1e-3


def test_pack_params_in_bfloat16_keeps_activations_float32():
    """A float32 model bound with bfloat16 panels: the kernels are bfloat16, the product
    returns float32, and the logits are within bfloat16 weight rounding of float32's."""
    from eagle_jax.models.config import ModelConfig
    from eagle_jax.models.llama import BoundModules, KVCache, LlamaModel, causal_mask

    cfg = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64)
    target = LlamaModel(cfg)
    f32, bf16 = BoundModules(target, pack=True), BoundModules(target, pack=True, pack_dtype="bfloat16")
    assert bf16.packed == f32.packed > 0
    assert {p.dtype for p in bf16.params[0] if p.ndim == 3} == {jnp.dtype(jnp.bfloat16)}
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 9)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(9), (1, 9))

    def run(bound):
        @jax.jit
        def f(params):
            (t,) = bound.modules(params)
            h, _, _ = t(tokens, pos, KVCache.zeros(cfg, 1, 16), pos, causal_mask(pos, 16))
            return h, t.logits(h)
        return [np.asarray(a) for a in f(bound.params)]

    (_, l32), (h16, l16) = run(f32), run(bf16)
    assert h16.dtype == np.float32
    assert 0 < np.max(np.abs(l16 - l32)) < 0.05 * np.max(np.abs(l32))


def test_rows_independent_of_the_call_and_leading_dims():
    """A verify forward's rows get the bits a one-row plain step would give them."""
    nb = cpu_matmul.panel_width()
    rng = np.random.default_rng(0)
    w = cpu_matmul.pack(rng.standard_normal((576, 4 * nb)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((2, 9, 576)).astype(np.float32))
    f = jax.jit(cpu_matmul.packed_matmul)
    many = np.asarray(f(x, w))
    assert many.shape == (2, 9, 4 * nb)
    for b in range(2):
        for t in range(9):
            np.testing.assert_array_equal(np.asarray(f(x[b, t][None], w))[0], many[b, t])


def test_pack_refuses_what_does_not_fit():
    nb = cpu_matmul.panel_width()
    with pytest.raises(ConfigError, match="cannot pack"):
        cpu_matmul.pack(np.zeros((8, nb + 1), np.float32))
    assert not cpu_matmul.packable(np.zeros((8, nb + 1), np.float32))
    assert not cpu_matmul.packable(jnp.zeros((8, nb), jnp.bfloat16))


def test_a_missing_kernel_source_falls_back_to_xla_and_says_why(monkeypatch, tmp_path):
    """An install without one of the sources (a wheel built without it) runs XLA's dot;
    the start-up line's matrix-product part names the missing file. No crash. (In the
    default mode: EAGLE_JAX_CPU_MATMUL=packed, which the code-path runs set, asks for the
    kernel and refuses to run without it; test_a_missing_source_under_packed_mode_is_an_error.)"""
    monkeypatch.setenv("EAGLE_JAX_CPU_MATMUL", "auto")
    missing = tmp_path / "cpu_attention.cc"
    monkeypatch.setattr(cpu_matmul, "SOURCES", (cpu_matmul.SOURCE, missing))
    cpu_matmul._load.cache_clear()
    try:
        use, line = cpu_matmul.status("cpu")
    finally:
        monkeypatch.undo()
        cpu_matmul._load.cache_clear()  # the real build again (cached on disk) for the tests after this one
    assert not use
    assert line.startswith("XLA dot (packed kernel unavailable: kernel source missing") and "cpu_attention.cc" in line, line


def test_a_missing_source_under_packed_mode_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE_JAX_CPU_MATMUL", "packed")
    monkeypatch.setattr(cpu_matmul, "SOURCES", (cpu_matmul.SOURCE, tmp_path / "cpu_attention.cc"))
    cpu_matmul._load.cache_clear()
    try:
        with pytest.raises(ConfigError, match="EAGLE_JAX_CPU_MATMUL=packed, but the kernel is unavailable: kernel source missing"):
            cpu_matmul.status("cpu")
    finally:
        monkeypatch.undo()
        cpu_matmul._load.cache_clear()


def test_mode_env(monkeypatch):
    monkeypatch.setenv("EAGLE_JAX_CPU_MATMUL", "xla")
    assert cpu_matmul.status("cpu") == (False, "XLA dot (EAGLE_JAX_CPU_MATMUL=xla)")
    monkeypatch.setenv("EAGLE_JAX_CPU_MATMUL", "fast")
    with pytest.raises(ConfigError, match="must be one of"):
        cpu_matmul.status("cpu")


def test_packed_model_matches_unpacked():
    """Every Linear kernel and both heads packed: the target's logits and the draft's
    are those of the unpacked modules."""
    from eagle_jax.checkpoint.draft_io import random_draft
    from eagle_jax.models.config import ModelConfig
    from eagle_jax.models.llama import BoundModules, KVCache, LlamaModel, causal_mask

    cfg = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      tie_word_embeddings=True)
    target = LlamaModel(cfg)
    draft = random_draft(cfg, seed=0, draft_vocab_size=128)
    plain, packed = BoundModules(target, draft), BoundModules(target, draft, pack=True)
    assert packed.packed > 0 and plain.packed == 0
    assert any(p.ndim == 3 for p in packed.params[0])
    # A second binding of the same modules reuses the packed arrays instead of packing again.
    again = BoundModules(target, draft, pack=True)
    assert all(a is b for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(packed.params)))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 7)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))

    @jax.jit
    def run(params):
        t, d = bound.modules(params)
        h, _, _ = t(tokens, pos, KVCache.zeros(cfg, 2, 16), pos, causal_mask(pos, 16))
        return t.logits(h), d.logits(h[..., : d.config.hidden_size])

    bound = plain
    want = [np.asarray(a) for a in run(plain.params)]
    bound = packed
    got = [np.asarray(a) for a in run(packed.params)]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_every_code_path_passes_the_kernel_tests(march, tmp_path):
    """The AVX2 build (``haswell``) and the generic-vector build (``x86-64``) of both
    kernels pass this file's and the attention kernel's tests: a CPU of each kind runs
    code this machine has checked, not only the path ``-march=native`` picks here."""
    flags = x86_flags()
    if flags is None:
        pytest.skip("haswell and x86-64 are x86 builds; this CPU is not x86 (no flags line in /proc/cpuinfo)")
    if march == "haswell" and not {"avx2", "fma"} <= flags:
        pytest.fail("this CPU cannot run the AVX2 build; the test needs one that can")
    here = Path(__file__).parent
    env = {**os.environ, "EAGLE_JAX_CPU_MARCH": march, "EAGLE_JAX_CACHE": str(tmp_path), "EAGLE_JAX_CPU_MATMUL": "packed"}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
         str(here / "test_cpu_matmul.py"), str(here / "test_cpu_attention.py")],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and "skipped" not in res.stdout, res.stdout[-2000:]
    want = {"haswell": "(AVX2, 16-column panels)", "x86-64": "(generic vectors, 16-column panels)"}[march]
    code = "from eagle_jax.kernels import cpu_matmul; print(cpu_matmul.status('cpu')[1])"
    line = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300).stdout
    assert want in line, line


def test_march_env_is_checked(monkeypatch):
    monkeypatch.setenv("EAGLE_JAX_CPU_MARCH", "native; rm -rf /")
    with pytest.raises(ConfigError, match="EAGLE_JAX_CPU_MARCH"):
        cpu_matmul.march()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_layer_of_stacked_panels_gives_that_layers_bits(dtype):
    """``packed_matmul(x, LayerOf(stack, i))`` reads layer i of ``[L, P, K, nb]`` panels in
    place (the stacked target's loop body): the same bits as the layer's own panels,
    for every layer, with the index traced."""
    nb = cpu_matmul.panel_width()
    rng = np.random.default_rng(3)
    ws = rng.standard_normal((4, 96, 3 * nb)).astype(np.float32)
    stack = cpu_matmul.pack(jnp.asarray(ws).astype(dtype))
    assert stack.shape == (4, 3, 96, nb)
    np.testing.assert_array_equal(np.asarray(cpu_matmul.unpack(stack)), np.asarray(jnp.asarray(ws).astype(dtype)))
    x = jnp.asarray(rng.standard_normal((5, 96)).astype(np.float32))
    f = jax.jit(lambda x, s, i: cpu_matmul.packed_matmul(x, cpu_matmul.LayerOf(s, i)))
    for i in range(4):
        want = cpu_matmul.packed_matmul(x, cpu_matmul.pack(jnp.asarray(ws[i]).astype(dtype)))
        np.testing.assert_array_equal(np.asarray(f(x, stack, jnp.int32(i))), np.asarray(want))
    # matmul() takes a LayerOf of packed panels to the kernel and slices an unpacked stack.
    np.testing.assert_array_equal(np.asarray(cpu_matmul.matmul(x, cpu_matmul.LayerOf(stack, jnp.int32(2)))),
                                  np.asarray(f(x, stack, jnp.int32(2))))
    plain = jnp.asarray(ws)
    np.testing.assert_array_equal(np.asarray(cpu_matmul.matmul(x, cpu_matmul.LayerOf(plain, jnp.int32(1)))),
                                  np.asarray(x @ plain[1]))


def test_a_layer_out_of_range_is_an_error_not_a_read_past_the_stack():
    nb = cpu_matmul.panel_width()
    stack = cpu_matmul.pack(jnp.zeros((2, 8, nb)))
    with pytest.raises(Exception, match="layer out of range"):
        jax.block_until_ready(cpu_matmul.packed_matmul(jnp.ones((1, 8)), cpu_matmul.LayerOf(stack, jnp.int32(2))))
