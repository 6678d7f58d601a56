"""Step 3 of the doctor: a program the compiler fails on, reduced to the smallest sub-program that still fails.

A candidate is a contiguous range of ops of one block (first `@main`'s body, later a loop body or a called
function's body), cut out as a standalone module: the values it uses from outside become `@main`'s arguments
(with their types), the values it defines and does not use itself are returned, and the functions it calls come
along. The reduction, each step keeping only candidates the compiler still fails on:
1. stages: the ops of one model stage (the named scopes in the source locations: layers/stages.STAGES and the hot
   ops' names, kernels/registry) as one range, smallest first, repeated while one fails;
2. op ranges: the range's end, then its start, bisected;
3. a single op left with a body (a `while` loop, a `func.call`, a `case`) is entered: its body becomes the block,
   and 1-3 repeat.
The `fails` predicate decides (with retries for an intermittent crash, see compiler.Compiler.fails); the ranges
bisected are assumed to fail monotonically (a range holding a failing range fails), and where that does not hold
the result is just larger than minimal, never a candidate that was not seen to fail."""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from typing import Callable

from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir

from ....kernels import registered
from ....layers.stages import STAGES

__all__ = ["Reproducer", "reduce_failure", "slice_program", "top_level_ops", "BudgetExhausted"]

_NAME = re.compile(r"%[A-Za-z0-9_$.\-]+(?:#\d+)?")
_LOC_NAME = re.compile(r'loc\("([^"]*)"')
_TERMINATORS = ("func.return", "stablehlo.return", "mhlo.return")


class BudgetExhausted(Exception):
    """The reduction spent its compiles (max_tests)."""


@dataclass
class Reproducer:
    """The smallest failing sub-program found: its module text, op count (nested ops included), the model stage
    most of its ops belong to, where it lies ("main[10:14] > while.body[3:4]") and the compiles spent."""
    text: str
    n_ops: int
    stage: str | None
    path: str
    tests: int


def _stage_names() -> frozenset[str]:
    return frozenset(STAGES) | frozenset(registered())


def _kind(op) -> str:
    """The op's name ("stablehlo.while"); a func.FuncOp view's `.name` is its symbol instead."""
    return op.operation.name


def _walk(op):
    yield op
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield from _walk(inner)


def _symbol(op) -> str:
    return ir.StringAttr(op.attributes["sym_name"]).value


class _Module:
    """The parsed program and the naming its text uses."""

    def __init__(self, text: str):
        self.context = mlir.make_ir_context()
        with self.context:
            self.module = ir.Module.parse(text)
            self.state = ir.AsmState(self.module.operation)
            self.funcs = {_symbol(op): op for op in self.module.body.operations if _kind(op) == "func.func"}
            attrs = self.module.operation.attributes
            named = [attrs[k] for k in range(len(attrs))]
            self.attributes = ", ".join(f"{a.name} = {a.attr}" for a in named if a.name != "sym_name")
        if "main" not in self.funcs:
            raise ValueError("the program has no @main function")
        self._stage_names = _stage_names()

    def name(self, value) -> str:
        return value.get_name(self.state)

    def print(self, op) -> str:
        buf = io.StringIO()
        op.print(self.state, file=buf)
        return buf.getvalue()

    def stages(self, op, nested: bool = True) -> set[str]:
        """Stage names in the source locations of op (and its nested ops)."""
        out: set[str] = set()
        for inner in (_walk(op) if nested else [op]):
            m = _LOC_NAME.search(str(inner.location))
            if m:
                out.update(p for p in m.group(1).split("/") if p in self._stage_names)
        return out

    def callees(self, ops) -> list[str]:
        """Functions the ops call, transitively, in first-call order."""
        seen: list[str] = []
        todo = list(ops)
        while todo:
            for inner in _walk(todo.pop(0)):
                if _kind(inner) == "func.call":
                    callee = ir.FlatSymbolRefAttr(inner.attributes["callee"]).value
                    if callee not in seen:
                        seen.append(callee)
                        todo.extend(self.funcs[callee].regions[0].blocks[0].operations)
        return seen


def top_level_ops(block) -> list:
    """The block's ops without its terminator."""
    ops = list(block.operations)
    return ops[:-1] if ops and _kind(ops[-1]) in _TERMINATORS else ops


def slice_program(m: _Module, block, start: int, stop: int) -> tuple[str, int]:
    """ops[start:stop] of `block` as a standalone module; returns (text, number of ops incl. nested)."""
    ops = top_level_ops(block)[start:stop]
    if not ops:
        raise ValueError("empty op range")
    with m.context:
        defined: set[str] = set()
        used: list = []
        n_ops = 0
        for op in ops:
            for inner in _walk(op):
                n_ops += 1
                used.extend(inner.operands)
                defined.update(m.name(r) for r in inner.results)
                for region in inner.regions:
                    for b in region.blocks:
                        defined.update(m.name(a) for a in b.arguments)
        externals: dict[str, str] = {}
        for v in used:
            n = m.name(v)
            if n not in defined and n not in externals:
                externals[n] = str(v.type)
        consumed = {m.name(v) for op in ops for inner in _walk(op) for v in inner.operands}
        results = [(m.name(r), str(r.type)) for op in ops for r in op.results if m.name(r) not in consumed]
        rename = {n: f"%in{k}" for k, n in enumerate(externals)}
        body = "\n".join(m.print(op) for op in ops)
        body = _NAME.sub(lambda t: rename.get(t.group(0), t.group(0)), body)
        args = ", ".join(f"{rename[n]}: {t}" for n, t in externals.items())
        rtypes = ", ".join(t for _, t in results)
        ret = (f"func.return {', '.join(n for n, _ in results)} : {rtypes}" if results else "func.return")
        funcs = [m.funcs[c].get_asm() for c in m.callees(ops)]
    indent = lambda s, k: "\n".join(" " * k + ln for ln in s.splitlines())  # noqa: E731
    attrs = f" attributes {{{m.attributes}}}" if m.attributes else ""
    text = (f"module @jdeep_repro{attrs} {{\n  func.func public @main({args}) -> ({rtypes}) {{\n"
            f"{indent(body, 4)}\n    {ret}\n  }}\n" + "".join(indent(f, 2) + "\n" for f in funcs) + "}\n")
    with mlir.make_ir_context():
        try:
            ir.Module.parse(text)
        except Exception as e:  # noqa: BLE001 - a slice that does not parse is this module's bug: say where
            raise RuntimeError(f"jdeep doctor built an invalid sub-program (ops {start}:{stop}): {e}") from e
    return text, n_ops


def _nested_blocks(m: _Module, op) -> list[tuple[str, object]]:
    """(label, block) of the bodies op runs: a while's body then its condition, case branches, a callee."""
    if _kind(op) == "func.call":
        callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
        return [(f"@{callee}", m.funcs[callee].regions[0].blocks[0])]
    labels = {"stablehlo.while": ("cond", "body")}.get(_kind(op))
    out = []
    for k, region in enumerate(op.regions):
        for block in region.blocks:
            label = labels[k] if labels and k < len(labels) else f"region{k}"
            out.append((f"{_kind(op).split('.')[-1]}.{label}", block))
    if _kind(op) == "stablehlo.while":
        out.reverse()                        # the body first: the condition is a compare
    return out


class _Search:
    def __init__(self, m: _Module, fails: Callable[[str], bool], max_tests: int):
        self.m, self.fails, self.max_tests, self.tests = m, fails, max_tests, 0
        self.seen: dict[str, bool] = {}

    def test(self, block, start: int, stop: int) -> bool:
        text = slice_program(self.m, block, start, stop)[0]   # the key: binding objects are not stable
        if text not in self.seen:
            if self.tests >= self.max_tests:
                raise BudgetExhausted
            self.tests += 1
            self.seen[text] = self.fails(text)
        return self.seen[text]

    def by_stage(self, block, start: int, stop: int) -> tuple[int, int]:
        ops = top_level_ops(block)
        while True:
            spans: dict[str, list[int]] = {}
            for k in range(start, stop):
                for s in self.m.stages(ops[k]):
                    spans.setdefault(s, []).append(k)
            candidates = sorted({(min(v), max(v) + 1) for v in spans.values()} - {(start, stop)},
                                key=lambda r: (r[1] - r[0], r[0]))
            for a, b in candidates:
                if self.test(block, a, b):
                    start, stop = a, b
                    break
            else:
                return start, stop

    def bisect(self, block, start: int, stop: int) -> tuple[int, int]:
        lo, hi = start + 1, stop                 # the smallest end that still fails
        while lo < hi:
            mid = (lo + hi) // 2
            if self.test(block, start, mid):
                hi = mid
            else:
                lo = mid + 1
        stop = hi
        lo, hi = start, stop - 1                 # the largest start that still fails
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.test(block, mid, stop):
                lo = mid
            else:
                hi = mid - 1
        return lo, stop


def reduce_failure(text: str, fails: Callable[[str], bool], max_tests: int = 300) -> Reproducer:
    """The smallest failing sub-program of `text` (a StableHLO module the compiler fails on) that `fails` finds.
    Raises RuntimeError if the whole program does not fail again."""
    m = _Module(text)
    if not fails(text):
        raise RuntimeError("the program compiled when retried: the failure did not show again (raise --reduce-tries "
                           "for an intermittent crash)")
    search = _Search(m, fails, max_tests)
    block = m.funcs["main"].regions[0].blocks[0]
    start, stop = 0, len(top_level_ops(block))
    if stop == 0:
        raise RuntimeError("the failing program has no ops to reduce")
    path: list[str] = []
    entered: list = []                       # the ops whose bodies the search went into
    label = "main"
    best = (block, start, stop, list(path), label)
    try:
        while True:
            start, stop = search.by_stage(block, start, stop)
            best = (block, start, stop, list(path), label)
            start, stop = search.bisect(block, start, stop)
            best = (block, start, stop, list(path), label)
            if stop - start != 1:
                break
            for inner_label, inner in _nested_blocks(m, top_level_ops(block)[start]):
                n = len(top_level_ops(inner))
                if n and search.test(inner, 0, n):
                    path.append(f"{label}[{start}:{stop}]")
                    entered.append(top_level_ops(block)[start])
                    block, start, stop, label = inner, 0, n, inner_label
                    break
            else:
                break
    except BudgetExhausted:
        pass
    block, start, stop, path, label = best
    text, n_ops = slice_program(m, block, start, stop)
    ops = top_level_ops(block)[start:stop]
    return Reproducer(text=text, n_ops=n_ops, stage=_stage_label(m, ops, entered),
                      path=" > ".join(path + [f"{label}[{start}:{stop}]"]), tests=search.tests)


def _stage_label(m: _Module, ops, entered: list) -> str | None:
    """The model stage and hot op most of the ops belong to ("projection / act_quant"); ops of a called function
    carry no scope of their own, so then the innermost op entered on the way decides."""
    for candidates in [ops] + [[op] for op in reversed(entered)]:
        counts: dict[str, int] = {}
        for op in candidates:
            for inner in _walk(op):
                for s in m.stages(inner, nested=False):
                    counts[s] = counts.get(s, 0) + 1
        if counts:
            layer = [s for s in sorted(counts, key=lambda s: -counts[s]) if s in STAGES]
            hot = [s for s in sorted(counts, key=lambda s: -counts[s]) if s not in STAGES]
            return " / ".join(([layer[0]] if layer else []) + ([hot[0]] if hot else []))
    return None
