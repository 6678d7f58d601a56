"""Loop analyses over a parsed module: constants, static while trip counts (S3, S5) and op-count sizes (S4).

The S12 index-bound analysis is in ``bounds``."""

from __future__ import annotations

import re

from .mlir import Module, Op, Region, Value, _terminator

# ----------------------------------------------------------------------------------------------------------------
# Analyses
# ----------------------------------------------------------------------------------------------------------------

_CONST_RE = re.compile(r"dense<(-?\d+|true|false)>")
_SWAP = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "EQ": "EQ", "NE": "NE"}


def _direction(op: Op) -> str:
    m = re.search(r"compare\s+([A-Z]+)\s*,", op.text) or re.search(r"comparison_direction\s+([A-Z]+)", op.text)
    return m.group(1) if m else ""


def _compare_type(op: Op) -> str:
    m = re.search(r",\s*(SIGNED|UNSIGNED|FLOAT|TOTALORDER|NOTYPE)\s*:", op.text) or re.search(
        r"comparison_type\s+(\w+)", op.text)
    return m.group(1) if m else ""


class _Analysis:
    def __init__(self, mod: Module):
        self.mod = mod
        self._trip: dict[int, tuple[int | None, str]] = {}
        self._fcost: dict[str, int] = {}
        self._rcost: dict[int, int] = {}

    # -- constants and trip counts ---------------------------------------------------------------------------
    def const_int(self, v: Value | None, depth: int = 0) -> int | None:
        if v is None or depth > 40:
            return None
        if v.kind == "result" and v.op is not None:
            op = v.op
            if op.short == "constant":
                m = _CONST_RE.search(op.text)
                if not m:
                    return None
                g = m.group(1)
                return {"true": 1, "false": 0}.get(g, None) if g in ("true", "false") else int(g)
            if op.short in ("convert", "reshape", "broadcast_in_dim", "broadcast") and op.operands:
                return self.const_int(op.operands[0], depth + 1)
            return None
        if v.kind == "iterarg" and v.owner is not None:
            return self.invariant_const(v.owner, v.index, depth + 1)
        if v.kind == "arg" and v.owner is not None and v.owner.func_name != self.mod.main.func_name:
            sites = self.mod.call_sites.get(v.owner.func_name, [])
            vals = {self.const_int(s.operands[v.index] if v.index < len(s.operands) else None, depth + 1)
                    for s in sites}
            if len(vals) == 1:
                return vals.pop()
        return None

    def invariant_const(self, w: Op, k: int, depth: int = 0) -> int | None:
        """Constant value of while carry k if the body passes it through unchanged and its init is constant."""
        if len(w.regions) < 2 or k >= len(w.operands):
            return None
        ret = _terminator(w.regions[1])
        if ret is None or k >= len(ret.operands):
            return None
        r = ret.operands[k]
        if r is None or not (r.kind == "iterarg" and r.owner is w and r.index == k):
            return None
        return self.const_int(w.operands[k], depth + 1)

    def trip(self, w: Op) -> tuple[int | None, str]:
        """(static trip count or None, reason when None) of a stablehlo.while."""
        key = id(w)
        if key not in self._trip:
            self._trip[key] = self._trip_impl(w)
        return self._trip[key]

    def _trip_impl(self, w: Op) -> tuple[int | None, str]:
        if len(w.regions) < 2:
            return None, "while without cond/body regions"
        ret = _terminator(w.regions[0])
        if ret is None or not ret.operands or ret.operands[0] is None:
            return None, "cond region has no return"
        c = ret.operands[0]
        if c.op is None or c.op.short != "compare":
            what = c.op.short if c.op is not None else c.kind
            return None, f"cond does not end in a compare (returns a {what} value)"
        cmp = c.op
        if len(cmp.operands) < 2:
            return None, "compare without two operands"
        d = _direction(cmp)
        a, b = cmp.operands[0], cmp.operands[1]
        reasons = []
        for iv, lim, dd in ((a, b, d), (b, a, _SWAP.get(d, d))):
            if iv is None or not (iv.kind == "iterarg" and iv.owner is w):
                continue
            k = iv.index
            init = self.const_int(w.operands[k] if k < len(w.operands) else None)
            step = self._step(w, k)
            if lim is not None and lim.kind == "iterarg" and lim.owner is w:
                limit = self.invariant_const(w, lim.index)
            else:
                limit = self.const_int(lim)
            if init is None:
                reasons.append(f"counter {iv.name} has no constant init")
                continue
            if step is None:
                reasons.append(f"counter {iv.name} is not updated by a constant step")
                continue
            if limit is None:
                reasons.append(f"bound {lim.name if lim else '?'} is not a constant (data-dependent loop)")
                continue
            t = _trip_formula(init, step, limit, dd)
            if t is None:
                reasons.append(f"cannot derive a trip count from {iv.name} {dd} {limit} (init {init}, step {step})")
                continue
            return t, ""
        if not reasons:
            reasons.append(f"compare {d} does not involve a loop counter (data-dependent condition)")
        return None, "; ".join(reasons)

    def _step(self, w: Op, k: int) -> int | None:
        ret = _terminator(w.regions[1])
        if ret is None or k >= len(ret.operands) or ret.operands[k] is None:
            return None
        r = ret.operands[k]
        if r.op is None or r.op.short not in ("add", "subtract") or len(r.op.operands) != 2:
            return None
        x, y = r.op.operands

        def is_iv(v: Value | None) -> bool:
            return v is not None and v.kind == "iterarg" and v.owner is w and v.index == k

        if is_iv(x):
            c = self.const_int(y)
            return None if c is None else (c if r.op.short == "add" else -c)
        if r.op.short == "add" and is_iv(y):
            return self.const_int(x)
        return None

    # -- costs -----------------------------------------------------------------------------------------------
    _SCALAR_REGION_OPS = frozenset({"reduce", "reduce_window", "sort", "scatter", "select_and_scatter", "all_reduce",
                                    "reduce_scatter", "map"})

    def region_cost(self, region: Region, stack: tuple[str, ...] = ()) -> int:
        key = id(region)
        if key in self._rcost:
            return self._rcost[key]
        total = 0
        for op in region.ops:
            total += self.op_cost(op, stack)
        self._rcost[key] = total
        return total

    def op_cost(self, op: Op, stack: tuple[str, ...] = ()) -> int:
        s = op.short
        if s in ("return", "constant") or op.name in ("func.func", "module"):
            return 0
        if s == "call":
            return self.func_cost(op.callee or "", stack)
        if s == "while":
            t, _ = self.trip(op)
            return (t if t is not None else 1) * self.loop_body(op, stack)
        if op.regions and s not in self._SCALAR_REGION_OPS:
            return 1 + sum(self.region_cost(r, stack) for r in op.regions)
        return 1

    def loop_body(self, w: Op, stack: tuple[str, ...] = ()) -> int:
        return sum(self.region_cost(r, stack) for r in w.regions)

    def func_cost(self, name: str, stack: tuple[str, ...] = ()) -> int:
        if name in self._fcost:
            return self._fcost[name]
        f = self.mod.funcs.get(name)
        if f is None or not f.regions or name in stack:
            return 1
        c = self.region_cost(f.regions[0], stack + (name,))
        self._fcost[name] = c
        return c


def _trip_formula(init: int, step: int, limit: int, d: str) -> int | None:
    if d == "LT" and step > 0:
        return max(0, -(-(limit - init) // step))
    if d == "LE" and step > 0:
        return max(0, (limit - init) // step + 1)
    if d == "GT" and step < 0:
        return max(0, -(-(init - limit) // -step))
    if d == "GE" and step < 0:
        return max(0, (init - limit) // -step + 1)
    if d == "NE" and step != 0 and (limit - init) % step == 0 and (limit - init) // step >= 0:
        return (limit - init) // step
    return None
