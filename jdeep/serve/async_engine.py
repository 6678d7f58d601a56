"""The continuous-batching engine on its own thread, fed by asyncio callers (the HTTP server).

One engine thread owns the Engine: it takes submitted and aborted requests from an inbox between steps,
runs `Engine.step()` while any request is waiting or running, and hands every request's new tokens and the text
they completed (the engine detokenises and matches stop strings) to its caller's asyncio queue
(`loop.call_soon_threadsafe`), one Delta per step. Callers never touch the Engine:
`submit` returns a RequestHandle (an async iterator of Deltas); `handle.abort()` (a client went away) ends
the request at the next step boundary and frees its slot. A step that raises fails the requests in flight
with an error and the thread keeps serving (the Engine itself isolates failures of one request's host work).

Back-pressure and deadlines: with `max_waiting`, `submit` refuses (QueueFull) requests that would leave more than
that many waiting for a slot, i.e. more than slots + max_waiting in flight (counted from submission to the end of
the request, so a burst cannot overshoot); a request given a `timeout` is finished by the engine thread once it
has been in flight that long (finish_reason "timeout", its slot freed).

Across processes (serve/lockstep.py): given a `lockstep` (process 0's side), every command the engine thread applies
to the Engine (requests added, aborts, timeouts) is published with whether the engine steps, before the step, so the
other processes replay it. A failed step or a lost process fails the mesh: the requests in flight end with
finish_reason "abort" and the reason, `submit` refuses new ones with it, and the engine thread stops (nothing can
step a mesh that lost a process).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from ..runtime.engine import Engine
from ..runtime.requests import Request
from ..runtime.sampling import SamplingParams
from .handles import Delta, QueueFull, RequestHandle
from .lockstep import Lockstep, MeshFailure
from .wire import request_to_wire

__all__ = ["AsyncEngine", "Delta", "RequestHandle", "QueueFull"]

log = logging.getLogger("jdeep.serve")


@dataclass
class _Tracked:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sent: int = 0          # tokens already handed over
    sent_prompt: bool = False    # prompt logprobs handed over
    sent_text: int = 0     # characters of the text already handed over
    deadline: float | None = None    # time.monotonic() after which the request is finished with "timeout"
    timeout: float | None = None


@dataclass
class EngineStats:
    """A snapshot the engine thread refreshes after every iteration (read from any thread)."""

    slots: int = 0
    running: int = 0
    waiting: int = 0
    steps: int = 0
    alive: bool = False
    error: str | None = None       # why the engine stopped (a failed mesh)
    restarts: int = 0              # times the engine thread failed outside a step and restarted the engine
    warming: bool = False          # compiling the engine's programs (`AsyncEngine(warmup=True)`): requests wait
    compiled: int = 0              # programs of the warm-up's inventory compiled so far
    total: int = 0                 # programs the warm-up compiles (0: no warm-up on the engine thread)
    compile_seconds: float = 0.0   # the warm-up's time so far


class AsyncEngine:
    """engine = AsyncEngine(Engine(model, ...)); engine.start(); h = engine.submit(ids, params); async for d in h."""

    def __init__(self, engine: Engine, on_error: Callable[[BaseException], None] | None = None,
                 max_waiting: int | None = None, lockstep: Lockstep | None = None, warmup: bool = False,
                 on_compiled: Callable[[int, int, float, bool], None] | None = None):
        """max_waiting: how many requests may wait for a slot (None: no limit). lockstep: process 0's side of a
        multi-process server (its failures end the engine: `fail_mesh`). warmup: the engine thread first compiles
        the engine's programs (Engine.warmup; stats.warming, compiled, total, compile_seconds follow it; requests
        submitted meanwhile wait), on_compiled(done, total, seconds, finished) after each compile (finished False) and
        once when warm-up is done (True)."""
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self._in_flight = 0        # submitted requests not yet finished (the admission count)
        self._cv = threading.Condition()
        self._inbox: list[tuple] = []
        self._tracked: dict[str, _Tracked] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._n = 0
        self._on_error = on_error
        self.on_step: Callable[[float], None] | None = None    # called (engine thread) with each step's seconds
        self.stats = EngineStats(slots=engine.n_slots, warming=warmup)
        self._on_compiled = on_compiled
        self.lockstep = lockstep
        self._applied: list = []     # commands applied since the last lockstep message (wire form)
        if lockstep is not None:
            lockstep.on_failure = self.fail_mesh

    # ------------------------------------------------------------------ caller side (any thread / event loop)
    def start(self) -> "AsyncEngine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="jdeep-engine", daemon=True)
            self.stats.alive = True
            self._thread.start()
        return self

    def check(self, prompt: Sequence[int] | str, params: SamplingParams) -> Request:
        """Validate without queueing (Engine.check_request): the Request, or RequestError (also for what the other
        processes of a multi-process server cannot replay)."""
        request = self.engine.check_request(prompt, params)
        if self.lockstep is not None:
            request_to_wire(request)
        return request

    @property
    def n_waiting(self) -> int:
        """Requests in flight beyond the engine's slots (what max_waiting bounds)."""
        return max(0, self._in_flight - self.engine.n_slots)

    def submit(self, request: Request, queue: asyncio.Queue | None = None, request_id: str | None = None,
               timeout: float | None = None) -> RequestHandle:
        """Queue a validated request (from `check`) from a coroutine; its Deltas go to `queue` (a new one by
        default; several requests may share one, Delta.request_id tells them apart). timeout: seconds from now
        after which it is finished with finish_reason "timeout". QueueFull past max_waiting."""
        return self.submit_all([request], queue, timeout, [request_id])[0]

    def submit_all(self, requests: Sequence[Request], queue: asyncio.Queue | None = None,
                   timeout: float | None = None, request_ids: Sequence[str | None] | None = None
                   ) -> list[RequestHandle]:
        """Queue several requests sharing `queue`: all of them, or none (QueueFull) when they would take the
        requests waiting for a slot past max_waiting."""
        if self.stats.error is not None:
            raise RuntimeError(self.stats.error)
        if self._stopping or self._thread is None or not self.stats.alive:
            raise RuntimeError("the engine is not running")
        loop = asyncio.get_running_loop()
        q = queue if queue is not None else asyncio.Queue()
        deadline = None if timeout is None else time.monotonic() + timeout
        handles = []
        with self._cv:
            if (self.max_waiting is not None
                    and self._in_flight + len(requests) > self.engine.n_slots + self.max_waiting):
                raise QueueFull(self.n_waiting, len(requests), self.max_waiting)
            self._in_flight += len(requests)
            for k, request in enumerate(requests):
                self._n += 1
                rid = (request_ids[k] if request_ids else None) or f"req-{self._n}"
                self._inbox.append(("add", rid, request, _Tracked(loop, q, deadline=deadline, timeout=timeout)))
                handles.append(RequestHandle(self, rid, q))
            self._cv.notify()
        return handles

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
        if self.lockstep is not None and self.stats.error is None:     # the followers leave first (lockstep.close)
            if not self.lockstep.close(timeout if timeout is not None else 30.0):
                log.error("the other processes of the server did not stop within %s s", timeout)

    def _post(self, cmd: tuple) -> None:
        with self._cv:
            self._inbox.append(cmd)
            self._cv.notify()

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        """The engine thread: `_serve` until it stops. A failure outside the engine step (the thread's own host work:
        a bug) fails the requests in flight and restarts the engine with a fresh state (`_restart`), so one bad
        moment never leaves the server without an engine; with a lockstep mesh it fails the mesh instead."""
        try:
            if self.stats.warming and not self._warmup():
                self._fail_tracked(self.stats.error)
                return
            while True:
                try:
                    self._serve()
                    return
                except Exception as e:      # noqa: BLE001
                    reason = f"the engine thread failed: {type(e).__name__}: {e}"
                    if self.lockstep is not None:     # the processes may no longer agree: the mesh is done
                        log.exception("the engine thread failed")
                        self.fail_mesh(reason)
                        return
                    log.exception("the engine thread failed; the engine restarts")
                    if not self._restart(reason):
                        return
        except BaseException as e:      # the interpreter is going away: nobody may wait forever
            self._fail_tracked(f"the engine thread stopped: {type(e).__name__}: {e}")
            raise
        finally:
            self.stats.alive = False

    def _warmup(self) -> bool:
        """Engine.warmup on the engine thread, its progress in stats; False if it failed (stats.error says why: the
        thread stops, /health reports it, the requests waiting get the error)."""
        st, t0 = self.stats, time.perf_counter()

        def progress(done: int, total: int, secs: float) -> None:
            st.compiled, st.total, st.compile_seconds = done, total, secs
            if self._on_compiled is not None:
                self._on_compiled(done, total, secs, False)

        try:
            n = self.engine.warmup(progress=progress)
        except Exception as e:          # noqa: BLE001
            log.exception("the warm-up failed")
            st.error = f"the warm-up failed: {type(e).__name__}: {e}"
            return False
        finally:
            st.compile_seconds = time.perf_counter() - t0
            st.warming = False
        st.total = st.total or n        # (a model on a mesh compiles as warm-up runs it: no progress calls)
        st.compiled = st.total
        if self._on_compiled is not None:
            self._on_compiled(st.compiled, st.total, st.compile_seconds, True)
        return True

    def _fail_tracked(self, message: str) -> None:
        """Every tracked request's caller gets a final error Delta; the requests are forgotten."""
        now = time.monotonic()
        tracked, self._tracked = self._tracked, {}
        for rid, t in tracked.items():
            _send(t, Delta(rid, [], True, "error", message, now))
        self._done(len(tracked))

    def _restart(self, reason: str) -> bool:
        """Fail the requests in flight with `reason` and give the engine a fresh state; False if even that fails
        (the thread then stops: /health reports it and new requests get 503)."""
        self.stats.restarts += 1
        self._fail_tracked(reason)
        try:
            self.engine.reset()
            for rid in list(self.engine.outputs):
                self.engine.release(rid)
        except Exception:               # noqa: BLE001
            log.exception("the engine could not be restarted; it stops")
            self.stats.error = f"{reason}; restarting the engine failed too"
            return False
        return True

    def _serve(self) -> None:
        eng = self.engine
        while True:
            with self._cv:
                while (not self._inbox and not eng.has_work and not self._stopping
                       and self.stats.error is None):
                    self._cv.wait()
                inbox, self._inbox = self._inbox, []
                stopping = self._stopping
            if self.stats.error is not None:
                return
            for cmd in inbox:
                self._apply(cmd)
            self._expire(time.monotonic())
            if stopping:
                for rid in list(self._tracked):
                    self._abort(rid)
                self._sync(step=False, stop=True)
                self._publish()
                return
            if not self._sync(step=eng.has_work):
                return
            if eng.has_work:
                t0 = time.perf_counter()
                try:
                    eng.step()
                except Exception as e:      # a bug or a device failure: fail the requests in flight, keep serving
                    if self.lockstep is not None:     # the processes may no longer agree: the mesh is done
                        self.fail_mesh(f"an engine step failed on process 0: {type(e).__name__}: {e}")
                        return
                    log.exception("engine step failed")
                    if self._on_error is not None:
                        self._on_error(e)
                    self._fail_all(f"internal error in the engine step: {type(e).__name__}: {e}")
                if self.lockstep is not None:
                    self.lockstep.step_done()
                self.stats.steps += 1
                if self.on_step is not None:
                    try:
                        self.on_step(time.perf_counter() - t0)
                    except Exception:       # noqa: BLE001 (a metrics hook never stops the engine)
                        log.exception("the on_step hook failed")
            self._publish()

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, request, tracked = cmd
            try:
                wire = request_to_wire(request) if self.lockstep is not None else None
                self.engine.add_request(request, request_id=rid)
            except Exception as e:          # a request id already in use, or a bug: this request alone fails
                self._done(1)
                _send(tracked, Delta(rid, [], True, "error", f"{type(e).__name__}: {e}", time.monotonic()))
                return
            self._tracked[rid] = tracked
            if wire is not None:
                self._applied.append(["add", rid, wire])
        elif cmd[0] == "abort":
            self._abort(cmd[1])
        else:
            for rid in list(self._tracked):
                self._abort(rid)

    def _abort(self, rid: str, reason: str = "abort", error: str | None = None) -> None:
        """Engine.abort, recorded for the other processes of a multi-process server."""
        if self.engine.abort(rid, reason, error) and self.lockstep is not None:
            self._applied.append(["abort", rid, reason, error])

    def _sync(self, step: bool, stop: bool = False) -> bool:
        """Multi-process: publish the commands applied since the last message and whether the engine steps (nothing
        to publish when nothing changed and no step follows). False when the mesh has failed."""
        if self.lockstep is None or not (self._applied or step or stop):
            return True
        try:
            self.lockstep.publish(self._applied, step, stop)
        except MeshFailure as e:
            self.fail_mesh(str(e))
            return False
        self._applied = []
        return True

    def fail_mesh(self, reason: str) -> None:
        """The mesh lost a process or fell out of step (any thread; once): every request in flight ends with
        finish_reason "abort" and the reason, new ones are refused with it, the engine thread stops."""
        with self._cv:
            if self.stats.error is not None:
                return
            self.stats.error = f"the server's mesh failed: {reason}"
            self._cv.notify()
        log.error("%s", self.stats.error)
        if self.lockstep is not None:
            self.lockstep.fail(reason)       # its heartbeat tells the other processes to stop
        now = time.monotonic()
        for rid, t in list(self._tracked.items()):
            _send(t, Delta(rid, [], True, "abort", self.stats.error, now))

    def _expire(self, now: float) -> None:
        """Finish every request past its deadline ("timeout"; the engine frees its slot)."""
        for rid, t in self._tracked.items():
            if t.deadline is not None and now >= t.deadline:
                out = self.engine.outputs.get(rid)
                n = len(out.tokens) if out is not None else 0
                self._abort(rid, "timeout", f"the request timed out after {t.timeout:g} s (the server's "
                                                  f"--request-timeout) with {n} tokens generated; it was cancelled")

    def _fail_all(self, message: str) -> None:
        """Fail every request in flight and start over with a fresh state (the failed step may have consumed
        the donated one)."""
        failed = [out for out in self.engine.outputs.values() if not out.finished]
        self.engine.reset()
        for out in failed:
            out.finish_reason, out.error = "error", message

    def _publish(self) -> None:
        """Send every tracked request its new tokens; forget the finished ones. A request whose Delta cannot be
        built (a bug in its own host work) ends alone with an error."""
        now = time.monotonic()
        ended = 0
        for rid, t in list(self._tracked.items()):
            try:
                d = self._delta(rid, t, now)
            except Exception as e:      # noqa: BLE001
                log.exception("request %s: its output could not be handed over", rid)
                self._abort(rid, "error", f"internal error while handing over this request's output: "
                                          f"{type(e).__name__}: {e}")
                d = Delta(rid, [], True, "error", f"internal error: {type(e).__name__}: {e}", now)
            if d is None:
                continue
            if d.finished:
                del self._tracked[rid]
                self.engine.release(rid)
                ended += 1
            _send(t, d)
        self._done(ended)
        self.stats.running, self.stats.waiting = self.engine.n_running, self.engine.n_waiting

    def _delta(self, rid: str, t: _Tracked, now: float) -> Delta | None:
        """The request's Delta since the last one (None: nothing new)."""
        out = self.engine.outputs.get(rid)
        if out is None:             # (a bug) the record is gone: the caller must still hear of it
            return Delta(rid, [], True, "error", "the engine lost this request", now)
        new = out.tokens[t.sent:]
        if not new and not out.finished:
            return None
        text = (out.text or "")[t.sent_text:]
        t.sent, t.sent_text = len(out.tokens), t.sent_text + len(text)
        lps, plps = out.logprobs, out.prompt_logprobs
        d = Delta(rid, list(new), out.finished, out.finish_reason, out.error, now, text,
                  None if lps is None else list(lps[t.sent - len(new):t.sent]),
                  None if plps is None or t.sent_prompt else list(plps))
        t.sent_prompt = t.sent_prompt or plps is not None
        return d

    def _done(self, n: int) -> None:
        """n requests have left the engine: they no longer count against max_waiting."""
        if n:
            with self._cv:
                self._in_flight -= n


def _send(t: _Tracked, d: Delta) -> None:
    """Hand a Delta to its caller's event loop (nothing to do once that loop has closed)."""
    try:
        t.loop.call_soon_threadsafe(t.queue.put_nowait, d)
    except RuntimeError:
        pass
