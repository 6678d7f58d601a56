"""Holding up under real serving (one-layer random model): beyond `max_waiting` waiting requests new ones get 429
with Retry-After; a request past `request_timeout` is cancelled (504, or an error event when streaming) and its slot
freed; both show in /metrics. A request with a seed no PRNG key holds (2**80) is a 400 while the requests sent
with it get exactly the tokens they get without it."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
import urllib.parse

import openai
import pytest

import jdeep
from jdeep import SamplingParams
from jdeep.cli import build_parser
from jdeep.config.small_models import TINY_CONFIG, one_layer_config
from jdeep.runtime.engine import Engine
from jdeep.serve.server import ServerSettings, background_server
from jdeep.tools.testing.random_weights import random_checkpoint

ENGINE = dict(max_num_seqs=2, max_len=64, prefill_chunk=16)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("one-layer")
    random_checkpoint(one_layer_config(), str(folder), seed=7)
    model = jdeep.load(folder)
    Engine(model, **ENGINE).warmup()                 # compiled once for the module: no compile pause in a timeout
    return model


def _slow_engine(model, delay: float, **kw) -> Engine:
    engine = Engine(model, **{**ENGINE, **kw})
    step = engine.step
    engine.step = lambda: (time.sleep(delay), step())[1]
    return engine


def _open(url: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def _metrics(url: str) -> dict[str, float]:
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln and ln[0] != "#"}


def _idle(engine: Engine) -> bool:
    t0 = time.time()
    while (engine.n_running or engine.n_waiting or engine.outputs) and time.time() - t0 < 20:
        time.sleep(0.01)
    return engine.n_running == 0 and engine.n_waiting == 0 and engine.outputs == {}


def test_past_max_waiting_new_requests_get_429_with_retry_after(model):
    engine = _slow_engine(model, 0.05)
    long = {"prompt": [0, 5, 9], "max_tokens": 60, "stream": True, "stop_token_ids": [], "temperature": 0}
    with background_server(engine, ServerSettings("tiny", max_waiting=2)) as (url, _):
        held = [_open(url, long) for _ in range(4)]              # 2 slots + 2 waiting: the server is full
        assert [r.status for _, r in held] == [200] * 4
        m = _metrics(url)
        assert m["jdeep_requests_waiting"] == 2 and m["jdeep_requests_waiting_limit"] == 2
        conn, r = _open(url, {**long, "stream": False})
        body = json.loads(r.read())
        assert r.status == 429 and r.getheader("Retry-After") == "1", body
        assert body["error"]["code"] == "too_many_waiting_requests" and "limit is 2" in body["error"]["message"]
        conn.close()
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="tiny", prompt=[[0, 1], [0, 2]], max_tokens=2)
        m = _metrics(url)
        assert m["jdeep_requests_rejected_total"] == 2
        assert m['jdeep_requests_total{endpoint="/v1/completions",status="429"}'] == 2
        for c, _ in held:                                        # the clients leave: their slots come back
            c.close()
        assert _idle(engine)
        r = client.completions.create(model="tiny", prompt=[0, 5, 9], max_tokens=2)
        assert r.choices[0].finish_reason in ("length", "stop")
        assert _metrics(url)["jdeep_requests_waiting"] == 0


def test_a_request_past_its_timeout_is_cancelled_and_its_slot_freed(model):
    engine = _slow_engine(model, 0.05)
    with background_server(engine, ServerSettings("tiny", request_timeout=0.6)) as (url, _):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:             # 60 tokens take >= 3 s
            client.completions.create(model="tiny", prompt=[0, 5, 9], max_tokens=60, extra_body={"stop_token_ids": []})
        assert e.value.status_code == 504 and "timed out after 0.6 s" in e.value.body["message"]
        assert e.value.body["code"] == "request_timeout"
        got = []
        with pytest.raises(openai.APIError, match="timed out"):     # streamed: an error event ends it
            for chunk in client.completions.create(model="tiny", prompt=[0, 5], max_tokens=60, stream=True,
                                                   extra_body={"stop_token_ids": [], "return_token_ids": True}):
                got += chunk.choices[0].token_ids
        assert 0 < len(got) < 60
        assert _idle(engine)
        r = client.completions.create(model="tiny", prompt=[0, 5, 9], max_tokens=2)   # well within the timeout
        assert r.choices[0].finish_reason in ("length", "stop")
        m = _metrics(url)
        assert m["jdeep_request_timeouts_total"] == 2
        assert m['jdeep_request_finished_total{finish_reason="timeout"}'] == 2


@pytest.mark.full
def test_a_seed_of_2_80_is_a_400_and_the_requests_beside_it_are_exact(model):
    """The defect of issue 20: `"seed": 2**80` passed validation and failed the whole engine step.

    Full tier: tests/serve/test_openai_protocol.py::test_every_field_is_bounded_at_the_edge covers the 400 naming
    `seed` for 2**80 (parse_completion, before anything reaches the engine) in the default run, and
    tests/runtime/test_engine_isolation.py::test_host_failures_of_one_request_leave_the_others_exact a 2**80 seed that
    reaches the engine failing alone while the requests beside it get their exact tokens."""
    rng_prompts = [[0, 5, 9, 33], [0, 40, 41], [0, 7], [0, 100, 200, 300, 400], [0, 11, 12, 13]]
    kinds = [dict(temperature=0), dict(temperature=0.8, seed=11), dict(temperature=0), dict(temperature=1.0, seed=3),
             dict(temperature=0)]
    alone = Engine(model, **ENGINE)
    ids = [alone.add_request(p, SamplingParams(max_new_tokens=8, temperature=k["temperature"], seed=k.get("seed")))
           for p, k in zip(rng_prompts, kinds)]
    want = [alone.run()[i].tokens for i in ids]
    engine = Engine(model, max_num_seqs=4, max_len=64, prefill_chunk=16)

    async def go(url):
        client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0)

        async def one(p, k):
            r = await client.completions.create(model="tiny", prompt=p, max_tokens=8, extra_body={
                "return_token_ids": True}, **k)
            return r.choices[0].token_ids

        async def bad():
            with pytest.raises(openai.BadRequestError) as e:
                await client.completions.create(model="tiny", prompt=[0, 5, 9], max_tokens=8, seed=2 ** 80)
            return e.value

        try:
            return await asyncio.gather(*[one(p, k) for p, k in zip(rng_prompts[:3], kinds)], bad(),
                                        *[one(p, k) for p, k in zip(rng_prompts[3:], kinds[3:])])
        finally:
            await client.close()

    with background_server(engine, ServerSettings("tiny")) as (url, _):
        got = asyncio.run(go(url))
        err = got.pop(3)
        assert err.status_code == 400 and err.body["param"] == "seed" and "seed" in err.body["message"]
        assert got == want
        after = asyncio.run(go(url))                                # and the next requests are served as well
        after.pop(3)
        assert after == want
        m = _metrics(url)
        assert m.get('jdeep_requests_total{endpoint="/v1/completions",status="500"}', 0) == 0
    assert _idle(engine)


def test_serve_flags():
    args = build_parser().parse_args(["serve", "--model", "m", "--max-waiting", "5", "--request-timeout", "2.5"])
    assert (args.max_waiting, args.request_timeout) == (5, 2.5)
    args = build_parser().parse_args(["serve", "--model", "m"])
    assert (args.max_waiting, args.request_timeout) == (None, None)
    assert TINY_CONFIG["vocab_size"] > 400                          # the prompts above are in the vocabulary
