"""A light, line-based parser of StableHLO/MLIR text: functions, ops with regions, values and their types.

Line lexing lives in ``mlir_lex``, type text in ``mlir_types``; ``tensor_dims_elem`` and ``elem_type`` are
re-exported here."""

from __future__ import annotations

import re
from collections.abc import Iterator

from .mlir_lex import _blank_strings, _find_top, _mask_arrows, _split_top, _strip_locs
from .mlir_types import _read_type, _result_types, elem_type, tensor_dims_elem

# elem_type and tensor_dims_elem are re-exported: the public type helpers of the parsed values
__all__ = ["Module", "Op", "Region", "Value", "elem_type", "tensor_dims_elem"]

# ----------------------------------------------------------------------------------------------------------------
# Parser
# ----------------------------------------------------------------------------------------------------------------


class Value:
    """An SSA value: an op result (kind "result"), a function parameter ("arg"), a while carry ("iterarg") or
    another block argument ("blockarg")."""

    __slots__ = ("index", "kind", "name", "op", "owner", "type")

    def __init__(self, name: str, type_: str, kind: str, index: int, op: Op | None = None, owner: Op | None = None):
        self.name, self.type, self.kind, self.index, self.op, self.owner = name, type_, kind, index, op, owner

    def __repr__(self) -> str:
        return f"Value({self.name}: {self.type})"


class Region:
    __slots__ = ("args", "ops", "owner", "symbols")

    def __init__(self, owner: Op):
        self.owner = owner
        self.ops: list[Op] = []
        self.args: list[Value] = []
        self.symbols: dict[str, Value] = {}

    def define(self, v: Value, *aliases: str) -> None:
        self.symbols[v.name] = v
        for a in aliases:
            self.symbols[a] = v


class Op:
    __slots__ = (
        "callee",
        "func_args",
        "func_name",
        "iter_names",
        "iter_types",
        "line",
        "name",
        "operands",
        "parent",
        "regions",
        "results",
        "short",
        "sig",
        "text",
    )

    def __init__(self, name: str, line: int, text: str, parent: Region | None):
        self.name = name
        self.short = _short_name(name)
        self.line = line
        self.text = text
        self.results: list[Value] = []
        self.operands: list[Value | None] = []
        self.sig = ""
        self.regions: list[Region] = []
        self.parent = parent
        self.callee: str | None = None
        self.iter_names: list[str] = []
        self.iter_types: list[str] = []
        self.func_args: list[tuple[str, str, str]] = []  # func.func: (name, type, attribute text)
        self.func_name = ""

    def __repr__(self) -> str:
        return f"Op({self.name} @{self.line})"

    def snippet(self, n: int = 140) -> str:
        t = " ".join(self.text.split())
        return t if len(t) <= n else t[: n - 3] + "..."


def _short_name(name: str) -> str:
    if name in ("return", "func.return", "stablehlo.return", "mhlo.return", "sdy.return"):
        return "return"
    if name in ("call", "func.call"):
        return "call"
    for p in ("stablehlo.", "chlo.", "mhlo.", "sdy.", "func."):
        if name.startswith(p):
            return name[len(p):]
    return name


_OP_RE = re.compile(
    r'^(?:(?P<res>%[\w.$\-]+(?::\d+)?(?:\s*,\s*%[\w.$\-]+)*)\s*=\s*)?(?:"(?P<gname>[\w.$\-]+)"|(?P<name>[A-Za-z_][\w.$\-]*))'
)
_REF_RE = re.compile(r"%[\w.$\-]+(?:#\d+)?")
_DEF_RE = re.compile(r"(%[\w.$\-]+)\s*:\s*(?=[a-z!(])")
_ITER_RE = re.compile(r"(%[\w.$\-]+)\s*=\s*(%[\w.$\-]+(?:#\d+)?)")
_CALLEE_RE = re.compile(r"@([\w.$\-]+)")


class Module:
    """Parsed module: ``funcs`` by name, ``main``, ``ops`` (every op in text order, nested ones included)."""

    def __init__(self, text: str):
        self.lines = text.splitlines()
        self.funcs: dict[str, Op] = {}
        self.ops: list[Op] = []
        self.call_sites: dict[str, list[Op]] = {}
        self._parse()
        main = self.funcs.get("main")
        if main is None:
            publics = [f for f in self.funcs.values() if " public " in f" {f.text} " or "private" not in f.text]
            main = publics[0] if publics else None
        if main is None:
            raise ValueError("no func.func @main in the StableHLO text")
        self.main = main
        for op in self.ops:
            if op.short == "call" and op.callee:
                self.call_sites.setdefault(op.callee, []).append(op)

    # -- parsing ---------------------------------------------------------------------------------------------
    def _parse(self) -> None:
        top = Op("module", 0, "", None)
        stack: list[Region] = [Region(top)]
        last_op: Op | None = None
        for lineno, raw in enumerate(self.lines, 1):
            s = _strip_locs(_blank_strings(raw)).strip()
            if not s or s.startswith(("#", "//")):
                continue
            closed: Op | None = None
            while s.startswith("}"):
                if len(stack) > 1:
                    closed = stack.pop().owner
                s = s[1:].lstrip()
                if s.startswith(")"):
                    s = s[1:].lstrip()
                if s.startswith(","):
                    s = s[1:].lstrip()
            if closed is not None:
                last_op = closed
                if s.startswith(("do", "{")):
                    self._push(stack, closed, s, lineno)
                elif s.startswith(":"):
                    closed.sig = s[1:].strip()
                    closed.text += "\n" + raw.strip()
                    self._set_result_types(closed)
                continue
            if s.startswith("^"):  # ^bb0(%a: T, ...):
                for v in self._defs(s, stack[-1].owner, "blockarg", len(stack[-1].args)):
                    stack[-1].args.append(v)
                    stack[-1].define(v)
                continue
            if s.startswith(("cond", "reducer")) and s.endswith("{") and last_op is not None:
                target = stack[-1].ops[-1] if stack[-1].ops else last_op
                self._push(stack, target, s, lineno)
                continue
            self._parse_op(s, raw, lineno, stack)
            last_op = stack[-1].ops[-1] if stack[-1].ops else last_op
            if stack[-1].ops and stack[-1].ops[-1].line == lineno and self._opens(s):
                self._push(stack, stack[-1].ops[-1], s, lineno)

    @staticmethod
    def _opens(s: str) -> bool:
        m = _mask_arrows(s)
        return m.count("{") - m.count("}") > 0

    def _defs(self, s: str, owner: Op, kind: str, start: int) -> list[Value]:
        out = []
        for m in _DEF_RE.finditer(s):
            t = _read_type(s, m.end())
            out.append(Value(m.group(1), t, kind, start + len(out), owner=owner))
        return out

    def _push(self, stack: list[Region], owner: Op, s: str, lineno: int) -> None:
        reg = Region(owner)
        if owner.short == "while":
            for k, (nm, t) in enumerate(zip(owner.iter_names, owner.iter_types)):
                reg.args.append(Value(nm, t, "iterarg", k, owner=owner))
        elif owner.name == "func.func":
            for k, (nm, t, _) in enumerate(owner.func_args):
                reg.args.append(Value(nm, t, "arg", k, owner=owner))
        else:
            # reducer(%a: T, %b: T) (%c: T, %d: T) {   or   sdy.manual_computation(...) (%arg1: T) {
            tail = s
            if owner.line == lineno and owner.short != "reduce":
                i = s.rfind("(%")
                tail = s[i:] if i >= 0 and _DEF_RE.search(s[i:]) else ""
            if owner.line != lineno or tail:
                reg.args.extend(self._defs(tail, owner, "blockarg", 0))
        for v in reg.args:
            reg.define(v)
        owner.regions.append(reg)
        stack.append(reg)

    def _lookup(self, stack: list[Region], name: str) -> Value | None:
        for reg in reversed(stack):
            v = reg.symbols.get(name)
            if v is not None:
                return v
            if reg.owner.name == "func.func":
                return None
        return None

    def _parse_op(self, s: str, raw: str, lineno: int, stack: list[Region]) -> None:
        m = _OP_RE.match(s)
        if not m:
            return
        name = m.group("gname") or m.group("name")
        op = Op(name, lineno, raw.strip(), stack[-1])
        rest = s[m.end():]
        if name == "func.func":
            self._parse_func(op, rest)
            stack[-1].ops.append(op)
            return
        if name == "module":
            stack[-1].ops.append(op)
            return
        # type signature: after the last depth-0 " : " (absent when the line opens a region)
        k = _find_top(rest, " : ")
        pre, op.sig = (rest[:k], rest[k + 3:].strip()) if k >= 0 else (rest, "")
        if op.short == "while":
            pairs = _ITER_RE.findall(pre)
            op.iter_names = [a for a, _ in pairs]
            refs = [b for _, b in pairs]
            op.iter_types = [_read_type(p, 0) for p in _split_top(op.sig)] if op.sig else [""] * len(pairs)
        else:
            defs = {d.group(1) for d in _DEF_RE.finditer(pre)}
            refs = [r for r in _REF_RE.findall(pre) if r not in defs]
        if op.short == "custom_call":  # the target as written (quoted or not)
            c = (re.search(r'call_target_name\s*=\s*"([^"]*)"', raw) if m.group("gname")
                 else re.search(r'custom_call\s*@(?:"((?:[^"\\]|\\.)*)"|([\w.$\-]+))', raw))
            op.callee = next((g for g in c.groups() if g is not None), None) if c else None
        elif op.short == "call":
            c = re.match(r"\s*@([\w.$\-]+)", pre)
            op.callee = c.group(1) if c else None
        op.operands = [self._lookup(stack, r) for r in refs]
        # results
        res = m.group("res")
        names: list[str] = []
        if res:
            if ":" in res and "," not in res:
                base, cnt = res.split(":")
                names = [f"{base.strip()}#{i}" for i in range(int(cnt))]
            else:
                names = [r.strip() for r in res.split(",")]
        op.results = [Value(nm, "", "result", i, op=op) for i, nm in enumerate(names)]
        self._set_result_types(op)
        for v in op.results:
            aliases = (v.name.split("#")[0],) if len(op.results) == 1 and "#" in v.name else ()
            stack[-1].define(v, *aliases)
            if len(op.results) == 1 and "#" not in v.name:
                stack[-1].define(v, v.name + "#0")
        stack[-1].ops.append(op)
        self.ops.append(op)

    def _set_result_types(self, op: Op) -> None:
        if op.short == "while" and op.iter_types and len(op.iter_types) == len(op.results):
            types = op.iter_types
        else:
            types = _result_types(op.sig, len(op.results))
        for v, t in zip(op.results, types):
            v.type = t

    def _parse_func(self, op: Op, rest: str) -> None:
        c = _CALLEE_RE.search(rest)
        op.func_name = c.group(1) if c else ""
        i = rest.find("(")
        if i >= 0:
            d, j = 0, i
            while j < len(rest):
                d += (rest[j] == "(") - (rest[j] == ")")
                if d == 0:
                    break
                j += 1
            for part in _split_top(rest[i + 1: j]):
                mm = re.match(r"(%[\w.$\-]+)\s*:\s*", part)
                if not mm:
                    continue
                t = _read_type(part, mm.end())
                op.func_args.append((mm.group(1), t, part[mm.end() + len(t):]))
            op.sig = rest[j + 1:]
        self.funcs[op.func_name] = op

    # -- helpers ---------------------------------------------------------------------------------------------
    def func_of(self, op: Op) -> Op | None:
        reg = op.parent
        while reg is not None:
            if reg.owner.name == "func.func":
                return reg.owner
            reg = reg.owner.parent
        return None

    def walk(self, region: Region) -> Iterator[Op]:
        for op in region.ops:
            yield op
            for r in op.regions:
                yield from self.walk(r)


def _terminator(region: Region) -> Op | None:
    for op in reversed(region.ops):
        if op.short == "return":
            return op
    return None
