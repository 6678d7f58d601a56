"""Serving from several processes (multi-controller JAX): process 0 runs the HTTP server and the scheduler; every
process runs the same engine steps in lockstep.

JAX's multi-controller model needs the same programs with the same inputs on every process. The Engine is
deterministic given the requests added, the aborts and the steps taken (seeds, slots, chunks and stop decisions
depend on nothing else, and its tokens come out of programs whose results every process holds), so each process
other than 0 (a follower) keeps an Engine of its own that replays process 0's. Before each step process 0 publishes
one message: the commands it applied to its engine since the last message (serve/wire.py: requests added with their
token ids and sampling parameters, aborts with their reason) and whether it steps. A follower applies the same
commands, checks that it agrees about stepping (else the processes are out of step and it stops), and steps.

Transport: the distributed runtime's key-value store (the coordination service jax.distributed runs in process 0),
not a JAX collective. A message's size varies with its prompts; a collective needs a fixed shape (a buffer sized for
the longest prompt, or a second collective for the size), is a device program (on Neuron a compiled program and
traffic on the device links every step) and cannot time out, so a dead peer would hang it. The store takes a message
of any size in one RPC (about 0.5 ms on one host), its reads take a timeout, and its failures say which side is gone.

Liveness: every process writes a heartbeat (a counter and the messages it has finished) every `interval` seconds from
a thread of its own, so a long compile does not stop it, and reads the others' from another (a write to a stopped
process 0's store never returns; the reads time out). Process 0 declares the mesh failed when a follower's
heartbeat has not changed for `peer_timeout` seconds, or when a publish or a step fails; its server then answers 503
to new requests, ends the requests in flight with the reason and reports it on /health. A multi-controller program
cannot go on without one of its processes, so nothing recovers: every process must be restarted. A follower exits
with the reason when process 0's heartbeat stops, the store is gone, process 0 reports a failed mesh, or its step fails.

Stopping: process 0's last message says so; the followers leave the coordination service, then process 0 does
(`close`). Its process hosts the service, and a service gone first takes the followers down with a fatal runtime
error; the runtime's own exit barrier does not order this when process 0 answers 503 instead of dying with a peer
(jax_enable_recoverability, set by `jdeep serve`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from jax._src import distributed as _distributed    # the runtime's client: JAX exposes its store only here

from .wire import apply_command

__all__ = ["MeshFailure", "StoreTimeout", "DistributedStore", "Lockstep", "PeerStatus", "follow"]

log = logging.getLogger("jdeep.serve")

PREFIX = "jdeep/serve"
INTERVAL_S = 0.5          # heartbeat period
PEER_TIMEOUT_S = 5.0      # a heartbeat unchanged this long: the process is dead or stopped
LAG_STEPS = 1             # a follower in step has finished within this many messages of process 0


class MeshFailure(RuntimeError):
    """A process of the mesh died, stalled or fell out of step: the multi-process program cannot go on."""


class StoreTimeout(Exception):
    """A store read found no value within its timeout."""


class DistributedStore:
    """The key-value store of jax.distributed's coordination service (process 0 hosts it). get raises StoreTimeout
    when the key is not there in time and MeshFailure when the service cannot be reached."""

    def __init__(self, client=None):
        if client is None:
            client = _distributed.global_state.client
            if client is None:
                raise RuntimeError("jax.distributed is not initialised")
        self.client = client

    def set(self, key: str, value: str) -> None:
        try:
            self.client.key_value_set(key, value, allow_overwrite=True)
        except Exception as e:
            raise MeshFailure(f"the coordination service (process 0) cannot be reached: {_first_line(e)}") from None

    def get(self, key: str, timeout: float) -> str:
        try:
            return self.client.blocking_key_value_get(key, max(1, int(timeout * 1000)))
        except Exception as e:
            text = str(e)
            if text.startswith("DEADLINE_EXCEEDED") or text.startswith("NOT_FOUND"):
                raise StoreTimeout(key) from None
            raise MeshFailure(f"the coordination service (process 0) cannot be reached: {_first_line(e)}") from None

    def disconnected(self, n_processes: int, timeout: float) -> bool:
        """Process 0: wait until every other process has left the coordination service (the runtime's live-node
        barrier returns once they disconnected); False after `timeout` seconds."""
        done = threading.Event()

        def wait() -> None:
            try:
                self.client.get_live_nodes(list(range(n_processes)))
            except Exception:       # the service already counts them as gone: nothing left to wait for       # the service already failed them: nothing left to wait for
                pass
            done.set()

        threading.Thread(target=wait, name="jdeep-shutdown", daemon=True).start()
        return done.wait(timeout)

    def leave(self) -> None:
        """A follower: disconnect from the coordination service now (jax.distributed.shutdown)."""
        _distributed.shutdown()

    def delete(self, key: str) -> None:
        try:
            self.client.key_value_delete(key)
        except Exception:       # a key left behind costs a few bytes in the service; never a reason to fail
            pass


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


@dataclass
class PeerStatus:
    """What process 0 last heard from one process: its heartbeat counter, the messages it has finished, and when the
    counter last changed (time.monotonic())."""

    process: int
    beat: int = -1
    steps: int = 0
    changed: float = field(default_factory=time.monotonic)


class Lockstep:
    """One process's side of a multi-process server: `Lockstep(store, process_id, n_processes).start()`.

    On process 0 (`leader`): `handshake`, then `publish` before each step and `step_done` after it. On the others:
    `handshake`, then `receive` the messages in order (serve.lockstep.follow runs the loop). `on_failure` is called
    once with the reason, from the heartbeat thread or the engine thread: the server fails its requests, a follower
    ends its process (its main thread may be blocked in a collective that never completes)."""

    def __init__(self, store, process_id: int, n_processes: int, interval: float = INTERVAL_S,
                 peer_timeout: float = PEER_TIMEOUT_S):
        if not peer_timeout > interval > 0:
            raise ValueError(f"the peer timeout ({peer_timeout} s) must exceed the heartbeat interval ({interval} s)")
        self.store, self.process_id, self.n_processes = store, process_id, n_processes
        self.interval, self.peer_timeout = interval, peer_timeout
        self.leader = process_id == 0
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self.sent = 0              # process 0: messages published
        self.completed = 0         # messages whose step this process has finished
        self._done_at: deque[tuple[float, int]] = deque(maxlen=4096)   # process 0: (time, completed) after each step
        self._deleted = 0
        self._lock = threading.Lock()
        watched = range(1, n_processes) if self.leader else [0]
        self.peers = {i: PeerStatus(i) for i in watched}
        self._beat = 0
        self._stop = threading.Event()

    def _key(self, *parts: Any) -> str:
        return "/".join((PREFIX,) + tuple(str(p) for p in parts))

    # ------------------------------------------------------------------ heartbeats (their own thread)
    def start(self) -> "Lockstep":
        """Start beating and watching, each on its own thread: a write to a stopped process 0's store never returns
        (the store's writes take no timeout), and the watcher, whose reads do, must still notice it."""
        for name, loop in (("jdeep-heartbeat", self._beat_loop), ("jdeep-watchdog", self._watch_loop)):
            threading.Thread(target=loop, name=name, daemon=True).start()
        return self

    def stop(self) -> None:
        """End the heartbeats and the watching."""
        self._stop.set()

    def close(self, timeout: float = 30.0) -> bool:
        """Leave after a clean stop, in order: the followers disconnect, then process 0 (whose process hosts the
        coordination service: gone first, it would take the followers down with a fatal runtime error). With the
        runtime's recoverable tasks its own exit barrier does not order this. False when process 0 gave up waiting."""
        self.stop()
        if not self.leader:
            self.store.leave()
            return True
        return self.store.disconnected(self.n_processes, timeout)

    def _beat_loop(self) -> None:
        while not self._stop.is_set():
            self._beat += 1
            beat = {"beat": self._beat, "steps": self.completed}
            if self.failure is not None and self.leader:
                beat["failed"] = self.failure
            self._guarded(lambda: self.store.set(self._key("alive", self.process_id), json.dumps(beat)))
            self._stop.wait(self.interval)

    def _watch_loop(self) -> None:
        while not self._stop.is_set():
            self._guarded(lambda: self._watch(time.monotonic()))
            self._stop.wait(self.interval)

    def _guarded(self, fn: Callable[[], None]) -> None:
        """Run one store operation; a lost store fails the mesh (unless the server is stopping anyway)."""
        try:
            fn()
        except MeshFailure as e:
            if not self._stop.is_set():
                self.fail(str(e))

    def _watch(self, now: float) -> None:
        """Read the watched processes' heartbeats; fail the mesh for one unchanged past the peer timeout."""
        for p in self.peers.values():
            try:
                beat = json.loads(self.store.get(self._key("alive", p.process), self.interval))
            except StoreTimeout:
                beat = None
            if beat is not None and beat["beat"] != p.beat:
                p.beat, p.steps, p.changed = beat["beat"], beat["steps"], now
                if beat.get("failed"):
                    self.fail(f"process 0 reported a failed mesh: {beat['failed']}")
            elif now - p.changed > self.peer_timeout:
                who = "process 0 (the server)" if p.process == 0 else f"process {p.process} of {self.n_processes}"
                self.fail(f"{who} sent no heartbeat for {now - p.changed:.1f} s (the --peer-timeout is "
                          f"{self.peer_timeout:g} s): it died, was stopped or lost the network; restart every process "
                          "of the server")
        if self.leader and self.peers:
            finished = min(p.steps for p in self.peers.values())
            for n in range(self._deleted, finished):         # every follower has read these messages
                self.store.delete(self._key("step", n))
            self._deleted = max(self._deleted, finished)

    def fail(self, reason: str) -> None:
        """Declare the mesh failed (once): on_failure hears the reason."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
        if self.on_failure is not None:
            self.on_failure(reason)

    # ------------------------------------------------------------------ start-up
    def handshake(self, settings: dict[str, Any], timeout: float = 3600.0) -> None:
        """Check that every process built the same engine before any of them runs a program: process 0 publishes
        `settings` (JSON values), every follower compares its own and answers; ValueError naming the differences
        (on process 0 for each follower that differs), MeshFailure when a process dies on the way."""
        if self.leader:
            self.store.set(self._key("settings"), json.dumps(settings, sort_keys=True))
            for pid in range(1, self.n_processes):
                answer = self._wait(self._key("ready", pid), timeout)
                if answer != "ok":
                    raise ValueError(f"process {pid} runs a different server: {answer}")
            return
        theirs = json.loads(self._wait(self._key("settings"), timeout))
        ours = json.loads(json.dumps(settings, sort_keys=True))
        diff = [f"{k}: process 0 has {theirs.get(k)!r}, process {self.process_id} has {ours.get(k)!r}"
                for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k)]
        self.store.set(self._key("ready", self.process_id), "ok" if not diff else "; ".join(diff))
        if diff:
            raise ValueError("every process of a multi-process server needs the same model and engine flags; "
                             + "; ".join(diff))

    def meet(self, name: str, timeout: float = 3600.0) -> None:
        """A barrier through the coordination service, not a collective: every process waits here until all have
        arrived (a process that compiles longer makes the others wait, with heartbeats, instead of timing out a
        collective). MeshFailure when a process dies on the way or `timeout` seconds pass."""
        self.store.set(self._key("meet", name, self.process_id), "here")
        for pid in range(self.n_processes):
            if pid != self.process_id:
                self._wait(self._key("meet", name, pid), timeout)

    def _wait(self, key: str, timeout: float) -> str:
        """A store value, waiting up to `timeout` seconds while the heartbeats say the mesh is alive."""
        end = time.monotonic() + timeout
        while True:
            if self.failure is not None:
                raise MeshFailure(self.failure)
            try:
                return self.store.get(key, self.interval)
            except StoreTimeout:
                if time.monotonic() > end:
                    raise MeshFailure(f"no answer for {key} within {timeout:g} s") from None

    # ------------------------------------------------------------------ process 0
    def publish(self, commands: list, step: bool, stop: bool = False) -> None:
        """Send the next message: the commands applied to the engine since the last one, whether the engine steps,
        whether the server is stopping. MeshFailure once the mesh has failed."""
        if self.failure is not None:
            raise MeshFailure(self.failure)
        msg = json.dumps({"n": self.sent, "cmds": commands, "step": step, "stop": stop}, separators=(",", ":"))
        self.store.set(self._key("step", self.sent), msg)
        self.sent += 1

    def step_done(self) -> None:
        """Process 0 finished the step of its last message."""
        self.completed = self.sent
        self._done_at.append((time.monotonic(), self.completed))

    def status(self) -> dict[str, Any]:
        """What /health and /metrics report: processes, whether they are in step, each one's heartbeat age and the
        messages it has finished. A follower is in step when its heartbeat is fresh and, allowing for the heartbeat
        period, it has finished within LAG_STEPS messages of process 0 (the steps' collectives keep them that close;
        more means one of them is stuck)."""
        now = time.monotonic()
        then = now - 3 * self.interval    # a heartbeat read may be two periods old
        reference = next((n for t, n in reversed(self._done_at) if t <= then), 0)
        procs = [{"process": 0, "steps": self.completed, "heartbeat_age_s": 0.0, "in_step": self.failure is None}]
        for p in self.peers.values():
            age = now - p.changed
            procs.append({"process": p.process, "steps": p.steps, "heartbeat_age_s": round(age, 3),
                          "in_step": self.failure is None and age < self.peer_timeout
                          and p.steps >= reference - LAG_STEPS})
        return {"processes": self.n_processes, "in_step": all(p["in_step"] for p in procs), "failed": self.failure,
                "by_process": procs}

    # ------------------------------------------------------------------ followers
    def receive(self) -> dict[str, Any]:
        """The next message from process 0 (blocks while the server is idle); MeshFailure when the mesh failed."""
        key = self._key("step", self.completed)
        while True:
            if self.failure is not None:
                raise MeshFailure(self.failure)
            try:
                return json.loads(self.store.get(key, self.interval))
            except StoreTimeout:
                continue


def follow(engine, lockstep: Lockstep) -> None:
    """A follower's loop: replay process 0's messages on `engine` until process 0 stops the server. MeshFailure
    when the mesh fails, or when this engine disagrees with process 0 about stepping (out of step)."""
    while True:
        msg = lockstep.receive()
        for cmd in msg["cmds"]:
            apply_command(engine, cmd)
        if not msg["stop"] and msg["step"] != engine.has_work:
            raise MeshFailure(f"process {lockstep.process_id} is out of step with process 0 at message {msg['n']}: "
                              f"it {'has' if engine.has_work else 'has no'} work to step")
        if msg["step"] and not msg["stop"]:
            engine.step()
        for rid in [rid for rid, out in engine.outputs.items() if out.finished]:    # as process 0 forgets them
            engine.release(rid)
        if msg["stop"]:
            return
        lockstep.completed += 1
