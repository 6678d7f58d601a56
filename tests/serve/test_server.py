"""The OpenAI-compatible server on the v4-tiny-hf golden through the official `openai` client: completions
and chat, plain and streamed, give jdeep.generate's greedy tokens; bad requests get their status codes and
the server keeps serving. The golden has no tokenizer.json, so the server is given a word-level one whose
ids 0..5 are DeepSeek's chat markers (id i <-> "tok<i>" otherwise)."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import threading
import time
import urllib.parse
from types import SimpleNamespace

import openai
import pytest
from conftest import golden_path

import jdeep
from jdeep.io.chat import V4, parse_reply
from jdeep.io.tokenizer import Tokenizer
from jdeep.runtime.engine import Engine
from jdeep.serve.server import ServerSettings, background_server
from jdeep.tools.testing.random_weights import write_word_tokenizer

KEY = "test-key"
MAX_LEN = 64
P1 = [0, 5, 9, 17, 33, 2, 8]
P2 = [0, 40, 41]
MESSAGES = [{"role": "system", "content": "tok9 tok10"}, {"role": "user", "content": "tok7 tok8 tok300"}]
N = 12


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    folder = golden_path("v4-tiny-hf")
    model = jdeep.load(folder)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    write_word_tokenizer(str(path), model.config.vocab_size, chat_markers=True)
    tok = Tokenizer(path)
    engine = Engine(model, max_num_seqs=1, max_len=MAX_LEN, prefill_chunk=16, tokenizer=tok)   # one compile set
    settings = ServerSettings("v4-tiny", api_key=KEY, max_body_bytes=64 << 10)
    with background_server(engine, settings) as (url, server):
        yield SimpleNamespace(url=url, engine=engine, model=model, tok=tok,
                              client=openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=300))


@pytest.fixture(scope="module")
def reference(srv):
    """jdeep.generate's greedy tokens for P1, P2 and the chat prompt (one batch)."""
    chat_ids = srv.tok.chat(MESSAGES)
    out = jdeep.generate(srv.model, [P1, P2, chat_ids], max_new_tokens=N)
    return [out.tokens[i, :out.lengths[i]].tolist() for i in range(3)]


def _reason(tokens: list[int], eos: int) -> str:
    return "stop" if tokens[-1] == eos else "length"


def test_completions_equal_generate(srv, reference):
    c, tok, eos = srv.client, srv.tok, srv.model.config.eos_token_id
    r = c.completions.create(model="v4-tiny", prompt=P1, max_tokens=N, temperature=0,
                             extra_body={"return_token_ids": True})
    (ch,) = r.choices
    assert ch.token_ids == reference[0] and ch.prompt_token_ids == P1
    assert ch.text == tok.decode(reference[0]) and ch.finish_reason == _reason(reference[0], eos)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(P1), len(reference[0]))
    # a batch of two prompts (token ids and text): one choice each
    r = c.completions.create(model="v4-tiny", prompt=[P1, tok.decode(P2, skip_special_tokens=False)], max_tokens=N,
                             temperature=0, extra_body={"return_token_ids": True})
    assert [x.index for x in r.choices] == [0, 1]
    assert [x.token_ids for x in r.choices] == reference[:2] and r.choices[1].prompt_token_ids == P2
    # streamed: the deltas add up to the same text and tokens, then a usage chunk
    text, ids, reasons, usage = "", [], [], None
    for chunk in c.completions.create(model="v4-tiny", prompt=P2, max_tokens=N, temperature=0, stream=True,
                                      stream_options={"include_usage": True}, extra_body={"return_token_ids": True}):
        if chunk.usage is not None:
            usage = chunk.usage
            continue
        text += chunk.choices[0].text
        ids += chunk.choices[0].token_ids
        reasons.append(chunk.choices[0].finish_reason)
    assert ids == reference[1] and text == tok.decode(reference[1])
    assert reasons[-1] == _reason(reference[1], eos) and set(reasons[:-1]) <= {None}
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(P2), len(reference[1]))


def test_chat_equals_generate(srv, reference):
    """The reply is read with special tokens kept (the reasoning / tool-call parser sees </think> and DSML tags);
    the word-level test tokenizer puts a space before the EOS marker the parser consumes."""
    c, tok = srv.client, srv.tok
    want = parse_reply(V4, tok.decode(reference[2], skip_special_tokens=False), thinking=False)["content"]
    r = c.chat.completions.create(model="v4-tiny", messages=MESSAGES, max_tokens=N, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(tok.chat(MESSAGES)) and r.usage.completion_tokens == len(reference[2])
    chunks = list(c.chat.completions.create(model="v4-tiny", messages=MESSAGES, max_tokens=N, temperature=0,
                                            stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert all(ch.id == chunks[0].id and ch.object == "chat.completion.chunk" for ch in chunks)


def _raw(srv, method: str, path: str, body: bytes | None = None, key: str | None = KEY, headers: dict | None = None):
    u = urllib.parse.urlparse(srv.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    h = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    conn.request(method, path, body=body, headers=h)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, resp.getheader("Content-Type", ""), data


def test_bad_requests_get_their_status_codes_and_the_server_keeps_serving(srv):
    c = srv.client

    def status(exc_type, **kw):
        with pytest.raises(exc_type) as e:
            c.completions.create(**{"model": "v4-tiny", "prompt": [0, 5], "max_tokens": 4, **kw})
        return e.value

    e = status(openai.NotFoundError, model="gpt-4")
    assert e.status_code == 404 and e.body["code"] == "model_not_found" and "gpt-4" in e.body["message"]
    for kw, what in [({"temperature": -1}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
                     ({"n": 0}, "'n'"), ({"logprobs": 21}, "logprobs"), ({"seed": -3}, "seed"),
                     ({"extra_body": {"top_k": -1}}, "top_k"), ({"prompt": [0, 5, 10**6]}, "outside the vocabulary"),
                     ({"prompt": []}, "prompt"), ({"stop": [""]}, "stop")]:
        e = status(openai.BadRequestError, **kw)
        assert e.status_code == 400 and what in e.body["message"], (kw, e.body)
    e = status(openai.BadRequestError, max_tokens=MAX_LEN)                      # prompt + completion > max_len
    assert e.body["code"] == "context_length_exceeded" and str(MAX_LEN) in e.body["message"]
    e = status(openai.BadRequestError, prompt=list(range(2, MAX_LEN + 2)))      # the prompt alone does not fit
    assert e.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="role"):
        c.chat.completions.create(model="v4-tiny", messages=[{"role": "wizard", "content": "hi"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.url, api_key="wrong", max_retries=0).models.list()

    code, ctype, data = _raw(srv, "POST", "/v1/completions", b'{"model": "v4-tiny", "prompt": [0, 5')
    assert code == 400 and ctype.startswith("application/json") and "not valid JSON" in json.loads(data)["error"]["message"]
    code, _, data = _raw(srv, "POST", "/v1/completions", json.dumps({"prompt": [0] * 40000}).encode())
    assert code == 413 and "limit" in json.loads(data)["error"]["message"]
    code, _, data = _raw(srv, "POST", "/v1/completions", b'{"prompt": [0, 5]}', key=None)
    assert code == 401 and json.loads(data)["error"]["code"] == "invalid_api_key"
    code, _, data = _raw(srv, "GET", "/v1/nothing-here")
    assert code == 404 and "error" in json.loads(data)
    assert _raw(srv, "GET", "/v1/completions")[0] == 405
    assert _raw(srv, "POST", "/v1/completions", b"[1, 2]")[0] == 400                # JSON, but not an object
    assert _raw(srv, "GET", "/health", key=None)[0] == 200                         # probes need no key
    code, ctype, text = _raw(srv, "GET", "/metrics", key=None)
    assert code == 200 and ctype.startswith("text/plain")
    for status_code in ("400", "401", "404", "405", "413"):
        assert f'status="{status_code}"' in text.decode()

    models = c.models.list()                                                   # and it still serves
    assert [m.id for m in models.data] == ["v4-tiny"]
    r = c.completions.create(model="v4-tiny", prompt=[0, 5], max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
    assert srv.engine.n_running == 0 and srv.engine.n_waiting == 0 and srv.engine.outputs == {}


def test_metrics_count_requests_tokens_and_latencies(srv):
    before = _metrics(srv)
    c = srv.client
    r = c.completions.create(model="v4-tiny", prompt=P2, max_tokens=3, temperature=0)
    after = _metrics(srv)
    assert after["jdeep_prompt_tokens_total"] - before.get("jdeep_prompt_tokens_total", 0) == len(P2)
    assert after["jdeep_generation_tokens_total"] - before.get("jdeep_generation_tokens_total", 0) == \
        r.usage.completion_tokens
    assert after["jdeep_time_to_first_token_seconds_count"] - before.get("jdeep_time_to_first_token_seconds_count",
                                                                         0) == 1
    assert after['jdeep_requests_total{endpoint="/v1/completions",status="200"}'] - before.get(
        'jdeep_requests_total{endpoint="/v1/completions",status="200"}', 0) == 1
    assert after["jdeep_slots_total"] == 1 and after["jdeep_slots_used"] == 0
    # the scheduler's view: the prompt prefilled, one decode token per later iteration, one queue time observed
    gained = {k: after[k] - before.get(k, 0) for k in ("jdeep_iteration_prefill_tokens_sum",
                                                        "jdeep_iteration_decode_tokens_sum",
                                                        "jdeep_request_queue_time_seconds_count")}
    assert gained == {"jdeep_iteration_prefill_tokens_sum": len(P2),
                      "jdeep_iteration_decode_tokens_sum": r.usage.completion_tokens - 1,
                      "jdeep_request_queue_time_seconds_count": 1}, gained
    assert after["jdeep_max_num_batched_tokens"] == srv.engine.max_num_batched_tokens
    assert after['jdeep_time_to_first_token_seconds_bucket{le="+Inf"}'] == after["jdeep_time_to_first_token_seconds_count"]


def _metrics(srv) -> dict[str, float]:
    code, _, text = _raw(srv, "GET", "/metrics", key=None)
    assert code == 200
    out = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_graceful_shutdown_finishes_the_stream_in_flight(srv):
    """A second server on the same model: shutting it down mid-stream lets the stream finish, then stops the
    engine thread; a request sent while it drains is turned away."""
    engine = Engine(srv.model, max_num_seqs=1, max_len=MAX_LEN, prefill_chunk=16, tokenizer=srv.tok)
    step = engine.step
    engine.step = lambda: (time.sleep(0.02), step())[1]      # slow steps: the stream is surely still running
    with background_server(engine, ServerSettings("v4-tiny")) as (url, server):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        stream = client.completions.create(model="v4-tiny", prompt=P2, max_tokens=40, temperature=0, stream=True,
                                           extra_body={"return_token_ids": True, "stop_token_ids": []})
        ids = list(next(iter(stream)).choices[0].token_ids)
        server.handle_exit(15, None)
        with pytest.raises((openai.APIConnectionError, openai.InternalServerError)):
            client.completions.create(model="v4-tiny", prompt=P2, max_tokens=2)
        for chunk in stream:
            ids += chunk.choices[0].token_ids
        assert len(ids) == 40 or ids[-1] == srv.model.config.eos_token_id
        reason = chunk.choices[0].finish_reason
        assert reason in ("length", "stop")
    assert not server.config.app.state.jdeep.engine.stats.alive       # the lifespan shutdown stopped the engine thread
    assert engine.n_running == 0


def test_disconnect_frees_the_slot_at_once(srv):
    engine = srv.engine
    step = engine.step
    engine.step = lambda: (time.sleep(0.02), step())[1]
    try:
        before = _metrics(srv)
        stream = srv.client.completions.create(model="v4-tiny", prompt=P2, max_tokens=MAX_LEN - len(P2),
                                               temperature=0, stream=True, extra_body={"stop_token_ids": []})
        it = iter(stream)
        next(it), next(it)
        assert engine.n_running == 1
        steps_at_close = _metrics(srv)["jdeep_engine_steps_total"]
        stream.close()
        t0 = time.time()
        while engine.n_running and time.time() - t0 < 10:
            time.sleep(0.01)
        engine_steps = _metrics(srv)["jdeep_engine_steps_total"]
        assert engine.n_running == 0 and engine.outputs == {}
        assert engine_steps - steps_at_close < 15       # freed within a few steps, not after the ~60 it asked for
        after = _metrics(srv)
        key = 'jdeep_request_finished_total{finish_reason="abort"}'
        assert after.get(key, 0) - before.get(key, 0) == 1
    finally:
        engine.step = step


def test_health_says_warming_until_the_programs_are_compiled(srv, reference):
    """ServerSettings(warmup=True): the engine thread compiles first (held here at 1 of 3 programs), /health answers
    503 "warming" with the counts and /metrics shows them; a request sent meanwhile waits and then gets the same
    tokens; once warm, /health is 200 and the counts are the inventory's."""
    engine = Engine(srv.model, max_num_seqs=1, max_len=MAX_LEN, prefill_chunk=16, tokenizer=srv.tok)
    gate, warm = threading.Event(), engine.warmup

    def held_warmup(progress=None, **kw):
        progress(1, 3, 0.5)
        assert gate.wait(120)
        return warm(progress=progress, **kw)

    engine.warmup = held_warmup
    with background_server(engine, ServerSettings("v4-tiny", warmup=True)) as (url, server):
        view = SimpleNamespace(url=url)
        status, _, body = _raw(view, "GET", "/health", key=None)
        assert status == 503 and json.loads(body) == {"status": "warming", "compiled": 1, "total": 3,
                                                      "processes": 1, "in_step": False}
        m = _metrics(view)
        assert (m["jdeep_warming"], m["jdeep_warmup_programs_compiled"], m["jdeep_warmup_programs"]) == (1, 1, 3)
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            sent = pool.submit(client.completions.create, model="v4-tiny", prompt=P2, max_tokens=N, temperature=0,
                               extra_body={"return_token_ids": True})
            time.sleep(0.5)
            assert not sent.done()                   # waiting for the warm-up
            gate.set()
            assert sent.result().choices[0].token_ids == reference[1]
        status, _, body = _raw(view, "GET", "/health", key=None)
        health, m = json.loads(body), _metrics(view)
        assert status == 200 and health["status"] == "ok" and health["compiled"] == health["total"] > 3
        assert (m["jdeep_warming"], m["jdeep_warmup_programs"]) == (0, health["total"])
        assert m["jdeep_programs_compiled_total"] >= health["total"]
