"""A generation request, validated once: its prompt as token ids, its sampling values and the token ids that end it;
and RequestOutput, what the Engine reports about one.

Every entry point (jdeep.generate, the Engine, the HTTP server through the Engine) checks a request here and
nowhere else; the error names the problem (bad ids, text without a tokenizer, bad sampling values, a request
longer than the context) and, for a server, the field it is about (`param`) and OpenAI's error code (`code`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .sampling import SamplingParams

__all__ = ["RequestError", "Request", "RequestOutput", "prompt_ids", "check_request", "stop_ids"]


class RequestError(ValueError):
    """An invalid request. param: the request field at fault (OpenAI's "param"), code: an OpenAI error code."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class Request:
    """A validated request: ids int32 [T] (the prompt), its sampling params, and stop_ids, the token ids that end
    it (its stop_token_ids, then the model's EOS unless ignored); images: its image spans (start, rows [n, D]) in
    the prompt (runtime.images; the span positions hold image_token_id)."""

    ids: np.ndarray
    params: SamplingParams
    stop_ids: tuple[int, ...]
    images: tuple = ()


@dataclass
class RequestOutput:
    request_id: str
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None     # "stop" (stop token / EOS / stop string), "length", "abort", "error" (or
                                         # another reason given to `abort`, e.g. a server's "timeout")
    error: str | None = None
    text: str | None = None              # the generated text so far (cut before a stop string), given a tokenizer
    queue_time: float | None = None      # seconds from add_request until it took a slot
    logprobs: list | None = None         # per token (id, logprob, [(id, logprob)] top), when the request asked
    prompt_logprobs: list | None = None  # per prompt token: None for the first, then as logprobs


def prompt_ids(prompt: Sequence[int] | str, vocab_size: int, tokenizer=None, index: int = 0) -> np.ndarray:
    """A prompt (token ids, or a string encoded with `tokenizer`) -> int32 ids [T]; RequestError naming prompt
    `index` if it is empty, not integer (bools are not token ids), out of the vocabulary, text the tokenizer cannot
    encode (unpaired surrogates), or text without a tokenizer."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError(f"prompt {index} is text but the model has no tokenizer (no tokenizer.json in its "
                               "folder): pass token ids or tokenizer=", "prompt")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(f"prompt {index} is not valid Unicode text: {e.reason} at character {e.start}",
                               "prompt") from None
        prompt = tokenizer.encode(prompt)
    if isinstance(prompt, (list, tuple)):      # Python ints: checked one by one (no silent float / object arrays)
        for j, t in enumerate(prompt):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise RequestError(f"prompt {index}: token {j} must be an integer token id, got "
                                   f"{type(t).__name__}", "prompt")
            if not 0 <= t < vocab_size:
                raise RequestError(f"prompt {index}: token id {_show_int(t)} at index {j} is outside the vocabulary "
                                   f"[0, {vocab_size})", "prompt")
    try:
        a = np.asarray(prompt)
    except (TypeError, ValueError) as e:
        raise RequestError(f"prompt {index} must be a 1-D list of token ids ({e})", "prompt") from None
    if a.ndim != 1 or a.size == 0:
        raise RequestError(f"prompt {index} must be a non-empty 1-D list of token ids, got shape {a.shape}", "prompt")
    if not np.issubdtype(a.dtype, np.integer):
        raise RequestError(f"prompt {index} must hold integer token ids, got dtype {a.dtype}", "prompt")
    bad = (a < 0) | (a >= vocab_size)
    if bad.any():
        j = int(np.argmax(bad))
        raise RequestError(f"prompt {index}: token id {int(a[j])} at index {j} is outside the vocabulary "
                           f"[0, {vocab_size})", "prompt")
    return a.astype(np.int32)


def _show_int(t: int) -> str:
    """An integer for a message, shortened when it is huge."""
    return str(t) if abs(int(t)) < 10 ** 30 else f"<a {int(t).bit_length()}-bit integer>"


def stop_ids(params: SamplingParams, eos: int | None) -> tuple[int, ...]:
    """The token ids that end a request: its stop_token_ids, then `eos` (None: EOS does not end it)."""
    return tuple(dict.fromkeys(tuple(params.stop_token_ids) + (() if eos is None else (eos,))))


def check_request(prompt: Sequence[int] | str, sampling: SamplingParams | None, *, vocab_size: int, max_len: int,
                  tokenizer=None, eos: int | None = None, limit_name: str = "max_len", index: int = 0) -> Request:
    """Validate one request: its prompt (prompt_ids), its sampling values (SamplingParams.validate), stop strings
    only with a tokenizer, and prompt + max_new_tokens within `max_len` (called `limit_name` in the message)."""
    ids = prompt_ids(prompt, vocab_size, tokenizer, index)
    p = sampling if sampling is not None else SamplingParams()
    if not isinstance(p, SamplingParams):
        raise RequestError(f"sampling must be a SamplingParams, got {type(p).__name__}", "sampling")
    try:
        p.validate(vocab_size)
    except ValueError as e:
        field = str(e).split(" ")[0].rstrip(":")
        raise RequestError(str(e), "max_tokens" if field == "max_new_tokens" else field) from None
    if p.stop and tokenizer is None:
        raise RequestError("stop strings need a tokenizer (the model has no tokenizer.json): use stop_token_ids",
                           "stop")
    total = len(ids) + p.max_new_tokens
    if total > max_len:       # the prompt itself is at fault when it leaves no room for a token
        raise RequestError(f"prompt ({len(ids)} tokens) + max_new_tokens ({p.max_new_tokens}) = {total} tokens "
                           f"exceeds {limit_name}={max_len}", "prompt" if len(ids) >= max_len else "max_tokens",
                           "context_length_exceeded")
    return Request(ids, p, stop_ids(p, eos))
