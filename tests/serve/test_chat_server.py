"""Chat as DeepSeek-V4's users call it, through the official `openai` client against `jdeep serve`: thinking on
and off (reasoning_content apart from content, streamed as deltas), a tool-call round trip (DSML calls parsed into
tool_calls with typed JSON arguments, streamed; the tool results encoded into the next prompt as DeepSeek's encoder
does), tool_choice none / required / named, and no markup in any content. The replies come from a scripted model
(scripted.py) on the v4-tiny-hf golden with v41-tiny-q's byte-level tokenizer, served in both chat formats."""

from __future__ import annotations

import json
from types import SimpleNamespace

import openai
import pytest
from conftest import golden_path
from scripted import ScriptedEngine, continuation

import jdeep
from jdeep.io.chat import FORMATS, encode_chat
from jdeep.io.chat.dsml import render_tool_calls
from jdeep.io.chat.formats import DSML, EOS, END_THINK, THINK
from jdeep.io.tokenizer import Tokenizer
from jdeep.serve.server import ServerSettings, background_server

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"},
                                                                          "days": {"type": "integer"}}}}}
CALLS = [{"function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}},
         {"function": {"name": "get_weather", "arguments": json.dumps({"city": "Zürich", "days": 1})}}]
ANSWER = "Paris: rain, 11 °C."
THOUGHT = "The user wants the weather; the tool knows it."


def _reply(fmt, prompt: str) -> str | None:
    """The scripted model: what it answers to a prompt (None: the model's own tokens)."""
    thinking = prompt.endswith(THINK)
    think = THOUGHT + END_THINK if thinking else ""
    if "<tool_result>" in prompt:
        return think + ANSWER + EOS
    if "two cities" in prompt:
        return continuation(prompt, think + render_tool_calls(fmt, CALLS, "script") + EOS)
    if "weather" in prompt:
        return continuation(prompt, think + render_tool_calls(fmt, CALLS[:1], "script") + EOS)
    if "Hello" in prompt:
        return think + "Hello! How can I help?" + EOS
    return None


@pytest.fixture(scope="module", params=["v4", pytest.param("v41", marks=pytest.mark.full)])
def srv(request):
    """A server whose model's replies are scripted in the chat format `request.param`.

    Full tier (the v41 parameter): the [v4] tests of this file cover the server's chat path in the default run (chat
    requests encoded by the format, replies parsed into reasoning_content / content / tool_calls, streamed as deltas,
    tool_choice, the 400s); tests/io/chat/test_encoding.py::test_prompt_equals_deepseek_encoder and
    tests/io/chat/test_encoding.py::test_reply_parse_equals_deepseek_parser cover the v41 format's encoding and parsing
    (thinking, tool calls)."""
    fmt = FORMATS[request.param]
    model = jdeep.load(golden_path("v4-tiny-hf"))
    tok = Tokenizer(golden_path("v41-tiny-q"))

    def script(ids):
        reply = _reply(fmt, tok.decode(ids, skip_special_tokens=False))
        return None if reply is None else tok.encode(reply)

    engine = ScriptedEngine(model, max_num_seqs=2, max_len=4096, prefill_chunk=256, tokenizer=tok, script=script)
    with background_server(engine, ServerSettings("tiny", chat_format=request.param)) as (url, _):
        yield SimpleNamespace(client=openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=300), fmt=fmt,
                              tok=tok, engine=engine)


def _chat(srv, messages, **kw):
    return srv.client.chat.completions.create(model="tiny", messages=messages, max_tokens=800, temperature=0, **kw)


def _streamed(srv, messages, **kw) -> tuple[dict, list]:
    """A streamed chat reply put together from its deltas: (message fields, chunks)."""
    out = {"reasoning_content": "", "content": "", "tool_calls": {}}
    chunks = list(_chat(srv, messages, stream=True, **kw))
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        out["reasoning_content"] += getattr(d, "reasoning_content", None) or ""
        out["content"] += d.content or ""
        for tc in d.tool_calls or []:
            c = out["tool_calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = tc.id or c["id"]
            c["name"] += tc.function.name or "" if tc.function else ""
            c["arguments"] += (tc.function.arguments or "") if tc.function else ""
    return out, chunks


def _no_markup(*texts):
    for t in texts:
        assert t is None or not any(m in t for m in (DSML, EOS, THINK, END_THINK, "<tool_result>")), t


HELLO = [{"role": "user", "content": "Hello"}]


def test_thinking_on_and_off(srv):
    r = _chat(srv, HELLO, extra_body={"chat_template_kwargs": {"thinking": True}})
    m = r.choices[0].message
    assert m.content == "Hello! How can I help?" and m.reasoning_content == THOUGHT
    assert r.choices[0].finish_reason == "stop"
    s, chunks = _streamed(srv, HELLO, extra_body={"chat_template_kwargs": {"thinking": True}})
    assert (s["reasoning_content"], s["content"]) == (THOUGHT, m.content)
    assert sum(bool(getattr(ch.choices[0].delta, "reasoning_content", None)) for ch in chunks if ch.choices) >= 2
    off = _chat(srv, HELLO).choices[0].message
    assert off.content == "Hello! How can I help?" and getattr(off, "reasoning_content", None) is None
    assert srv.engine.prompts[-1] == srv.tok.encode(encode_chat(srv.fmt, HELLO))
    _no_markup(m.content, m.reasoning_content, s["content"], s["reasoning_content"], off.content)


@pytest.mark.parametrize("thinking", [False, True])
def test_tool_call_round_trip(srv, thinking):
    kw = {"tools": [WEATHER], "extra_body": {"chat_template_kwargs": {"thinking": thinking}}}
    messages = [{"role": "system", "content": "You help."}, {"role": "user", "content": "weather in Paris?"}]
    r = _chat(srv, messages, **kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}       # days typed as a number
    assert (ch.message.content or "") == "" and (getattr(ch.message, "reasoning_content", None) or "") == (
        THOUGHT if thinking else "")
    assert srv.engine.prompts[-1] == srv.tok.encode(encode_chat(srv.fmt, messages, thinking=thinking,
                                                                tools=[WEATHER["function"]]))
    s, chunks = _streamed(srv, messages, **kw)
    assert [(c["name"], json.loads(c["arguments"])) for c in s["tool_calls"].values()] == [
        ("get_weather", {"city": "Paris", "days": 3})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and s["content"] == ""
    # the client runs the tool and sends its result back: the next prompt is DeepSeek's encoding of all of it
    follow = messages + [ch.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "rain", "t": 11})}]
    r2 = _chat(srv, follow, **kw)
    assert r2.choices[0].message.content == ANSWER and r2.choices[0].finish_reason == "stop"
    want = encode_chat(srv.fmt, follow, thinking=thinking, tools=[WEATHER["function"]])
    assert srv.engine.prompts[-1] == srv.tok.encode(want)
    assert "<tool_result>" in want and '"rain"' in want
    _no_markup(ch.message.content, r2.choices[0].message.content, s["content"])


def test_parallel_calls_and_tool_choice(srv):
    two = [{"role": "user", "content": "weather in two cities?"}]
    r = _chat(srv, two, tools=[WEATHER])
    assert [json.loads(c.function.arguments)["city"] for c in r.choices[0].message.tool_calls] == ["Paris", "Zürich"]
    one = _chat(srv, two, tools=[WEATHER], parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = _chat(srv, [{"role": "user", "content": "weather?"}], tools=[WEATHER], tool_choice=choice)
        calls = r.choices[0].message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris", "days": 3})]
        s, _ = _streamed(srv, [{"role": "user", "content": "weather?"}], tools=[WEATHER], tool_choice=choice)
        assert [c["name"] for c in s["tool_calls"].values()] == ["get_weather"]
    # none: the tools are not shown; a call the model writes anyway is neither reported nor leaked
    r = _chat(srv, [{"role": "user", "content": "weather?"}], tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert srv.engine.prompts[-1] == srv.tok.encode(encode_chat(srv.fmt, [{"role": "user", "content": "weather?"}]))
    _no_markup(r.choices[0].message.content)


def test_bad_tool_requests_are_400s(srv):
    for kw, what in [({"tool_choice": "required"}, "tools"), ({"tools": [{"type": "function"}]}, "tools"),
                     ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                      "not among the tools"),
                     ({"tools": [WEATHER], "tool_choice": "required",
                       "extra_body": {"chat_template_kwargs": {"thinking": True}}}, "thinking")]:
        with pytest.raises(openai.BadRequestError, match=what):
            _chat(srv, HELLO, **kw)
