"""The multi-device checks of ``test_sharding.py``, run in a subprocess of 8 simulated CPU
devices (the device count is fixed when JAX starts): ``python tests/sharding_worker.py``
with ``JAX_NUM_CPU_DEVICES=8``. Prints one JSON object on its last line of stdout.

On a small random Llama target (8 heads, 4 KV heads, MLP 128, vocabulary 256) and a
random draft: greedy tokens per mesh and mode (plain, chain, tree), the shardings of the
placed parameters and state, the collectives of the compiled plain target step, and the
errors for meshes that cannot work.
"""

from __future__ import annotations

import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.checkpoint.draft_io import random_draft
from eagle_jax.models.config import ModelConfig
from eagle_jax.serving.engine import Engine, EngineConfig
from eagle_jax.errors import ConfigError
from eagle_jax.models.llama import LlamaModel
from eagle_jax.serving.policy import FixedPolicy
from eagle_jax.runtime.step_table import StepTable
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.runtime.sharding import make_mesh
from eagle_jax.spec.config import SpeculativeConfig

MESHES = [(1, 1), (1, 8), (2, 4), (8, 1)]
CHAIN = SpeculativeConfig(num_steps=3)
TREE = SpeculativeConfig(num_steps=3, topk=2, num_draft_tokens=6)
NEW_TOKENS = 10


def tiny_target(heads=8, kv_heads=4, seed=0) -> LlamaModel:
    cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8,
                      attention_bias=True, max_position_embeddings=128)
    return LlamaModel(cfg, rngs=nnx.Rngs(seed))


def spec(x) -> list:
    """A sharding's PartitionSpec as a list, trailing replicated dims dropped."""
    p = list(x.sharding.spec)
    while p and p[-1] is None:
        p.pop()
    return p


# One batch bucket of 8: split over data=2 and data=8; the prefill batch of 1 (always
# compiled) is not a multiple of data, so its rows run replicated over data.
ENGINE_BASE = dict(max_batch=8, batch_buckets=(8,), max_seq_len=32, prompt_buckets=(16,), sampled_steps=False)


def engine_inputs() -> tuple:
    """(target, draft, prompts, sampling params) of the engine checks (8 prompts)."""
    target = tiny_target()
    draft = random_draft(target.config, seed=1, draft_vocab_size=64)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (3, 5, 7, 9, 11, 13, 14, 6)]
    return target, draft, prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)


def decode(target, draft, prompts, params, mesh, shape, **config) -> dict:
    """Greedy tokens, accept lengths and the start-up line of one engine run (``shape``
    None: plain, no draft; else ``FixedPolicy(shape)``), config fields over ``ENGINE_BASE``."""
    cfg = EngineConfig(speculative=shape, mesh=mesh, **{**ENGINE_BASE, **config})
    engine = Engine(target, None if shape is None else draft, cfg,
                    policy=None if shape is None else FixedPolicy(shape), progress=False)
    done = engine.generate(prompts, params)
    return {"tokens": [c.token_ids for c in done], "accept_lengths": [c.accept_lengths for c in done],
            "describe": engine.description, "engine": engine}


MODES = (("plain", None), ("chain", CHAIN), ("tree", TREE))


def engines() -> dict:
    """Greedy tokens of every mesh and mode (plain, chain, tree), through the engine."""
    target, draft, prompts, params = engine_inputs()
    runs = {}
    for mesh in MESHES:
        for mode, shape in MODES:
            if mesh == (8, 1) and mode == "chain":  # rows over data alone: plain and the tree suffice
                continue
            r = decode(target, draft, prompts, params, mesh, shape)
            r.pop("engine")
            runs[f"{mesh[0]}x{mesh[1]} {mode}"] = r
    # The draft split over model like the target (draft_sharding="model"): the tree on
    # model=8, the chain on data=2 x model=4 (each engine costs the slow suite ~20 s).
    for mesh, (mode, shape) in (((1, 8), MODES[2]), ((2, 4), MODES[1])):
        r = decode(target, draft, prompts, params, mesh, shape, draft_sharding="model")
        r["draft_specs"] = sorted({str(spec(x)) for x in r.pop("engine").table.params[1]})
        runs[f"{mesh[0]}x{mesh[1]} {mode} draft-split"] = r
    return {"runs": runs}


EXPERT_MESHES = [(1, 1, 1), (1, 8, 1), (1, 4, 2), (2, 2, 2)]


def tiny_moe_target(int4: bool, seed=0):
    """A random DeepSeek-V3 target (MLA, one dense layer, 8 routed experts, top-2 of 2
    groups); with ``int4`` its experts are random INT4 packs."""
    from eagle_jax.models.deepseek import DeepseekV3Config, DeepseekV3Model
    from eagle_jax.models.quant import QuantConfig

    cfg = DeepseekV3Config(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                           num_hidden_layers=3, num_attention_heads=4, kv_lora_rank=16, q_lora_rank=24,
                           qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                           n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=2,
                           first_k_dense_replace=1, routed_scaling_factor=2.0, max_position_embeddings=128,
                           quant=QuantConfig(group_size=32) if int4 else None, int4_moe_layers=(1, 2) if int4 else ())
    model = DeepseekV3Model(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for layer in model.layers[1:]:
        moe = layer.mlp
        moe.gate_weight.set_value(jnp.asarray(rng.normal(0, 0.5, moe.gate_weight.shape), jnp.float32))
        if int4:
            for name in ("gate", "up", "down"):
                p = getattr(moe, f"experts_{name}_packed")
                p.set_value(jnp.asarray(rng.integers(-2**31, 2**31, p.shape, dtype=np.int64).astype(np.int32)))
                sc = getattr(moe, f"experts_{name}_scale")
                sc.set_value(jnp.asarray(rng.uniform(0.001, 0.01, sc.shape), jnp.float32))
    return model


def experts() -> dict:
    """Expert parallelism: greedy tokens of a MoE target per mesh (plain, chain, tree;
    float and INT4 experts), the experts' placed sharding, the plain step's all-reduces."""
    out: dict = {"runs": {}, "shardings": {}, "hlo": {}, "errors": {}}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 96, size=n).tolist() for n in (3, 5, 7, 9)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    base = dict(max_batch=4, batch_buckets=(4,), max_seq_len=32, prompt_buckets=(16,), sampled_steps=False)
    for int4 in (False, True):
        target = tiny_moe_target(int4)
        draft = random_draft(target.config, seed=1, draft_vocab_size=32)
        for mesh in EXPERT_MESHES:
            for mode, shape in (("plain", None), ("chain", CHAIN), ("tree", TREE)):
                # Each engine costs the slow suite ~25 s: the tree on one device and the
                # widest mix (data, expert and model), INT4 experts on one device and
                # expert x model.
                if mode == "tree" and (int4 or mesh not in ((1, 1, 1), (2, 2, 2))):
                    continue
                if int4 and mesh not in ((1, 1, 1), (1, 4, 2)):
                    continue
                cfg = EngineConfig(speculative=shape, mesh=mesh, **base)
                engine = Engine(target, None if shape is None else draft, cfg,
                                policy=None if shape is None else FixedPolicy(shape), progress=False)
                done = engine.generate(prompts, params)
                out["runs"][f"{'int4' if int4 else 'f32'} {'x'.join(map(str, mesh))} {mode}"] = {
                    "tokens": [c.token_ids for c in done], "describe": engine.description}
        for mesh in [(1, 4, 1), (1, 4, 2), (2, 2, 2)]:
            t = StepTable(target, None, shapes=(), batch_buckets=(2,), prompt_buckets=(), max_seq_len=32,
                          sampled=False, mesh=make_mesh(mesh))
            t.build()
            key = f"{'int4' if int4 else 'f32'} {'x'.join(map(str, mesh))}"
            out["shardings"][key] = {k: spec(v) for k, v in zip(_paths(target), t.params[0]) if "experts" in k}
            text = t._get(("step", 2, None, True)).as_text()
            out["hlo"][key] = [m.group(1) for m in re.finditer(r"all-reduce(?:-start)?\(.*?replica_groups=(\S+)", text)]
    for key, fn in {
        "experts do not divide": lambda: Engine(tiny_moe_target(False), None, EngineConfig(speculative=None, mesh=(1, 3, 1), **base),
                                                progress=False),
        "no experts": lambda: Engine(tiny_target(), None, EngineConfig(speculative=None, mesh=(1, 2, 1), **base), progress=False),
    }.items():
        try:
            fn()
            out["errors"][key] = None
        except ConfigError as e:
            out["errors"][key] = str(e)
    return out


def tables() -> dict:
    """Placed shardings, the plain step's collectives, and the clear errors."""
    target = tiny_target()
    draft = random_draft(target.config, seed=1, draft_vocab_size=64)
    out: dict = {"shardings": {}, "hlo": {}, "errors": {}}
    for mesh in [(1, 8), (2, 4)]:
        t = StepTable(target, draft, shapes=(CHAIN,), batch_buckets=(8,), prompt_buckets=(), max_seq_len=32,
                      sampled=False, mesh=make_mesh(mesh))
        t.build()
        state = t.zeros(8)
        state, _, _, _ = t.step(state, t.sampling([SamplingParams()] * 8, 8), CHAIN, True)
        out["shardings"][f"{mesh[0]}x{mesh[1]}"] = {
            "target": {k: spec(v) for k, v in zip(_paths(target), t.params[0])},
            "draft": {k: spec(v) for k, v in zip(_paths(draft), t.params[1])},
            "target_cache": spec(state.target_cache.k[0]),
            "draft_cache": spec(state.draft_cache.k[0]),
            "seq_lens": spec(state.seq_lens),
            "draft_hidden": spec(state.draft_hidden),
            "kernel_impl": t.kernel_impl,
            "kernel_path": t.plan.kernel_path,
        }
    # The compiled plain step of the target alone (no draft extend): its collectives.
    for mesh in [(1, 8), (2, 4), (1, 1)]:
        t = StepTable(target, None, shapes=(), batch_buckets=(2,), prompt_buckets=(), max_seq_len=32,
                      sampled=False, mesh=make_mesh(mesh))
        t.build()
        text = t._get(("step", 2, None, True)).as_text()
        ops = {op: [m.group(1) for m in re.finditer(rf"= (\S+|\(.*?\)) {op}(?:-start)?\(.*?replica_groups=(\S+)", text)]
               for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")}
        out["hlo"][f"{mesh[0]}x{mesh[1]}"] = {
            "counts": {op: len(v) for op, v in ops.items()},
            "all-reduce": [(m.group(1), m.group(2)) for m in re.finditer(r"= (\S+|\(.*?\)) all-reduce\(.*?replica_groups=(\S+ \S+|\S+)", text)],
            "custom_call_targets": sorted(set(re.findall(r'custom_call_target="([^"]+)"', text))),
            "matmul_path": t.plan.matmul_path,
        }
    base = dict(max_batch=2, max_seq_len=32, prompt_buckets=(16,), sampled_steps=False)
    for key, fn in {
        "too many devices": lambda: make_mesh((4, 4)),
        "heads do not divide": lambda: Engine(tiny_target(heads=6, kv_heads=2), None,
                                              EngineConfig(speculative=None, mesh=(1, 4), **base), progress=False),
    }.items():
        try:
            fn()
            out["errors"][key] = None
        except ConfigError as e:
            out["errors"][key] = str(e)
    return out


def sliced() -> dict:
    """A multi-file Hugging Face checkpoint loaded straight onto meshes: parameter values
    and shardings, the host memory the load stages (tracemalloc: numpy and safetensors
    allocations, not the device buffers), and greedy output of an engine given the path."""
    import tempfile
    import tracemalloc
    from pathlib import Path

    import torch
    import transformers
    from safetensors import safe_open

    from eagle_jax.checkpoint.hf import load_model, safetensors_files

    cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                                   max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    out = {}
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d, safe_serialization=True, max_shard_size="3MB")
        sys.path.insert(0, str(Path(__file__).parent))
        from hf_factories import write_word_tokenizer

        write_word_tokenizer(Path(d), cfg.vocab_size)  # the engine given a path reads its tokenizer
        files = safetensors_files(Path(d))
        out["files"] = len(set(files.values()))
        sizes = {}
        for f in set(files.values()):
            with safe_open(f, framework="numpy") as h:
                for n in h.keys():
                    sizes[n] = int(np.prod(h.get_slice(n).get_shape())) * 4
        out["checkpoint_bytes"] = sum(sizes.values())
        out["largest_tensor_bytes"] = max(sizes.values())
        # tracemalloc sees safetensors' host reads: a full read peaks at the checkpoint.
        tracemalloc.start()
        held = []
        for f in sorted(set(files.values())):
            with safe_open(f, framework="numpy") as h:
                held += [h.get_tensor(n) for n in h.keys()]
        out["full_read_peak_bytes"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        del held
        full = load_model(d)
        want = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(full, nnx.Param))}
        out["meshes"] = {}
        for shape in ((1, 8), (2, 4)):
            mesh = make_mesh(shape)
            load_model(d, mesh=mesh)  # first: compiles and imports, not what a load stages
            tracemalloc.start()
            model = load_model(d, mesh=mesh)
            # On CPU devices a device buffer may alias the numpy block it was made from, so
            # what stays traced after the load is the devices' memory; the staging is the
            # peak above it.
            live, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            got = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
            equal = all(np.array_equal(np.asarray(got[p][...]), w) for p, w in want.items())
            specs = {".".join(map(str, p)): spec(got[p][...]) for p in got
                     if p[-1] in ("kernel", "embedding", "weight") or p == ("lm_head",) or p == ("embed_tokens",)}
            out["meshes"][f"{shape[0]}x{shape[1]}"] = {"peak_bytes": peak, "live_bytes": live, "equal": equal, "specs": specs}
        # The engine given the path loads sliced and decodes like one device.
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, 2048, size=n).tolist() for n in (3, 7)]
        params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        base = dict(max_batch=2, max_seq_len=32, prompt_buckets=(16,), speculative=None)
        one = Engine(full, None, EngineConfig(**base), progress=False).generate(prompts, params)
        tp = Engine(d, None, EngineConfig(mesh=(1, 8), **base), progress=False)
        out["engine_equal"] = [c.token_ids for c in tp.generate(prompts, params)] == [c.token_ids for c in one]
        out["engine_param_specs"] = sorted({str(spec(a)) for a in jax.tree.leaves(tp.table.params[0])})
    return out


# (mesh, query heads, KV heads): KV heads split over model, sliced per device from a
# replicated cache (one KV head per device; two devices per KV head), and neither fitting.
ATTENTION_CASES = [((2, 4), 8, 4), ((1, 8), 8, 4), ((1, 4), 8, 2), ((1, 4), 12, 3), ((1, 1), 8, 4)]


def kernels() -> dict:
    """The Pallas kernels under a mesh (eagle_jax.kernels.sharded) on CPU: tree attention
    split per device for each ``ATTENTION_CASES`` case beside the unsharded attention (max
    abs difference, and how the KV heads were split); and greedy tokens of the engine with
    ``kernel_impl="kernel"`` (the interpreted verify kernel inside the steps) per mesh."""
    from pallas_kernels.testing import random_trees
    from pallas_kernels.tree import tree_ancestor_mask
    from pallas_kernels.tree_attention import tree_attention_reference

    from eagle_jax.kernels.sharded import kv_slice, shard_tree_attention

    out: dict = {"attention": {}, "runs": {}}
    b, t, d, s = 4, 6, 64, 128
    parents = random_trees(np.random.default_rng(0), b, t, max_depth=3, vocab=16, pad_prob=0.0).parents
    mask = tree_ancestor_mask(jnp.asarray(parents))
    seq = jnp.asarray([5, 40, 64, 100], jnp.int32)
    for mesh, hq, hkv in ATTENTION_CASES:
        key = jax.random.split(jax.random.PRNGKey(hq * 10 + hkv), 3)
        q = jax.random.normal(key[0], (b, t, hq, d)).astype(jnp.bfloat16)
        k = jax.random.normal(key[1], (b, s, hkv, d)).astype(jnp.bfloat16)
        v = jax.random.normal(key[2], (b, s, hkv, d)).astype(jnp.bfloat16)
        want = tree_attention_reference(q, k, v, seq, mask, scale=d ** -0.5)
        m = make_mesh(mesh)
        # The reference inside shard_map: the kernel itself is checked alone, interpreted, in
        # tests/kernels/test_tree_attention.py; Mosaic GPU's interpreter keeps one shared
        # memory for every device of a process and fails when 8 run it at once.
        f = jax.jit(lambda *a: shard_tree_attention(*a, scale=d ** -0.5, impl="reference", mesh=m))
        with jax.set_mesh(m):
            text = f.lower(q, k, v, seq, mask).as_text()
            got = f(q, k, v, seq, mask)
        out["attention"][f"{mesh[0]}x{mesh[1]} {hq}/{hkv}"] = {
            "max_abs_diff": float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)))),
            "split": kv_slice(hq, hkv, mesh[1]) if mesh[1] > 1 else None,
            "shard_map": "shard_map" in text or "manual" in text,
        }
    target, draft, prompts, _ = engine_inputs()
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    small = dict(max_batch=4, batch_buckets=(4,), max_seq_len=24)
    for mesh, impl in (((1, 1), "reference"), ((2, 4), "kernel"), ((1, 8), "kernel")):
        for mode, shape in MODES[1:]:
            r = decode(target, draft, prompts[:4], params, mesh, shape, kernel_impl=impl, **small)
            out["runs"][f"{mesh[0]}x{mesh[1]} {mode} {impl}"] = {"tokens": r["tokens"], "describe": r["describe"]}
    return out


def main() -> None:
    what = sys.argv[1]
    out = {"tables": tables, "engines": engines, "experts": experts, "sliced": sliced, "kernels": kernels}[what]()
    out["devices"] = len(jax.devices())
    print(json.dumps(out))


def _paths(module) -> list[str]:
    """Parameter paths of a module in the step table's flatten order."""
    _, state = nnx.split(module)
    pairs, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path) for path, _ in pairs]


if __name__ == "__main__":
    sys.exit(main())
