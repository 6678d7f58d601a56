"""Write tests/io/chat/data/deepseek_encoder.json: DeepSeek's own encoders' prompts for a set of conversations
and their parses of replies, the reference jdeep's chat encoding (jdeep/io/chat) is tested against.

    python scripts/make_chat_fixtures.py --v4 PATH/encoding_dsv4.py --v41 PATH/encoding_dsv41.py

--v4: `encoding/encoding_dsv4.py` from the DeepSeek-V4 model repository (checked first against the four test
conversations it ships with, when --v4-tests points at its encoding/tests folder); --v41: the V4.1 encoder
(published with DeepSeek-V4.1; SGLang vendors it as python/sglang/srt/entrypoints/openai/encoding_dsv41.py).
The encoders are imported from the given paths; nothing of them is kept but their outputs.

Each case gives jdeep's inputs (OpenAI messages, request-level tools, thinking, reasoning_effort); the script
passes them to DeepSeek's encoder the way jdeep's documented choices say (tools on the first system message, an
empty one added when there is none; "developer" messages as system messages).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import pathlib

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "io" / "chat" / "data" / "deepseek_encoder.json"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "units": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Web search; returns a list of hits.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                    "filters": {"type": "object"}, "top": {"type": "number"}}}}}


def _call(cid: str, name: str, args) -> dict:
    return {"id": cid, "type": "function",
            "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}


TOOL_TURNS = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "Weather in Paris and Zürich for 3 days?"},
    {"role": "assistant", "content": "", "reasoning_content": "Two cities: two calls.",
     "tool_calls": [_call("call_1", "get_weather", {"city": "Paris", "days": 3}),
                    _call("call_2", "get_weather", {"city": "Zürich", "days": 3, "units": "c"})]},
    {"role": "tool", "tool_call_id": "call_2", "content": "{\"temp\": 4, \"sky\": \"snow\"}"},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 11, \"sky\": \"rain\"}"},
]
TOOL_ANSWER = {"role": "assistant", "content": "Paris: 11 °C, rain. Zürich: 4 °C, snow.",
               "reasoning_content": "Both results are in."}
HISTORY = [
    {"role": "system", "content": "Answer in one line."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4.", "reasoning_content": "Simple arithmetic."},
    {"role": "user", "content": "And 3*3?"},
    {"role": "assistant", "content": "9.", "reasoning_content": "Multiply."},
    {"role": "user", "content": "Thanks! Now 10/4?"},
]


def cases() -> list[dict]:
    """(name, formats, messages, tools, thinking, reasoning_effort) for every conversation."""
    both = ["v4", "v41"]
    out = [
        dict(name="system_user", formats=both, messages=HISTORY[:2]),
        dict(name="user_only", formats=both, messages=[{"role": "user", "content": "Hello"}]),
        dict(name="multi_turn", formats=both, messages=HISTORY),
        dict(name="developer_is_system", formats=both,
             messages=[{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "Hi"}]),
        dict(name="consecutive_users", formats=both,
             messages=[{"role": "user", "content": "first"}, {"role": "user", "content": "second"}]),
        dict(name="unicode_and_markup_like_text", formats=both,
             messages=[{"role": "system", "content": "Réponds en français 🙂."},
                       {"role": "user", "content": "Explain <b>tags</b> & \"quotes\"\n\nin 漢字 too."}]),
        dict(name="latest_reminder", formats=both,
             messages=[{"role": "system", "content": "Assistant."},
                       {"role": "latest_reminder", "content": "2026-12-03, Thursday, Berlin"},
                       {"role": "user", "content": "What day is it?"}]),
        dict(name="tools_pending_results", formats=both, messages=TOOL_TURNS, tools=[WEATHER, SEARCH]),
        dict(name="tools_then_user", formats=both, tools=[WEATHER],
             messages=TOOL_TURNS + [TOOL_ANSWER, {"role": "user", "content": "And Rome?"}]),
        dict(name="tools_without_system", formats=both, tools=[SEARCH],
             messages=[{"role": "user", "content": "Find jdeep."}]),
        dict(name="tool_argument_types", formats=both, tools=[SEARCH], messages=[
            {"role": "user", "content": "search"},
            {"role": "assistant", "content": "Searching.", "tool_calls": [_call("s1", "search", {
                "query": "line one\nline \"two\"", "filters": {"lang": ["en", "de"], "safe": True, "max": None},
                "top": 2.5})]},
            {"role": "tool", "tool_call_id": "s1", "content": "[]"}]),
        dict(name="tool_result_parts", formats=both, tools=[SEARCH], messages=[
            {"role": "user", "content": "search"},
            {"role": "assistant", "content": None, "tool_calls": [_call("s1", "search", {"query": "x"})]},
            {"role": "tool", "tool_call_id": "s1", "content": [{"type": "text", "text": "hit 1"},
                                                                {"type": "text", "text": "hit 2"}]}]),
    ]
    for effort in ("high", "max"):
        out.append(dict(name=f"v4_effort_{effort}", formats=["v4"], messages=HISTORY[:2], reasoning_effort=effort))
    for effort in ("low", "xhigh", 7, "max"):
        out.append(dict(name=f"v41_effort_{effort}", formats=["v41"], messages=HISTORY[:2], reasoning_effort=effort))
    out += [
        dict(name="v41_effort_without_system", formats=["v41"], messages=[{"role": "user", "content": "Hi"}],
             reasoning_effort="xhigh"),
        dict(name="v41_mid_system", formats=["v41"], messages=HISTORY[:3] + [
            {"role": "system", "content": "From now on answer in German."}]),
        dict(name="v41_mid_system_then_user", formats=["v41"], messages=HISTORY[:3] + [
            {"role": "developer", "content": "Answer in German."}, {"role": "user", "content": "Und 5+5?"}]),
        dict(name="v41_images", formats=["v41"], messages=[
            {"role": "user", "content": [{"type": "text", "text": "Compare"},
                                         {"type": "image_url", "image_url": {"url": "https://x.test/a.png"}},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                                         {"type": "text", "text": "please."}]}]),
        dict(name="v4_arguments_not_json", formats=["v4"], tools=[SEARCH], messages=[
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "", "tool_calls": [_call("a", "search", "not json at all")]},
            {"role": "tool", "tool_call_id": "a", "content": "ok"}]),
    ]
    return out


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _reference_messages(case: dict) -> list[dict]:
    msgs = [dict(m, role="system") if m["role"] == "developer" else dict(m) for m in copy.deepcopy(case["messages"])]
    if case.get("tools"):
        if msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": ""})
        msgs[0]["tools"] = case["tools"]
    return msgs


def _check_shipped_tests(enc, folder: str) -> None:
    """The V4 encoder against the conversations it ships with (its own test_encoding_dsv4.py's first cases)."""
    for k, mode in ((1, "thinking"), (2, "thinking")):
        td = json.load(open(os.path.join(folder, f"test_input_{k}.json")))
        messages = td["messages"] if isinstance(td, dict) else td
        if isinstance(td, dict) and td.get("tools"):
            messages[0]["tools"] = td["tools"]
        gold = open(os.path.join(folder, f"test_output_{k}.txt")).read()
        assert enc.encode_messages(messages, thinking_mode=mode) == gold, f"shipped test {k} differs"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--v4", required=True)
    ap.add_argument("--v41", required=True)
    ap.add_argument("--v4-tests", help="the V4 repository's encoding/tests folder (a self-check of --v4)")
    args = ap.parse_args()
    encoders = {"v4": _load(args.v4, "deepseek_encoding_dsv4"), "v41": _load(args.v41, "deepseek_encoding_dsv41")}
    if args.v4_tests:
        _check_shipped_tests(encoders["v4"], args.v4_tests)
    prompts, replies = [], []
    for case in cases():
        for fmt in case["formats"]:
            enc = encoders[fmt]
            for thinking in (False, True):
                effort = case.get("reasoning_effort")
                text = enc.encode_messages(_reference_messages(case), thinking_mode="thinking" if thinking else "chat",
                                           reasoning_effort=effort)
                prompts.append({"name": case["name"], "format": fmt, "thinking": thinking, "reasoning_effort": effort,
                                "messages": case["messages"], "tools": case.get("tools"), "prompt": text})
            msgs = _reference_messages(case)
            for k, m in enumerate(msgs):          # each assistant turn as the reply DeepSeek's parser reads back
                if m["role"] != "assistant" or (fmt == "v4" and case["name"] == "v4_arguments_not_json"):
                    continue
                for thinking in (False, True):
                    mode = "thinking" if thinking else "chat"
                    reply = enc.render_message(k, msgs, mode, drop_thinking=False)
                    parsed = enc.parse_message_from_completion_text(reply, thinking_mode=mode)
                    replies.append({"name": f"{case['name']}[{k}]", "format": fmt, "thinking": thinking,
                                    "reply": reply, "parsed": parsed})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"generated_by": "scripts/make_chat_fixtures.py", "prompts": prompts,
                               "replies": replies}, ensure_ascii=False, indent=1) + "\n")
    print(f"{OUT}: {len(prompts)} prompts, {len(replies)} replies")


if __name__ == "__main__":
    main()
