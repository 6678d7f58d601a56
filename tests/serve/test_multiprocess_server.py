"""`jdeep serve` as a 2-process multi-controller program (2 x 4 CPU devices, mesh data=2,expert=4, jax.distributed on
localhost, gloo collectives), warmed up as deployed (every process compiles its inventory, then they meet):
concurrent streaming requests get the tokens of a single-process server on the same
model; killing process 1 makes process 0 answer 503 within seconds; SIGTERM to process 0 stops both cleanly."""

from __future__ import annotations

import json
import os
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mp") / "model"       # one layer: cheap compiles in both processes
    random_checkpoint(one_layer_config(), str(path), seed=4)
    return path


class Deployment:
    """Two `jdeep serve` processes; process 0's HTTP port."""

    def __init__(self, model_dir, tmp):
        self.port, coordinator = _free_port(), _free_port()
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
            assert all(p.poll() is None for p in self.procs), self.stderr()
            try:
                if _get(self.url + "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError("the 2-process server did not come up\n" + self.stderr())

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


def test_killing_process_1_gives_503_within_seconds(deployment):
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


def test_sigterm_to_process_0_stops_both_cleanly(model_dir, tmp_path):
    d = Deployment(model_dir, tmp_path)
    try:
        d.procs[0].send_signal(signal.SIGTERM)
        codes = [p.wait(120) for p in d.procs]
        log = d.stderr()
        assert codes[1] == 0, log
        assert "Terminating process" not in log and "Check failure" not in log, log
    finally:
        d.close()


def test_a_stopped_process_0_ends_the_follower(model_dir, tmp_path):
    """SIGSTOP on process 0 (a stall: its store answers nothing, a write to it never returns): process 1 exits with
    the reason within seconds instead of waiting for the runtime's own 100 s heartbeat timeout."""
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
