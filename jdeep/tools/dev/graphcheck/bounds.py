"""S12 index boundedness over a parsed module: a forward data-flow analysis of which values may reach a
gather/scatter index without a clamp (the rule is stated in the package docstring)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .mlir import Module, Op, Value, _terminator
from .mlir_types import elem_type

# -- S12 index boundedness -------------------------------------------------------------------------------------

_BOUNDED_SOURCES = frozenset({"constant", "iota", "clamp", "minimum", "maximum", "compare"})
_PROPAGATE_ALL = frozenset({
    "convert", "reshape", "broadcast_in_dim", "broadcast", "transpose", "slice", "concatenate", "reverse", "copy",
    "pad", "add", "subtract", "multiply", "divide", "negate", "abs", "sign", "floor", "ceil", "round_nearest_even",
    "round_nearest_afz", "sharding_constraint", "or", "xor", "not", "shift_left", "shift_right_logical",
    "shift_right_arithmetic", "reshard",
})


# ops whose single region runs once on the operands (block argument j = operand j) and yields the results
_FORWARDING = frozenset({"manual_computation", "named_computation"})


class _Top:
    """Lattice top: unbounded whatever the calling context."""

    def __repr__(self) -> str:
        return "TOP"


_TOP = _Top()
_BOUNDED: frozenset = frozenset()


def _join(a: Any, b: Any) -> Any:
    if a is _TOP or b is _TOP:
        return _TOP
    return a | b


class _Bounds:
    """S12 index boundedness (see the module docstring): a greatest-fixpoint forward analysis with per-function
    summaries. The state of a value is ``frozenset()`` (bounded), a set of parameter indices of its function
    (unbounded iff one of those parameters is) or ``_TOP`` (unbounded). Call results are evaluated per call site
    from the callee's summary, so a shared helper (JAX dedups ``_where``, ``clip``, ``remainder``... into one private
    function) does not leak one caller's unbounded argument into another caller's result. A parameter is unbounded
    (``param_bad``) if any call site passes it a value unbounded in that caller's context; an op inside a shared
    function is reported once if any context reaches it with an unbounded index."""

    def __init__(self, mod: Module):
        self.mod = mod
        self.state: dict[int, Any] = {}
        self.why: dict[int, Any] = {}  # id(value) -> culprit Value, or "source"
        self.values: dict[int, Value] = {}
        self.param_bad: dict[str, list[bool]] = {}
        self._run()

    # -- lattice helpers -----------------------------------------------------------------------------------------
    def get(self, v: Value | None) -> Any:
        return _BOUNDED if v is None else self.state.get(id(v), _BOUNDED)

    def _set(self, v: Value, new: Any, culprit: Any) -> bool:
        if v.type and elem_type(v.type) == "i1":
            return False
        old = self.get(v)
        j = _join(old, new)
        if j is old or j == old:
            return False
        self.state[id(v)] = j
        self.values[id(v)] = v
        if id(v) not in self.why or old is not _TOP and j is _TOP:
            self.why[id(v)] = culprit
        return True

    def _from(self, vals: Iterable[Value | None]) -> tuple[Any, Any]:
        """Join of the states of vals and the first unbounded one (the culprit)."""
        acc, culprit = _BOUNDED, None
        for v in vals:
            s = self.get(v)
            if s is _BOUNDED:
                continue
            if culprit is None or (s is _TOP and acc is not _TOP):
                culprit = v
            acc = _join(acc, s)
        return acc, culprit

    # -- fixpoint ------------------------------------------------------------------------------------------------
    def _run(self) -> None:
        mod = self.mod
        for f in mod.funcs.values():
            if not f.regions:
                continue
            for k, a in enumerate(f.regions[0].args):
                if f is mod.main:
                    self._set(a, _TOP, "source")
                else:
                    self._set(a, frozenset({k}), "param")
        for _ in range(10_000):
            changed = False
            for op in mod.ops:
                changed |= self._transfer(op)
            if not changed:
                break
        # which parameters of private functions are unbounded in some calling context
        self.param_bad = {n: [False] * len(f.func_args) for n, f in mod.funcs.items()}
        self.param_bad[mod.main.func_name] = [True] * len(mod.main.func_args)
        for _ in range(10_000):
            changed = False
            for fname, sites in mod.call_sites.items():
                f = mod.funcs.get(fname)
                if f is None or f is mod.main:
                    continue
                flags = self.param_bad[fname]
                for s in sites:
                    caller = mod.func_of(s)
                    for k in range(min(len(flags), len(s.operands))):
                        if not flags[k] and self.bad_in(s.operands[k], caller):
                            flags[k] = changed = True
            if not changed:
                break

    def bad_in(self, v: Value | None, func: Op | None) -> bool:
        """Whether v (a value of func) is unbounded in some calling context of func."""
        s = self.get(v)
        if s is _TOP:
            return True
        if not s or func is None:
            return False
        flags = self.param_bad.get(func.func_name, [])
        return any(flags[k] for k in s if k < len(flags))

    def _transfer(self, op: Op) -> bool:
        s, ops_, res = op.short, op.operands, op.results
        if not res or s in _BOUNDED_SOURCES:
            return False
        changed = False

        def set_all(vals: Iterable[Value | None]) -> bool:
            st, c = self._from(vals)
            if st is _BOUNDED:
                return False
            ch = False
            for r in res:
                ch |= self._set(r, st, c)
            return ch

        def set_one(r: Value, vals: Iterable[Value | None]) -> bool:
            st, c = self._from(vals)
            return False if st is _BOUNDED else self._set(r, st, c)

        if s == "top_k":
            return set_one(res[0], ops_[:1])
        if s in _PROPAGATE_ALL:
            return set_all(ops_)
        if s == "select":
            return set_all(ops_[1:])
        if s == "and":
            return False if any(self.get(v) is _BOUNDED for v in ops_) else set_all(ops_)
        if s == "remainder":
            return set_all(ops_[1:2])
        if s in ("dynamic_slice", "gather"):
            return set_all(ops_[:1])
        if s == "dynamic_update_slice":
            return set_all(ops_[:2])
        if s == "scatter":
            n_in = max(1, (len(ops_) - 1) // 2)
            return set_all(ops_[:n_in] + ops_[n_in + 1:])
        if s in ("sort", "optimization_barrier"):
            for k, r in enumerate(res):
                changed |= set_one(r, ops_[k: k + 1])
            return changed
        if s == "reduce":
            n = len(res)
            for k, r in enumerate(res):
                changed |= set_one(r, [ops_[k] if k < len(ops_) else None, ops_[n + k] if n + k < len(ops_) else None])
            return changed
        if s == "while":
            body_ret = _terminator(op.regions[1]) if len(op.regions) > 1 else None
            for k, r in enumerate(res):
                cands = [ops_[k] if k < len(ops_) else None]
                if body_ret is not None and k < len(body_ret.operands):
                    cands.append(body_ret.operands[k])
                changed |= set_one(r, cands)
                for reg in op.regions:
                    if k < len(reg.args):
                        changed |= set_one(reg.args[k], cands)
            return changed
        if s == "call":
            f = self.mod.funcs.get(op.callee or "")
            ret = _terminator(f.regions[0]) if f is not None and f.regions else None
            for k, r in enumerate(res):
                if ret is None or k >= len(ret.operands):
                    changed |= self._set(r, _TOP, "source")
                    continue
                summ = self.get(ret.operands[k])
                if summ is _TOP:
                    changed |= self._set(r, _TOP, ret.operands[k])
                elif summ:
                    changed |= set_one(r, [ops_[p] for p in summ if p < len(ops_)])
            return changed
        if s in _FORWARDING and op.regions:
            reg = op.regions[0]
            for j, a in enumerate(reg.args):  # block argument j <- operand j
                changed |= set_one(a, ops_[j: j + 1])
            t = _terminator(reg)
            for k, r in enumerate(res):
                if t is not None and k < len(t.operands):
                    changed |= set_one(r, [t.operands[k]])
            return changed
        if s in ("case", "if"):
            for k, r in enumerate(res):
                for reg in op.regions:
                    t = _terminator(reg)
                    if t is not None and k < len(t.operands):
                        changed |= set_one(r, [t.operands[k]])
            return changed
        for r in res:
            changed |= self._set(r, _TOP, "source")
        return changed

    # -- reporting -----------------------------------------------------------------------------------------------
    def unbounded(self, v: Value | None, op: Op) -> bool:
        return self.bad_in(v, self.mod.func_of(op))

    def _func_of_value(self, v: Value) -> Op | None:
        if v.kind == "result" and v.op is not None:
            return self.mod.func_of(v.op)
        if v.kind == "arg":
            return v.owner
        return self.mod.func_of(v.owner) if v.owner is not None else None

    def _inputs(self, v: Value) -> list[Value | None]:
        """Values v's state was computed from (over-approximation, used only to explain a violation)."""
        if v.kind in ("iterarg", "result") and (v.owner if v.kind == "iterarg" else v.op) is not None:
            op = v.owner if v.kind == "iterarg" else v.op
            k = v.index
            if op.short == "while":
                ret = _terminator(op.regions[1]) if len(op.regions) > 1 else None
                return [op.operands[k] if k < len(op.operands) else None,
                        ret.operands[k] if ret is not None and k < len(ret.operands) else None]
            if op.short == "call":
                f = self.mod.funcs.get(op.callee or "")
                ret = _terminator(f.regions[0]) if f is not None and f.regions else None
                return ([ret.operands[k]] if ret is not None and k < len(ret.operands) else []) + list(op.operands)
            if op.short in _FORWARDING or op.short in ("case", "if"):
                ts = [_terminator(r) for r in op.regions]
                return [t.operands[k] for t in ts if t is not None and k < len(t.operands)]
            return list(op.operands)
        if v.kind == "blockarg" and v.owner is not None and v.index < len(v.owner.operands):
            return [v.owner.operands[v.index]]
        return []

    def root(self, v: Value) -> Value:
        """Walk back from an unbounded value to an unbounded source (a @main argument or an op result), through
        call sites for parameters, always stepping to an input that is itself unbounded in its context."""
        seen: set[int] = set()
        for _ in range(100_000):
            if id(v) in seen:
                break
            seen.add(id(v))
            if v.kind == "arg":
                if v.owner is None or v.owner is self.mod.main:
                    return v
                site = next((s for s in self.mod.call_sites.get(v.owner.func_name, [])
                             if v.index < len(s.operands) and self.bad_in(s.operands[v.index], self.mod.func_of(s))),
                            None)
                if site is None:
                    return v
                v = site.operands[v.index]
                continue
            c = self.why.get(id(v))
            if c == "source":
                return v
            cands = ([c] if isinstance(c, Value) else []) + self._inputs(v)
            cands = [u for u in cands if u is not None and self.bad_in(u, self._func_of_value(u))]
            if not cands:
                return v
            cands.sort(key=lambda u: self.get(u) is not _TOP)  # prefer context-free unbounded inputs
            v = cands[0]
        return v

    def describe(self, v: Value) -> str:
        r = self.root(v)
        if r.kind == "arg" and r.owner is self.mod.main:
            return f"@main argument {r.name} ({r.type})"
        if r.kind == "result" and r.op is not None:
            return f"the result of {r.op.name} at line {r.op.line}"
        return f"{r.kind} {r.name}"
