"""OpenAI request bodies -> validated requests: each bad field is a 4xx naming it; prompt and message forms."""

from __future__ import annotations

import functools

import pytest

from jdeep import SamplingParams
from jdeep.io.tokenizer import Tokenizer
from jdeep.runtime.requests import check_request
from jdeep.io.chat import V4, V41, encode_chat
from jdeep.serve.chat_protocol import parse_chat
from jdeep.serve.openai_protocol import APIError, ServingContext, parse_completion, parse_json
from jdeep.tools.testing.random_weights import write_word_tokenizer

V, MAX_LEN = 512, 64


def _check(tokenizer):
    """The engine's request validation for a model of V tokens and MAX_LEN positions."""
    return functools.partial(check_request, vocab_size=V, max_len=MAX_LEN, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    write_word_tokenizer(str(path), V, chat_markers=True)
    return Tokenizer(path)


@pytest.fixture
def ctx(tok):
    return ServingContext("m", MAX_LEN, tok, _check(tok))


def _error(fn, body, ctx) -> APIError:
    with pytest.raises(APIError) as e:
        fn(body, ctx)
    return e.value


def test_completion_fields_become_sampling_params(ctx):
    r = parse_completion({"model": "m", "prompt": [0, 7, 9], "max_tokens": 5, "temperature": 0.5, "top_p": 0.9,
                          "top_k": 20, "min_p": 0.1, "seed": 4, "stop": "tok3", "stop_token_ids": [11]}, ctx)
    assert r.prompts == [[0, 7, 9]] and r.kind == "completion" and not r.stream and r.id.startswith("cmpl-")
    assert r.params == SamplingParams(temperature=0.5, top_k=20, top_p=0.9, min_p=0.1, seed=4, max_new_tokens=5,
                                      stop_token_ids=(11,), stop=("tok3",))
    d = parse_completion({"prompt": "tok7 tok9"}, ctx)          # model may be left out; OpenAI's defaults
    assert d.model == "m" and d.prompts == [[7, 9]] and d.params.max_new_tokens == 16 and d.params.temperature == 1.0
    several = parse_completion({"prompt": ["tok7", [0, 1, 2]], "stream": True,
                                "stream_options": {"include_usage": True}}, ctx)
    assert several.prompts == [[7], [0, 1, 2]] and several.stream and several.include_usage


def test_bad_completion_fields_name_themselves(ctx):
    cases = [({"model": "other", "prompt": [1]}, 404, "model"), ({"prompt": [1], "temperature": "hot"}, 400, "temperature"),
             ({"prompt": [1], "max_tokens": 0}, 400, "max_tokens"), ({"prompt": [1], "max_tokens": True}, 400, "max_tokens"),
             ({"prompt": [1], "n": 0}, 400, "n"), ({"prompt": [1], "echo": 1}, 400, "echo"),
             ({"prompt": [1], "presence_penalty": 2.5}, 400, "presence_penalty"), ({"prompt": [1], "stop": 3}, 400, "stop"),
             ({"prompt": [1], "n": 3, "best_of": 2}, 400, "best_of"), ({"prompt": [1], "logprobs": 21}, 400, "logprobs"),
             ({"prompt": [1], "best_of": 3, "stream": True}, 400, "best_of"),
             ({"prompt": [1], "logit_bias": {"x": 1}}, 400, "logit_bias"),
             ({"prompt": [1], "logit_bias": {"7": 101}}, 400, "logit_bias"),
             ({"prompt": [1], "logit_bias": {str(V): 1}}, 400, "logit_bias"),
             ({"prompt": [1], "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens"),
             ({"prompt": [1], "repetition_penalty": 0}, 400, "repetition_penalty"),
             ({"prompt": [1], "top_logprobs": 2}, 400, "top_logprobs"), ({"prompt": [1], "suffix": "x"}, 400, "suffix"),
             ({"prompt": [1], "stream_options": {"include_usage": True}}, 400, "stream_options"),
             ({"prompt": [[1], []]}, 400, "prompt"), ({"prompt": [1.5]}, 400, "prompt"), ({}, 400, "prompt"),
             ({"prompt": [1], "max_tokens": MAX_LEN}, 400, "max_tokens"), ({"prompt": [1] * MAX_LEN}, 400, "prompt")]
    for body, status, param in cases:
        e = _error(parse_completion, body, ctx)
        assert (e.status, e.param) == (status, param), (body, e.message)
        assert e.body()["error"]["message"] == e.message
    assert _error(parse_completion, [1, 2], ctx).status == 400                 # not an object
    e = _error(parse_completion, {"prompt": [1, 2, V]}, ctx)                  # the engine's own validation
    assert e.status == 400 and "vocabulary" in e.message
    for off in ({"n": 1}, {"logprobs": None}, {"echo": False}, {"frequency_penalty": 0}, {"logit_bias": {}}):
        parse_completion({"prompt": [1], **off}, ctx)                          # explicit "off" values are fine


def test_completion_choices_logprobs_penalties(ctx):
    """n, best_of, logprobs, echo and the penalties reach the engine's requests: best_of samples per prompt (seeds
    apart), logprobs for best_of's ranking, prompt logprobs only with echo."""
    r = parse_completion({"prompt": [[0, 7], [0, 8]], "n": 2, "best_of": 3, "seed": 5, "logprobs": 2, "echo": True,
                          "presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.2,
                          "logit_bias": {"9": -100, "11": 2.5}, "min_tokens": 2, "max_tokens": 4}, ctx)
    assert (r.n, r.best_of, r.logprobs, r.echo) == (2, 3, 2, True)
    assert [q.ids.tolist() for q in r.requests] == [[0, 7]] * 3 + [[0, 8]] * 3
    assert [q.params.seed for q in r.requests] == [5, 6, 7] * 2
    p = r.requests[0].params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens) == (0.5, -0.25, 1.2, 2)
    assert p.logit_bias == ((9, -100.0), (11, 2.5)) and p.logprobs == 2 and p.prompt_logprobs == 2
    ranked = parse_completion({"prompt": [0, 7], "n": 1, "best_of": 2}, ctx)
    assert ranked.requests[0].params.logprobs == 0 and ranked.requests[0].params.prompt_logprobs is None
    plain = parse_completion({"prompt": [0, 7], "n": 3}, ctx)
    assert len(plain.requests) == 3 and plain.requests[0].params.logprobs is None
    assert [q.params.seed for q in plain.requests] == [None] * 3     # the engine draws each its own seed
    assert _error(parse_completion, {"prompt": [[0, 7]] * 9, "n": 8}, ctx).param == "n"     # 72 sequences


def test_chat_messages(ctx, tok):
    r = parse_chat({"messages": [{"role": "developer", "content": "tok9"},
                                 {"role": "user", "content": [{"type": "text", "text": "tok7 "}, {"type": "text",
                                                                                                 "text": "tok8"}]}]}, ctx)
    want = tok.chat([{"role": "system", "content": "tok9"}, {"role": "user", "content": "tok7 tok8"}])
    assert r.prompts == [want] and r.kind == "chat" and r.id.startswith("chatcmpl-")
    assert r.params.max_new_tokens == MAX_LEN - len(want)                       # chat: the rest of the context
    think = parse_chat({"messages": [{"role": "user", "content": "tok7"}], "max_completion_tokens": 3,
                        "chat_template_kwargs": {"thinking": True}}, ctx)
    assert think.prompts == [tok.chat([{"role": "user", "content": "tok7"}], thinking=True)]
    assert think.params.max_new_tokens == 3
    for messages in ([], [{"role": "user", "content": None}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                     [{"role": "assistant", "content": "tok1"}], "hello"):
        assert _error(parse_chat, {"messages": messages}, ctx).param == "messages"
    assert _error(parse_chat, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
                  ctx).param == "tools"


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
USER = [{"role": "user", "content": "tok7"}]


def _long(tok, fmt=V4):
    """A context long enough for DeepSeek's tools section (each of its words is a token of the word tokenizer)."""
    return ServingContext("m", 1024, tok, functools.partial(check_request, vocab_size=V, max_len=1024, tokenizer=tok),
                          fmt)


def test_chat_tools_and_tool_choice(tok):
    ctx = _long(tok)
    auto = parse_chat({"messages": USER, "tools": [TOOL]}, ctx)
    assert auto.chat.tool_choice == "auto" and auto.chat.tool_names == ("get_weather",) and auto.chat.prefix == ""
    assert auto.prompts == [tok.encode(encode_chat(V4, USER, tools=[TOOL["function"]]))]
    assert not auto.requests[0].params.skip_special_tokens            # the parser reads </think> and DSML tags
    none = parse_chat({"messages": USER, "tools": [TOOL], "tool_choice": "none"}, ctx)
    assert none.prompts == [tok.chat(USER)] and not none.chat.report_calls     # tools not shown
    named = parse_chat({"messages": USER, "tools": [TOOL],
                        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, ctx)
    assert named.chat.prefix.endswith('name="get_weather">\n') and named.chat.prefix.startswith("\n\n<｜DSML｜")
    assert named.prompts == [tok.encode(encode_chat(V4, USER, tools=[TOOL["function"]]) + named.chat.prefix)]
    required = parse_chat({"messages": USER, "tools": [TOOL], "tool_choice": "required"}, ctx)
    assert required.chat.prefix.endswith('invoke name="')
    for body, param in [({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                         "tool_choice"),
                        ({"tools": [TOOL], "tool_choice": "required", "chat_template_kwargs": {"thinking": True}},
                         "tool_choice"),
                        ({"tools": [TOOL, TOOL]}, "tools"), ({"tools": [{"type": "function", "function": {
                            "name": "bad name"}}]}, "tools"), ({"tools": "x"}, "tools"),
                        ({"tools": [TOOL], "parallel_tool_calls": 1}, "parallel_tool_calls"),
                        ({"reasoning_effort": "medium"}, "reasoning_effort"), ({"top_logprobs": 3}, "top_logprobs"),
                        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"echo": True}, "echo")]:
        assert _error(parse_chat, {"messages": USER, **body}, ctx).param == param, body


def test_chat_thinking_effort_and_format(tok):
    ctx, v41 = _long(tok), _long(tok, V41)
    r = parse_chat({"messages": USER, "reasoning_effort": "max", "chat_template_kwargs": {"thinking": True},
                    "logprobs": True, "top_logprobs": 3, "n": 2}, v41)
    assert r.prompts == [tok.encode(encode_chat(V41, USER, thinking=True, reasoning_effort="max"))]
    assert r.chat.thinking and r.chat.logprobs and r.logprobs == 3 and r.n == 2 and len(r.requests) == 2
    assert parse_chat({"messages": USER, "reasoning_effort": "max", "chat_template_kwargs": {"thinking": True}},
                      ctx).prompts == [tok.encode(encode_chat(V4, USER, thinking=True, reasoning_effort="max"))]
    assert _error(parse_chat, {"messages": USER, "reasoning_effort": 75}, ctx).param == "reasoning_effort"   # V4
    assert parse_chat({"messages": USER, "reasoning_effort": 75}, v41).chat.fmt is V41
    image = [{"role": "user", "content": [{"type": "text", "text": "tok7"},
                                          {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    e = _error(parse_chat, {"messages": image}, v41)
    assert e.param == "messages" and "vision tower" in e.message


def test_without_a_tokenizer_token_ids_come_back_and_text_is_refused(ctx):
    bare = ServingContext("m", MAX_LEN, None, _check(None))
    assert parse_completion({"prompt": [0, 5]}, bare).return_token_ids
    assert not parse_completion({"prompt": [0, 5]}, ctx).return_token_ids
    assert "tokenizer" in _error(parse_completion, {"prompt": "tok5"}, bare).message
    assert "tokenizer" in _error(parse_chat, {"messages": [{"role": "user", "content": "x"}]}, bare).message


def test_every_field_is_bounded_at_the_edge(ctx):
    """Values the engine could not hold (int32 / int64 overflow, non-finite floats, bools as numbers, oversized lists
    and strings, unpaired surrogates) are 400s naming their field, before anything reaches the engine."""
    big = 2 ** 80
    cases = [({"seed": big}, "seed"), ({"seed": 2 ** 63}, "seed"), ({"seed": True}, "seed"), ({"seed": 1.0}, "seed"),
             ({"max_tokens": big}, "max_tokens"), ({"max_tokens": 2 ** 31}, "max_tokens"),
             ({"max_tokens": 4.0}, "max_tokens"), ({"top_k": big}, "top_k"), ({"top_k": -1}, "top_k"),
             ({"top_k": False}, "top_k"), ({"temperature": 10 ** 400}, "temperature"),
             ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
             ({"temperature": True}, "temperature"), ({"temperature": 1e39}, "temperature"),
             ({"top_p": float("nan")}, "top_p"), ({"min_p": float("-inf")}, "min_p"),
             ({"presence_penalty": float("nan")}, "presence_penalty"),
             ({"frequency_penalty": big}, "frequency_penalty"),
             ({"n": big}, "n"), ({"n": True}, "n"), ({"logit_bias": {str(big): 1}}, "logit_bias"),
             ({"prompt": [0, big]}, "prompt"), ({"prompt": [0, -big]}, "prompt"), ({"prompt": [0, True]}, "prompt"),
             ({"prompt": [[0, 1]] * 65}, "prompt"), ({"prompt": "tok1 \ud800"}, "prompt"),
             ({"prompt": "x" * (64 * MAX_LEN + 1)}, "prompt"), ({"stop": ["a"] * 33}, "stop"),
             ({"stop": ["a" * 1025]}, "stop"), ({"stop": ["\udfff"]}, "stop"), ({"stop": [["nested"]]}, "stop"),
             ({"stop_token_ids": [1] * 257}, "stop_token_ids"), ({"stop_token_ids": [big]}, "stop_token_ids"),
             ({"stop_token_ids": [True]}, "stop_token_ids"), ({"stream": 1}, "stream"),
             ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
             ({"return_token_ids": 0}, "return_token_ids"), ({"model": ["m"]}, "model")]
    for extra, param in cases:
        e = _error(parse_completion, {"prompt": [0, 5], **extra}, ctx)
        assert (e.status, e.param) == (400, param), (extra, e.message)
        assert len(e.message) < 400 and param.split("_")[0] in e.message, (extra, e.message)
    for extra, param in [({"max_completion_tokens": big}, "max_completion_tokens"),
                         ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
                         ({"messages": [{"role": big, "content": "x"}]}, "messages"),
                         ({"chat_template_kwargs": {"thinking": 1}}, "chat_template_kwargs")]:
        body = {"messages": [{"role": "user", "content": "tok7"}], **extra}
        assert _error(parse_chat, body, ctx).param == param, extra
    deep = []
    for _ in range(5000):           # deeper than repr can print: the message still names the field
        deep = [deep]
    for name in ("n", "stop", "seed"):
        assert _error(parse_completion, {"prompt": [0, 5], name: deep}, ctx).param == name
    ok = parse_completion({"prompt": [0, 5], "seed": 2 ** 63 - 1, "top_k": 2 ** 31 - 1, "temperature": 2}, ctx)
    assert ok.params.seed == 2 ** 63 - 1 and ok.params.temperature == 2.0


def test_parse_json_refuses_what_is_not_standard_json():
    assert parse_json(b'{"a": [1, 2.5, "x"]}') == {"a": [1, 2.5, "x"]}
    for raw, what in [(b'{"temperature": NaN}', "NaN"), (b'{"temperature": Infinity}', "Infinity"),
                      (b'{"t": -Infinity}', "Infinity"), (b"[" * 100_000, "nested"), (b"1" * 5000, "digits"),
                      (b"\xff\xfe{}", "JSON"), (b'{"a": 1', "JSON"), (b"", "JSON")]:
        with pytest.raises(APIError) as e:
            parse_json(raw)
        assert e.value.status == 400 and what in e.value.message, (raw[:20], e.value.message)
