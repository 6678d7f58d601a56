"""JSON from untrusted text with its nesting bounded: request bodies and the tool-call arguments inside chat messages.

Python's json parser recurses once per nesting level, and so do `json.dumps`, `copy.deepcopy` and `repr` of what it
returns: a value nested a few hundred levels deep parses but breaks whatever walks it next (RecursionError), and
one nested past the interpreter's limit breaks the parser itself. `loads` refuses both with a ValueError, so a
value it returns can be walked by any recursive code.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_DEPTH", "TooDeep", "loads", "depth"]

MAX_DEPTH = 64      # nesting levels of arrays and objects; no request field or tool schema needs more


class TooDeep(ValueError):
    """A JSON value nested deeper than allowed."""


def depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """Nesting depth of a JSON value (a scalar is 0, [] and {} are 1), counted without recursion; stops counting
    past `limit` (returns limit + 1)."""
    deepest = 0
    stack = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, dict)):
            d += 1
            if d > limit:
                return limit + 1
            deepest = max(deepest, d)
            stack.extend((x, d) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def loads(raw: str | bytes, max_depth: int = MAX_DEPTH, **kwargs) -> Any:
    """json.loads(raw, **kwargs), with TooDeep (a ValueError) for nesting deeper than max_depth (and for nesting so deep the
    parser itself gives up) as for any other malformed text."""
    try:
        value = json.loads(raw, **kwargs)
    except RecursionError:
        raise TooDeep(f"nested more than {max_depth} levels deep") from None
    if depth(value, max_depth) > max_depth:
        raise TooDeep(f"nested more than {max_depth} levels deep")
    return value
