"""Multi-process serving's protocol (serve/lockstep.py, serve/wire.py) in one process: process 0's AsyncEngine and a
follower Engine joined by an in-memory store instead of jax.distributed's. The follower replays process 0's engine
exactly (tokens, finish reasons, aborts, timeouts); mismatched engines, a follower out of step and a lost heartbeat
fail with the reason; a failed mesh answers 503 even while the engine thread is blocked in a step (a collective
waiting for a dead process). The real 2-process server is tests/serve/test_multiprocess_server.py."""

from __future__ import annotations

import asyncio
import json
import pathlib
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from conftest import golden_path

import jdeep
from jdeep.io.tokenizer import Tokenizer
from jdeep.runtime.engine import Engine
from jdeep.runtime.requests import Request, RequestError
from jdeep.runtime.sampling import SamplingParams
from jdeep.serve.async_engine import AsyncEngine
from jdeep.serve.lockstep import Lockstep, MeshFailure, StoreTimeout, follow
from jdeep.serve.server import ServerSettings, background_server
from jdeep.serve.wire import request_from_wire, request_to_wire
from jdeep.speculative.engine import make_engine
from jdeep.tools.testing.random_weights import write_word_tokenizer

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


def _pair(store: MemoryStore, peer_timeout: float = 30.0, interval: float = 0.05):
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


@pytest.fixture(scope="module")
def word_tokenizer(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    write_word_tokenizer(str(path), model.config.vocab_size)
    return Tokenizer(path)


def _replay(leader_engine: Engine, follower_engine: Engine, requests: list) -> tuple[dict, dict, MemoryStore, Lockstep]:
    """Process 0 (an AsyncEngine with the leader's side) and a follower thread over one store. requests: (prompt,
    SamplingParams, timeout) submitted together, each on its own queue; the first one is aborted by its client after
    its first delta. Returns process 0's (tokens, finish reason, text) per request id and the follower's outputs."""
    store = MemoryStore()
    leader, follower = _pair(store)
    replay = _Replay(follower_engine, follower)
    aengine = AsyncEngine(leader_engine, lockstep=leader)
    for ls in (leader, follower):
        ls.start()
    threading.Thread(target=follower.handshake, args=({"a": 1},), daemon=True).start()
    leader.handshake({"a": 1})
    replay.start()
    aengine.start()

    async def run():
        handles = [aengine.submit(aengine.check(p, s), timeout=t) for p, s, t in requests]
        got = {}
        first = await handles[0].queue.get()
        handles[0].abort()
        got[handles[0].request_id] = (first.tokens, "abort", None)
        for h in handles[1:]:
            toks, text, last = [], "", None
            async for d in h:
                toks, text, last = toks + d.tokens, text + d.text, d
            got[h.request_id] = (toks, last.finish_reason, text)
        return got

    got = asyncio.run(run())
    aengine.stop()
    replay.join(60)
    assert replay.error is None and not replay.is_alive()
    return got, replay.finished, store, leader


def _assert_same(got: dict, finished: dict) -> None:
    aborted = next(iter(got))
    assert finished[aborted].finish_reason == "abort"       # after at least its first token: not compared
    assert {rid: (out.tokens, out.finish_reason) for rid, out in finished.items() if rid != aborted} == \
        {rid: (t, r) for rid, (t, r, _) in got.items() if rid != aborted}
    others = [t for rid, (t, r, _) in got.items() if rid != aborted and r != "timeout"]
    assert len({tuple(t) for t in others}) == len(others)       # the requests really differ


def test_follower_replays_process_0(model, word_tokenizer):
    """Concurrent requests (greedy, default seeds, explicit seeds, penalties, stop ids, a stop string matched on the
    text), one aborted by its client after its first token and one past its timeout: the follower finishes every
    request with process 0's tokens and finish reason, stops with process 0, and the store keeps no message but the
    last (the stop)."""
    eng = lambda: Engine(model, max_num_seqs=2, max_len=MAX_LEN, prefill_chunk=16, seed=7, tokenizer=word_tokenizer)
    plain = jdeep.generate(model, [[0, 5, 9, 17, 33]], max_new_tokens=12).tokens[0].tolist()
    stop = f"tok{plain[4]}"                      # the greedy text's fifth word ends that request
    requests = [([0, 6, 6], SamplingParams(max_new_tokens=30), None),
                ([0, 5, 9, 17, 33], SamplingParams(max_new_tokens=12), None),
                ([0, 40, 41], SamplingParams(max_new_tokens=10, temperature=0.9), None),
                ([0] + [7] * 18 + [8], SamplingParams(max_new_tokens=8, temperature=1.0, seed=99, presence_penalty=0.5),
                 None),
                ([0, 3], SamplingParams(max_new_tokens=12, temperature=0.8, top_k=4, stop_token_ids=(11,)), None),
                ([0, 5, 9, 17, 33], SamplingParams(max_new_tokens=12, stop=(stop,)), None),
                ([0, 9], SamplingParams(max_new_tokens=30), 0.0)]
    got, finished, store, leader = _replay(eng(), eng(), requests)
    _assert_same(got, finished)
    by_stop = got["req-6"]
    assert by_stop[1] == "stop" and len(by_stop[0]) == 5 and stop not in by_stop[2]
    assert got["req-7"][1] == "timeout" and finished["req-7"].finish_reason == "timeout"
    time.sleep(0.3)                                                   # the follower's last heartbeat
    leader._watch(time.monotonic())
    assert [k for k in store.data if "/step/" in k] == [f"jdeep/serve/step/{leader.sent - 1}"]   # the stop message


@pytest.mark.full
def test_follower_replays_a_speculative_engine():
    """The MTP speculative engine (several tokens per step) replays the same way.

    Full tier: test_follower_replays_process_0 covers the replay in the default run (AsyncEngine publishing its
    commands, follow() applying add/abort through wire.apply_command, stepping and releasing finished requests;
    follow() calls only the engine's add_request/abort/step/has_work/outputs/release, which a SpeculativeEngine
    shares), and tests/speculative/test_spec_engine.py::test_server_with_speculative_config covers the MTP
    SpeculativeEngine behind the AsyncEngine and the HTTP server."""
    demo = jdeep.load(pathlib.Path(jdeep.__file__).parent / "demo_model", mtp=True, quantize_activations=False)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    eng = lambda: make_engine(demo, spec, max_num_seqs=2, max_len=96, prefill_chunk=16, ignore_eos=True)
    ids = demo.tokenizer.encode("def add(a, b):\n    return")
    requests = [(ids, SamplingParams(max_new_tokens=20), None),
                (ids, SamplingParams(max_new_tokens=10), None),
                (ids[:5], SamplingParams(max_new_tokens=9, temperature=0.8, seed=4), None)]
    got, finished, _, _ = _replay(eng(), eng(), requests)
    _assert_same(got, finished)


def test_different_engines_are_named(model):
    store = MemoryStore()
    leader, follower = _pair(store)
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
    _, follower = _pair(store)
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
    leader, follower = _pair(store, peer_timeout=0.5)
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


class _StalledStore(MemoryStore):
    """Process 0's store as a follower sees it when process 0 is stopped (SIGSTOP): a write never returns, a read
    finds nothing within its timeout."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def set(self, key: str, value: str) -> None:
        self.release.wait(60)

    def get(self, key: str, timeout: float) -> str:
        time.sleep(timeout)
        raise StoreTimeout(key)


def test_a_follower_whose_process_0_stalls_fails_within_the_peer_timeout():
    """A follower's watchdog names process 0 within the peer timeout although its heartbeat thread is stuck in a
    store write that never returns (tests/serve/test_multiprocess_server.py::test_a_stopped_process_0_ends_the_follower
    with real processes); the reason reaches on_failure (jdeep serve's exit) and a follower waiting in receive()."""
    store = _StalledStore()
    follower = Lockstep(store, 1, 2, interval=0.05, peer_timeout=0.5)
    reasons = []
    follower.on_failure = reasons.append
    t0 = time.monotonic()
    follower.start()
    try:
        with pytest.raises(MeshFailure, match=r"process 0 \(the server\) sent no heartbeat"):
            follower.receive()
        assert time.monotonic() - t0 < 0.5 + 2.0
        assert len(reasons) == 1 and reasons[0].startswith("process 0 (the server) sent no heartbeat")
    finally:
        follower.stop()
        store.release.set()


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


def test_meet_waits_for_the_slowest_process_and_fails_if_it_dies():
    """The warm-up barrier (through the store, not a collective): process 0 waits while process 1 is still compiling
    (here: 1 s late), and a process that stops beating while the other waits fails the mesh."""
    store = MemoryStore()
    leader, follower = _pair(store)
    arrived = []

    def late():
        time.sleep(1.0)
        follower.meet("warmup")
        arrived.append(time.monotonic())

    t = threading.Thread(target=late)
    t0 = time.monotonic()
    t.start()
    leader.meet("warmup")
    assert time.monotonic() - t0 >= 1.0
    t.join(10)
    assert arrived
    leader, follower = _pair(MemoryStore(), peer_timeout=0.5)
    leader.start()                               # beats, watches; its peer never beats: the mesh fails
    try:
        with pytest.raises(MeshFailure, match="process 1"):
            leader.meet("warmup", timeout=30)
    finally:
        leader.stop()
