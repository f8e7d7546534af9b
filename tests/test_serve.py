"""``eagle-jax serve`` run as a user runs it (a subprocess on 127.0.0.1), driven by the
official ``openai`` client and by raw HTTP for what that client cannot send: outputs
equal the offline engine's, token for token; disconnects cancel; bad input gets 400s;
overload gets 429s; a bounded load test; SIGTERM exits 0. Also the engine's thread-safe
inbox (``Engine.submit`` / ``cancel_soon`` / ``take_submitted``), in process.

Two servers on one tiny target (tests/hf_factories.write_tiny_eval_models, whose draft
agrees with the target on some steps): one with the draft (a fixed chain), one without.
Each offline reference engine is built from the same flags through the same code
(``cli.serve_engine``), so the server's start-up reads its graphs from the test
session's compilation cache."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from eagle_jax.cli import build_parser, serve_engine
from eagle_jax.errors import InputError
from eagle_jax.spec.sampling import SamplingParams
from hf_factories import write_tiny_eval_models

MODEL = "tiny"
# The draft server: long enough a context that a stream outlives a disconnect and SIGTERM.
DRAFT_FLAGS = ["--batch-size", "8", "--max-seq-len", "256", "--steps", "2", "--topk", "1", "--max-queue", "32"]
PLAIN_FLAGS = ["--batch-size", "2", "--max-seq-len", "64", "--no-speculation"]
PROMPTS = ["w5 w9 w13 w40", "w7 w8 w100", "w3", "w11 w12 w13 w14 w15 w16"]
START_TIMEOUT_S = 240  # start-up compiles (cold cache on a loaded 2-core machine)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return write_tiny_eval_models(tmp_path_factory.mktemp("serve_models"))


def _args(models, flags, draft: bool):
    extra = ["--draft", str(models["draft"])] if draft else []
    return build_parser().parse_args(["serve", "--model", str(models["target"]), *extra, *flags,
                                      "--served-model-name", MODEL])


class ServerProcess:
    """``python -m eagle_jax.cli serve`` on a free port of 127.0.0.1."""

    def __init__(self, models, flags, draft: bool, log_path: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        extra = ["--draft", str(models["draft"])] if draft else []
        cache = os.environ["EAGLE_JAX_TEST_JIT_CACHE"]  # conftest's: the offline engines' graphs
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache,
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
        self.log_path = log_path
        self.log = log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "eagle_jax.cli", "serve", "--model", str(models["target"]), *extra, *flags,
             "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{log_path.read_text()}")
            try:
                if self.get("/health")[0] == 200:
                    break
            except OSError:
                pass  # not listening yet
            assert time.monotonic() < deadline, f"server not up in {START_TIMEOUT_S} s:\n{log_path.read_text()}"
            time.sleep(0.5)
        self.base = f"http://127.0.0.1:{self.port}/v1"

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base, api_key="unused", max_retries=0, timeout=60, **kw)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base, api_key="unused", max_retries=0, timeout=60)

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"} if body is not None else {})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def get(self, path: str) -> tuple[int, bytes]:
        return self.request("GET", path)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {series{labels}: value}."""
        status, text = self.get("/metrics")
        assert status == 200
        out = {}
        for line in text.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def offline_draft(models):
    return serve_engine(_args(models, DRAFT_FLAGS, draft=True))


@pytest.fixture(scope="module")
def offline_plain(models):
    return serve_engine(_args(models, PLAIN_FLAGS, draft=False))


@pytest.fixture(scope="module")
def draft_server(models, offline_draft, tmp_path_factory):
    s = ServerProcess(models, DRAFT_FLAGS, True, tmp_path_factory.mktemp("logs") / "draft_server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain_server(models, offline_plain, tmp_path_factory):
    s = ServerProcess(models, PLAIN_FLAGS, False, tmp_path_factory.mktemp("logs") / "plain_server.log")
    yield s
    s.stop()


def _chat(text):
    return [{"role": "user", "content": text}]


def _greedy(n):
    return SamplingParams(temperature=0.0, max_new_tokens=n)


# -- the engine's inbox, in process


def test_engine_inbox_adds_refuses_and_cancels_from_another_thread(offline_plain):
    e = offline_plain
    added = {}
    threads = [threading.Thread(target=e.submit, args=([5, 6, 7], _greedy(40)),
                                kwargs=dict(request_id=f"t{i}", on_added=lambda rid, err: added.setdefault(rid, err)))
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    e.submit([5, 10_000], _greedy(4), request_id="bad", on_added=lambda rid, err: added.setdefault(rid, err))
    assert e.submissions_waiting() == 3
    assert e.take_submitted() == 3
    assert added["t0"] is None and added["t1"] is None
    assert isinstance(added["bad"], InputError) and "outside the vocabulary" in str(added["bad"])
    e.step()
    e.step()
    assert e.scheduler.live == 2
    e.cancel_soon("t0")
    e.cancel_soon("never-submitted")  # finished and popped before the cancel arrived: left alone
    assert e.take_submitted(timeout=1.0) == 2
    assert e.result("t0").finish_reason == "cancelled"
    e.step()  # the cancelled row is free after one step
    assert e.scheduler.live == 1
    e.run_until_done()
    done = {c.id: c for c in e.pop_finished()}
    assert done["t1"].finish_reason == "length" and len(done["t1"].token_ids) == 40
    assert sum(done["t1"].metrics.steps_by_shape.values()) >= 1
    with pytest.raises(InputError, match="request_id"):
        e.submit([5], _greedy(1), request_id=None, on_added=lambda *_: None)


def test_serve_takes_every_engine_flag_of_generate():
    p = build_parser()
    sub = next(a for a in p._actions if a.dest == "command").choices

    def options(name):
        return {o for a in sub[name]._actions for o in a.option_strings}

    generate_only = {"--prompt", "--prompt-file", "--chat", "--system", "--max-new-tokens", "--temperature", "--top-k",
                     "--top-p", "--seed", "--stop", "--output"}
    missing = options("generate") - generate_only - options("serve")
    assert not missing, f"serve lacks generate's engine flags {sorted(missing)}"


# -- greedy over HTTP equals the offline engine


@pytest.mark.parametrize("which", ["draft", "plain"])
def test_greedy_over_http_equals_offline(which, request):
    server = request.getfixturevalue(f"{which}_server")
    offline = request.getfixturevalue(f"offline_{which}")
    n = 24
    refs = offline.generate(PROMPTS, _greedy(n))
    chat_refs = offline.generate([_chat(p) for p in PROMPTS[:2]], _greedy(n))
    client = server.client()
    for prompt, ref in zip(PROMPTS, refs):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
        assert r.model_extra["eagle_jax"]["token_ids"] == ref.token_ids
        assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == len(ref.token_ids)
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == ref.text
        assert chunks[-1].choices[0].finish_reason == ref.finish_reason
        assert chunks[-1].model_extra["eagle_jax"]["token_ids"] == ref.token_ids
    for prompt, ref in zip(PROMPTS[:2], chat_refs):
        r = client.chat.completions.create(model=MODEL, messages=_chat(prompt), max_tokens=n, temperature=0)
        assert r.model_extra["eagle_jax"]["token_ids"] == ref.token_ids
        assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
        assert r.usage.total_tokens == len(ref.prompt_token_ids) + len(ref.token_ids)
        stream = client.chat.completions.create(model=MODEL, messages=_chat(prompt), max_tokens=n, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
        ext = chunks[-2].model_extra["eagle_jax"]
        assert ext["token_ids"] == ref.token_ids
        if which == "draft":  # the extension says what speculation did for this request
            assert ext["spec_steps"] == sum(ext["steps_by_shape"].values()) == len(ext["accept_lengths"]) > 0
            assert set(ext["steps_by_shape"]) == {"chain S=2"}
        else:
            assert ext["steps_by_shape"] == {"plain": ext["plain_steps"]} and ext["accept_lengths"] == []
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_16_concurrent_seeded_streams_equal_their_offline_runs(draft_server, offline_draft):
    settings = [dict(temperature=[0.0, 0.7, 1.0, 1.3][i % 4], top_p=[1.0, 0.9, 0.6][i % 3], top_k=[0, 5, 40][i % 3],
                     seed=1000 + i) for i in range(16)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    n = 30
    refs = offline_draft.generate(prompts, [
        SamplingParams(temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"], seed=s["seed"],
                       max_new_tokens=n) for s in settings])

    async def one(client, prompt, s):
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=n, temperature=s["temperature"], top_p=s["top_p"], seed=s["seed"],
            stream=True, extra_body={"top_k": s["top_k"]})
        chunks = [c async for c in stream]
        return "".join(c.choices[0].text for c in chunks), chunks[-1].model_extra["eagle_jax"]["token_ids"]

    async def run():
        async with draft_server.async_client() as client:
            return await asyncio.gather(*(one(client, p, s) for p, s in zip(prompts, settings)))

    outs = asyncio.run(run())
    for i, ((text, ids), ref) in enumerate(zip(outs, refs)):
        assert ids == ref.token_ids, (i, settings[i])
        assert text == ref.text, i
    assert len({tuple(ids) for _, ids in outs}) > 4  # the settings really differ


# -- cancellation, bad input, overload, load


def _wait_for(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_disconnect_mid_stream_cancels_and_frees_the_slot(draft_server):
    before = draft_server.metrics()
    client = draft_server.client()
    stream = client.completions.create(model=MODEL, prompt="w5 w9", max_tokens=250, temperature=0, stream=True)
    it = iter(stream)
    got = [next(it) for _ in range(3)]
    assert all(c.choices[0].finish_reason is None for c in got)
    assert draft_server.metrics()["eagle_jax_running_requests"] == 1
    stream.close()  # the client goes away mid-stream

    def freed():
        m = draft_server.metrics()
        return (m['eagle_jax_requests_total{outcome="cancelled"}'] == before['eagle_jax_requests_total{outcome="cancelled"}'] + 1
                and m["eagle_jax_running_requests"] == 0 and m["eagle_jax_free_slots"] == m["eagle_jax_max_batch"])

    _wait_for(freed)
    m = draft_server.metrics()
    assert m['eagle_jax_requests_total{outcome="length"}'] == before['eagle_jax_requests_total{outcome="length"}']


BAD = [
    # (path, body, status, param, words in the message)
    ("/v1/completions", b'{"model": "tiny", "prompt": "w5",', 400, None, "malformed JSON"),
    ("/v1/completions", b'["not", "an", "object"]', 400, None, "JSON object"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "w5", "logprobs": 2}', 400, "logprobs", "unknown"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "w5", "temperature": 2.5}', 400, "temperature", "less than or equal to 2"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "w5", "temperature": "hot"}', 400, "temperature", "number"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "w5", "top_p": 0}', 400, "top_p", "greater than 0"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "w5", "top_k": -2}', 400, "top_k", "greater than or equal to -1"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "w5", "max_tokens": 0}', 400, "max_tokens", "greater than or equal to 1"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "w5", "seed": -1}', 400, "seed", "greater than or equal to 0"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "w5", "stop": ["a", "b", "c", "d", "e"]}', 400, "stop", "at most 4"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "w5", "n": 2}', 400, "n", "only n=1"),
    ("/v1/completions", b'{"model": "tiny"}', 400, "prompt", "required"),
    ("/v1/completions", b'{"model": "tiny", "prompt": ""}', 400, "prompt", "empty"),
    ("/v1/completions", b'{"model": "tiny", "prompt": [5, 99999]}', 400, "prompt", "outside the vocabulary"),
    ("/v1/completions", json.dumps({"model": "tiny", "prompt": " ".join(["w5"] * 300)}).encode(), 400, "prompt",
     "max_seq_len"),
    ("/v1/completions", b'{"model": "other", "prompt": "w5"}', 404, "model", "serves 'tiny'"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "robot", "content": "w5"}]}', 400,
     "messages[0].role", "'system', 'user' or 'assistant'"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": []}', 400, "messages", "at least 1"),
    ("/v1/chat/completions", json.dumps({"model": "tiny", "messages": _chat(" ".join(["w5"] * 300))}).encode(), 400,
     "messages", "max_seq_len"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "w5"}], "n": 3}', 400, "n",
     "only n=1"),
]


def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(draft_server):
    before = draft_server.metrics()['eagle_jax_requests_total{outcome="invalid"}']
    for path, body, status, param, words in BAD:
        got, raw = draft_server.request("POST", path, body)
        err = json.loads(raw)["error"]
        assert got == status, (body, raw)
        assert err["param"] == param, (body, err)
        assert words in err["message"], (body, err)
        if param is not None:
            assert err["message"].startswith(param), err  # the message names the field
    # The official client sees the same (an unknown parameter through extra_body).
    client = draft_server.client()
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model=MODEL, prompt="w5", max_tokens=2, presence_penalty=0.5)
    assert draft_server.metrics()['eagle_jax_requests_total{outcome="invalid"}'] == before + len(BAD) + 1
    r = client.completions.create(model=MODEL, prompt="w5 w9", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4 and draft_server.get("/health")[0] == 200


def test_overload_gets_429_never_a_hang(draft_server):
    """64 long requests at once on 8 slots and a queue of 32: the excess is refused at
    once with a 429; the rest finish."""

    async def one(client):
        try:
            r = await client.completions.create(model=MODEL, prompt="w5", max_tokens=200, temperature=0)
            return r.choices[0].finish_reason
        except openai.RateLimitError as e:
            assert "overloaded" in e.message
            return 429

    async def run():
        async with draft_server.async_client() as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client) for _ in range(64))), 120)

    outs = asyncio.run(run())
    assert outs.count(429) >= 1 and outs.count("length") >= 8 + 32 - 2, outs
    assert set(outs) <= {429, "length"}


def test_load_200_requests_at_concurrency_32(draft_server):
    before = draft_server.metrics()
    peak = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak.append(draft_server.metrics()["eagle_jax_queue_length"])
            time.sleep(0.05)

    async def run():
        gate = asyncio.Semaphore(32)
        async with draft_server.async_client() as client:
            async def one(i):
                async with gate:
                    r = await client.completions.create(model=MODEL, prompt=PROMPTS[i % 4], max_tokens=8,
                                                        temperature=0.8, seed=i)
                    return r.choices[0].finish_reason, r.usage.completion_tokens

            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(200))), 180)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        outs = asyncio.run(run())
    finally:
        stop.set()
        watcher.join()
    assert len(outs) == 200 and all(reason in ("length", "stop") for reason, _ in outs)
    assert all(n == 8 for reason, n in outs if reason == "length")
    m = draft_server.metrics()
    ended = sum(m[f'eagle_jax_requests_total{{outcome="{o}"}}'] - before[f'eagle_jax_requests_total{{outcome="{o}"}}']
                for o in ("stop", "length"))
    assert ended == 200
    for o in ("failed", "rejected", "cancelled"):
        key = f'eagle_jax_requests_total{{outcome="{o}"}}'
        assert m[key] == before[key], o
    assert max(peak) <= 32  # bounded by the clients in flight (never grows with the 200)
    assert m["eagle_jax_running_requests"] == 0 and m["eagle_jax_queue_length"] == 0
    assert m["eagle_jax_time_to_first_token_seconds_count"] >= before["eagle_jax_time_to_first_token_seconds_count"] + 200
    assert any(k.startswith('eagle_jax_steps_total{bucket="8",shape="chain S=2"}') for k in m)
    assert m["eagle_jax_accept_length_count"] > before["eagle_jax_accept_length_count"]


def test_sigterm_with_requests_in_flight_exits_0(draft_server):
    """Last (it stops the module's draft server)."""
    client = draft_server.client()
    streams = [client.completions.create(model=MODEL, prompt=p, max_tokens=200, temperature=0, stream=True)
               for p in PROMPTS]
    iters = [iter(s) for s in streams]
    for it in iters:
        next(it)  # every request is running
    t0 = time.monotonic()
    draft_server.proc.send_signal(signal.SIGTERM)
    reasons = []
    for it in iters:  # in flight: each finishes (or is cut off if the grace period ends first)
        chunks = list(it)
        reasons.append(chunks[-1].choices[0].finish_reason if chunks else None)
    assert draft_server.proc.wait(60) == 0
    assert time.monotonic() - t0 < 10 + 15  # the grace period (--shutdown-timeout 10) and the engine's stop
    assert set(reasons) <= {"length", None}
    log = draft_server.log_path.read_text()
    assert re.search(r"stopped \(SIGTERM\)", log), log
