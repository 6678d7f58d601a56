"""JSON field checks of the OpenAI API's request bodies: each raises APIError (an HTTP status and OpenAI's error body
{"error": {message, type, param, code}}) naming the field when its JSON type or range is wrong."""

from __future__ import annotations

import math
from typing import Any

from ..io import bounded_json

__all__ = ["APIError", "parse_json", "show", "field", "integer", "number", "text"]


class APIError(Exception):
    """An HTTP error in OpenAI's shape (headers: extra response headers, e.g. a 429's Retry-After)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def parse_json(raw: bytes) -> Any:
    """A request body -> its JSON value; APIError 400 for anything that is not standard JSON (bad syntax or UTF-8,
    NaN / Infinity, integers beyond Python's digit limit) and for nesting deeper than bounded_json.MAX_DEPTH (no
    field needs it, and recursive code that walks a value nested deeper fails)."""
    def no_constant(name: str):
        raise ValueError(f"{name} is not a JSON number")

    try:
        return bounded_json.loads(raw, parse_constant=no_constant)
    except (ValueError, UnicodeDecodeError) as e:        # JSONDecodeError is a ValueError
        raise APIError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None


def show(v: Any) -> str:
    """A value for an error message: its repr, at most 200 characters (also for ints too long to print and values
    nested too deeply to print)."""
    try:
        r = repr(v)
    except (ValueError, RecursionError):
        r = f"<a {v.bit_length()}-bit integer>" if isinstance(v, int) else f"<a deeply nested {type(v).__name__}>"
    return r if len(r) <= 200 else r[:197] + "..."


def field(body: dict, name: str, types: tuple, default: Any = None, what: str | None = None) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in types or not isinstance(v, types):
        raise APIError(400, f"'{name}' must be {what or ' or '.join(t.__name__ for t in types)}, got {show(v)}",
                       param=name)
    return v


def integer(body: dict, name: str, lo: int, hi: int, default: Any = None) -> Any:
    """An integer field within [lo, hi] (booleans are not integers)."""
    v = field(body, name, (int,), None, f"an integer in [{lo}, {hi}]")
    if v is None:
        return default
    if not lo <= v <= hi:
        raise APIError(400, f"'{name}' must be an integer in [{lo}, {hi}], got {show(v)}", param=name)
    return v


def number(body: dict, name: str, default: float) -> float:
    """A finite number field (an int too large for a float is not one)."""
    v = field(body, name, (int, float), None, "a finite number")
    if v is None:
        return default
    try:
        x = float(v)
    except OverflowError:
        x = math.inf
    if not math.isfinite(x):
        raise APIError(400, f"'{name}' must be a finite number, got {show(v)}", param=name)
    return x


def text(s: str, param: str, what: str, limit: int) -> str:
    """A string the tokenizer may see: valid Unicode (no unpaired surrogates) and at most `limit` characters."""
    if len(s) > limit:
        raise APIError(400, f"{what} is {len(s)} characters long; the limit is {limit}", param=param)
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{what} is not valid Unicode text: {e.reason} at character {e.start}",
                       param=param) from None
    return s
