"""`jdeep serve` as a 2-process multi-controller program (2 x 4 CPU devices, mesh data=2,expert=4, jax.distributed on
localhost, gloo collectives), warmed up as deployed (every process compiles its inventory, then they meet):
concurrent streaming requests get the tokens of a single-process server on the same
model; killing process 1 makes process 0 answer 503 within seconds; SIGTERM to process 0 stops both cleanly."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

import jdeep
from jdeep.config.small_models import one_layer_config
from jdeep.runtime.engine import Engine
from jdeep.serve.server import ServerSettings, background_server
from jdeep.tools.testing.random_weights import random_checkpoint

PEER_TIMEOUT = 3.0
ENGINE = ["--max-num-seqs", "4", "--max-len", "128", "--prefill-chunk", "16", "--seed", "0"]
REQUESTS = [  # every request names its seed: OpenAI's default temperature is 1, and a default seed depends on the
    # arrival order, which concurrency changes
    {"prompt": [1, 5, 9, 33, 100, 7, 3], "max_tokens": 12, "temperature": 0},
    {"prompt": [4, 8, 15, 16, 23, 42, 2, 9, 77], "max_tokens": 9, "temperature": 0.9, "seed": 5},
    {"prompt": list(range(10, 40)), "max_tokens": 14, "temperature": 0.7, "top_k": 20, "seed": 11},
    {"prompt": [7, 7, 7], "max_tokens": 10, "temperature": 0, "presence_penalty": 0.5},
    {"prompt": [300, 301, 302, 303, 304], "max_tokens": 6, "seed": 3},
]


PORT_RANGE = (20000, 32000)    # below Linux's ephemeral range (32768-60999): no outgoing connection is given one
BIND_FAILED = re.compile(r"address already in use|errno 98|failed to bind|failed to add port|no address added", re.I)


def _free_port() -> int:
    """A port free now, below the ephemeral range. (A port from bind(("127.0.0.1", 0)) is an ephemeral one: between
    this check and the server binding it, any outgoing connection on the machine, such as test_cli's clients of its
    own subprocess servers, may be given it as its local port; Deployment retries with new ports if a bind still
    fails.)"""
    rng = random.Random()
    while True:
        port = rng.randrange(*PORT_RANGE)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mp") / "model"       # one layer: cheap compiles in both processes
    random_checkpoint(one_layer_config(), str(path), seed=4)
    return path


class _PortTaken(Exception):
    """A process of the deployment could not bind its HTTP or coordinator port."""


class Deployment:
    """Two `jdeep serve` processes; process 0's HTTP port."""

    def __init__(self, model_dir, tmp, attempts: int = 3):
        """Start both processes and wait for process 0's /health; when a process exits because one of the two
        ports was taken between _free_port and its bind (the race behind setup failures beside test_cli's
        subprocess servers), start again on new ports."""
        for attempt in range(attempts):
            try:
                self._start(model_dir, tmp)
                return
            except _PortTaken as e:
                self.close()
                if attempt == attempts - 1:
                    raise AssertionError(f"the 2-process server found its ports taken {attempts} times\n{e}") from None

    def _start(self, model_dir, tmp):
        self.port, coordinator = _free_port(), _free_port()
        while coordinator == self.port:
            coordinator = _free_port()
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "JDEEP_NO_COMPILE_CACHE": "1",
               "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"}
        self.logs = [open(tmp / f"process{i}.err", "w+") for i in range(2)]
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "jdeep.cli", "serve", "--model", str(model_dir), "--mesh", "data=2,expert=4",
             *ENGINE, "--port", str(self.port), "--peer-timeout", str(PEER_TIMEOUT),
             "--served-model-name", "m", "--coordinator", f"127.0.0.1:{coordinator}", "--num-processes", "2",
             "--process-id", str(i)], env=env, stdout=subprocess.DEVNULL, stderr=self.logs[i]) for i in range(2)]
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                log = self.stderr()
                if any(BIND_FAILED.search(self._whole_log(i)) for i in range(2)):
                    raise _PortTaken(log)
                raise AssertionError(log)
            try:
                if _get(self.url + "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError("the 2-process server did not come up\n" + self.stderr())

    def _whole_log(self, i: int) -> str:
        self.logs[i].flush()
        self.logs[i].seek(0)
        return self.logs[i].read()

    def stderr(self, i: int | None = None) -> str:
        out = []
        for k in ([i] if i is not None else range(2)):
            self.logs[k].flush()
            self.logs[k].seek(0)
            out.append(f"--- process {k}\n" + self.logs[k].read()[-4000:])
        return "\n".join(out)

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(30)
        for f in self.logs:
            f.close()


@pytest.fixture(scope="module")
def deployment(model_dir, tmp_path_factory):
    d = Deployment(model_dir, tmp_path_factory.mktemp("logs"))
    yield d
    d.close()


def _get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _stream(base: str, body: dict) -> list[int]:
    """A streamed completion's token ids (the model has no tokenizer: chunks carry token_ids)."""
    req = urllib.request.Request(base + "/v1/completions", json.dumps({"model": "m", "stream": True, **body}).encode(),
                                 {"Content-Type": "application/json"})
    tokens = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: {"):
                tokens += json.loads(line[6:])["choices"][0].get("token_ids") or []
    return tokens


def _concurrently(base: str) -> list[list[int]]:
    out: list = [None] * len(REQUESTS)
    errors = []

    def run(i):
        try:
            out[i] = _stream(base, REQUESTS[i])
        except Exception as e:   # the assertion below reports it
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(REQUESTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    assert not errors, errors
    return out


def test_streams_equal_a_single_process_server(deployment, model_dir):
    status, body = _get(deployment.url + "/health")
    health = json.loads(body)
    assert status == 200 and health["processes"] == 2 and health["in_step"] is True
    got = _concurrently(deployment.url)
    engine = Engine(jdeep.load(model_dir), max_num_seqs=4, max_len=128, prefill_chunk=16, seed=0)
    with background_server(engine, ServerSettings("m")) as (url, _):
        want = _concurrently(url[:-3])
    assert got == want
    assert [len(t) for t in got] == [r["max_tokens"] for r in REQUESTS]
    status, body = _get(deployment.url + "/health")
    assert status == 200 and json.loads(body)["in_step"] is True
    metrics = _get(deployment.url + "/metrics")[1]
    assert "jdeep_mesh_processes 2" in metrics and "jdeep_mesh_processes_in_step 2" in metrics


def test_sigterm_to_process_0_stops_both_cleanly(deployment):
    """On the module's deployment, after test_streams_equal_a_single_process_server has served on it (it ends the
    deployment: the tests after it start their own)."""
    d = deployment
    try:
        d.procs[0].send_signal(signal.SIGTERM)
        codes = [p.wait(120) for p in d.procs]
        log = d.stderr()
        assert codes[1] == 0, log
        assert "Terminating process" not in log and "Check failure" not in log, log
    finally:
        d.close()


@pytest.mark.full
def test_killing_process_1_gives_503_within_seconds(model_dir, tmp_path):
    """SIGKILL on process 1: process 0 answers 503 naming the failed mesh within seconds and keeps answering. On a
    deployment of its own (test_sigterm_to_process_0_stops_both_cleanly ends the module's).

    Full tier: tests/serve/test_lockstep.py::test_a_lost_heartbeat_fails_the_mesh_with_503 covers process 0's side
    in the default run (Lockstep._watch failing the mesh on a follower's stale heartbeat, AsyncEngine.fail_mesh ending
    the request in flight while the engine thread is blocked in a step, 503 from /health and new requests,
    jdeep_mesh_failed in /metrics), and test_streams_equal_a_single_process_server the real 2-process deployment."""
    deployment = Deployment(model_dir, tmp_path)
    try:
        _kill_process_1(deployment)
    finally:
        deployment.close()


def _kill_process_1(deployment):
    deployment.procs[1].send_signal(signal.SIGKILL)
    deployment.procs[1].wait(30)
    t0 = time.monotonic()
    body = json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}).encode()
    while True:
        req = urllib.request.Request(deployment.url + "/v1/completions", body, {"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=30).read()
            status, text = 200, ""
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode()
        if status == 503:
            break
        assert time.monotonic() - t0 < PEER_TIMEOUT + 5, "no 503 after process 1 died"
        time.sleep(0.2)
    assert time.monotonic() - t0 < PEER_TIMEOUT + 5
    assert "mesh failed" in text       # (named by its lost heartbeat, or by the step whose collective lost it)
    time.sleep(PEER_TIMEOUT + 1)
    status, body = _get(deployment.url + "/health")
    health = json.loads(body)
    assert status == 503 and health["processes"] == 2 and health["in_step"] is False
    assert health["by_process"][1]["heartbeat_age_s"] > PEER_TIMEOUT
    assert deployment.procs[0].poll() is None            # process 0 keeps answering
    deployment.procs[0].send_signal(signal.SIGTERM)
    deployment.procs[0].wait(60)


@pytest.mark.full
def test_a_stopped_process_0_ends_the_follower(model_dir, tmp_path):
    """SIGSTOP on process 0 (a stall: its store answers nothing, a write to it never returns): process 1 exits with
    the reason within seconds instead of waiting for the runtime's own 100 s heartbeat timeout.

    Full tier: tests/serve/test_lockstep.py::test_a_follower_whose_process_0_stalls_fails_within_the_peer_timeout
    covers the follower's side in the default run (Lockstep._watch on a follower naming "process 0 (the server)",
    on_failure called from the watchdog thread while the heartbeat thread's store write never returns), and
    test_sigterm_to_process_0_stops_both_cleanly the follower's process ending through jdeep serve."""
    d = Deployment(model_dir, tmp_path)
    try:
        d.procs[0].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        code = d.procs[1].wait(PEER_TIMEOUT + 30)
        assert time.monotonic() - t0 < PEER_TIMEOUT + 5
        assert code == 1 and "process 0 (the server) sent no heartbeat" in d.stderr(1)
    finally:
        d.procs[0].send_signal(signal.SIGCONT)
        d.close()
