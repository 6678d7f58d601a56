"""The OpenAI-compatible HTTP server (starlette + uvicorn) on the continuous-batching engine.

Routes: POST /v1/completions, POST /v1/chat/completions (both with "stream": true as server-sent events in
OpenAI's chunk format, ending with `data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus).
Every request shares the one engine (AsyncEngine: the Engine on its own thread); a client that disconnects
has its requests aborted at once, which frees their slots at the engine's next step. Errors are OpenAI's
JSON ({"error": {...}}) with 4xx codes for the client's mistakes: 400 bad fields or JSON, 401 without the
API key (--api-key guards /v1/*; /health and /metrics stay open for probes and scrapers), 404 unknown model
or route, 405, 413 body too large, 429 (with Retry-After) when `max_waiting` requests already wait for a slot,
503 while shutting down; a request past `request_timeout` seconds is cancelled and gets 504 (a stream: an error
event); 500 only for a failure inside the engine, which ends that request alone. Shutdown (SIGINT/SIGTERM) stops
accepting connections and lets requests in flight finish; one second before `shutdown_timeout` the engine aborts those
still running (a stream ends with an error event and [DONE], a plain request gets 503), uvicorn cancels
whatever is left at the timeout, and the engine thread stops.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..io.chat import chat_format_for
from ..runtime.engine import Engine
from ..runtime.images import expand_image_prompt
from ..runtime.requests import RequestError
from ..vision.processor import ImageError, data_url_bytes
from .async_engine import AsyncEngine
from .handles import QueueFull, RequestHandle
from .chat_protocol import parse_chat
from .connections import ReadDeadline, RequestBodyTimeout, h11_with_header_timeout
from .lockstep import Lockstep
from .openai_protocol import APIError, GenerationRequest, ServingContext, parse_completion, parse_json, parse_request
from .responses import (Choice, chat_chunk, chat_response, chat_role_chunk, completion_chunk, completion_response,
                        pick_best, req_prompt_text, usage, usage_chunk)
from .server_metrics import Latency, ServerMetrics

__all__ = ["ServerSettings", "build_app", "serve", "make_server", "background_server"]

log = logging.getLogger("jdeep.serve")

DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_READ_TIMEOUT_S = 30.0   # a request's headers, and then its body, must arrive within this
PARSE_THREADS = 2           # requests parsed (and tokenised) at once, off the event loop
CLIENT_GONE = 499           # the status counted for a request whose client went away before its answer (nginx's)
WAITING_PER_SLOT = 4        # default max_waiting: this many times the engine's slots
RETRY_AFTER_S = 1           # the Retry-After of a 429


@dataclass(frozen=True)
class ServerSettings:
    """model_name: the id clients send; max_waiting: requests that may wait for a slot before new ones get 429
    (None: WAITING_PER_SLOT x the engine's slots); request_timeout: seconds a request may take from arrival before
    it is cancelled (None: no limit)."""

    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    created: int = 0                    # the model's "created" timestamp in /v1/models
    max_waiting: int | None = None
    request_timeout: float | None = None
    chat_format: str | None = None      # "v4" / "v41" (io/chat); None: from the model's config
    read_timeout: float = DEFAULT_READ_TIMEOUT_S    # seconds for a request's headers, then for its whole body
    warmup: bool = False                # the engine thread compiles the engine's programs first; /health says "warming"
    on_compiled: Callable[[int, int, float, bool], None] | None = None   # warm-up progress (AsyncEngine's)


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


FAILED = ("error", "abort", "timeout")      # finish reasons that end a request without its completion


def _failure(finish_reason: str, error: str | None) -> APIError:
    """A request the server ended: "abort" (shutting down) -> 503, "timeout" (--request-timeout) -> 504, "error"
    (the engine failed) -> 500."""
    if finish_reason == "abort":      # shutting down, or (with its reason) a multi-process server's failed mesh
        return APIError(503, error or "the request was cancelled (the server is shutting down)", type="server_error")
    if finish_reason == "timeout":
        return APIError(504, error or "the request timed out", type="timeout_error", code="request_timeout")
    return APIError(500, error or "the engine failed while generating", type="server_error")


async def _abort_on_disconnect(receive, handles: list[RequestHandle], on_disconnect=None) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    if on_disconnect is not None and not all(h.finished for h in handles):
        on_disconnect()
    for h in handles:
        h.abort()


class _Stream(StreamingResponse):
    """An SSE response whose requests are aborted whenever it ends early (disconnect, cancellation, error)."""

    def __init__(self, content, handles: list[RequestHandle], on_disconnect=None):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.handles, self.on_disconnect = handles, on_disconnect

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.ensure_future(_abort_on_disconnect(receive, self.handles, self.on_disconnect))
        try:
            await super().__call__(scope, receive, send)
        finally:
            watcher.cancel()
            for h in self.handles:
                h.abort()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _App:
    def __init__(self, aengine: AsyncEngine, settings: ServerSettings):
        self.engine, self.settings = aengine, settings
        eng = aengine.engine
        expand = None
        if eng.model.vision is not None:
            def expand(text: str, images: list):
                try:    # the tower gets the images' bytes: no client string reaches open_image's path branch
                    images = [data_url_bytes(url) for url in images]
                except ImageError as e:
                    raise RequestError(str(e), "messages") from None
                return expand_image_prompt(eng.model, {"text": text, "images": images}, eng.tokenizer)
        self.ctx = ServingContext(settings.model_name, eng.max_len, eng.tokenizer, aengine.check,
                                  chat_format_for(eng.model.config.model_type, settings.chat_format), expand)
        self.metrics = ServerMetrics(aengine)
        self.draining = False
        # parsing tokenises (Tokenizer.encode releases the GIL) and may run the vision tower: a small pool of its
        # own, so hostile prompts take at most PARSE_THREADS cores from the engine and queue behind each other
        self.parser = concurrent.futures.ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="jdeep-parse")

    # ------------------------------------------------------------------ plain routes
    async def health(self, request: Request) -> Response:
        """200 {"status": "ok", "processes": N, "in_step": true, ...} while serving; 503 with the reason otherwise:
        {"status": "warming", "compiled": n, "total": N} while the engine thread compiles its programs (requests
        wait meanwhile), "draining", "engine failed", ... A multi-process server adds "by_process": each process's
        heartbeat age and finished steps."""
        st = self.engine.stats
        ok = st.alive and st.error is None and not self.draining and not st.warming
        failed = "mesh failed" if self.engine.lockstep is not None else "engine failed"
        body: dict[str, Any] = {"status": "ok" if ok else "draining" if self.draining else
                                failed if st.error else "warming" if st.warming and st.alive else "engine stopped"}
        if st.total:
            body.update(compiled=st.compiled, total=st.total)
        if st.error:
            body["error"] = st.error
        lockstep = self.engine.lockstep
        body.update(lockstep.status() if lockstep is not None else {"processes": 1, "in_step": ok})
        return JSONResponse(body, status_code=200 if ok else 503)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.settings.model_name, "object": "model", "created": self.settings.created, "owned_by": "jdeep",
            "max_model_len": self.ctx.max_len}]})

    async def metrics_route(self, request: Request) -> Response:
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # ------------------------------------------------------------------ generation
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, parse_chat)

    async def _read_json(self, request: Request) -> Any:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body ({declared} bytes) exceeds the limit of {limit} bytes")
        chunks, n = [], 0
        try:
            async for chunk in request.stream():
                n += len(chunk)
                if n > limit:
                    raise APIError(413, f"the request body exceeds the limit of {limit} bytes")
                chunks.append(chunk)
        except RequestBodyTimeout as e:
            raise APIError(408, str(e), code="request_read_timeout", headers={"Connection": "close"}) from None
        return parse_json(b"".join(chunks))

    def _submit(self, req: GenerationRequest, queue: asyncio.Queue) -> list[RequestHandle]:
        """Queue the request's prompts, all or none: 429 past max_waiting, 503 without an engine."""
        eng = self.engine
        if eng.max_waiting is not None and len(req.requests) > eng.engine.n_slots + eng.max_waiting:
            raise APIError(400, f"the request holds {len(req.requests)} prompts; this server takes at most "
                           f"{eng.engine.n_slots + eng.max_waiting} at once", param="prompt")
        try:
            return eng.submit_all(req.requests, queue, timeout=self.settings.request_timeout)
        except QueueFull as e:
            self.metrics.rejected.inc()
            raise APIError(429, f"the server is busy: {e}; retry later", type="rate_limit_error",
                           code="too_many_waiting_requests", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except RuntimeError as e:
            raise APIError(503, str(e), type="service_unavailable") from None

    async def _generate(self, request: Request, parse) -> Response:
        timer = Latency(self.metrics)
        try:
            if self.draining:
                raise APIError(503, "the server is shutting down", type="service_unavailable")
            body = await self._read_json(request)
            # off the event loop: tokenising a long prompt, or an image's vision tower, takes seconds
            req: GenerationRequest = await asyncio.get_running_loop().run_in_executor(
                self.parser, parse_request, parse, body, self.ctx)
            if await request.is_disconnected():     # the client left while its request was parsed
                return self._client_gone()
            queue: asyncio.Queue = asyncio.Queue()
            handles = self._submit(req, queue)
        except ClientDisconnect:                    # the client went away while sending its body
            return self._client_gone()
        except APIError as e:
            return _error(e)
        choices = [Choice(req, self.ctx.tokenizer, k // req.best_of) for k in range(len(handles))]
        index = {h.request_id: i for i, h in enumerate(handles)}
        if req.stream:
            return _Stream(self._events(req, handles, queue, choices, index, timer), handles,
                           self.metrics.disconnects.inc)
        gone = []
        watcher = asyncio.ensure_future(_abort_on_disconnect(request.receive, handles, lambda: gone.append(True)))
        try:
            async for i, d in self._deltas(handles, queue, index, timer):
                choices[i].push(d)
        finally:
            watcher.cancel()
            for h in handles:
                h.abort()
        failed = [c for c in choices if c.finish_reason in FAILED]
        self._done(req, choices, timer)
        if gone:
            return self._client_gone()
        if failed:
            return _error(_failure(failed[0].finish_reason, failed[0].error))
        u = _usage(req, choices)
        best = pick_best(req, choices)
        if req.kind == "completion":
            return JSONResponse(completion_response(req, best, u))
        return JSONResponse(chat_response(req, best, u))

    def _client_gone(self) -> Response:
        """The answer to a request whose client has gone (never sent: counted as CLIENT_GONE, not as an error)."""
        self.metrics.disconnects.inc()
        return Response(status_code=CLIENT_GONE)

    async def _deltas(self, handles: list[RequestHandle], queue: asyncio.Queue, index: dict, timer: Latency):
        """(choice index, Delta) until every request has finished; feeds the latency metrics."""
        left = len(handles)
        while left:
            d = await queue.get()
            i = index[d.request_id]
            timer.tokens(len(d.tokens), d.time)
            if d.finished:
                handles[i].finished = True
                left -= 1
            yield i, d

    def _done(self, req: GenerationRequest, choices: list[Choice], timer: Latency) -> None:
        timer.done(sum(map(len, req.prompts)), sum(len(c.tokens) for c in choices),
                   [c.finish_reason or "abort" for c in choices])

    async def _events(self, req: GenerationRequest, handles, queue, choices: list[Choice], index: dict, timer: Latency):
        chat = req.kind == "chat"
        started = [False] * len(choices)
        try:
            if chat:
                for i in range(len(choices)):
                    yield _sse(chat_role_chunk(req, i))
            async for i, d in self._deltas(handles, queue, index, timer):
                c = choices[i]
                delta = c.push(d)
                if d.finish_reason in FAILED:
                    yield _sse(_failure(d.finish_reason, d.error).body())
                    break
                wanted = delta if chat else delta["text"]
                if req.echo and not started[i]:
                    wanted = req_prompt_text(req, c) + wanted
                if not (wanted or d.finished or (d.tokens and (req.return_token_ids or req.logprobs is not None))):
                    continue
                if chat:
                    yield _sse(chat_chunk(req, i, c, delta, len(d.tokens)))
                else:
                    yield _sse(completion_chunk(req, i, c, wanted, len(d.tokens), echo=req.echo and not started[i]))
                started[i] = True
            if req.include_usage:
                yield _sse(usage_chunk(req, _usage(req, choices)))
            yield "data: [DONE]\n\n"
        finally:
            self._done(req, choices, timer)


def _usage(req: GenerationRequest, choices: list[Choice]) -> dict:
    """Prompt tokens once per prompt, completion tokens of every sequence generated (best_of ones included)."""
    return usage(sum(map(len, req.prompts)), sum(len(c.tokens) for c in choices))


class _Boundary:
    """ASGI middleware around every HTTP request: the API key on /v1/*, the read deadline of the body
    (connections.ReadDeadline), the one answer to an exception no handler took (a 500 JSON error, logged once; the
    exception goes no further, so the client's kept-alive connection stays usable), and the count of every request
    by route and status."""

    def __init__(self, app, state: _App, routes: set[str]):
        self.app, self.state, self.routes = app, state, routes

    def _authorized(self, scope) -> bool:
        key = self.state.settings.api_key
        if key is None or not scope["path"].startswith("/v1"):
            return True
        auth = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        # the scheme is case-insensitive (RFC 9110 11.1); the key is compared as the bytes the client sent, UTF-8
        return hmac.compare_digest(scheme.lower() + b" " + token.strip(), b"bearer " + key.encode("utf-8"))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status = [None]

        async def send_(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if not self._authorized(scope):
                err = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
                return await _error(err)(scope, receive, send_)
            await self.app(scope, ReadDeadline(receive, self.state.settings.read_timeout), send_)
        except Exception as exc:      # noqa: BLE001 (the last boundary: answered here, not re-raised to uvicorn)
            log.error("unhandled error on %s", path, exc_info=exc)
            if status[0] is None:
                await _error(APIError(500, f"internal server error: {type(exc).__name__}",
                                      type="server_error"))(scope, receive, send_)
            else:                     # a stream already answered 200: the connection cannot be reused, close it
                status[0] = 500
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.state.metrics.requests.inc(1, path if path in self.routes else "other", str(status[0] or 500))


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request_error")
    msg = {404: f"no route {request.url.path}", 405: f"method {request.method} is not allowed on {request.url.path}"}
    return _error(APIError(exc.status_code, msg.get(exc.status_code, str(exc.detail)), type=kind))


def build_app(aengine: AsyncEngine, settings: ServerSettings):
    """The ASGI app; starts the engine thread on startup and stops it on shutdown. `app.state.jdeep` is the
    _App (its `draining` flag turns new requests away with 503)."""
    state = _App(aengine, settings)
    routes = [Route("/v1/completions", state.completions, methods=["POST"]),
              Route("/v1/chat/completions", state.chat, methods=["POST"]),
              Route("/v1/models", state.models, methods=["GET"]),
              Route("/health", state.health, methods=["GET"]),
              Route("/metrics", state.metrics_route, methods=["GET"])]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        aengine.start()
        try:
            yield
        finally:
            state.draining = True
            await asyncio.get_running_loop().run_in_executor(None, aengine.stop)
            state.parser.shutdown(wait=False, cancel_futures=True)

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})
    app.state.jdeep = state
    app.add_middleware(_Boundary, state=state, routes={r.path for r in routes})
    return app


def make_server(engine: Engine, settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000,
                shutdown_timeout: float = 30.0, log_level: str = "info", lockstep: Lockstep | None = None):
    """A uvicorn Server for the engine: `server.run()` blocks until SIGINT/SIGTERM (or `server.should_exit`).
    lockstep: process 0's side of a multi-process server (serve/lockstep.py)."""
    max_waiting = settings.max_waiting if settings.max_waiting is not None else WAITING_PER_SLOT * engine.n_slots
    aengine = AsyncEngine(engine, max_waiting=max_waiting, lockstep=lockstep, warmup=settings.warmup,
                          on_compiled=settings.on_compiled)
    app = build_app(aengine, settings)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            state = app.state.jdeep
            if not state.draining:      # turn new requests away; end the rest cleanly just before uvicorn cancels them
                state.draining = True
                timer = threading.Timer(max(0.0, shutdown_timeout - 1.0), aengine.abort_all)
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)
            # a signal asks for the drain that follows: once it is done the process exits 0, not by the signal
            getattr(self, "_captured_signals", []).clear()

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout,
                            lifespan="on", http=h11_with_header_timeout(settings.read_timeout))
    return _Server(config)


def serve(engine: Engine, settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000,
          shutdown_timeout: float = 30.0, log_level: str = "info", lockstep: Lockstep | None = None) -> None:
    make_server(engine, settings, host, port, shutdown_timeout, log_level, lockstep).run()


@contextlib.contextmanager
def background_server(engine: Engine, settings: ServerSettings, host: str = "127.0.0.1", port: int = 0,
                      shutdown_timeout: float = 30.0, log_level: str = "warning", lockstep: Lockstep | None = None):
    """Serve from a background thread (a notebook, tests): `with background_server(engine, settings) as (url,
    server):` with url = "http://HOST:PORT/v1" (port 0: a free one). Leaving the block shuts it down as a
    signal would (in-flight requests get `shutdown_timeout` seconds)."""
    server = make_server(engine, settings, host, port, shutdown_timeout, log_level, lockstep)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="jdeep-http", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server thread ended before it started serving")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}/v1", server
    finally:
        server.handle_exit(15, None)
        thread.join(shutdown_timeout + 10)
        sock.close()
