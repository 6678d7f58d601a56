"""MLIR type text: reading one type, the types of an op from its trailing signature, and tensor shapes and
element types (``tensor<2x?xf32>`` -> dims, element type; integer/float/low-precision classes)."""

from __future__ import annotations

import re

from .mlir_lex import _find_top, _matching, _split_top


def _read_type(s: str, i: int) -> str:
    """The type starting at s[i] (balanced <...>/(...)), up to a depth-0 ',' ')' '{' or whitespace."""
    d, j = 0, i
    while j < len(s):
        ch = s[j]
        if ch in "<(":
            d += 1
        elif ch in ">)":
            if d == 0:
                break
            d -= 1
        elif d == 0 and (ch in ",{" or ch.isspace()):
            break
        j += 1
    return s[i:j]


def _types_in(s: str) -> list[str]:
    """All ``tensor<...>`` types in s (balanced, so ``tensor<4xcomplex<f32>>`` is one type)."""
    out, i = [], 0
    while True:
        i = s.find("tensor<", i)
        if i < 0:
            return out
        j = _matching(s, i + 6, "<", ">")
        out.append(s[i: j + 1])
        i = j + 1


_DIM_RE = re.compile(r"^((?:(?:\d+|\?)x)*)(.+)$")


def tensor_dims_elem(t: str) -> tuple[list[str], str]:
    """``tensor<2x?xf32>`` -> (["2", "?"], "f32"); a non-tensor type t -> ([], t)."""
    t = t.strip()
    if not t.startswith("tensor<"):
        return [], t
    parts = _split_top(t[7:-1]) if t.endswith(">") else [t[7:]]
    body = parts[0] if parts else ""
    m = _DIM_RE.match(body)
    if not m:
        return [], body
    return [d for d in m.group(1).split("x") if d], m.group(2).strip()


def elem_type(t: str) -> str:
    return tensor_dims_elem(t)[1]


def _is_int(e: str) -> bool:
    return bool(re.fullmatch(r"u?i\d+", e))


def _int_width(e: str) -> int:
    m = re.fullmatch(r"u?i(\d+)", e)
    return int(m.group(1)) if m else 0


def _is_float(e: str) -> bool:
    return bool(re.match(r"(b?f\d|tf32|complex)", e))


_LOWP_RE = re.compile(r"f[468]E\d")


def _result_types(sig: str, n: int) -> list[str]:
    """Result types of an op from its trailing type signature."""
    if not sig or n == 0:
        return [""] * n
    k = _find_top(sig, "->")
    if k >= 0:
        outs = sig[k + 2:].strip()
        if outs.startswith("("):
            outs = outs[1: outs.rfind(")")]
        parts = [_read_type(p, 0) for p in _split_top(outs)]
    else:
        parts = [_read_type(p, 0) for p in _split_top(sig)]
    if len(parts) == n:
        return parts
    if n == 1:
        return [parts[-1]] if parts else [""]
    return (parts[-n:] if len(parts) >= n else parts + [""] * (n - len(parts)))


def _input_types(sig: str) -> list[str]:
    k = _find_top(sig, "->")
    if k < 0:
        return []
    ins = sig[:k].strip()
    if ins.startswith("("):
        ins = ins[1: ins.rfind(")")]
    return [_read_type(p, 0) for p in _split_top(ins)]
