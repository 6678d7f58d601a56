"""Property-based fuzzing of the protocol layer (hypothesis): no request body — random JSON values for every field,
wrong types, huge integers, NaN and infinities, nested junk, raw bytes, wrong content types — gets anything but a
success or a 4xx. Parsing is fuzzed directly (many examples: whatever it accepts, the engine's per-request host work
takes without an exception), then through the HTTP server on a one-layer random model (fewer examples, each a real
request; the server must still serve afterwards)."""

from __future__ import annotations

import http.client
import json
import pathlib
import tempfile
import urllib.parse

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

import jdeep
from jdeep.io.tokenizer import Tokenizer
from jdeep.config.small_models import TINY_CONFIG, one_layer_config
from jdeep.runtime.engine import Engine
from jdeep.runtime.requests import check_request
from jdeep.runtime.sampling import batch_params
from jdeep.serve.chat_protocol import parse_chat
from jdeep.serve.openai_protocol import APIError, GenerationRequest, ServingContext, parse_completion
from jdeep.serve.server import ServerSettings, background_server
from jdeep.tools.testing.random_weights import random_checkpoint, write_word_tokenizer

V, MAX_LEN = TINY_CONFIG["vocab_size"], 64
# hypothesis keeps caches (source constants) in ./.hypothesis by default: not in the repository
set_hypothesis_home_dir(pathlib.Path(tempfile.gettempdir()) / "jdeep-hypothesis")

# ---------------------------------------------------------------------- strategies
_ints = st.one_of(st.integers(-3, 70), st.integers(-2 ** 100, 2 ** 100), st.sampled_from([2 ** 31, 2 ** 63, -2 ** 63]))
_floats = st.floats(allow_nan=True, allow_infinity=True)
_scalars = st.one_of(st.none(), st.booleans(), _ints, _floats, st.text(max_size=12))
_junk = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                     max_leaves=12)
_token_ids = st.lists(st.one_of(st.integers(0, V - 1), _ints, st.booleans()), max_size=12)
_words = st.lists(st.integers(0, V - 1).map(lambda i: f"tok{i}"), max_size=8).map(" ".join)
_text = st.one_of(_words, st.text(max_size=20))


_FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
           "min_p", "seed", "stop", "stop_token_ids", "stream", "stream_options", "return_token_ids", "n", "logprobs",
           "echo", "presence_penalty", "logit_bias", "chat_template_kwargs", "user", "tools", "best_of", "top_logprobs",
           "frequency_penalty", "repetition_penalty", "min_tokens", "tool_choice", "parallel_tool_calls",
           "reasoning_effort"]
# a plausible request (mostly valid: sizes within the tiny server's context) ...
_valid_sampling = st.fixed_dictionaries({}, optional={
    "model": st.just("m"), "max_tokens": st.integers(1, 8), "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1), "top_k": st.integers(0, 40), "min_p": st.floats(0, 0.5),
    "seed": st.integers(0, 2 ** 63 - 1),
    "stop": st.one_of(_words.filter(bool), st.lists(_words.filter(bool), max_size=2)),
    "stop_token_ids": st.lists(st.integers(0, V - 1), max_size=3), "stream": st.booleans(),
    "return_token_ids": st.booleans(), "n": st.integers(1, 3), "presence_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, V - 1).map(str), st.floats(-100, 100), max_size=3)})
_valid_prompt = st.one_of(_words.filter(bool), st.lists(st.integers(0, V - 1), min_size=1, max_size=12),
                          st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=6), min_size=1, max_size=3))
_valid_messages = st.tuples(st.booleans(), _words, _words).map(
    lambda t: ([{"role": "system", "content": t[1]}] if t[0] else []) + [{"role": "user", "content": t[2]}])
# ... with up to two fields replaced by junk (wrong types, huge ints, NaN, nested values)
_mutations = st.dictionaries(st.sampled_from(_FIELDS), st.one_of(_junk, _token_ids, _text), max_size=2)


def _body(base: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.tuples(base, _mutations).map(lambda t: {**t[0], **t[1]}), _junk)


_completion_body = _body(st.tuples(st.fixed_dictionaries({"prompt": _valid_prompt}), _valid_sampling).map(
    lambda t: {**t[0], **t[1]}))
_chat_body = _body(st.tuples(st.fixed_dictionaries({"messages": _valid_messages}), _valid_sampling).map(
    lambda t: {**t[0], **t[1]}))


def _nested(depth: int, kind: str) -> object:
    v: object = {}
    for _ in range(depth):
        v = [v] if kind == "list" else {"type": "object", "properties": {"x": v}}
    return v


# chat shapes a hostile client sends (issue 46): tool calls whose id or arguments are junk or deeply nested, tool
# results, tool schemas nested past any sane depth, role markers inside the text
_depths = st.sampled_from([1, 10, 63, 64, 65, 300, 990])
_arguments = st.one_of(_text, _junk.map(json.dumps), _depths.map(lambda d: "[" * d + "]" * d),
                       st.just("[" * 100000), _depths.map(lambda d: json.dumps({"q": _nested(d, "list")})))
_tool_call = st.fixed_dictionaries({"function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"]),
                                                                       "arguments": _arguments})},
                                   optional={"id": st.one_of(_junk, st.sampled_from(["a", "b"])),
                                             "type": st.just("function")})
_marker = st.sampled_from(["<｜User｜>", "<｜Assistant｜>", "</think>", "<｜end▁of▁sentence｜>", "<tool_result>"])
_tool_messages = st.tuples(_words, st.lists(_tool_call, min_size=1, max_size=3),
                           st.lists(st.tuples(st.one_of(_junk, st.sampled_from(["a", "b"])), _text), max_size=3),
                           _marker).map(lambda t: [
                               {"role": "user", "content": t[0] + t[3]},
                               {"role": "assistant", "content": t[3], "tool_calls": t[1]},
                               *({"role": "tool", "tool_call_id": i, "content": c + t[3]} for i, c in t[2]),
                               {"role": "user", "content": t[0]}])
_tools = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g"])},
    optional={"parameters": st.one_of(_junk, _depths.map(lambda d: _nested(d // 2, "schema"))),
              "description": st.one_of(_text, _marker)})}), max_size=2)
_tool_chat_body = st.tuples(_tool_messages, _tools, st.integers(1, 4)).map(
    lambda t: {"messages": t[0], "tools": t[1], "max_tokens": t[2]})


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    write_word_tokenizer(str(path), V, chat_markers=True)
    return Tokenizer(path)


# ---------------------------------------------------------------------- parsing
@settings(max_examples=400, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=_completion_body, chat_body=_chat_body, tool_body=_tool_chat_body, use_tokenizer=st.booleans())
def test_parsing_accepts_only_what_the_engine_takes(tok, body, chat_body, tool_body, use_tokenizer):
    t = tok if use_tokenizer else None
    ctx = ServingContext("m", MAX_LEN, t, lambda ids, p: check_request(ids, p, vocab_size=V, max_len=MAX_LEN,
                                                                       tokenizer=t))
    # (the parsers themselves, not parse_request's boundary: an exception other than APIError fails the test)
    for parse, b in ((parse_completion, body), (parse_chat, chat_body), (parse_chat, tool_body)):
        try:
            req = parse(b, ctx)
        except APIError as e:
            assert 400 <= e.status < 500 and e.body()["error"]["message"]
            json.dumps(e.body())                     # the error body is serialisable as it is
            continue
        assert isinstance(req, GenerationRequest) and req.requests
        for r in req.requests:                       # the host work the engine does per request must not raise
            assert r.ids.dtype == np.int32 and 0 < len(r.ids) and len(r.ids) + r.params.max_new_tokens <= MAX_LEN
            batch_params([r.params])


# ---------------------------------------------------------------------- through HTTP
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("one-layer")
    random_checkpoint(one_layer_config(), str(folder), seed=5)
    write_word_tokenizer(str(folder / "tokenizer.json"), V, chat_markers=True)
    model = jdeep.load(folder)
    engine = Engine(model, max_num_seqs=2, max_len=MAX_LEN, prefill_chunk=16)
    engine.warmup()
    with background_server(engine, ServerSettings("m", max_body_bytes=16 << 10)) as (url, _):
        yield urllib.parse.urlparse(url), engine


def _post(u, path: str, body: bytes, content_type: str | None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.request("POST", path, body=body, headers={} if content_type is None else {"Content-Type": content_type})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


_content_types = st.one_of(st.none(), st.sampled_from([
    "application/json", "text/plain", "application/octet-stream", "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x", "application/json; charset=latin-1"]))


@settings(max_examples=100, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), completion=_completion_body,
       chat=st.one_of(_chat_body, _tool_chat_body), raw=st.none() | st.none() | st.none() | st.binary(max_size=64),
       content_type=_content_types)
def test_no_body_gets_a_server_error(server, route, completion, chat, raw, content_type):
    u, engine = server
    body = raw if raw is not None else json.dumps(completion if route == "/v1/completions" else chat,
                                                  allow_nan=True).encode()
    status, data = _post(u, route, body, content_type)
    assert status == 200 or 400 <= status < 500, (status, body[:300], data[:300])
    if status != 200:
        err = json.loads(data)["error"]
        assert err["message"] and err["type"]


def test_the_server_still_serves_after_the_fuzzing(server):
    """(after the fuzz test above, in file order) every slot is free and a plain request succeeds."""
    u, engine = server
    status, data = _post(u, "/v1/completions", json.dumps({"prompt": [0, 5, 9], "max_tokens": 3}).encode(),
                         "application/json")
    assert status == 200 and json.loads(data)["choices"][0]["finish_reason"] in ("length", "stop")
    assert engine.n_running == 0 and engine.n_waiting == 0
