"""The OpenAI API's request and response bodies: JSON in -> a validated GenerationRequest, results -> JSON.

Requests (POST /v1/completions, POST /v1/chat/completions) are parsed field by field (JSON types, prompt and
message forms); the request itself (ids, sampling values, context length) is validated once, by the engine's
check (runtime/requests.py). Anything wrong is an APIError carrying the HTTP status and OpenAI's error body
({"error": {message, type, param, code}}).
Supported beyond OpenAI's own fields (as vLLM names them): top_k, min_p, stop_token_ids, return_token_ids
(each choice and stream chunk also carries its token ids; always, for a model without a tokenizer) and, for chat, chat_template_kwargs.thinking
(DeepSeek's thinking mode). Fields jdeep cannot honour (n > 1, logprobs, echo, penalties, logit_bias,
tools, response_format) are rejected by name rather than silently ignored.

Every field is checked for its JSON type and range before anything uses it (`parse_json` refuses NaN/Infinity
literals, nesting too deep and integers too long to read): booleans are not numbers, integers stay within what the
engine holds (max_tokens and top_k int32, seed int64, token ids in the vocabulary), floats are finite, and lists
and strings are bounded (MAX_PROMPTS prompts per request, text at most MAX_CHARS_PER_TOKEN characters per token of
the context, SamplingParams' stop limits), so no body can reach the engine with a value it cannot take.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..runtime.requests import Request, RequestError
from ..runtime.sampling import (INT32_MAX, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SEED_MAX,
                                SamplingParams)

__all__ = ["APIError", "GenerationRequest", "ServingContext", "parse_json", "parse_completion", "parse_chat",
           "completion_response", "chat_response", "completion_chunk", "chat_chunk", "usage", "MAX_PROMPTS",
           "MAX_CHARS_PER_TOKEN"]

MAX_PROMPTS = 64             # prompts (choices) in one completions request
MAX_CHARS_PER_TOKEN = 64     # text (a prompt, the messages) longer than this x max_len is refused untokenized


class APIError(Exception):
    """An HTTP error in OpenAI's shape (headers: extra response headers, e.g. a 429's Retry-After)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ServingContext:
    """What parsing needs to know about the served model.
    check(ids, params) -> Request or RequestError: the engine's request validation (Engine.check_request)."""

    model_name: str
    max_len: int
    tokenizer: Any
    check: Callable[[Sequence[int], SamplingParams], Request]


@dataclass
class GenerationRequest:
    """One validated request: a prompt per choice (token ids; `requests` the engine's validated Requests), shared
    sampling params."""

    kind: str                       # "completion" or "chat"
    id: str
    created: int
    model: str
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    requests: tuple[Request, ...] = ()


_UNSUPPORTED = {   # field -> the values that mean "off" (anything else is rejected)
    "n": (None, 1), "best_of": (None, 1), "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}), "suffix": (None, ""), "tools": (None, []), "functions": (None, []),
    "response_format": (None, {"type": "text"}), "tool_choice": (None, "none", "auto"),
}


def parse_json(raw: bytes) -> Any:
    """A request body -> its JSON value; APIError 400 for anything that is not standard JSON (bad syntax or UTF-8,
    NaN / Infinity, integers beyond Python's digit limit, nesting deeper than the parser's recursion limit)."""
    def no_constant(name: str):
        raise ValueError(f"{name} is not a JSON number")

    try:
        return json.loads(raw, parse_constant=no_constant)
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:        # JSONDecodeError is a ValueError
        raise APIError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None


def _show(v: Any) -> str:
    """A value for an error message: its repr, at most 200 characters (also for ints too long to print and values
    nested too deeply to print)."""
    try:
        r = repr(v)
    except (ValueError, RecursionError):
        r = f"<a {v.bit_length()}-bit integer>" if isinstance(v, int) else f"<a deeply nested {type(v).__name__}>"
    return r if len(r) <= 200 else r[:197] + "..."


def _field(body: dict, name: str, types: tuple, default: Any = None, what: str | None = None) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in types or not isinstance(v, types):
        raise APIError(400, f"'{name}' must be {what or ' or '.join(t.__name__ for t in types)}, got {_show(v)}",
                       param=name)
    return v


def _int(body: dict, name: str, lo: int, hi: int, default: Any = None) -> Any:
    """An integer field within [lo, hi] (booleans are not integers)."""
    v = _field(body, name, (int,), None, f"an integer in [{lo}, {hi}]")
    if v is None:
        return default
    if not lo <= v <= hi:
        raise APIError(400, f"'{name}' must be an integer in [{lo}, {hi}], got {_show(v)}", param=name)
    return v


def _float(body: dict, name: str, default: float) -> float:
    """A finite number field (an int too large for a float is not one)."""
    v = _field(body, name, (int, float), None, "a finite number")
    if v is None:
        return default
    try:
        x = float(v)
    except OverflowError:
        x = math.inf
    if not math.isfinite(x):
        raise APIError(400, f"'{name}' must be a finite number, got {_show(v)}", param=name)
    return x


def _text(s: str, param: str, what: str, limit: int) -> str:
    """A string the tokenizer may see: valid Unicode (no unpaired surrogates) and at most `limit` characters."""
    if len(s) > limit:
        raise APIError(400, f"{what} is {len(s)} characters long; the limit is {limit}", param=param)
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{what} is not valid Unicode text: {e.reason} at character {e.start}",
                       param=param) from None
    return s


def _check_model(body: dict, ctx: ServingContext) -> str:
    model = body.get("model")
    if model is None:
        return ctx.model_name
    if not isinstance(model, str):
        raise APIError(400, f"'model' must be a string, got {_show(model)}", param="model")
    if model != ctx.model_name:
        raise APIError(404, f"The model {_show(model)} does not exist; this server serves '{ctx.model_name}'",
                       param="model", code="model_not_found")
    return model


def _check_unsupported(body: dict) -> None:
    for name, off in _UNSUPPORTED.items():
        v = body.get(name)
        if v is not None and not any(v == o and isinstance(v, bool) == isinstance(o, bool) for o in off):
            raise APIError(400, f"'{name}'={_show(v)} is not supported by jdeep", param=name)


def _sampling(body: dict, max_tokens: int) -> SamplingParams:
    stop = _field(body, "stop", (str, list), ())
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings, "
                       f"got {_show(list(stop))}", param="stop")
    for s in stop:
        _text(s, "stop", "a 'stop' string", MAX_STOP_CHARS)
    stop_ids = _field(body, "stop_token_ids", (list,), [])
    if len(stop_ids) > MAX_STOP_TOKEN_IDS or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise APIError(400, f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} integers",
                       param="stop_token_ids")
    return SamplingParams(
        temperature=_float(body, "temperature", 1.0), top_k=_int(body, "top_k", 0, INT32_MAX, 0),
        top_p=_float(body, "top_p", 1.0), min_p=_float(body, "min_p", 0.0), seed=_int(body, "seed", 0, SEED_MAX),
        max_new_tokens=max_tokens, stop_token_ids=tuple(stop_ids), stop=stop)


def _max_tokens(body: dict, names: Sequence[str], default: int | None) -> int | None:
    for name in names:
        v = _int(body, name, 1, INT32_MAX)
        if v is not None:
            return v
    return default


def _finish(body: dict, kind: str, model: str, prompts: list[list[int]], max_tokens: int | None,
            ctx: ServingContext, prompt_param: str) -> GenerationRequest:
    """The engine's validation of each prompt and the stream options, shared by both endpoints."""
    if max_tokens is None:                 # chat: as much as the context allows
        max_tokens = max(1, ctx.max_len - max(len(p) for p in prompts))
    params = _sampling(body, max_tokens)
    requests = []
    for p in prompts:
        try:
            requests.append(ctx.check(p, params))
        except RequestError as e:
            param = prompt_param if e.param == "prompt" else e.param
            raise APIError(400, str(e), param=param, code=e.code) from None
    stream = _field(body, "stream", (bool,), False, "a boolean")
    opts = _field(body, "stream_options", (dict,), {}, "an object")
    if opts and not stream:
        raise APIError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options")
    if not isinstance(opts.get("include_usage", False), bool):
        raise APIError(400, "'stream_options.include_usage' must be a boolean", param="stream_options")
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    return GenerationRequest(kind, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model,
                             [r.ids.tolist() for r in requests], params, stream, bool(opts.get("include_usage", False)),
                             _field(body, "return_token_ids", (bool,), False, "a boolean") or ctx.tokenizer is None,
                             tuple(requests))


def parse_completion(body: Any, ctx: ServingContext) -> GenerationRequest:
    """POST /v1/completions: prompt is a string, a list of token ids, or a list of either (one choice each)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = _check_model(body, ctx)
    _check_unsupported(body)
    if "prompt" not in body:
        raise APIError(400, "'prompt' is required", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(
            isinstance(p, str) or (isinstance(p, list) and p and all(_is_id(t) for t in p)) for p in prompt):
        raise APIError(400, "'prompt' must be a string, a non-empty list of token ids, or a list of those",
                       param="prompt")
    if len(prompt) > MAX_PROMPTS:
        raise APIError(400, f"'prompt' holds {len(prompt)} prompts; at most {MAX_PROMPTS} per request", param="prompt")
    prompts = []
    for p in prompt:
        if isinstance(p, str):
            if ctx.tokenizer is None:
                raise APIError(400, "this model has no tokenizer (no tokenizer.json): send the prompt as token ids",
                               param="prompt")
            p = ctx.tokenizer.encode(_text(p, "prompt", "the prompt", MAX_CHARS_PER_TOKEN * ctx.max_len))
            if not p:
                raise APIError(400, "the prompt encodes to no tokens", param="prompt")
        prompts.append(p)
    max_tokens = _max_tokens(body, ("max_tokens",), 16)
    return _finish(body, "completion", model, prompts, max_tokens, ctx, "prompt")


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _message_text(i: int, m: Any) -> dict:
    if not isinstance(m, dict):
        raise APIError(400, f"messages[{i}] must be an object with 'role' and 'content'", param="messages")
    role, content = m.get("role"), m.get("content")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant"):
        raise APIError(400, f"messages[{i}]: role must be system, developer, user or assistant, got {_show(role)}",
                       param="messages")
    if isinstance(content, list):     # content parts: only text
        if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str) for c in content):
            raise APIError(400, f"messages[{i}]: only text content parts are supported", param="messages")
        content = "".join(c["text"] for c in content)
    if not isinstance(content, str):
        raise APIError(400, f"messages[{i}]: content must be a string or a list of text parts", param="messages")
    return {"role": role, "content": content}


def parse_chat(body: Any, ctx: ServingContext) -> GenerationRequest:
    """POST /v1/chat/completions: messages in DeepSeek's chat format (io/tokenizer.py chat_prompt)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = _check_model(body, ctx)
    _check_unsupported(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    if ctx.tokenizer is None:
        raise APIError(400, "this model has no tokenizer (no tokenizer.json): chat needs one; use /v1/completions "
                       "with token ids", param="messages")
    messages = [_message_text(i, m) for i, m in enumerate(messages)]
    _text("".join(m["content"] for m in messages), "messages", "the messages' text", MAX_CHARS_PER_TOKEN * ctx.max_len)
    kwargs = _field(body, "chat_template_kwargs", (dict,), {}, "an object")
    thinking = kwargs.get("thinking", False)
    if not isinstance(thinking, bool):
        raise APIError(400, "'chat_template_kwargs.thinking' must be a boolean", param="chat_template_kwargs")
    try:
        ids = ctx.tokenizer.chat(messages, thinking=thinking)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), None)
    return _finish(body, "chat", model, [ids], max_tokens, ctx, "messages")


# ---------------------------------------------------------------------- responses
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _reason(r: str | None) -> str | None:
    return None if r is None else ("length" if r == "length" else "stop")


def completion_response(req: GenerationRequest, choices: list[dict], usage_: dict) -> dict:
    """choices: [{"text", "finish_reason", "token_ids"}] in prompt order."""
    out = []
    for i, c in enumerate(choices):
        choice = {"index": i, "text": c["text"], "logprobs": None, "finish_reason": _reason(c["finish_reason"])}
        if req.return_token_ids:
            choice.update(token_ids=c["token_ids"], prompt_token_ids=req.prompts[i])
        out.append(choice)
    return {"id": req.id, "object": "text_completion", "created": req.created, "model": req.model,
            "choices": out, "usage": usage_}


def chat_response(req: GenerationRequest, choice: dict, usage_: dict) -> dict:
    c = {"index": 0, "message": {"role": "assistant", "content": choice["text"]}, "logprobs": None,
         "finish_reason": _reason(choice["finish_reason"])}
    if req.return_token_ids:
        c.update(token_ids=choice["token_ids"], prompt_token_ids=req.prompts[0])
    return {"id": req.id, "object": "chat.completion", "created": req.created, "model": req.model,
            "choices": [c], "usage": usage_}


def completion_chunk(req: GenerationRequest, index: int, text: str, token_ids: list[int] | None,
                     finish_reason: str | None) -> dict:
    c = {"index": index, "text": text, "logprobs": None, "finish_reason": _reason(finish_reason)}
    if req.return_token_ids:
        c["token_ids"] = token_ids or []
    return {"id": req.id, "object": "text_completion", "created": req.created, "model": req.model, "choices": [c]}


def chat_chunk(req: GenerationRequest, delta: dict, token_ids: list[int] | None, finish_reason: str | None) -> dict:
    c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": _reason(finish_reason)}
    if req.return_token_ids:
        c["token_ids"] = token_ids or []
    return {"id": req.id, "object": "chat.completion.chunk", "created": req.created, "model": req.model,
            "choices": [c]}


def usage_chunk(req: GenerationRequest, usage_: dict) -> dict:
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    return {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": [], "usage": usage_}
