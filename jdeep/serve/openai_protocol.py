"""The OpenAI API's request bodies: JSON in -> a validated GenerationRequest (chat_protocol.py adds the chat
endpoint's messages, tools and thinking; responses.py writes the answers).

Requests (POST /v1/completions, POST /v1/chat/completions) are parsed field by field (JSON types, prompt and
message forms); the request itself (ids, sampling values, context length) is validated once, by the engine's
check (runtime/requests.py). Anything wrong is an APIError carrying the HTTP status and OpenAI's error body.
Sampling fields: OpenAI's (temperature, top_p, seed, stop, max_tokens / max_completion_tokens, presence_penalty,
frequency_penalty, logit_bias, n, best_of, logprobs, top_logprobs, echo) and vLLM's extensions (top_k, min_p,
repetition_penalty, min_tokens, stop_token_ids, return_token_ids: each choice and stream chunk also carries its
token ids; always, for a model without a tokenizer). Fields jdeep cannot honour (suffix, functions, a
response_format other than text) are rejected by name rather than silently ignored.

Every field is checked for its JSON type and range before anything uses it (`parse_json` refuses NaN/Infinity
literals, nesting too deep and integers too long to read): booleans are not numbers, integers stay within what the
engine holds (max_tokens and top_k int32, seed int64, token ids in the vocabulary), floats are finite, and lists
and strings are bounded (MAX_PROMPTS prompts per request, MAX_CHOICES choices, text at most MAX_CHARS_PER_TOKEN
characters per token of the context, SamplingParams' stop and logit_bias limits), so no body can reach the engine
with a value it cannot take.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..io.chat import V4, ChatFormat
from ..runtime.requests import Request, RequestError
from ..runtime.sampling import (INT32_MAX, MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                                MAX_TOP_LOGPROBS, SEED_MAX, SamplingParams)
from .fields import APIError, field, integer, number, parse_json, show, text

__all__ = ["APIError", "GenerationRequest", "ServingContext", "parse_json", "parse_completion", "parse_request",
           "encode_text",
           "sampling_fields",
           "finish_request", "check_model", "check_unsupported", "max_tokens_field", "MAX_PROMPTS", "MAX_CHOICES", "MAX_CHARS_PER_TOKEN"]

MAX_PROMPTS = 64             # prompts in one completions request
MAX_CHOICES = 64             # sequences one request may generate (prompts x best_of)
MAX_CHARS_PER_TOKEN = 64     # text (a prompt, the messages) longer than this x max_len is refused untokenized
PROBE_CHARS_PER_TOKEN = 16   # a text longer than this x max_len has its head tokenised first (encode_text)

log = logging.getLogger("jdeep.serve")


@dataclass(frozen=True)
class ServingContext:
    """What parsing needs to know about the served model.
    check(ids, params) -> Request or RequestError: the engine's request validation (Engine.check_request).
    chat_format: the model's chat layout (io/chat: V4 or V4.1). expand_images(text, images) -> the prompt with its
    images (runtime.images.ImagePrompt; RequestError for a bad image), None for a model without a vision tower."""

    model_name: str
    max_len: int
    tokenizer: Any
    check: Callable[[Sequence[int], SamplingParams], Request]
    chat_format: ChatFormat = V4
    expand_images: Callable[[str, list], Any] | None = None


@dataclass
class GenerationRequest:
    """One validated request: a prompt per choice group (token ids), shared sampling params, and `requests`, the
    engine's validated Requests: best_of of them per prompt (prompt p, sample j at p * best_of + j), of which the
    n with the highest cumulative logprob are returned (all of them when best_of == n). logprobs: top
    alternatives per token (None: no logprobs); echo: the prompt (and its logprobs) comes first. chat: the chat
    endpoint's plan (chat_protocol.ChatPlan)."""

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
    n: int = 1
    best_of: int = 1
    logprobs: int | None = None
    echo: bool = False
    chat: Any = None


_UNSUPPORTED = {   # field -> the values that mean "off" (anything else is rejected)
    "suffix": (None, ""), "functions": (None, []), "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
}


def check_model(body: dict, ctx: ServingContext) -> str:
    model = body.get("model")
    if model is None:
        return ctx.model_name
    if not isinstance(model, str):
        raise APIError(400, f"'model' must be a string, got {show(model)}", param="model")
    if model != ctx.model_name:
        raise APIError(404, f"The model {show(model)} does not exist; this server serves '{ctx.model_name}'",
                       param="model", code="model_not_found")
    return model


def check_unsupported(body: dict, names: Sequence[str] = ()) -> None:
    """400 for a field jdeep does not honour set to anything but its "off" value, and for any of `names`."""
    for name, off in _UNSUPPORTED.items():
        v = body.get(name)
        if v is not None and not any(v == o and isinstance(v, bool) == isinstance(o, bool) for o in off):
            raise APIError(400, f"'{name}'={show(v)} is not supported by jdeep", param=name)
    for name in names:
        if body.get(name) is not None:
            raise APIError(400, f"'{name}' is not supported on this endpoint", param=name)


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias {"<token id>": bias} -> ((id, bias), ...); ids and biases checked by SamplingParams."""
    bias = field(body, "logit_bias", (dict,), {}, "an object mapping token ids to biases")
    if len(bias) > MAX_LOGIT_BIAS:
        raise APIError(400, f"'logit_bias' holds {len(bias)} entries; at most {MAX_LOGIT_BIAS}", param="logit_bias")
    out = []
    for k, v in bias.items():
        if not (k.isascii() and k.lstrip("-").isdigit() and len(k) <= 20):
            raise APIError(400, f"'logit_bias' keys must be token ids, got {show(k)}", param="logit_bias")
        out.append((int(k), number({"logit_bias": v}, "logit_bias", 0.0)))
    return tuple(out)


def sampling_fields(body: dict, max_tokens: int) -> SamplingParams:
    """The request's sampling values as SamplingParams (JSON types here; ranges in SamplingParams.validate)."""
    stop = field(body, "stop", (str, list), ())
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings, "
                       f"got {show(list(stop))}", param="stop")
    for s in stop:
        text(s, "stop", "a 'stop' string", MAX_STOP_CHARS)
    stop_ids = field(body, "stop_token_ids", (list,), [])
    if len(stop_ids) > MAX_STOP_TOKEN_IDS or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise APIError(400, f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} integers",
                       param="stop_token_ids")
    return SamplingParams(
        temperature=number(body, "temperature", 1.0), top_k=integer(body, "top_k", 0, INT32_MAX, 0),
        top_p=number(body, "top_p", 1.0), min_p=number(body, "min_p", 0.0), seed=integer(body, "seed", 0, SEED_MAX),
        max_new_tokens=max_tokens, stop_token_ids=tuple(stop_ids), stop=stop,
        presence_penalty=number(body, "presence_penalty", 0.0),
        frequency_penalty=number(body, "frequency_penalty", 0.0),
        repetition_penalty=number(body, "repetition_penalty", 1.0), logit_bias=_logit_bias(body),
        min_tokens=integer(body, "min_tokens", 0, INT32_MAX, 0))


def max_tokens_field(body: dict, names: Sequence[str], default: int | None) -> int | None:
    """The first of `names` the body sets (an integer in [1, INT32_MAX]), else `default`."""
    for name in names:
        v = integer(body, name, 1, INT32_MAX)
        if v is not None:
            return v
    return default


def _choices(body: dict, n_prompts: int, allow_best_of: bool) -> tuple[int, int]:
    """(n, best_of): choices returned and sequences generated per prompt."""
    n = integer(body, "n", 1, MAX_CHOICES, 1)
    best_of = integer(body, "best_of", 1, MAX_CHOICES, None) if allow_best_of else None
    if best_of is None:
        best_of = n
    if best_of < n:
        raise APIError(400, f"'best_of' ({best_of}) must be >= 'n' ({n})", param="best_of")
    if best_of * n_prompts > MAX_CHOICES:
        raise APIError(400, f"the request asks for {best_of * n_prompts} sequences ({n_prompts} prompts x "
                       f"{best_of}); at most {MAX_CHOICES}", param="best_of" if best_of > n else "n")
    return n, best_of


def finish_request(body: dict, kind: str, model: str, prompts: list[list[int]], max_tokens: int | None,
                   ctx: ServingContext, prompt_param: str, *, logprobs: int | None = None, echo: bool = False,
                   allow_best_of: bool = False, chat: Any = None, **params_update) -> GenerationRequest:
    """The engine's validation of each prompt's samples and the stream options, shared by both endpoints.
    params_update: SamplingParams fields the endpoint sets (e.g. skip_special_tokens for chat)."""
    if max_tokens is None:                 # chat: as much as the context allows
        max_tokens = max(1, ctx.max_len - max(len(p) for p in prompts))
    n, best_of = _choices(body, len(prompts), allow_best_of)
    stream = field(body, "stream", (bool,), False, "a boolean")
    if stream and best_of > n:
        raise APIError(400, "'best_of' > 'n' cannot be streamed (the best ones are known only at the end)",
                       param="best_of")
    want = logprobs if logprobs is not None else (0 if best_of > n else None)   # best_of ranks by logprob
    params = dataclasses.replace(sampling_fields(body, max_tokens), logprobs=want,
                                 prompt_logprobs=logprobs if echo and logprobs is not None else None, **params_update)
    requests = []
    for p in prompts:
        for j in range(best_of):
            sample = params if params.seed is None or j == 0 else dataclasses.replace(
                params, seed=(params.seed + j) % (SEED_MAX + 1))
            try:
                requests.append(ctx.check(p, sample))
            except RequestError as e:
                param = prompt_param if e.param == "prompt" else e.param
                raise APIError(400, str(e), param=param, code=e.code) from None
    opts = field(body, "stream_options", (dict,), {}, "an object")
    if opts and not stream:
        raise APIError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options")
    if not isinstance(opts.get("include_usage", False), bool):
        raise APIError(400, "'stream_options.include_usage' must be a boolean", param="stream_options")
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    return GenerationRequest(kind, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model,
                             [requests[k * best_of].ids.tolist() for k in range(len(prompts))], params, stream,
                             bool(opts.get("include_usage", False)),
                             field(body, "return_token_ids", (bool,), False, "a boolean") or ctx.tokenizer is None,
                             tuple(requests), n, best_of, logprobs, echo, chat)


def parse_completion(body: Any, ctx: ServingContext) -> GenerationRequest:
    """POST /v1/completions: prompt is a string, a list of token ids, or a list of either (n choices each);
    logprobs: N (0..MAX_TOP_LOGPROBS) top alternatives per token; echo: the prompt first."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = check_model(body, ctx)
    check_unsupported(body, ("tools", "tool_choice", "messages", "top_logprobs"))
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
            p = encode_text(ctx, p, "prompt", "the prompt")
            if not p:
                raise APIError(400, "the prompt encodes to no tokens", param="prompt")
        prompts.append(p)
    logprobs = body.get("logprobs")
    if isinstance(logprobs, bool):          # the chat API's form: true = the sampled token's logprob only
        logprobs = 0 if logprobs else None
    else:
        logprobs = integer(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    echo = field(body, "echo", (bool,), False, "a boolean")
    max_tokens = max_tokens_field(body, ("max_tokens",), 16)
    return finish_request(body, "completion", model, prompts, max_tokens, ctx, "prompt", logprobs=logprobs,
                          echo=echo, allow_best_of=True)


def encode_text(ctx: ServingContext, s: str, param: str, what: str) -> list[int]:
    """The token ids of a text prompt (a ChatText: as io/chat marks it), with the tokeniser's work bounded: text
    over MAX_CHARS_PER_TOKEN x max_len characters is refused untokenised, and one over PROBE_CHARS_PER_TOKEN x
    max_len has only its first that many characters tokenised when they alone are over twice the context (a cut
    changes at most the tokens around it). A hostile prompt costs a fraction of its full tokenisation."""
    text(s, param, what, MAX_CHARS_PER_TOKEN * ctx.max_len)
    probe = PROBE_CHARS_PER_TOKEN * ctx.max_len
    if len(s) > probe:
        n = len(ctx.tokenizer.encode(str(s)[:probe]))
        if n > 2 * ctx.max_len:
            raise APIError(400, f"{what} is longer than this model's context of {ctx.max_len} tokens: its first "
                           f"{probe} characters alone are {n} tokens", param=param, code="context_length_exceeded")
    return ctx.tokenizer.encode(s)


def parse_request(parse: Callable[[Any, ServingContext], GenerationRequest], body: Any,
                  ctx: ServingContext) -> GenerationRequest:
    """parse(body, ctx) (parse_completion or chat_protocol.parse_chat) with every failure an APIError: the protocol
    boundary's one error mapping. Parsing reads nothing but the client's body, so whatever it raises is about that
    body: a 400 that names the exception (logged at INFO with its traceback, for a parser bug to be found)."""
    try:
        return parse(body, ctx)
    except APIError:
        raise
    except RequestError as e:
        raise APIError(400, str(e), param=e.param, code=e.code) from None
    except Exception as e:     # noqa: BLE001 (the boundary: nothing a client sends may become a 500)
        log.info("a request body failed to parse (answered 400)", exc_info=True)
        raise APIError(400, f"the request could not be read: {type(e).__name__}: {str(e)[:200]}") from None


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)

