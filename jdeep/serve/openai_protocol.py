"""The OpenAI API's request and response bodies: JSON in -> a validated GenerationRequest, results -> JSON.

Requests (POST /v1/completions, POST /v1/chat/completions) are parsed field by field (JSON types, prompt and
message forms); the request itself (ids, sampling values, context length) is validated once, by the engine's
check (runtime/requests.py). Anything wrong is an APIError carrying the HTTP status and OpenAI's error body
({"error": {message, type, param, code}}).
Supported beyond OpenAI's own fields (as vLLM names them): top_k, min_p, stop_token_ids, return_token_ids
(each choice and stream chunk also carries its token ids; always, for a model without a tokenizer) and, for chat, chat_template_kwargs.thinking
(DeepSeek's thinking mode). Fields jdeep cannot honour (n > 1, logprobs, echo, penalties, logit_bias,
tools, response_format) are rejected by name rather than silently ignored.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..runtime.requests import Request, RequestError
from ..runtime.sampling import SamplingParams

__all__ = ["APIError", "GenerationRequest", "ServingContext", "parse_completion", "parse_chat",
           "completion_response", "chat_response", "completion_chunk", "chat_chunk", "usage"]


class APIError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

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


def _field(body: dict, name: str, types: tuple, default: Any = None, what: str | None = None) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in types or not isinstance(v, types):
        raise APIError(400, f"'{name}' must be {what or ' or '.join(t.__name__ for t in types)}, got {v!r}"[:300],
                       param=name)
    return v


def _check_model(body: dict, ctx: ServingContext) -> str:
    model = body.get("model")
    if model is None:
        return ctx.model_name
    if not isinstance(model, str):
        raise APIError(400, f"'model' must be a string, got {model!r}"[:300], param="model")
    if model != ctx.model_name:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{ctx.model_name}'",
                       param="model", code="model_not_found")
    return model


def _check_unsupported(body: dict) -> None:
    for name, off in _UNSUPPORTED.items():
        v = body.get(name)
        if v is not None and not any(v == o and isinstance(v, bool) == isinstance(o, bool) for o in off):
            raise APIError(400, f"'{name}'={v!r} is not supported by jdeep"[:300], param=name)


def _sampling(body: dict, max_tokens: int) -> SamplingParams:
    stop = _field(body, "stop", (str, list), ())
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, f"'stop' must be a string or a list of non-empty strings, got {list(stop)!r}"[:300],
                       param="stop")
    stop_ids = _field(body, "stop_token_ids", (list,), [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise APIError(400, "'stop_token_ids' must be a list of integers", param="stop_token_ids")
    return SamplingParams(
        temperature=float(_field(body, "temperature", (int, float), 1.0, "a number")),
        top_k=_field(body, "top_k", (int,), 0, "an integer"),
        top_p=float(_field(body, "top_p", (int, float), 1.0, "a number")),
        min_p=float(_field(body, "min_p", (int, float), 0.0, "a number")),
        seed=_field(body, "seed", (int,), None, "an integer"),
        max_new_tokens=max_tokens, stop_token_ids=tuple(stop_ids), stop=stop)


def _max_tokens(body: dict, names: Sequence[str], default: int | None) -> int | None:
    for name in names:
        v = _field(body, name, (int,), None, "an integer")
        if v is not None:
            if v < 1:
                raise APIError(400, f"'{name}' must be at least 1, got {v}", param=name)
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
    prompts = []
    for p in prompt:
        if isinstance(p, str):
            if ctx.tokenizer is None:
                raise APIError(400, "this model has no tokenizer (no tokenizer.json): send the prompt as token ids",
                               param="prompt")
            p = ctx.tokenizer.encode(p)
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
        raise APIError(400, f"messages[{i}]: role must be system, developer, user or assistant, got {role!r}"[:300],
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
