"""Lexing of one line of MLIR text, with no notion of ops or types: blanking string literals and ``loc(...)``
annotations, matching brackets, and splitting or searching at bracket depth 0."""

from __future__ import annotations

import re

_STR_RE = re.compile(r'"(?:[^"\\]|\\.)*"')
_OPEN = "([{<"
_CLOSE = ")]}>"


_GENERIC_HEAD_RE = re.compile(r'^\s*(?:%[\w.$#:\-, %]*=\s*)?"[\w.$\-]+"')


_QUOTED_SYM_RE = re.compile(r'@"((?:[^"\\]|\\.)*)"')


def _sym(name: str) -> str:
    """A quoted symbol name (``@"<lambda>"``) as a bare one (``@_q_3c_lambda_3e_``), injectively."""
    return "_q" + re.sub(r"[^\w]", lambda c: f"_{ord(c.group()):x}_", name)


def _blank_strings(raw: str) -> str:
    """Blank string literals ("..." -> ""), keeping a generic op name ("stablehlo.scatter"(...)) intact and
    turning quoted symbol names (@"<lambda>") into bare ones."""
    raw = _QUOTED_SYM_RE.sub(lambda m: "@" + _sym(m.group(1)), raw)
    m = _GENERIC_HEAD_RE.match(raw)
    k = m.end() if m else 0
    return raw[:k] + _STR_RE.sub('""', raw[k:])


def _matching(s: str, start: int, open_: str, close: str) -> int:
    """Index of the bracket closing the one at s[start] (or the last index if unbalanced)."""
    d, j = 0, start
    while j < len(s):
        d += (s[j] == open_) - (s[j] == close)
        if d == 0:
            break
        j += 1
    return j


def _strip_locs(s: str) -> str:
    """Remove ``loc(...)`` annotations (balanced parentheses); strings must already be blanked."""
    while True:
        i = s.find("loc(")
        if i < 0 or (i > 0 and (s[i - 1].isalnum() or s[i - 1] in "_.")):
            return s
        j = _matching(s, i + 3, "(", ")")
        s = s[:i].rstrip() + " " + s[j + 1:]


def _mask_arrows(s: str) -> str:
    return s.replace("->", "~~")


def _split_top(s: str, sep: str = ",") -> list[str]:
    """Split at depth-0 separators (depth over ()[]{}<>, '->' ignored)."""
    m = _mask_arrows(s)
    parts, d, start = [], 0, 0
    for i, ch in enumerate(m):
        if ch in _OPEN:
            d += 1
        elif ch in _CLOSE:
            d -= 1
        elif ch == sep and d == 0:
            parts.append(s[start:i].strip())
            start = i + 1
    tail = s[start:].strip()
    if tail:
        parts.append(tail)
    return parts


def _find_top(s: str, token: str, last: bool = True) -> int:
    """Index of a depth-0 occurrence of ``token`` in ``s`` (last or first), -1 if none."""
    m = _mask_arrows(s) if token != "->" else s.replace("->", "\0\0")
    tok = token if token != "->" else "\0\0"
    d, found = 0, -1
    for i, ch in enumerate(m):
        if d == 0 and m.startswith(tok, i):
            found = i
            if not last:
                return i
        if ch in _OPEN:
            d += 1
        elif ch in _CLOSE:
            d -= 1
    return found
