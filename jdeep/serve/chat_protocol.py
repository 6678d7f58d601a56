"""POST /v1/chat/completions: OpenAI chat messages, tools and DeepSeek's thinking mode -> a GenerationRequest
whose prompt is DeepSeek's chat encoding (io/chat) and whose `chat` plan tells the server how to read the reply.

- Thinking: `chat_template_kwargs: {"thinking": true}` (as vLLM and SGLang take it for DeepSeek; default off).
  `reasoning_effort` (OpenAI's field, or in chat_template_kwargs): the model's own values (io/chat/formats.py).
- Tools: OpenAI `tools` ([{"type": "function", "function": {name, description?, parameters?}}]) go into the
  system prompt as DeepSeek's tools section. `tool_choice`: "auto" (default with tools), "none" (the tools are
  not shown and no call is reported), "required" or {"type": "function", "function": {"name": ...}}: the reply
  is opened with the calls block (and the named invoke), so the model must call (that) tool. A forced call needs
  thinking off: its reasoning would come before the calls block, which the prompt cannot open yet.
  `parallel_tool_calls: false` keeps only the first call.
- The reply is decoded with special tokens kept (`</think>` and the DSML tags are special tokens in DeepSeek's
  tokenizer) and parsed by io/chat.ReplyParser into reasoning_content, content and tool_calls.
- Message text is text: DeepSeek's role markers, `<think>` or DSML tags typed in a message (or a tool result, a
  tool's schema, an earlier call's arguments) are encoded as the characters they are, not as the special tokens the
  encoder writes around the messages (io/chat.ChatText), so no client can forge a turn boundary or a tool result.
  DeepSeek's reference encoders return one string and leave this to the tokenizer call; vLLM and transformers
  encode a rendered chat template's special-token strings wherever they stand.
- logprobs (bool) / top_logprobs (0..20): every generated token's logprob (reasoning tokens included).
- Images (DeepSeek-V4.1 with its vision tower): `image_url` content parts of user and tool messages, as `data:`
  URLs (base64); jdeep fetches nothing, so other URLs get a 400, as does a model without a vision tower. io/chat
  puts V4.1's placeholder where each part was; the engine's check runs the tower (runtime.images).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..io.chat import ChatFormat, encode_chat
from ..io.chat.chat_text import markup
from ..runtime.requests import RequestError
from ..runtime.sampling import MAX_TOP_LOGPROBS
from .fields import APIError, field, integer, show, text
from .openai_protocol import (MAX_CHARS_PER_TOKEN, GenerationRequest, ServingContext, check_model, check_unsupported,
                              encode_text, finish_request, max_tokens_field)

__all__ = ["ChatPlan", "parse_chat", "MAX_TOOLS"]

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


@dataclass(frozen=True)
class ChatPlan:
    """How to read a chat reply. prefix: reply text the prompt already holds (a forced calls-block opening);
    tool_choice: "none", "auto", "required" or "function"; report_calls: whether tool calls are reported;
    parallel: more than one call may be reported; logprobs: per-token logprobs are returned."""

    fmt: ChatFormat
    thinking: bool
    tool_names: tuple[str, ...] = ()
    tool_choice: str = "none"
    prefix: str = ""
    parallel: bool = True
    logprobs: bool = False

    @property
    def report_calls(self) -> bool:
        return self.tool_choice != "none"


def _tools(body: dict) -> list[dict]:
    """The request's tools as their "function" objects, validated."""
    tools = field(body, "tools", (list,), [], "a list of tools")
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"'tools' holds {len(tools)} tools; at most {MAX_TOOLS}", param="tools")
    out, names = [], set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict):
            raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param="tools")
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise APIError(400, f"tools[{i}].function.name must be 1-64 characters of a-z, A-Z, 0-9, _, ., -; got "
                           f"{show(name)}", param="tools")
        if name in names:
            raise APIError(400, f"tools[{i}]: the tool name {name!r} is used twice", param="tools")
        if not isinstance(f.get("description", ""), str):
            raise APIError(400, f"tools[{i}].function.description must be a string", param="tools")
        if not isinstance(f.get("parameters", {}), dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON Schema object", param="tools")
        names.add(name)
        out.append(f)
    return out


def _tool_choice(body: dict, names: list[str]) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "function", the named function)."""
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto" if names else "none"), None
    if choice in ("none", "auto", "required"):
        if choice != "none" and not names:
            raise APIError(400, f"'tool_choice' {choice!r} needs 'tools'", param="tool_choice")
        return choice, None
    f = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(f, dict):
        raise APIError(400, "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                       f"{{'name': ...}}}}, got {show(choice)}", param="tool_choice")
    if f.get("name") not in names:
        raise APIError(400, f"'tool_choice' names {show(f.get('name'))}, which is not among the tools",
                       param="tool_choice")
    return "function", f["name"]


def _thinking(body: dict, fmt: ChatFormat) -> tuple[bool, Any]:
    kwargs = field(body, "chat_template_kwargs", (dict,), {}, "an object")
    thinking = kwargs.get("thinking", kwargs.get("enable_thinking", False))
    if not isinstance(thinking, bool):
        raise APIError(400, "'chat_template_kwargs.thinking' must be a boolean", param="chat_template_kwargs")
    effort = body.get("reasoning_effort", kwargs.get("reasoning_effort"))
    try:
        fmt.check_effort(effort)
    except ValueError as e:
        raise APIError(400, str(e), param="reasoning_effort") from None
    return thinking, effort


def _images(messages: list, ctx: ServingContext) -> list[str]:
    """The data: URLs of the messages' image parts in prompt order (400 for other URLs, malformed parts, or a model
    without a vision tower)."""
    urls = []
    for i, m in enumerate(messages):
        parts = m.get("content") if isinstance(m, dict) else None
        if not isinstance(parts, list):
            continue
        for j, p in enumerate(parts):
            if not isinstance(p, dict) or p.get("type") not in ("image_url", "image"):
                continue
            where = f"messages[{i}].content[{j}]"
            if ctx.expand_images is None:
                raise APIError(400, f"{where}: this model takes no images (no vision tower: its config.json has no "
                               "vision_config)", param="messages")
            url = p.get("image_url", p.get("url"))
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise APIError(400, f"{where}: an image part needs image_url.url (a data: URL)", param="messages")
            if not url.startswith("data:"):
                raise APIError(400, f"{where}: image URLs are not fetched; send the image as a base64 data: URL",
                               param="messages")
            urls.append(url)
    return urls


def parse_chat(body: Any, ctx: ServingContext) -> GenerationRequest:
    """POST /v1/chat/completions -> a GenerationRequest with its ChatPlan (`chat`)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = check_model(body, ctx)
    check_unsupported(body, ("prompt", "suffix", "echo", "best_of"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    if ctx.tokenizer is None:
        raise APIError(400, "this model has no tokenizer (no tokenizer.json): chat needs one; use /v1/completions "
                       "with token ids", param="messages")
    fmt = ctx.chat_format
    images = _images(messages, ctx)
    tools = _tools(body)
    choice, forced = _tool_choice(body, [f["name"] for f in tools])
    thinking, effort = _thinking(body, fmt)
    if choice in ("required", "function") and thinking:
        raise APIError(400, f"'tool_choice' {choice if forced is None else forced!r} forces the reply to open with a "
                       "tool call, which thinking mode does not allow (its reasoning comes first): turn thinking off "
                       "or use 'auto'", param="tool_choice")
    parallel = field(body, "parallel_tool_calls", (bool,), True, "a boolean")
    logprobs = field(body, "logprobs", (bool,), False, "a boolean")
    top = integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    try:
        prompt = encode_chat(fmt, messages, thinking=thinking, reasoning_effort=effort,
                             tools=tools if choice != "none" else None)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    prefix = ""
    if choice == "required":
        prefix = f"{fmt.tool_calls_start}\n{fmt.invoke_open} name=\""
    elif choice == "function":
        prefix = f"{fmt.tool_calls_start}\n{fmt.invoke_open} name=\"{forced}\">\n"
    prompt = prompt + markup(prefix)       # (message text stays text: io/chat.ChatText)
    if images:
        text(prompt, "messages", "the messages' text", MAX_CHARS_PER_TOKEN * ctx.max_len)
        try:
            ids = ctx.expand_images(prompt, images)
        except RequestError as e:
            raise APIError(400, str(e), param="messages") from None
    else:
        ids = encode_text(ctx, prompt, "messages", "the messages' text")
    plan = ChatPlan(fmt, thinking, tuple(f["name"] for f in tools), choice, prefix, parallel, logprobs)
    max_tokens = max_tokens_field(body, ("max_completion_tokens", "max_tokens"), None)
    return finish_request(body, "chat", model, [ids], max_tokens, ctx, "messages",
                          logprobs=(top or 0) if logprobs else None, chat=plan, skip_special_tokens=False)
