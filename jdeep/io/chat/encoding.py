"""OpenAI chat messages -> a DeepSeek-V4 / V4.1 prompt, as DeepSeek's own encoders lay it out (`encode_messages` in
`encoding/encoding_dsv4.py` of the V4 release, and its V4.1 counterpart; formats.py lists what differs):

    BOS [effort line] {system}[tools section] <｜User｜>{user}<｜Assistant｜></think>{reply}EOS <｜User｜>...
    ... <｜User｜>{last user}<｜Assistant｜>   then `</think>` (chat mode) or `<think>` (thinking mode)

The points followed, in DeepSeek's order:
1. Tool results: OpenAI `tool` messages become `<tool_result>{content}</tool_result>` blocks of a user turn, merged
   with the user text that follows (blocks joined by a blank line), sorted into the order of the assistant's calls
   (by tool_call_id).
2. Reasoning of earlier turns: in thinking mode without tools, the assistant turns before the last user message
   lose their reasoning (and their `</think>`); with tools every turn keeps it (`<think>` opens every reply).
   Chat mode writes no reasoning at all.
3. An assistant turn is `{reasoning}</think>{content}{tool calls}EOS` (thinking mode, kept reasoning) or
   `{content}{tool calls}EOS`; tool calls are a DSML block after a blank line (dsml.py).
4. Tools (OpenAI's request-level `tools`) are rendered after the first system message's text; without a system
   message jdeep adds an empty one to hold them (as vLLM's DeepSeek tokenizer modes do).
5. Reasoning effort: formats.ChatFormat.effort_line, before the first message, thinking mode only.
jdeep's own choices, where DeepSeek's encoder takes no OpenAI input: "developer" messages are system messages
(OpenAI's meaning; DeepSeek's internal "developer" role is not exposed), text parts of one message are joined by a
blank line (as DeepSeek joins a turn's blocks), `reasoning` is accepted as an alias of `reasoning_content`.
"""

from __future__ import annotations

from typing import Any, Sequence

from .chat_text import ChatText, content, markup
from .dsml import render_tool_calls, render_tools, to_json
from .formats import ASSISTANT, BOS, END_THINK, EOS, IMAGE, LATEST_REMINDER, THINK, USER, ChatFormat

__all__ = ["encode_chat", "normalize_messages"]

_ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")


def _content_text(fmt: ChatFormat, i: int, content_: Any, role: str) -> ChatText:
    """A message's content (a string, None, or OpenAI content parts) as content text; image parts become the V4.1
    image placeholder (markup)."""
    if content_ is None:
        if role not in ("assistant", "tool"):
            raise ValueError(f"messages[{i}]: a {role} message needs content")
        return ChatText()
    if isinstance(content_, str):
        if fmt.images and IMAGE in content_:
            raise ValueError(f"messages[{i}]: content contains the image token {IMAGE}; send images as image parts")
        return content(content_)
    if not isinstance(content_, list):
        raise ValueError(f"messages[{i}]: content must be a string or a list of content parts")
    out = ChatText()
    for j, part in enumerate(content_):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            piece = _content_text(fmt, i, part["text"], role)
        elif kind in ("image_url", "image") and role in ("user", "tool"):
            if not fmt.images:
                raise ValueError(f"messages[{i}].content[{j}]: DeepSeek-V4 takes no images (V4.1 does)")
            piece = markup(IMAGE)
        else:
            raise ValueError(f"messages[{i}].content[{j}]: unsupported content part {to_json(part)[:100]}")
        out = out + (markup("\n\n") if j else ChatText()) + piece
    return out


def normalize_messages(fmt: ChatFormat, messages: Sequence[dict]) -> list[dict]:
    """Validate OpenAI chat messages and bring them to the encoder's form: roles system / user / assistant /
    tool / latest_reminder, string contents, assistant `reasoning_content` and `tool_calls`, tool `tool_call_id`.
    ValueError naming messages[i] for anything else."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with a role")
        role = m.get("role")
        if role not in _ROLES:
            raise ValueError(f"messages[{i}]: role must be one of {', '.join(_ROLES)}, got {str(role)[:50]!r}")
        role = "system" if role == "developer" else role
        msg = {"role": role, "content": _content_text(fmt, i, m.get("content"), role)}
        if role == "assistant":
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if reasoning is not None and not isinstance(reasoning, str):
                raise ValueError(f"messages[{i}]: reasoning_content must be a string")
            if reasoning and fmt.images and IMAGE in reasoning:
                raise ValueError(f"messages[{i}]: reasoning_content contains the image token {IMAGE}")
            msg["reasoning_content"] = content(reasoning) if reasoning else reasoning
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise ValueError(f"messages[{i}]: tool_calls must be a list")
            for j, c in enumerate(calls):
                f = c.get("function") if isinstance(c, dict) else None
                if (not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]
                        or not isinstance(f.get("arguments", "{}"), str)):
                    raise ValueError(f"messages[{i}].tool_calls[{j}] must be {{'function': {{'name': str, "
                                     "'arguments': JSON string}}}")
                if not isinstance(c.get("id", ""), (str, type(None))):
                    raise ValueError(f"messages[{i}].tool_calls[{j}].id must be a string")
            msg["tool_calls"] = calls
        elif role == "tool":
            tid = m.get("tool_call_id", "")
            if not isinstance(tid, str):
                raise ValueError(f"messages[{i}]: tool_call_id must be a string")
            msg["tool_call_id"] = tid
        out.append(msg)
    return out


def _merge_tool_results(messages: list[dict]) -> list[dict]:
    """Tool messages -> tool_result blocks of a user turn; a user message right after joins that turn."""
    merged: list[dict] = []
    for msg in messages:
        msg = dict(msg)         # the blocks lists are new; nothing nested is changed in place
        if msg["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": msg["tool_call_id"], "content": msg["content"]}
            if merged and merged[-1]["role"] == "user" and "blocks" in merged[-1]:
                merged[-1]["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block]})
        elif msg["role"] == "user":
            block = {"type": "text", "text": msg["content"]}
            if merged and merged[-1]["role"] == "user" and "blocks" in merged[-1]:
                merged[-1]["blocks"].append(block)
            else:
                merged.append({"role": "user", "content": msg["content"], "blocks": [block]})
        else:
            merged.append(msg)
    return merged


def _sort_tool_results(messages: list[dict]) -> list[dict]:
    """Each turn's tool_result blocks in the order of the preceding assistant's calls (stable; unknown ids first)."""
    order: dict[str, int] = {}
    for msg in messages:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            order = {c["id"]: k for k, c in enumerate(msg["tool_calls"]) if c.get("id")}
        elif msg["role"] == "user" and "blocks" in msg and order:
            results = [b for b in msg["blocks"] if b["type"] == "tool_result"]
            if len(results) > 1:
                results = iter(sorted(results, key=lambda b: order.get(b["tool_use_id"], 0)))
                msg["blocks"] = [next(results) if b["type"] == "tool_result" else b for b in msg["blocks"]]
    return messages


def _last_user(fmt: ChatFormat, messages: list[dict]) -> int:
    """Index of the last user turn (V4.1: a system message after the first counts as one); -1 if none."""
    for k in range(len(messages) - 1, -1, -1):
        role = messages[k]["role"]
        if role == "user" or (fmt.name == "v41" and role == "system" and k > 0):
            return k
    return -1


def _drop_reasoning(fmt: ChatFormat, messages: list[dict]) -> list[dict]:
    """The reasoning of assistant turns before the last user turn removed."""
    last = _last_user(fmt, messages)
    out = []
    for k, msg in enumerate(messages):
        if msg["role"] == "assistant" and k < last:
            msg = dict(msg, reasoning_content=None)
        out.append(msg)
    return out


def _opens_reply(fmt: ChatFormat, messages: list[dict], k: int) -> bool:
    """Whether message k is followed by the generation header (a user turn, or V4.1's later system message)."""
    role = messages[k]["role"]
    return role == "user" or (fmt.name == "v41" and role == "system" and k > 0)


def _render(fmt: ChatFormat, messages: list[dict], k: int, thinking: bool, drop: bool, effort, tools) -> ChatText:
    msg, role = messages[k], messages[k]["role"]
    last = _last_user(fmt, messages)
    effort_line = fmt.effort_line(effort) if k == 0 and thinking else ""
    out = markup(fmt.system_token if k == 0 and (effort_line or role == "system") and fmt.system_token else "")
    out += markup(effort_line)
    if role == "system":
        if k > 0:
            out += markup(fmt.system_token)
        out += msg["content"]
        if msg.get("tools"):
            out += markup("\n\n") + render_tools(fmt, msg["tools"])
    elif role == "user":
        out += markup(USER)
        for n, b in enumerate(msg.get("blocks") or [{"type": "text", "text": msg["content"]}]):
            out += markup("\n\n" if n else "")
            out += (b["text"] if b["type"] == "text" else
                    markup("<tool_result>") + b["content"] + markup("</tool_result>"))
    elif role == "latest_reminder":
        out += markup(LATEST_REMINDER) + msg["content"]
    else:   # assistant
        calls = render_tool_calls(fmt, msg["tool_calls"], f"messages[{k}]") if msg.get("tool_calls") else ChatText()
        if thinking and (not drop or k > last):
            out += (msg.get("reasoning_content") or ChatText()) + markup(END_THINK)
        out += msg["content"] + calls + markup(EOS)
    if k + 1 < len(messages) and messages[k + 1]["role"] not in ("assistant", "latest_reminder"):
        return out
    if _opens_reply(fmt, messages, k):
        out += markup(ASSISTANT + (THINK if thinking and (not drop or k >= last) else END_THINK))
    return out


def encode_chat(fmt: ChatFormat, messages: Sequence[dict], *, thinking: bool = False, reasoning_effort=None,
                tools: Sequence[dict] | None = None, drop_thinking: bool = True, add_bos: bool = True) -> ChatText:
    """The prompt text of a conversation, ending where the assistant's reply begins: a ChatText, the string
    DeepSeek's encoder writes, whose parts keep the messages' text apart from the encoder's markup (special-token
    strings typed in a message stay text when Tokenizer.encode reads it).

    messages: OpenAI chat messages (normalize_messages); tools: OpenAI tools' "function" objects (already
    validated); thinking: DeepSeek's thinking mode; reasoning_effort: see ChatFormat.effort_line. ValueError
    naming the message at fault (and for a conversation whose last turn is not the user's or a tool's)."""
    fmt.check_effort(reasoning_effort)
    msgs = normalize_messages(fmt, messages)
    if not msgs:
        raise ValueError("messages must not be empty")
    if tools:
        if msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": ChatText()})
        msgs[0]["tools"] = list(tools)
    msgs = _sort_tool_results(_merge_tool_results(msgs))
    if not _opens_reply(fmt, msgs, len(msgs) - 1):
        raise ValueError("the last message must be the user's (or a tool result), not "
                         f"{msgs[-1]['role']!r}: the prompt must end where the assistant's reply begins")
    drop = drop_thinking and not tools
    if thinking and drop:
        msgs = _drop_reasoning(fmt, msgs)
    out = markup(BOS if add_bos else "")
    for k in range(len(msgs)):
        out += _render(fmt, msgs, k, thinking, drop, reasoning_effort, tools)
    return out
