"""The HTTP side: FastAPI routes on uvicorn, over an ``EngineThread``.

Handlers run on uvicorn's event loop and never touch JAX: they check the body, encode the
prompt with the tokenizer (pure Python and Rust), submit it to the engine thread and
await its events. A client that goes away cancels its request (streaming: Starlette
cancels the response when the client disconnects; otherwise the handler polls for the
disconnect while it waits). Overload (more requests waiting than ``max_queue``) is a
429 at once, never a hang.

Shutdown (SIGTERM or SIGINT): uvicorn stops accepting connections and gives in-flight
requests ``shutdown_timeout`` seconds to finish, then cancels the handlers, which cancel
their requests; the engine thread then ends and ``serve`` returns 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
import uuid
from typing import Any, AsyncIterator

import fastapi
import uvicorn
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from eagle_jax.errors import InputError
from eagle_jax.serving.engine import Engine
from eagle_jax.server import protocol
from eagle_jax.server.metrics import ServerMetrics
from eagle_jax.server.protocol import APIError
from eagle_jax.server.worker import Added, Done, EngineStopped, EngineThread, Failed, Sink, Text

log = logging.getLogger(__name__)

# How often a non-streaming handler looks for its client's disconnect while it waits.
DISCONNECT_POLL_S = 0.1


class Server:
    """The app and what it serves: one engine thread, the model's name and limits."""

    def __init__(self, engine: Engine, *, model_name: str, max_queue: int):
        if engine.tokenizer is None:
            raise InputError("serve needs the model's tokenizer (the OpenAI API speaks text)")
        self.engine = engine  # read on the HTTP side for its config and tokenizer only
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.max_seq_len = engine.config.max_seq_len
        self.max_batch = engine.config.max_batch
        self.max_queue = max_queue
        accept = max((s.num_steps + 1 for s in engine.table.shapes), default=1)
        self.metrics = ServerMetrics(self.max_batch, accept)
        self.worker = EngineThread(engine, self.metrics)
        self.app = self._routes()

    # -- requests

    def _encode(self, req: protocol.CompletionRequest | protocol.ChatRequest) -> tuple[list[int], str]:
        """The prompt's token ids (as ``Engine.add_request`` encodes text and chat) and the field it came from."""
        if isinstance(req, protocol.ChatRequest):
            messages = [m.model_dump(exclude_none=True) for m in req.messages]
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            except InputError as e:
                raise APIError(400, f"messages: {e}", param="messages") from e
            return self.tokenizer.encode(text), "messages"
        if isinstance(req.prompt, str):
            return self.tokenizer.encode(req.prompt, add_special_tokens=True), "prompt"
        return list(req.prompt), "prompt"

    def _check(self, req) -> tuple[list[int], Any, str]:
        if req.model != self.model_name:
            raise APIError(404, f"model: this server serves {self.model_name!r}, not {req.model!r}", param="model",
                           code="model_not_found")
        ids, field = self._encode(req)
        if not ids:
            raise APIError(400, f"{field}: the prompt is empty", param=field)
        if len(ids) >= self.max_seq_len:
            raise APIError(400, f"{field}: the prompt has {len(ids)} tokens; max_seq_len is {self.max_seq_len}, "
                                f"leaving no room for a new token", param=field)
        room = self.max_seq_len - len(ids)
        if isinstance(req, protocol.ChatRequest):
            if req.max_tokens is not None and req.max_completion_tokens is not None:
                raise APIError(400, "max_tokens: give max_tokens or max_completion_tokens, not both", param="max_tokens")
            max_tokens = req.max_completion_tokens or req.max_tokens or room
        else:
            max_tokens = req.max_tokens or protocol.DEFAULT_COMPLETION_MAX_TOKENS
        try:
            params = req.sampling_params(max_tokens)
        except InputError as e:  # SamplingParams' own checks
            raise APIError(400, str(e)) from e
        return ids, params, field

    async def _start(self, http: fastapi.Request, req, arrival: float) -> tuple[str, Sink, str, int]:
        ids, params, field = self._check(req)
        waiting = self.worker.open_requests() - self.max_batch
        if waiting >= self.max_queue:
            self.metrics.requests.labels("rejected").inc()
            raise APIError(429, f"the server is overloaded: {waiting} requests are waiting (max_queue {self.max_queue}); "
                                f"retry later", type="server_overloaded")
        rid = f"{'chatcmpl' if isinstance(req, protocol.ChatRequest) else 'cmpl'}-{uuid.uuid4().hex}"
        sink = Sink(asyncio.get_running_loop(), arrival, len(ids))
        try:
            self.worker.submit(rid, ids, params, sink)
        except EngineStopped as e:
            self.metrics.requests.labels("rejected").inc()
            raise APIError(503, str(e), type="server_unavailable") from e
        try:
            event = await self._next(sink, rid, http)
        except asyncio.CancelledError:  # the client went away before the engine took the request
            self.worker.cancel(rid)
            raise
        if isinstance(event, Added) and event.error is not None:
            raise APIError(400, f"{field}: {event.error}", param=field)
        if isinstance(event, Failed):
            raise APIError(500, f"the engine failed: {event.error!r}", type="server_error")
        return rid, sink, field, len(ids)

    async def _next(self, sink: Sink, rid: str, http: fastapi.Request | None):
        """The request's next event; with ``http``, polling for its client's disconnect
        (a disconnect cancels the request: ``asyncio.CancelledError`` reaches the caller)."""
        if http is None:
            return await sink.events.get()
        while True:
            try:
                return await asyncio.wait_for(sink.events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await http.is_disconnected():
                    raise asyncio.CancelledError(f"client of {rid} disconnected") from None

    async def _generate(self, http: fastapi.Request, model: type[protocol._Strict]) -> Response:
        arrival = time.perf_counter()
        chat = model is protocol.ChatRequest
        try:
            req = protocol.parse(model, await http.body())
            rid, sink, _, n_prompt = await self._start(http, req, arrival)
        except APIError as e:
            if e.status < 429:
                self.metrics.requests.labels("invalid").inc()
            raise
        if req.stream:
            return EventSourceResponse(self._stream(rid, sink, n_prompt, chat, req.include_usage))
        done = False
        try:
            while True:
                event = await self._next(sink, rid, http)
                if isinstance(event, Done):
                    done = True
                    return JSONResponse(protocol.completion_body(rid, self.model_name, n_prompt, event.completion, chat=chat))
                if isinstance(event, Failed):
                    done = True
                    raise APIError(500, f"the engine failed: {event.error!r}", type="server_error")
        finally:
            if not done:  # the client went away, or shutdown cancelled the handler
                self.worker.cancel(rid)

    async def _stream(self, rid: str, sink: Sink, n_prompt: int, chat: bool, include_usage: bool) -> AsyncIterator[bytes]:
        created = int(time.time())
        sse = lambda body: format_sse_event(data_str=json.dumps(body, ensure_ascii=False))  # noqa: E731
        done = False
        try:
            if chat:
                yield sse(protocol.chunk_body(rid, self.model_name, created, chat=True, role=True))
            while True:
                event = await sink.events.get()
                if isinstance(event, Text):
                    yield sse(protocol.chunk_body(rid, self.model_name, created, chat=chat, text=event.delta))
                elif isinstance(event, Done):
                    done = True
                    c = event.completion
                    yield sse(protocol.chunk_body(rid, self.model_name, created, chat=chat, finish=c))
                    if include_usage:
                        yield sse(protocol.usage_chunk(rid, self.model_name, created, n_prompt, c, chat=chat))
                    yield format_sse_event(data_str="[DONE]")
                    return
                elif isinstance(event, Failed):
                    done = True
                    # Headers are sent: the error goes in the stream, as OpenAI's does.
                    yield sse(APIError(500, f"the engine failed: {event.error!r}", type="server_error").body())
                    return
        finally:
            if not done:  # the client disconnected (Starlette cancelled us) or shutdown
                self.worker.cancel(rid)

    # -- routes

    def _routes(self) -> fastapi.FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            yield
            # uvicorn has drained or cancelled the handlers; the engine thread finishes
            # the cancels (one step) and ends.
            if not self.worker.stop(timeout=30.0):
                log.error("the engine thread did not stop within 30 s")

        app = fastapi.FastAPI(title="eagle-jax", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)

        @app.exception_handler(APIError)
        async def api_error(_, e: APIError):
            return JSONResponse(e.body(), status_code=e.status, headers={"Retry-After": "1"} if e.status in (429, 503) else None)

        @app.post("/v1/completions")
        async def completions(http: fastapi.Request):
            return await self._generate(http, protocol.CompletionRequest)

        @app.post("/v1/chat/completions")
        async def chat_completions(http: fastapi.Request):
            return await self._generate(http, protocol.ChatRequest)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "eagle-jax", "max_model_len": self.max_seq_len}]}

        @app.get("/health")
        async def health():
            if self.worker.error is not None:
                return JSONResponse({"status": "failed", "error": repr(self.worker.error)}, status_code=503)
            if not self.worker.alive:
                return JSONResponse({"status": "stopping"}, status_code=503)
            # "compiling": --background-compile, plain steps until the speculative ones are ready.
            return {"status": "ok", "speculation": "ready" if self.worker.speculation_ready else "compiling"}

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        return app


def serve(engine: Engine, *, host: str, port: int, model_name: str, max_queue: int, shutdown_timeout: float) -> int:
    """Serve ``engine`` until SIGTERM or SIGINT; 0 after a clean shutdown, 1 if the engine failed."""
    server = Server(engine, model_name=model_name, max_queue=max_queue)
    config = uvicorn.Config(server.app, host=host, port=port, timeout_graceful_shutdown=max(1, round(shutdown_timeout)),
                            log_level="warning", lifespan="on")
    http = uvicorn.Server(config)

    def engine_failed() -> None:  # on the engine thread: uvicorn polls should_exit
        http.should_exit = True

    server.worker.on_failure = engine_failed
    # uvicorn restores the handler it found and raises the signal again once it has shut
    # down; this one records it, so the process then returns 0 instead of dying of it. A
    # signal before uvicorn takes over (it installs its own in run()) stops it at once.
    stopped_by: list[int] = []

    def on_signal(sig: int, _frame) -> None:
        stopped_by.append(sig)
        http.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    server.worker.start()
    log.warning("eagle-jax serve: %s on http://%s:%d/v1 (batch %d, max_seq_len %d, max_queue %d)", model_name, host,
                port, server.max_batch, server.max_seq_len, max_queue)
    http.run()
    if server.worker.error is not None:
        log.error("the engine failed: %r", server.worker.error)
        return 1
    log.warning("eagle-jax serve: stopped (%s)", ", ".join(signal.Signals(s).name for s in stopped_by) or "no signal")
    return 0
