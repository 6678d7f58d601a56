"""One check per compile-safety rule, registered in `_CHECKS` (rule id -> check)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from ....platforms import logical_nc_config
from ..kernel_artifacts import kernel_refs
from .analysis import _Analysis, _compare_type, _direction
from .bounds import _FORWARDING, _Bounds
from .mlir import Module, Op, Value, _short_name, _terminator
from .mlir_types import _LOWP_RE, _input_types, _int_width, _is_float, _is_int, _types_in, elem_type, tensor_dims_elem
from .report import NOT_CHECKED_HERE, RULES, Limits, Violation

# ----------------------------------------------------------------------------------------------------------------
# Rules
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class _Ctx:
    mod: Module
    an: _Analysis
    limits: Limits
    donated: Sequence[bool] | None
    n_experts: int | None
    decode: bool
    pruned_donated: Sequence[int] = ()
    stats: dict = field(default_factory=dict)


def _sig_types(op: Op) -> list[str]:
    return _types_in(op.sig)


def _func_types(f: Op) -> list[str]:
    return [t for _, t, _ in f.func_args] + _types_in(f.sig)


def _all_typed(ctx: _Ctx, skip: Callable[[Op], bool] = lambda op: False) -> Iterator[tuple[Op, str]]:
    """(op, type) for @main's signature and every non-terminator op's type signature (private function signatures
    and returns only repeat types already seen at their call sites / definitions)."""
    for t in _func_types(ctx.mod.main):
        yield ctx.mod.main, t
    for op in ctx.mod.ops:
        if skip(op) or op.short == "return":
            continue
        for t in _sig_types(op):
            yield op, t


def _v(rule: str, op: Op | None, msg: str) -> Violation:
    return Violation(rule, msg, op.line if op is not None else 0)


_DYNAMIC_OPS = frozenset({"dynamic_broadcast_in_dim", "dynamic_reshape", "dynamic_iota", "real_dynamic_slice",
                          "dynamic_pad", "dynamic_gather", "dynamic_conv", "set_dimension_size"})


def _s1(ctx: _Ctx) -> Iterator[Violation]:
    seen = set()
    for op, t in _all_typed(ctx):
        if "?" in tensor_dims_elem(t)[0] and op.line not in seen:
            seen.add(op.line)
            yield _v("S1", op, f"dynamic dimension in {t}: {op.snippet()}")
    for op in ctx.mod.ops:
        if op.short in _DYNAMIC_OPS:
            yield _v("S1", op, f"dynamic-shape op {op.name}")


def _s2(ctx: _Ctx) -> Iterator[Violation]:
    for op in ctx.mod.ops:
        if op.short in ("if", "case"):
            yield _v("S2", op, f"conditional {op.name} with {len(op.regions)} branches (lax.cond/switch): use select")


def _s3(ctx: _Ctx) -> Iterator[Violation]:
    for op in ctx.mod.ops:
        if op.short == "while":
            t, why = ctx.an.trip(op)
            if t is None:
                yield _v("S3", op, f"while loop without a static trip count: {why}")


def _s4(ctx: _Ctx) -> Iterator[Violation]:
    L = ctx.limits
    for op in ctx.mod.ops:
        if op.short != "while":
            continue
        t, _ = ctx.an.trip(op)
        body = ctx.an.loop_body(op)
        t1 = t if t is not None else 1
        if t is not None and t > L.loop_trip:
            yield _v("S4", op, f"loop trip count {t} > {L.loop_trip}")
        if body > L.loop_body:
            yield _v("S4", op, f"loop body of {body} ops > {L.loop_body}")
        if t1 * body > L.loop_total:
            yield _v("S4", op, f"loop trip x body = {t1} x {body} = {t1 * body} ops > {L.loop_total}")
    total = ctx.stats["unrolled_ops"]
    if total > L.program_ops:
        yield Violation("S4", f"program unrolled size {total} ops > {L.program_ops}", ctx.mod.main.line)


def _s5(ctx: _Ctx) -> Iterator[Violation]:
    if not ctx.n_experts:
        return
    for op in ctx.mod.ops:
        if op.short == "while" and ctx.an.trip(op)[0] == ctx.n_experts:
            yield _v("S5", op, f"while loop with trip count {ctx.n_experts} == n_experts (loop over experts?)")


def _s6(ctx: _Ctx) -> Iterator[Violation]:
    for op in ctx.mod.ops:
        if op.short != "sort":
            continue
        if ctx.decode:
            yield _v("S6", op, "sort in a decode program (use top_k)")
        if not op.regions:
            continue
        reg = op.regions[0]
        body = list(reg.ops)
        good = False
        if len(body) == 2 and body[0].short == "compare" and body[1].short == "return" and body[0].results:
            cmp, ret = body
            args = {id(a) for a in reg.args}
            good = (_direction(cmp) in ("LT", "GT", "LE", "GE") and _compare_type(cmp) != "TOTALORDER"
                    and len(cmp.operands) == 2 and all(v is not None and id(v) in args for v in cmp.operands)
                    and len(ret.operands) == 1 and ret.operands[0] is cmp.results[0])
        if not good:
            kinds = ", ".join(o.short for o in body)
            tot = " TOTALORDER" if any(o.short == "compare" and _compare_type(o) == "TOTALORDER" for o in body) else ""
            yield _v("S6", op, f"sort comparator is not a single LT/GT/LE/GE compare ({kinds}){tot}: float sort?")


def _s7(ctx: _Ctx) -> Iterator[Violation]:
    for op in ctx.mod.ops:
        is_topk = op.short == "top_k" or (op.short == "custom_call" and op.callee and "topk" in op.callee.lower())
        if not is_topk:
            continue
        v = op.operands[0] if op.operands else None
        t = v.type if v is not None and v.type else (_input_types(op.sig) or [""])[0]
        e = elem_type(t)
        if e not in ("f32", "bf16", "f16"):
            yield _v("S7", op, f"top_k on {e or '?'} ({t}): cast to float first (NCC_EVRF013)")


def _s8(ctx: _Ctx) -> Iterator[Violation]:
    for op in ctx.mod.ops:
        if op.short in ("reduce", "reduce_window"):
            n = len(op.operands) // 2
            if n > 1:
                yield _v("S8", op, f"variadic {op.short} with {n} inputs (argmax/argmin?): {op.snippet()}")


def _s9(ctx: _Ctx) -> Iterator[Violation]:
    for op in ctx.mod.ops:
        if op.short in ("dot_general", "dot", "convolution"):
            types = [v.type for v in op.operands[:2] if v is not None and v.type] or _input_types(op.sig)[:2]
            ints = [t for t in types if _is_int(elem_type(t))]
            if ints:
                yield _v("S9", op, f"integer {op.short} ({', '.join(types)})")


def _s10(ctx: _Ctx) -> Iterator[Violation]:
    seen = set()
    for op, t in _all_typed(ctx):
        if elem_type(t) in ("i64", "ui64") and op.line not in seen:
            seen.add(op.line)
            yield _v("S10", op, f"64-bit integer type {t}: {op.snippet()}")


def _s11(ctx: _Ctx) -> Iterator[Violation]:
    for op in ctx.mod.ops:
        if op.short == "scatter" and op.operands:
            v = op.operands[0]
            e = elem_type(v.type) if v is not None else ""
            computes = [o.short for r in op.regions for o in r.ops if o.short != "return"]
            if _is_int(e) and e != "i1" and computes:
                yield _v("S11", op, f"integer ({e}) scatter with a computing update region ({', '.join(computes)}):"
                                    " computed in fp32 on Neuron")
        elif op.short in ("all_reduce", "reduce_scatter"):
            es = {elem_type(v.type) for v in op.operands if v is not None}
            bad = sorted(e for e in es if _is_int(e) and e != "i1")
            if bad:
                yield _v("S11", op, f"integer {op.short} ({', '.join(bad)}): computed in fp32 on Neuron")


def _s12(ctx: _Ctx) -> Iterator[Violation]:
    b = _Bounds(ctx.mod)
    for op in ctx.mod.ops:
        if op.short == "gather" and len(op.operands) >= 2:
            idx = op.operands[1]
        elif op.short == "scatter" and len(op.operands) >= 3:
            idx = op.operands[max(1, (len(op.operands) - 1) // 2)]
        else:
            continue
        if idx is not None and b.unbounded(idx, op):
            yield _v("S12", op, f"{op.short} index {idx.name} is not clamped: it derives from {b.describe(idx)}")


def _is_nki(op: Op) -> bool:
    return op.short == "custom_call" and (op.callee or "") == "AwsNeuronCustomNativeKernel"


def _s13(ctx: _Ctx) -> Iterator[Violation]:
    seen = set()
    for op, t in _all_typed(ctx, skip=_is_nki):
        e = elem_type(t)
        if _LOWP_RE.match(e) and op.line not in seen:
            seen.add(op.line)
            yield _v("S13", op, f"low-precision float type {e}: {op.snippet()}")
    for op in ctx.mod.ops:
        if op.short == "bitcast_convert":
            src = op.operands[0].type if op.operands and op.operands[0] is not None else ""
            dst = op.results[0].type if op.results else ""
            es, ed = elem_type(src), elem_type(dst)
            if _is_float(es) or _is_float(ed):
                yield _v("S13", op, f"bitcast_convert {es} -> {ed} involves a float type")


_NARROW = frozenset({"i8", "ui8", "i16", "ui16"})
_ARITH = frozenset({"add", "subtract", "multiply", "divide", "remainder", "negate", "abs", "and", "or", "xor", "not",
                    "shift_left", "shift_right_logical", "shift_right_arithmetic", "maximum", "minimum", "clamp",
                    "popcnt", "count_leading_zeros", "sign", "power"})


def _s15(ctx: _Ctx) -> Iterator[Violation]:
    for op in ctx.mod.ops:
        if op.short == "shift_right_arithmetic" and op.results:
            e = elem_type(op.results[0].type)
            if _int_width(e) != 32:
                yield _v("S15", op, f"shift_right_arithmetic on {e} (needs 32-bit operands, NCC_EVRF022)")


def _n1(ctx: _Ctx) -> Iterator[Violation]:
    for op in ctx.mod.ops:
        if not op.results:
            continue
        e = elem_type(op.results[0].type)
        if e not in _NARROW:
            continue
        if op.short in _ARITH:
            yield _v("N1", op, f"{op.short} on {e}: widen codes to int32/f32 before arithmetic")
        elif op.short in ("reduce", "reduce_window"):
            m = re.search(r"applies\s+([\w.]+)", op.text)
            inner = [o.short for r in op.regions for o in r.ops if o.short in _ARITH]
            if (m and _short_name(m.group(1)) in _ARITH) or inner:
                yield _v("N1", op, f"{op.short} computing on {e}: widen before reducing")


def _n2(ctx: _Ctx) -> Iterator[Violation]:
    lnc = None
    for op in ctx.mod.ops:
        if not _is_nki(op):
            continue
        try:
            refs = kernel_refs(op.text + " :", "the call")
        except ValueError as e:
            yield _v("N2", op, str(e))
            continue
        for ref in refs:
            lnc = logical_nc_config() if lnc is None else lnc
            if ref.grid != lnc:
                yield _v("N2", op, f"NKI kernel {ref.func_name} launched at LNC={ref.grid}; the runtime runs at "
                                   f"{lnc} (NEURON_LOGICAL_NC_CONFIG): a runtime error")
            if not os.path.isfile(ref.binary):
                yield _v("N2", op, f"NKI kernel {ref.func_name}: compiled file {ref.binary} is missing (NCC_EVRF059)")


_ALLOWED_CC = frozenset({"AwsNeuronCustomNativeKernel", "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"})


def _s17(ctx: _Ctx) -> Iterator[Violation]:
    for op in ctx.mod.ops:
        if op.short != "custom_call":
            continue
        t = op.callee or "?"
        if "callback" in t.lower():
            yield _v("S17", op, f"host callback custom_call @{t} (pure_callback/io_callback/debug.print)")
        elif not (t in _ALLOWED_CC or t.startswith(("AwsNeuron", "xla.sdy."))):
            yield _v("S17", op, f"custom_call @{t} is not an allowed target")


def _s18(ctx: _Ctx) -> Iterator[Violation]:
    for op in ctx.mod.ops:
        if op.short == "reduce_precision":
            yield _v("S18", op, "reduce_precision")
    seen = set()
    for op, t in _all_typed(ctx):
        e = elem_type(t)
        if (e.startswith("complex") or e == "f64") and op.line not in seen:
            seen.add(op.line)
            yield _v("S18", op, f"unsupported type {e}: {op.snippet()}")
    tf_funcs = set()
    for name, f in ctx.mod.funcs.items():
        if "threefry" in name.lower():
            tf_funcs.add(name)
            yield _v("S18", f, f"threefry PRNG (@{name}): use the rbg PRNG impl or sample on the host")
    for op in ctx.mod.ops:
        f = ctx.mod.func_of(op)
        if f is not None and f.func_name in tf_funcs:
            continue
        if op.short == "custom_call" and "threefry" in (op.callee or "").lower():
            yield _v("S18", op, f"threefry custom_call @{op.callee}")
        elif op.short == "constant" and re.search(r"dense<466688986>\s*:\s*tensor<(\d+x)*ui32>", op.text):
            if f is not None:
                tf_funcs.add(f.func_name)
            yield _v("S18", op, "threefry key-schedule constant 0x1BD11BDA (inlined threefry)")


def _s19(ctx: _Ctx) -> Iterator[Violation]:
    n = len(ctx.mod.main.func_args)
    if n > ctx.limits.max_args:
        yield Violation("S19", f"@main has {n} arguments > {ctx.limits.max_args}", ctx.mod.main.line)


_ALIAS_RE = re.compile(r"tf\.aliasing_output\s*=\s*(\d+)")


def _s20(ctx: _Ctx) -> Iterator[Violation]:
    main = ctx.mod.main
    for i in ctx.pruned_donated:
        yield Violation("S20", f"donated argument #{i} is unused and was pruned from @main (donation wasted)",
                        main.line)
    ret = _terminator(main.regions[0]) if main.regions else None
    for k, (nm, t, attrs) in enumerate(main.func_args):
        m = _ALIAS_RE.search(attrs)
        donated = ctx.donated[k] if ctx.donated is not None else None
        if donated and not m and "jax.buffer_donor" not in attrs:
            yield Violation("S20", f"donated argument {nm} ({t}) is not aliased to any output (unusable donation: "
                                   "no output of the same shape/dtype)", main.line)
        if m and ret is not None:
            n = int(m.group(1))
            arg = main.regions[0].args[k]
            if n < len(ret.operands):
                why = _inplace(ctx.mod, ret.operands[n], arg)
                if why:
                    yield Violation("S20", f"donated {nm} ({t}) -> output {n} is not updated in place: {why}",
                                    _why_line(why, main.line))


def _why_line(why: str, default: int) -> int:
    m = re.search(r"line (\d+)", why)
    return int(m.group(1)) if m else default


_PASS_THROUGH = frozenset({"sharding_constraint", "reshape", "optimization_barrier", "reshard"})


def _inplace(mod: Module, v: Value | None, origin: Value, calls: tuple[Op, ...] = (), depth: int = 0) -> str:
    """'' if v is ``origin`` updated only by dynamic_update_slice/scatter (through loops, calls, reshapes), else why."""
    while depth < 10_000:
        depth += 1
        if v is None:
            return "unresolved value"
        if v is origin:
            return ""
        if v.kind == "arg":
            if v.owner is mod.main:
                return f"it is a different argument {v.name}"
            if not calls:
                return f"parameter {v.name} of @{v.owner.func_name if v.owner else '?'}"
            site, calls = calls[-1], calls[:-1]
            v = site.operands[v.index] if v.index < len(site.operands) else None
            continue
        if v.kind == "iterarg":
            w = v.owner
            v = w.operands[v.index] if w is not None and v.index < len(w.operands) else None
            continue
        if v.kind == "blockarg" and v.owner is not None and v.owner.short in _FORWARDING:
            v = v.owner.operands[v.index] if v.index < len(v.owner.operands) else None
            continue
        if v.kind == "blockarg" or v.op is None:
            return f"block argument {v.name}"
        op = v.op
        s = op.short
        if s in ("dynamic_update_slice", "scatter"):
            v = op.operands[0] if op.operands else None
        elif s == "while":
            body_ret = _terminator(op.regions[1]) if len(op.regions) > 1 else None
            if body_ret is None or v.index >= len(body_ret.operands):
                return f"unreadable while at line {op.line}"
            v = body_ret.operands[v.index]
        elif s == "call":
            f = mod.funcs.get(op.callee or "")
            ret = _terminator(f.regions[0]) if f is not None and f.regions else None
            if ret is None or v.index >= len(ret.operands):
                return f"unreadable call at line {op.line}"
            calls = calls + (op,)
            v = ret.operands[v.index]
        elif s in _FORWARDING and op.regions:
            t = _terminator(op.regions[0])
            if t is None or v.index >= len(t.operands):
                return f"unreadable {op.name} at line {op.line}"
            v = t.operands[v.index]
        elif s in _PASS_THROUGH:
            v = op.operands[v.index if s == "optimization_barrier" else 0] if op.operands else None
        else:
            fresh = " (a fresh buffer, e.g. the ys of a lax.scan)" if s in ("broadcast_in_dim", "broadcast",
                                                                             "constant") else ""
            return f"rebuilt by {op.name} at line {op.line}{fresh}"
    return "too deep"


_CHECKS: dict[str, Callable[[_Ctx], Iterable[Violation]]] = {
    "S1": _s1, "S2": _s2, "S3": _s3, "S4": _s4, "S5": _s5, "S6": _s6, "S7": _s7, "S8": _s8, "S9": _s9,
    "S10": _s10, "S11": _s11, "S12": _s12, "S13": _s13, "S15": _s15, "N1": _n1, "N2": _n2, "S17": _s17, "S18": _s18,
    "S19": _s19, "S20": _s20,
}
assert set(_CHECKS) | set(NOT_CHECKED_HERE) == set(RULES)
