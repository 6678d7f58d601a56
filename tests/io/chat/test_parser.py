"""The reply parser beyond well-formed replies: streamed in any chunking it gives what the whole text gives,
markup never reaches content or reasoning, and replies DeepSeek's parser refuses (no `</think>`, a cut-off call,
loose whitespace, junk inside a calls block) still give the content and calls they hold."""

from __future__ import annotations

import json
import pathlib
import random

import pytest

from jdeep.io.chat import FORMATS, V4, V41, ReplyParser, parse_reply
from jdeep.io.chat.formats import DSML, END_THINK, EOS, THINK

DATA = json.loads((pathlib.Path(__file__).parent / "data" / "deepseek_encoder.json").read_text())


def _stream(fmt, text: str, thinking: bool, cuts: list[int]) -> dict:
    p = ReplyParser(fmt, thinking)
    events = []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        events += p.push(text[a:b])
    events += p.finish()
    out = {"reasoning_content": "", "content": "", "tool_calls": []}
    for ev in events:
        if ev[0] == "reasoning":
            out["reasoning_content"] += ev[1]
        elif ev[0] == "content":
            out["content"] += ev[1]
        elif ev[0] == "call":
            assert ev[1] == len(out["tool_calls"])          # calls are announced in order, once
            out["tool_calls"].append({"name": ev[2], "arguments": ""})
        else:
            out["tool_calls"][ev[1]]["arguments"] += ev[2]
    return out


@pytest.mark.parametrize("case", DATA["replies"], ids=lambda c: f"{c['format']}-{c['name']}-{c['thinking']}")
def test_any_chunking_gives_the_whole_parse(case):
    fmt, text = FORMATS[case["format"]], case["reply"]
    whole = parse_reply(fmt, text, case["thinking"])
    rng = random.Random(len(text))
    for chunking in ([], list(range(1, len(text))), sorted(rng.sample(range(1, len(text)), min(9, len(text) - 1)))):
        assert _stream(fmt, text, case["thinking"], chunking) == whole


def _markup_free(out: dict) -> bool:
    return not any(m in out[k] for k in ("content", "reasoning_content") for m in (DSML, EOS, THINK, END_THINK))


@pytest.mark.parametrize("fmt", [V4, V41])
def test_markup_never_leaks_from_mangled_replies(fmt):
    """Random cuts, duplications and deletions of well-formed replies: whatever the parser makes of them, no
    marker text reaches content or reasoning, and every call's arguments are a complete JSON text."""
    rng = random.Random(0)
    replies = [c["reply"] for c in DATA["replies"] if c["format"] == fmt.name and c["parsed"]["tool_calls"]]
    assert replies
    for trial in range(300):
        t = rng.choice(replies)
        a, b = sorted(rng.sample(range(len(t)), 2))
        mangled = [t[:a] + t[b:], t[:b], t + t[a:b], t[a:]][trial % 4]
        for thinking in (False, True):
            cuts = sorted(rng.sample(range(1, len(mangled)), min(5, len(mangled) - 1))) if len(mangled) > 1 else []
            out = _stream(fmt, mangled, thinking, cuts)
            assert _markup_free(out), (mangled, out)
            assert out == parse_reply(fmt, mangled, thinking)


def test_thinking_without_end_think():
    assert parse_reply(V4, "still thinking when the tokens ran out", True) == {
        "reasoning_content": "still thinking when the tokens ran out", "content": "", "tool_calls": []}
    # a calls block ends the reasoning even without </think>
    r = parse_reply(V4, 'let me call\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
                        '<｜DSML｜parameter name="a" string="false">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
                        '</｜DSML｜tool_calls>' + EOS, True)
    assert r == {"reasoning_content": "let me call", "content": "", "tool_calls": [{"name": "f", "arguments": '{"a": 1}'}]}


def test_cut_off_call_is_closed_with_what_was_read():
    text = ('ok\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="a" string="true">x'
            '</｜DSML｜ parameter>\n<｜DSML｜ parameter name="b" string="true">cut he')
    r = parse_reply(V41, text, False)
    assert r["content"] == "ok" and r["tool_calls"] == [{"name": "f", "arguments": '{"a": "x"}'}]
    r = parse_reply(V41, 'ok\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="g">', False)
    assert r["tool_calls"] == [{"name": "g", "arguments": "{}"}]


def test_loose_whitespace_and_junk_inside_a_block():
    text = ('\n\n<｜DSML｜tool_calls>\n  <｜DSML｜invoke  name="f" >\nnoise\n'
            '<｜DSML｜parameter name="q"  string="true" >a "b"\nc</｜DSML｜parameter>\n\n</｜DSML｜invoke>\n'
            '<｜DSML｜invoke name="g">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\nAfter the calls.' + EOS)
    r = parse_reply(V4, text, False)
    assert r["tool_calls"] == [{"name": "f", "arguments": '{"q": "a \\"b\\"\\nc"}'}, {"name": "g", "arguments": "{}"}]
    assert r["content"] == "\n\nAfter the calls."


def test_eos_and_stray_markers_are_consumed():
    assert parse_reply(V4, "Hello." + EOS, False)["content"] == "Hello."
    assert parse_reply(V4, "</think>Hello.", False)["content"] == "Hello."      # chat mode, a stray </think>
    r = parse_reply(V41, "<think>why</think>because" + EOS + "ignored", True)
    assert r == {"reasoning_content": "why", "content": "because", "tool_calls": []}


def test_prefix_is_parsed_not_reported():
    """A forced opening (a named tool_choice) is part of the reply's markup, not of the generated text: its
    events come with the first push."""
    p = ReplyParser(V4, False, prefix='\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n')
    events = p.push('<｜DSML｜parameter name="x" string="false">[1, 2]</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
                    '</｜DSML｜tool_calls>') + p.finish()
    assert events == [("call", 0, "f"), ("arguments", 0, '{"x": [1, 2]'), ("arguments", 0, "}")]
    assert p.n_calls == 1
