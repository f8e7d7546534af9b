"""Two processes on loopback (JAX's multi-controller runtime, gloo collectives on CPU),
each with 2 simulated CPU devices: the engine's greedy output on meshes spanning both
processes equals the single-process run, token for token (``distributed_worker.py``).
Plus the argument checks of ``sharding.initialize_distributed``, in this process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from eagle_jax.errors import ConfigError
from eagle_jax.runtime.sharding import DISTRIBUTED_ENV, initialize_distributed

WORKER = Path(__file__).with_name("distributed_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}
    return {**env, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2", **extra}


@pytest.mark.slow
def test_two_processes_decode_like_one(tmp_path):
    port = _free_port()
    procs = []
    for i in range(2):
        env = _env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i))
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(tmp_path / f"p{i}.json")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    ref = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "ref.json")], env=_env(JAX_NUM_CPU_DEVICES="1"),
                         capture_output=True, text=True, timeout=900)
    assert ref.returncode == 0, ref.stderr[-4000:]
    for p in procs:
        try:
            _, err = p.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-4000:]
    reference = json.loads((tmp_path / "ref.json").read_text())
    assert reference["distributed"] is None and reference["processes"] == 1
    want = reference["runs"]["1x1 plain"]["tokens"]
    assert len({tuple(t) for t in want}) > 1 and all(len(t) == 10 for t in want)
    for mode in ("chain", "tree"):
        assert reference["runs"][f"1x1 {mode}"]["tokens"] == want  # lossless on one device
    members = [json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2)]
    for i, m in enumerate(members):
        assert (m["process"], m["processes"], m["devices"], m["local_devices"]) == (i, 2, 4, 2), m["distributed"]
        assert f"process {i} of 2" in m["distributed"]
        assert set(m["runs"]) == {f"{d}x{k} {mode}" for d, k in ((1, 4), (2, 2)) for mode in ("plain", "chain", "tree")}
        for name, run in m["runs"].items():
            assert run["tokens"] == want, (i, name)
            assert f"(process {i} of 2; tokens read back replicated)" in run["describe"], run["describe"]
        # The speculative runs accepted the same way in both processes.
        assert m["runs"]["1x4 tree"]["accept_lengths"] == members[0]["runs"]["1x4 tree"]["accept_lengths"]
        assert "decides from measured step times" in (m["auto_error"] or ""), m["auto_error"]


def test_no_distributed_settings_is_a_single_process(monkeypatch):
    for k in DISTRIBUTED_ENV:
        monkeypatch.delenv(k, raising=False)
    assert initialize_distributed() is None


@pytest.mark.parametrize("kwargs, env, match", [
    (dict(coordinator="127.0.0.1:1234"), {}, "number of processes, process id missing"),
    (dict(num_processes=2, process_id=0), {}, "coordinator address missing"),
    ({}, {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"}, "process id missing"),
    (dict(coordinator="h:1", num_processes=2, process_id=2), {}, "process id 2 of 2 processes"),
    ({}, {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"}, "must be integers"),
])
def test_incomplete_distributed_settings_are_clear_errors(monkeypatch, kwargs, env, match):
    for k in DISTRIBUTED_ENV:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match=match):
        initialize_distributed(**kwargs)
