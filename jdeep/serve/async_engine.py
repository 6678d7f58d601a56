"""The continuous-batching engine on its own thread, fed by asyncio callers (the HTTP server).

One engine thread owns the Engine: it takes submitted and aborted requests from an inbox between steps,
runs `Engine.step()` while any request is waiting or running, and hands every request's new tokens and the text
they completed (the engine detokenises and matches stop strings) to its caller's asyncio queue
(`loop.call_soon_threadsafe`), one Delta per step. Callers never touch the Engine:
`submit` returns a RequestHandle (an async iterator of Deltas); `handle.abort()` (a client went away) ends
the request at the next step boundary and frees its slot. A step that raises fails the requests in flight
with an error and the thread keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..runtime.engine import Engine
from ..runtime.requests import Request
from ..runtime.sampling import SamplingParams

__all__ = ["AsyncEngine", "Delta", "RequestHandle"]

log = logging.getLogger("jdeep.serve")


@dataclass
class Delta:
    """What one engine step gave a request: its new tokens, the text they completed (given a tokenizer), and
    whether it has finished. time: time.monotonic() when the step ended."""

    request_id: str
    tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None    # "stop", "length", "abort" or "error"
    error: str | None = None
    time: float = 0.0
    text: str = ""


@dataclass
class _Tracked:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sent: int = 0          # tokens already handed over
    sent_text: int = 0     # characters of the text already handed over


class RequestHandle:
    """A submitted request: `async for delta in handle` until delta.finished; `abort()` ends it early."""

    def __init__(self, engine: "AsyncEngine", request_id: str, queue: asyncio.Queue):
        self.engine, self.request_id, self.queue = engine, request_id, queue
        self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        if self.finished:
            raise StopAsyncIteration
        d = await self.queue.get()
        self.finished = d.finished
        return d

    def abort(self) -> None:
        """End the request (no-op once finished): its slot is free after the engine's current step."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


@dataclass
class EngineStats:
    """A snapshot the engine thread refreshes after every iteration (read from any thread)."""

    slots: int = 0
    running: int = 0
    waiting: int = 0
    steps: int = 0
    alive: bool = False
    step_seconds: list[float] = field(default_factory=list)   # durations since the last drain (metrics)


class AsyncEngine:
    """engine = AsyncEngine(Engine(model, ...)); engine.start(); h = engine.submit(ids, params); async for d in h."""

    def __init__(self, engine: Engine, on_error: Callable[[BaseException], None] | None = None):
        self.engine = engine
        self._cv = threading.Condition()
        self._inbox: list[tuple] = []
        self._tracked: dict[str, _Tracked] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._n = 0
        self._on_error = on_error
        self.stats = EngineStats(slots=engine.n_slots)

    # ------------------------------------------------------------------ caller side (any thread / event loop)
    def start(self) -> "AsyncEngine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="jdeep-engine", daemon=True)
            self.stats.alive = True
            self._thread.start()
        return self

    def check(self, prompt: Sequence[int] | str, params: SamplingParams) -> Request:
        """Validate without queueing (Engine.check_request): the Request, or RequestError."""
        return self.engine.check_request(prompt, params)

    def submit(self, request: Request, queue: asyncio.Queue | None = None,
               request_id: str | None = None) -> RequestHandle:
        """Queue a validated request (from `check`) from a coroutine; its Deltas go to `queue` (a new one by
        default; several requests may share one, Delta.request_id tells them apart)."""
        if self._stopping or self._thread is None or not self.stats.alive:
            raise RuntimeError("the engine is not running")
        with self._cv:
            self._n += 1
            rid = request_id or f"req-{self._n}"
        q = queue if queue is not None else asyncio.Queue()
        self._post(("add", rid, request, _Tracked(asyncio.get_running_loop(), q)))
        return RequestHandle(self, rid, q)

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def abort_all(self) -> None:
        """End every request in flight (a shutdown that cannot wait longer): callers get finish_reason "abort"."""
        self._post(("abort_all",))

    def stop(self, timeout: float | None = 10.0) -> None:
        """Abort whatever is in flight (callers get finish_reason "abort") and end the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _post(self, cmd: tuple) -> None:
        with self._cv:
            self._inbox.append(cmd)
            self._cv.notify()

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        eng = self.engine
        try:
            while True:
                with self._cv:
                    while not self._inbox and not eng.has_work and not self._stopping:
                        self._cv.wait()
                    inbox, self._inbox = self._inbox, []
                    stopping = self._stopping
                for cmd in inbox:
                    self._apply(cmd)
                if stopping:
                    for rid in list(self._tracked):
                        eng.abort(rid)
                    self._publish()
                    return
                if eng.has_work:
                    t0 = time.perf_counter()
                    try:
                        eng.step()
                    except Exception as e:      # a bug or a device failure: fail the requests in flight, keep serving
                        log.exception("engine step failed")
                        if self._on_error is not None:
                            self._on_error(e)
                        self._fail_all(f"internal error in the engine step: {type(e).__name__}: {e}")
                    self.stats.steps += 1
                    self.stats.step_seconds.append(time.perf_counter() - t0)
                self._publish()
        except BaseException as e:      # a bug outside the step: nobody may wait forever
            log.exception("the engine thread failed")
            self.stats.alive = False
            for rid, t in self._tracked.items():
                try:
                    t.loop.call_soon_threadsafe(t.queue.put_nowait, Delta(
                        rid, [], True, "error", f"the engine thread failed: {type(e).__name__}: {e}", time.monotonic()))
                except RuntimeError:
                    pass
            raise
        finally:
            self.stats.alive = False

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, request, tracked = cmd
            self._tracked[rid] = tracked
            try:
                self.engine.add_request(request, request_id=rid)
            except ValueError as e:         # a request id already in use
                del self._tracked[rid]
                tracked.loop.call_soon_threadsafe(tracked.queue.put_nowait,
                                                  Delta(rid, [], True, "error", str(e), time.monotonic()))
        elif cmd[0] == "abort":
            self.engine.abort(cmd[1])
        else:
            for rid in list(self._tracked):
                self.engine.abort(rid)

    def _fail_all(self, message: str) -> None:
        """Fail every request in flight and start over with a fresh state (the failed step may have consumed
        the donated one)."""
        failed = [out for out in self.engine.outputs.values() if not out.finished]
        self.engine.reset()
        for out in failed:
            out.finish_reason, out.error = "error", message

    def _publish(self) -> None:
        """Send every tracked request its new tokens; forget the finished ones."""
        now = time.monotonic()
        for rid, t in list(self._tracked.items()):
            out = self.engine.outputs[rid]
            new = out.tokens[t.sent:]
            if not new and not out.finished:
                continue
            text = (out.text or "")[t.sent_text:]
            t.sent, t.sent_text = len(out.tokens), t.sent_text + len(text)
            d = Delta(rid, list(new), out.finished, out.finish_reason, out.error, now, text)
            if out.finished:
                del self._tracked[rid]
                self.engine.release(rid)
            try:
                t.loop.call_soon_threadsafe(t.queue.put_nowait, d)
            except RuntimeError:        # the caller's event loop has closed
                pass
        self.stats.running, self.stats.waiting = self.engine.n_running, self.engine.n_waiting
