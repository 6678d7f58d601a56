"""DSML, DeepSeek's tool-call markup: the tools section of the system prompt, earlier turns' tool calls written
back into the prompt, and the JSON arguments of a parsed call.

A reply's tool calls, as the V4 encoder writes them (V4.1: the tag names of formats.V41):

    \\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

A parameter marked string="true" holds raw text; any other value is JSON. The arguments of a call are the JSON
object DeepSeek's decoder builds from them: `{"city": "Paris", "days": 3}` (keys and string values JSON-encoded,
non-string values copied as the model wrote them).
"""

from __future__ import annotations

import json
from typing import Any

from .. import bounded_json
from .chat_text import ChatText
from .formats import END_THINK, THINK, ChatFormat

__all__ = ["to_json", "render_tools", "render_tool_calls", "argument_piece", "ARGUMENTS_OPEN", "ARGUMENTS_CLOSE"]

ARGUMENTS_OPEN, ARGUMENTS_CLOSE = "{", "}"

_TOOLS = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"{calls_open}" block like the following:

{calls_open}
{invoke_open} name="$TOOL_NAME">
{parameter_open} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{parameter_close}
...
{invoke_close}
{invoke_open} name="$TOOL_NAME2">
...
{invoke_close}
{calls_close}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think}), you MUST output your complete reasoning inside \
{think}...{end_think} BEFORE any tool calls or final response.

Otherwise, output directly after {end_think} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def to_json(value: Any) -> str:
    """JSON as DeepSeek's encoder writes it: non-ASCII characters kept, ", " and ": " separators. ValueError for a
    value nested deeper than bounded_json.MAX_DEPTH."""
    if bounded_json.depth(value) > bounded_json.MAX_DEPTH:
        raise ValueError(f"a JSON value nested more than {bounded_json.MAX_DEPTH} levels deep")
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return json.dumps(value, ensure_ascii=True)


def render_tools(fmt: ChatFormat, functions: list[dict]) -> ChatText:
    """The tools section appended to the system message: functions are OpenAI tools' "function" objects (their
    JSON is content: special-token strings in it stay text)."""
    head, tail = _TOOLS.split("{schemas}")
    tags = dict(calls_open=fmt.calls_open, calls_close=fmt.calls_close, invoke_open=fmt.invoke_open,
                invoke_close=fmt.invoke_close, parameter_open=fmt.parameter_open,
                parameter_close=fmt.parameter_close, think=THINK, end_think=END_THINK)
    return ChatText([(head.format(**tags), True), ("\n".join(to_json(f) for f in functions), False),
                     (tail.format(**tags), True)])


def _arguments(fmt: ChatFormat, raw: Any, where: str) -> dict:
    """An earlier call's arguments (OpenAI: a JSON string) as a dict. V4 keeps text that is not JSON as
    {"arguments": text}; V4.1 requires a JSON object."""
    try:
        value = bounded_json.loads(raw) if isinstance(raw, str) else raw
    except bounded_json.TooDeep as e:
        raise ValueError(f"{where}: function.arguments is {e}") from None
    except ValueError:
        if fmt.name == "v4":
            return {"arguments": raw}
        raise ValueError(f"{where}: function.arguments must be a JSON object, got {raw[:100]!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: function.arguments must be a JSON object, got {to_json(value)[:100]}")
    return value


def render_tool_calls(fmt: ChatFormat, calls: list[dict], where: str) -> ChatText:
    """An assistant turn's tool calls (OpenAI's [{"function": {"name", "arguments"}}]) as the DSML block that
    follows its content (names and values are content: special-token strings in them stay text)."""
    parts = [(f"\n\n{fmt.calls_open}\n", True)]
    for n, c in enumerate(calls):
        parts += [("\n" if n else "", True), (f'{fmt.invoke_open} name="', True), (c["function"]["name"], False),
                  ('">\n', True)]
        for k, (name, v) in enumerate(_arguments(fmt, c["function"].get("arguments", "{}"), where).items()):
            parts += [("\n" if k else "", True), (f'{fmt.parameter_open} name="', True), (name, False),
                      (f'" string="{"true" if isinstance(v, str) else "false"}">', True),
                      (v if isinstance(v, str) else to_json(v), False), (fmt.parameter_close, True)]
        parts.append((f"\n{fmt.invoke_close}", True))
    parts.append((f"\n{fmt.calls_close}", True))
    return ChatText(parts)


def argument_piece(first: bool, name: str, value: str, is_string: bool) -> str:
    """The next piece of a call's JSON arguments for one parsed parameter (the pieces of a call, then
    ARGUMENTS_CLOSE, concatenate to DeepSeek's decoded arguments)."""
    return ("{" if first else ", ") + f"{to_json(name)}: {to_json(value) if is_string else value}"
