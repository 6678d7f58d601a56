"""Multi-process serving's protocol (serve/lockstep.py, serve/wire.py) in one process: process 0's AsyncEngine and a
follower Engine joined by an in-memory store instead of jax.distributed's. The follower replays process 0's engine
exactly (tokens, finish reasons, aborts, timeouts); mismatched engines, a follower out of step and a lost heartbeat
fail with the reason; a failed mesh answers 503 even while the engine thread is blocked in a step (a collective
waiting for a dead process). The real 2-process server is tests/serve/test_multiprocess_server.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from conftest import golden_path

import jdeep
from jdeep.runtime.engine import Engine
from jdeep.runtime.requests import Request, RequestError
from jdeep.runtime.sampling import SamplingParams
from jdeep.serve.async_engine import AsyncEngine
from jdeep.serve.lockstep import Lockstep, MeshFailure, StoreTimeout, follow
from jdeep.serve.server import ServerSettings, background_server
from jdeep.serve.wire import request_from_wire, request_to_wire

MAX_LEN = 64


class MemoryStore:
    """The key-value store's interface (DistributedStore) over a dict, for processes that are threads."""

    def __init__(self):
        self.data: dict[str, str] = {}
        self.cv = threading.Condition()

    def set(self, key: str, value: str) -> None:
        with self.cv:
            self.data[key] = value
            self.cv.notify_all()

    def get(self, key: str, timeout: float) -> str:
        with self.cv:
            if not self.cv.wait_for(lambda: key in self.data, timeout):
                raise StoreTimeout(key)
            return self.data[key]

    def delete(self, key: str) -> None:
        with self.cv:
            self.data.pop(key, None)

    def disconnected(self, n_processes: int, timeout: float) -> bool:
        return True

    def leave(self) -> None:
        pass


@pytest.fixture(scope="module")
def model():
    return jdeep.load(golden_path("v4-tiny-hf"))


def _engine(model) -> Engine:
    return Engine(model, max_num_seqs=2, max_len=MAX_LEN, prefill_chunk=16, seed=7)


def _pair(model, store: MemoryStore, peer_timeout: float = 30.0, interval: float = 0.05):
    leader = Lockstep(store, 0, 2, interval=interval, peer_timeout=peer_timeout)
    follower = Lockstep(store, 1, 2, interval=interval, peer_timeout=peer_timeout)
    return leader, follower


class _Replay(threading.Thread):
    """A follower process as a thread: follow() on its own engine, keeping every request it finished."""

    def __init__(self, engine: Engine, lockstep: Lockstep):
        super().__init__(daemon=True)
        self.engine, self.lockstep, self.finished, self.error = engine, lockstep, {}, None
        release = engine.release

        def keep(rid):
            self.finished[rid] = release(rid)
            return self.finished[rid]

        engine.release = keep

    def run(self):
        try:
            follow(self.engine, self.lockstep)
        except BaseException as e:     # the test reads it
            self.error = e


def test_sampling_params_travel_exactly():
    p = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=12345, max_new_tokens=9,
                       stop_token_ids=(3, 4), stop=("ab", "\n\n"), presence_penalty=0.5, frequency_penalty=0.25,
                       repetition_penalty=1.1, logit_bias=((7, -1.5), (9, 2.0)), min_tokens=2, logprobs=3,
                       prompt_logprobs=1, skip_special_tokens=False)
    r = Request(np.array([1, 2, 3], np.int32), p, (3, 4, 1))
    back = request_from_wire(json.loads(json.dumps(request_to_wire(r))))
    assert back.params == p and back.stop_ids == r.stop_ids
    assert back.ids.dtype == np.int32 and back.ids.tolist() == [1, 2, 3]
    with pytest.raises(RequestError, match="image prompts are not served by a multi-process server"):
        request_to_wire(Request(r.ids, p, (), images=((0, np.zeros((2, 4))),)))
    with pytest.raises(ValueError, match="same jdeep version"):
        request_from_wire({"ids": [1], "params": {"temperature": 0.0, "beam_width": 4}, "stop_ids": []})


def test_follower_replays_process_0(model):
    """Concurrent requests (greedy, default seeds, explicit seeds, penalties, stop ids), one aborted by its client
    after its first token and one past its timeout: the follower finishes every request with process 0's tokens
    and finish reason, stops with process 0, and the store keeps no message but the last (the stop)."""
    store = MemoryStore()
    leader, follower = _pair(model, store)
    replay = _Replay(_engine(model), follower)
    aengine = AsyncEngine(_engine(model), lockstep=leader)
    for ls in (leader, follower):
        ls.start()
    threading.Thread(target=follower.handshake, args=({"a": 1},), daemon=True).start()
    leader.handshake({"a": 1})
    replay.start()
    aengine.start()
    prompts = [[0, 5, 9, 17, 33], [0, 40, 41], [0, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 8], [0, 3]]
    params = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=10, temperature=0.9),
              SamplingParams(max_new_tokens=8, temperature=1.0, seed=99, presence_penalty=0.5),
              SamplingParams(max_new_tokens=12, temperature=0.8, top_k=4, stop_token_ids=(11,))]

    async def run():
        handles = [aengine.submit(aengine.check(p, s)) for p, s in zip(prompts, params)]
        aborted = aengine.submit(aengine.check([0, 6, 6], SamplingParams(max_new_tokens=30)))
        timed = aengine.submit(aengine.check([0, 9], SamplingParams(max_new_tokens=30)), timeout=0.0)
        got = {}
        for h in handles + [timed]:
            toks, last = [], None
            async for d in h:
                toks += d.tokens
                last = d
            got[h.request_id] = (toks, last.finish_reason)
        first = await aborted.queue.get()
        aborted.abort()
        got[aborted.request_id] = (first.tokens, "abort")
        return got

    got = asyncio.run(run())
    aengine.stop()
    replay.join(30)
    assert replay.error is None and not replay.is_alive()
    assert {rid: (out.tokens, out.finish_reason) for rid, out in replay.finished.items()
            if rid != "req-5"} == {rid: v for rid, v in got.items() if rid != "req-5"}
    assert replay.finished["req-5"].finish_reason == "abort"          # aborted after at least its first token
    assert got["req-6"][1] == "timeout" and replay.finished["req-6"].finish_reason == "timeout"
    assert len({tuple(t) for t, _ in got.values()}) == len(got)      # the requests really differ
    time.sleep(0.3)                                                   # the follower's last heartbeat
    leader._watch(time.monotonic())
    assert [k for k in store.data if "/step/" in k] == [f"jdeep/serve/step/{leader.sent - 1}"]   # the stop message


def test_different_engines_are_named(model):
    store = MemoryStore()
    leader, follower = _pair(model, store)
    errors = []

    def join():
        try:
            follower.handshake({"max_len": 128, "seed": 0})
        except ValueError as e:
            errors.append(str(e))

    t = threading.Thread(target=join)
    t.start()
    with pytest.raises(ValueError, match=r"process 1 runs a different server: max_len: process 0 has 64, process 1 "
                                         r"has 128"):
        leader.handshake({"max_len": 64, "seed": 0})
    t.join(10)
    assert errors and "same model and engine flags" in errors[0]


def test_a_follower_out_of_step_stops(model):
    store = MemoryStore()
    _, follower = _pair(model, store)
    engine = _engine(model)
    engine.add_request([0, 5, 9])               # work process 0 does not know about
    store.set("jdeep/serve/step/0", json.dumps({"n": 0, "cmds": [], "step": False, "stop": False}))
    with pytest.raises(MeshFailure, match="out of step with process 0 at message 0"):
        follow(engine, follower)


def test_a_lost_heartbeat_fails_the_mesh_with_503(model):
    """The follower stops beating while process 0's engine thread is blocked inside a step (as in a collective
    whose peer died): /health and new requests answer 503 naming process 1 within the peer timeout, and the
    request in flight ends with 503 instead of hanging."""
    store = MemoryStore()
    leader, follower = _pair(model, store, peer_timeout=0.5)
    for ls in (leader, follower):
        ls.start()
    engine = _engine(model)
    stuck = threading.Event()
    entered = threading.Event()

    def step():
        entered.set()
        stuck.wait(60)
        return []

    engine.step = step
    settings = ServerSettings("v4-tiny")
    with background_server(engine, settings, lockstep=leader) as (url, _):
        assert _get(url[:-3] + "/health")[0] == 200
        result = {}
        t = threading.Thread(target=lambda: result.update(r=_post(url + "/completions", [0, 5, 9])))
        t.start()
        assert entered.wait(30)
        follower.stop()
        t0 = time.monotonic()
        t.join(30)
        waited = time.monotonic() - t0
        status, body = result["r"]
        assert status == 503 and "process 1 of 2 sent no heartbeat" in body["error"]["message"]
        assert waited < 0.5 + 2.0
        status, health = _get(url[:-3] + "/health")
        assert status == 503 and health["status"] == "mesh failed" and health["processes"] == 2
        assert health["in_step"] is False and "process 1 of 2" in health["error"]
        assert _post(url + "/completions", [0, 5])[0] == 503
        metrics = urllib.request.urlopen(url[:-3] + "/metrics", timeout=30).read().decode()
        assert "jdeep_mesh_failed 1" in metrics and "jdeep_mesh_processes 2" in metrics
        stuck.set()


def _get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _post(url: str, prompt: list[int]):
    body = json.dumps({"model": "v4-tiny", "prompt": prompt, "max_tokens": 4}).encode()
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
