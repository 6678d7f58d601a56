"""A bounded load test of the HTTP server (one-layer random model: the server's and engine's logic, cheap
compiles): 64 concurrent streaming requests with random lengths through 8 slots, greedy and seeded sampled
ones, 2 clients disconnecting early. Every other request gets exactly the tokens the engine gives it without
the server; afterwards every slot is back in the pool. Also: a shutdown that outlasts its timeout ends the
request in flight with an error event and still stops cleanly; a failing engine step fails only its requests."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import jax
import openai
import pytest

import jdeep
from jdeep import SamplingParams
from jdeep.config.small_models import TINY_CONFIG, one_layer_config
from jdeep.runtime.engine import Engine
from jdeep.serve.server import ServerSettings, background_server
from jdeep.tools.perf.loadgen import make_requests, run_load, summarize
from jdeep.tools.testing.random_weights import random_checkpoint

ENGINE = dict(max_num_seqs=8, max_len=64, prefill_chunk=16)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("one-layer")
    random_checkpoint(one_layer_config(), str(folder), seed=7)
    return jdeep.load(folder)


def test_64_concurrent_streams_with_2_disconnects(model):
    reqs = make_requests(64, TINY_CONFIG["vocab_size"], seed=3, max_tokens=16, n_disconnect=2)
    engine = Engine(model, **ENGINE)
    step = engine.step
    engine.step = lambda: (time.sleep(0.002), step())[1]    # the disconnecting clients leave mid-request
    with background_server(engine, ServerSettings("tiny", max_waiting=64)) as (url, server):   # all 64 queue
        t0 = time.perf_counter()
        results = asyncio.run(run_load(url, "tiny", reqs))
        wall = time.perf_counter() - t0
        stats = summarize(results, wall)
        print(f"\nload: {stats}")
        t1 = time.time()
        while (engine.n_running or engine.n_waiting) and time.time() - t1 < 10:
            time.sleep(0.01)
        assert engine.n_running == 0 and engine.n_waiting == 0 and engine.outputs == {}
        assert engine.slots == [None] * engine.n_slots
        assert max(engine.steps_per_bucket) == 8                    # the pool was full at times
    assert stats["errors"] == 0 and stats["disconnected"] == 2 and stats["completed"] == 62
    # the engine alone, on the same requests (a request's tokens do not depend on its company)
    alone = Engine(model, **ENGINE)
    ids = [alone.add_request(r.prompt, SamplingParams(temperature=r.temperature, top_p=r.top_p, seed=r.seed,
                                                      max_new_tokens=r.max_tokens)) for r in reqs]
    outs = alone.run()
    for i, (r, res) in enumerate(zip(reqs, results)):
        want = outs[ids[i]]
        if r.disconnect_after is not None:
            assert res.disconnected and len(res.tokens) < r.max_tokens
            continue
        assert res.tokens == want.tokens, i
        assert res.finish_reason == ("length" if want.finish_reason == "length" else "stop")


def test_shutdown_timeout_cancels_the_request_in_flight(model):
    engine = Engine(model, **ENGINE)
    engine.warmup()                                         # no compile pause inside the shutdown window
    step = engine.step
    engine.step = lambda: (time.sleep(0.05), step())[1]     # 60 tokens take >= 3 s; the shutdown allows 2 s
    with background_server(engine, ServerSettings("tiny"), shutdown_timeout=2.0) as (url, server):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        stream = client.completions.create(model="tiny", prompt=[0, 5, 9], max_tokens=60, temperature=0, stream=True,
                                           extra_body={"return_token_ids": True})
        it = iter(stream)
        got = list(next(it).choices[0].token_ids)
        t0 = time.perf_counter()
        server.handle_exit(15, None)
        with pytest.raises(openai.APIError, match="shutting down"):    # an error event ends the stream
            for chunk in it:
                got += chunk.choices[0].token_ids
                assert chunk.choices[0].finish_reason is None
    assert time.perf_counter() - t0 < 10
    assert len(got) < 60
    assert not server.config.app.state.jdeep.engine.stats.alive
    assert engine.n_running == 0 and engine.n_waiting == 0


def test_a_failing_engine_step_fails_its_requests_and_the_server_goes_on(model):
    engine = Engine(model, **ENGINE)
    step, calls = engine.step, []

    def flaky():
        calls.append(1)
        if len(calls) == 2:         # a step that failed after its donated state was consumed
            jax.tree_util.tree_map(lambda a: a.delete(), engine.state)
            raise RuntimeError("device lost")
        return step()

    engine.step = flaky
    with background_server(engine, ServerSettings("tiny")) as (url, server):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="tiny", prompt=[0, 5, 9], max_tokens=4, temperature=0)
        assert e.value.status_code == 500
        r = client.completions.create(model="tiny", prompt=[0, 5, 9], max_tokens=4, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop") and engine.n_running == 0
        with urllib.request.urlopen(url.removesuffix("/v1") + "/health") as h:
            assert h.status == 200
