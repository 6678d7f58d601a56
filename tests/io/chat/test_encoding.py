"""jdeep's chat encoding against DeepSeek's own V4 and V4.1 encoders: the prompts they write for a set of
conversations (system, multi-turn, thinking, reasoning effort, tools, tool results, V4.1's system token, images)
and their parses of replies, fixed as test data by scripts/make_chat_fixtures.py."""

from __future__ import annotations

import json
import pathlib

import pytest

from jdeep.io.chat import FORMATS, V4, V41, chat_format_for, encode_chat, parse_reply

DATA = json.loads((pathlib.Path(__file__).parent / "data" / "deepseek_encoder.json").read_text())


def _id(case: dict) -> str:
    return f"{case['format']}-{case['name']}-{'thinking' if case['thinking'] else 'chat'}"


@pytest.mark.parametrize("case", DATA["prompts"], ids=_id)
def test_prompt_equals_deepseek_encoder(case):
    tools = [t["function"] for t in case["tools"]] if case["tools"] else None
    got = encode_chat(FORMATS[case["format"]], case["messages"], thinking=case["thinking"],
                      reasoning_effort=case["reasoning_effort"], tools=tools)
    assert got == case["prompt"]


@pytest.mark.parametrize("case", DATA["replies"], ids=_id)
def test_reply_parse_equals_deepseek_parser(case):
    want = case["parsed"]
    got = parse_reply(FORMATS[case["format"]], case["reply"], case["thinking"])
    assert got["content"] == want["content"]
    assert got["reasoning_content"] == want["reasoning_content"]
    assert [(c["name"], c["arguments"]) for c in got["tool_calls"]] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in want["tool_calls"]]
    for c in got["tool_calls"]:
        json.loads(c["arguments"])


def test_fixtures_cover_the_features():
    """The test data holds what the issue names: both formats, both modes, efforts, tools and results, images."""
    names = {(c["format"], c["name"]) for c in DATA["prompts"]}
    for fmt in ("v4", "v41"):
        assert {(fmt, "multi_turn"), (fmt, "tools_then_user"), (fmt, "tools_pending_results")} <= names
    assert ("v41", "v41_images") in names and ("v41", "v41_mid_system") in names
    assert any(c["reasoning_effort"] == "max" and c["format"] == "v4" and c["thinking"] for c in DATA["prompts"])
    assert any(c["parsed"]["tool_calls"] for c in DATA["replies"] if c["format"] == "v41")
    # the cases differ where the formats differ
    prompts = {(c["format"], c["name"], c["thinking"]): c["prompt"] for c in DATA["prompts"]}
    assert prompts[("v4", "system_user", False)] != prompts[("v41", "system_user", False)]


def test_format_selection():
    assert chat_format_for("deepseek_v41") is V41 and chat_format_for("deepseek_v4") is V4
    assert chat_format_for("deepseek_v4", "v41") is V41
    with pytest.raises(ValueError, match="chat format"):
        chat_format_for("deepseek_v4", "v3")


@pytest.mark.parametrize("fmt,effort", [(V4, "low"), (V4, 50), (V41, 0), (V41, 101), (V41, "medium"), (V41, True)])
def test_bad_reasoning_effort_is_named(fmt, effort):
    with pytest.raises(ValueError, match="reasoning_effort"):
        encode_chat(fmt, [{"role": "user", "content": "hi"}], thinking=True, reasoning_effort=effort)


@pytest.mark.parametrize("fmt,messages,match", [
    (V4, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "no images"),
    (V41, [{"role": "user", "content": "see <｜deepseek_image｜>"}], "image token"),
    (V4, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "last message"),
    (V4, [{"role": "robot", "content": "q"}], "role"),
    (V4, [{"role": "user", "content": 5}], "content"),
    (V41, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "[1, 2]"}}]}, {"role": "tool", "content": "r"}], "JSON object"),
    (V4, [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
          {"role": "tool", "content": "r"}], "tool_calls\\[0\\]"),
])
def test_bad_messages_are_named(fmt, messages, match):
    with pytest.raises(ValueError, match=match):
        encode_chat(fmt, messages)
