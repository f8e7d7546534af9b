"""Sharding over a (data, model) mesh: mesh strings and errors in this process; on 8
simulated CPU devices (a subprocess, ``sharding_worker.py``: the device count is fixed
when JAX starts) the placed shardings, the compiled step's collectives, the errors for
meshes a model cannot use, and greedy output of every mesh equal to one device's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from eagle_jax.serving.engine import EngineConfig
from eagle_jax.errors import ConfigError
from eagle_jax.runtime.sharding import make_mesh, parse_mesh

WORKER = Path(__file__).with_name("sharding_worker.py")
LAYERS = 4  # sharding_worker.tiny_target


def _worker(what: str, timeout: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8")
    r = subprocess.run([sys.executable, str(WORKER), what], capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["devices"] == 8  # the simulated devices took effect
    return out


@pytest.mark.parametrize("text, shape", [
    ("data=2,model=4", (2, 4)), ("model=4, data=2", (2, 4)), ("model=8", (1, 8)), ("data=1,model=1", (1, 1)),
    ("auto", "auto"), (" AUTO ", "auto"),
])
def test_mesh_strings(text, shape):
    assert parse_mesh(text) == shape
    assert EngineConfig(mesh=text).mesh == shape


@pytest.mark.parametrize("value", ["data=2,model=", "data=0,model=1", "rows=2", "data=2,data=2", (2,), (0, 1), "2x4"])
def test_bad_mesh_values_are_clear_errors(value):
    with pytest.raises(ConfigError, match="mesh"):
        EngineConfig(mesh=value)


def test_default_mesh_is_one_device():
    assert EngineConfig().mesh == (1, 1)
    mesh = make_mesh((1, 1))
    assert dict(mesh.shape) == {"data": 1, "expert": 1, "model": 1}


def test_more_devices_than_exist_is_a_clear_error():
    n = len(jax.devices())
    with pytest.raises(ConfigError, match=rf"needs {n + 1} devices; {n} (is|are) available"):
        make_mesh((1, n + 1))


@pytest.fixture(scope="module")
def tables():
    return _worker("tables", timeout=600)


def test_parameters_and_caches_are_sharded_as_the_rules_say(tables):
    for mesh, kv_split in (("1x8", False), ("2x4", True)):
        sh = tables["shardings"][mesh]
        t = sh["target"]
        kv = [None, "model"] if kv_split else []  # 4 KV heads: split over model=4, replicated over model=8
        for i in range(LAYERS):
            p = f"layers.{i}."
            assert t[p + "self_attn.q_proj.kernel"] == [None, "model"], mesh
            assert t[p + "self_attn.q_proj.bias"] == ["model"]
            assert t[p + "self_attn.k_proj.kernel"] == kv and t[p + "self_attn.v_proj.kernel"] == kv, mesh
            assert t[p + "self_attn.k_proj.bias"] == kv[1:]
            assert t[p + "self_attn.o_proj.kernel"] == ["model"]  # rows: the input heads
            assert t[p + "mlp.gate_proj.kernel"] == t[p + "mlp.up_proj.kernel"] == [None, "model"]
            assert t[p + "mlp.down_proj.kernel"] == ["model"]
            assert t[p + "input_layernorm.weight"] == t[p + "post_attention_layernorm.weight"] == []
        assert t["embed_tokens"] == ["model"] and t["lm_head"] == [None, "model"] and t["norm.weight"] == []
        assert all(v == [] for v in sh["draft"].values()), sh["draft"]  # the draft runs replicated
        # Caches [B, S, KV, D]: rows on data, KV heads on model where they divide it.
        assert sh["target_cache"] == (["data", None, "model"] if kv_split else ["data"])
        assert sh["draft_cache"] == ["data"] and sh["seq_lens"] == ["data"] and sh["draft_hidden"] == ["data"]
        assert sh["kernel_impl"] == "auto" and "Pallas kernels under shard_map over 8 devices" in sh["kernel_path"]


def test_the_plain_step_holds_the_tensor_parallel_collectives(tables):
    """Measured on the compiled plain step of the target alone, batch 2:

    - all-reduce of the ``[B, 1, H]`` hidden state over model: one per layer after
      o_proj and one after down_proj (row-split products), and one for the embedding
      lookup (the table is split by vocabulary: each shard looks up its own rows, zero
      elsewhere, and the sum joins them): 2 * layers + 1;
    - on data=2 one more all-reduce, of int32 scalars: the batch-wide longest prefix,
      the trip count of each layer's prefix-attention loop (one tuple for all layers);
    - all-gather: 2 for the greedy argmax over the vocabulary-split logits (each shard's
      best value and index), plus on model=8 two per layer of the new token's k and v:
      the 4 KV heads are replicated there (8 does not divide 4), and GSPMD computes them
      split by KV head to match the split queries, then gathers them for the replicated
      cache write (a sharding constraint could trade these for redundant projections);
    - no custom calls (the CPU FFI kernels are off under a mesh), which the one-device
      table has.
    """
    hlo = tables["hlo"]
    for mesh, data_reduce, kv_gathers in (("1x8", 0, 2 * LAYERS), ("2x4", 1, 0)):
        h = hlo[mesh]
        shapes = [s for s, _ in h["all-reduce"]]
        hidden = [s for s in shapes if s.startswith("f32[") and s.split("{")[0].endswith(",1,64]")]
        assert len(hidden) == 2 * LAYERS + 1, (mesh, shapes)
        assert len(shapes) - len(hidden) == data_reduce, (mesh, shapes)
        assert all("s32" in s for s in shapes if s not in hidden)
        assert h["counts"]["all-gather"] == 2 + kv_gathers, (mesh, h["counts"])
        assert h["counts"]["all-to-all"] == h["counts"]["collective-permute"] == h["counts"]["reduce-scatter"] == 0
        assert h["custom_call_targets"] == [], h
        assert "single-device" in h["matmul_path"]
    assert hlo["1x1"]["counts"] == {k: 0 for k in hlo["1x1"]["counts"]}


def test_meshes_the_model_cannot_use_are_clear_errors(tables):
    e = tables["errors"]
    assert e["too many devices"] == "mesh data=4,model=4 needs 16 devices; 8 are available (cpu)"
    # 6 heads on model=4; the sizes that divide heads, MLP width and vocabulary are named.
    assert "heads 6 is not a multiple of model=4" in e["heads do not divide"]
    assert e["heads do not divide"].endswith("model sizes it can use (dividing heads 6, mlp 128, vocab 256, up to the 8 devices): 1, 2")


@pytest.mark.slow
def test_every_mesh_decodes_like_one_device():
    """(1, 8), (2, 4), (8, 1) against (1, 1): greedy tokens of 8 prompts through the
    engine, plain and speculative (a chain and a tree; on (8, 1) plain and the tree),
    token for token."""
    runs = _worker("engines", timeout=1200)["runs"]
    reference = runs["1x1 plain"]["tokens"]
    assert all(len(t) == 10 for t in reference) and len({tuple(t) for t in reference}) > 1
    for name, r in runs.items():
        assert r["tokens"] == reference, name
        if not name.startswith("1x1"):
            assert "kernels auto (Pallas kernels under shard_map" in r["describe"] and "mesh data=" in r["describe"], \
                r["describe"]
    assert "KV heads: 4, replicated over model=8" in runs["1x8 plain"]["describe"]
    assert "KV heads: 4 split over model" in runs["2x4 chain"]["describe"]
    assert "draft replicated over model" in runs["2x4 tree"]["describe"]
    # draft_sharding="model": the same tokens (checked above), the draft's parameters split over model.
    assert {n for n in runs if n.endswith("draft-split")} == {"1x8 tree draft-split", "2x4 chain draft-split"}
    for name in ("1x8 tree draft-split", "2x4 chain draft-split"):
        r = runs[name]
        assert "draft split over model" in r["describe"], r["describe"]
        assert "['model']" in r["draft_specs"] and "[None, 'model']" in r["draft_specs"], r["draft_specs"]
    assert "batch rows split over data=8" in runs["8x1 plain"]["describe"]


@pytest.mark.slow
def test_the_pallas_kernels_run_under_shard_map_on_a_mesh():
    """Tree attention through shard_tree_attention's per-device split equals the unsharded
    attention for KV heads split over model, sliced per device from a replicated cache, and
    a head count that fits neither (the reference runs inside shard_map: Mosaic GPU's
    interpreter cannot run on 8 devices of one process at once; the kernel is checked
    alone in tests/kernels); the engine with the verify kernel inside its steps
    (kernel_impl="kernel", interpreted) decodes on (2, 4) and (1, 8) like one device."""
    out = _worker("kernels", timeout=1800)
    att = out["attention"]
    assert att["2x4 8/4"]["split"] == ["split", 0]
    assert att["1x8 8/4"]["split"] == ["slice", 1] and att["1x4 8/2"]["split"] == ["slice", 1]
    assert att["1x4 12/3"]["split"] is None  # 3 query heads per device, groups of 4: every head on every device
    assert att["1x1 8/4"]["split"] is None
    for name, a in att.items():
        assert a["max_abs_diff"] <= 2e-2, (name, a)  # bfloat16 outputs
        assert a["shard_map"] == (not name.startswith("1x1")), name
    runs = out["runs"]
    for mode in ("chain", "tree"):
        want = runs[f"1x1 {mode} reference"]["tokens"]
        assert all(len(t) == 6 for t in want)
        for mesh in ("2x4", "1x8"):
            r = runs[f"{mesh} {mode} kernel"]
            assert r["tokens"] == want, (mesh, mode)
            assert "kernels kernel (Pallas kernels under shard_map over 8 devices)" in r["describe"], r["describe"]


@pytest.mark.slow
def test_expert_parallel_moe_decodes_like_one_device():
    """A DeepSeek-V3 target with its routed experts split over the mesh's expert axis
    (float and INT4 experts): greedy tokens of every mesh, plain and speculative, equal
    one device's (float: plain and chain on every mesh, the tree on one device and
    2x2x2; INT4: plain and chain on one device and 1x4x2); the experts' parameters are placed on ``expert`` (and their MLP width
    on ``model``); each MoE layer adds one all-reduce; meshes that cannot work are named."""
    out = _worker("experts", timeout=1200)
    runs = out["runs"]
    for name, r in runs.items():
        kind = name.split()[0]
        assert r["tokens"] == runs[f"{kind} 1x1x1 plain"]["tokens"], name
    assert len({tuple(t) for t in runs["f32 1x1x1 plain"]["tokens"]}) > 1
    assert "routed experts: 8 split over expert=8 (1 per device)" in runs["f32 1x8x1 chain"]["describe"]
    assert {"f32 2x2x2 tree", "int4 1x4x2 chain", "int4 1x4x2 plain"} <= set(runs) and len(runs) == 14, sorted(runs)
    for key, specs in out["shardings"].items():
        assert specs and all(s[0] == "expert" for s in specs.values()), (key, specs)
        if key.startswith("f32"):
            assert specs["layers.1.mlp.experts_gate"] == ["expert", None, "model"]
            assert specs["layers.2.mlp.experts_down"] == ["expert", "model"]
        else:
            assert specs["layers.1.mlp.experts_up_packed"] == ["expert", "model"]
    # On expert=4 alone, the only collectives are one all-reduce over expert per MoE layer
    # (the router is replicated: routing needs none).
    moe_layers = 2
    for kind in ("f32", "int4"):
        groups = out["hlo"][f"{kind} 1x4x1"]
        assert len(groups) == moe_layers and all("'expert'=4" in g or "[1,4]<=[4]" in g for g in groups), groups
    e = out["errors"]
    assert "experts 8 is not a multiple of expert=3" in e["experts do not divide"]
    assert "expert=2 splits routed experts and this model has none" in e["no experts"]


@pytest.mark.slow
def test_a_sharded_load_reads_each_block_straight_into_its_shards():
    """A 5-file Hugging Face checkpoint (12 MB) loaded onto meshes (1, 8) and (2, 4): every
    parameter equals the plain load and carries the rules' sharding; the host memory the
    load stages beyond what ends on the devices stays below half of one tensor (traced by
    tracemalloc, which sees a full read of the files peak at the checkpoint's size); an
    engine given the path decodes like one device."""
    out = _worker("sliced", timeout=900)
    assert out["files"] == 5 and out["full_read_peak_bytes"] >= out["checkpoint_bytes"]
    for name, m in out["meshes"].items():
        assert m["equal"], name
        staged = m["peak_bytes"] - m["live_bytes"]
        assert staged <= out["largest_tensor_bytes"] / 2, (name, staged)
        s = m["specs"]
        assert s["layers.0.self_attn.q_proj.kernel"] == [None, "model"] and s["layers.1.self_attn.o_proj.kernel"] == ["model"]
        assert s["layers.0.mlp.down_proj.kernel"] == ["model"] and s["lm_head"] == [None, "model"]
        assert s["embed_tokens"] == ["model"] and s["norm.weight"] == []
    # 4 KV heads: replicated on model=8, split on model=4.
    assert out["meshes"]["1x8"]["specs"]["layers.0.self_attn.k_proj.kernel"] == []
    assert out["meshes"]["2x4"]["specs"]["layers.0.self_attn.k_proj.kernel"] == [None, "model"]
    assert out["engine_equal"] is True
    assert "[None, 'model']" in out["engine_param_specs"]
