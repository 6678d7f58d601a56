"""Compile-safety checker for jdeep graphs: lint the lowered StableHLO text of a jitted program against the rules of
§9 "Compile-safety rules for jdeep graphs" of the Neuron notes (``shared/docs/neuron-notes.md``).

Every compiled entry point (prefill/decode per bucket, the sampler) is lowered on CPU with the pinned JAX,
``jax.jit(fn, donate_argnums=...).lower(*args)``, and the text (``lowered.as_text()``) is checked here with a light,
line-based parser of the MLIR text (no MLIR bindings; exported ``.mlir`` files work too)::

    report = check_lowered(fn.lower(params, state, tokens, positions, eng), name="decode", decode=True, n_experts=256)
    assert report.ok, report.format()

The parser builds, per ``func.func``, a tree of ops with their regions (``while`` cond/body, sort comparators,
reducers, scatter update computations, ``case`` branches), resolves SSA operands lexically (regions are not isolated,
names are reused in sibling regions), and reads types from each op's trailing type signature, so attribute payloads
(``array<i64: ...>``, ``dense<...> : tensor<2xindex>``, ``{index = 0 : ui64}``) never count as value types. Private
functions (``func.call``/``call``, JAX's ``closed_call``, ``_take``, ``clip``, ``threefry2x32``...) are analysed once;
their ops count at every call site for the size budget (S4), and index safety (S12) flows through their parameters
and results.

Rules and detection (see ``RULES``; S14, S16, S21-S23 are not properties of one program's text):

- S1  ``?`` in any value type; ``dynamic_broadcast_in_dim``, ``dynamic_reshape``, ``dynamic_iota``,
  ``real_dynamic_slice``, ``dynamic_pad``, ``dynamic_gather``, ``dynamic_conv``, ``set_dimension_size``.
- S2  ``stablehlo.if`` / ``stablehlo.case`` (``lax.cond``/``lax.switch`` lower to ``case`` in JAX 0.10.0).
- S3  the cond region of each ``while`` must end in ``compare DIR, iv, limit`` where ``iv`` is a loop-carried value
  whose init is an integer constant and whose body update is ``iv + c`` / ``iv - c`` (c a constant), and ``limit`` is a
  constant: defined in the cond region, captured from outside, or a loop-carried value passed through the body
  unchanged with a constant init (what ``fori_loop(jnp.int32(0), jnp.int32(3), ...)`` emits). Constants are followed
  through ``convert``/``reshape``/``broadcast_in_dim`` and through private-function parameters when every call site
  passes the same constant. The trip count is computed for LT/LE/GT/GE/NE. ``lax.scan``/``fori_loop`` with static
  bounds pass; ``lax.while_loop`` on data and ``fori_loop`` with a traced bound fail.
- S4  op counts (constants and terminators excluded; a reducer/comparator/scatter region counts as its op, 1): per loop
  ``body_ops`` = ops of cond + body with nested loops multiplied by their trip and calls inlined; flags trip >
  ``loop_trip``, body > ``loop_body``, trip x body > ``loop_total``; the program's unrolled size (every loop as trip x
  body, every call inlined, straight-line ops counted once) > ``program_ops``. A loop of unknown trip counts once.
- S5  a ``while`` whose static trip count equals ``n_experts`` (may hit unrelated loops of that trip: judge by line).
- S6  ``decode=True``: any ``sort``. Always: a comparator other than exactly ``compare LT|GT|LE|GE`` on two block
  arguments (type SIGNED/UNSIGNED/FLOAT, not TOTALORDER) + ``return``: JAX's float sort (``jnp.sort``/``argsort``)
  fails, an int32 ``lax.sort`` passes.
- S7  operand of ``chlo.top_k`` (what ``lax.top_k`` lowers to) or of a ``TopK``-like custom call not f32/bf16/f16.
- S8  ``reduce`` / ``reduce_window`` with more than one input (``jnp.argmax``/``argmin``, ``random.categorical``).
- S9  ``dot_general``/``dot``/``convolution`` with an integer operand.
- S10 ``i64``/``ui64`` value types (also produced by ``jax.random``: threefry's ``ui64`` iota, rbg's ``ui64`` state).
- S11 integer ``scatter`` whose update region computes anything (``.at[].add/mul/min/max``), integer
  ``all_reduce``/``reduce_scatter``. Booleans (i1) are exempt. No attempt to prove values < 2^24.
- S12 index operands of ``gather``/``scatter`` must be "bounded", by this forward data-flow rule (greatest fixpoint,
  loops and calls included): bounded are constants, ``iota``, ``clamp``/``minimum``/``maximum`` results,
  ``compare`` results and any i1 value, ``top_k`` indices; boundedness propagates through ``convert``, ``reshape``,
  ``broadcast(_in_dim)``, ``transpose``, ``slice``, ``concatenate``, ``reverse``, ``pad``, ``copy``, sharding
  constraints and arithmetic/bitwise ops (``add``, ``subtract``, ``multiply``, ``divide``, ``negate``, ``abs``,
  ``floor``..., ``or``, ``xor``, ``not``, shifts) when all their operands are bounded; ``select`` when both data
  operands are (the predicate is ignored); ``and`` when any operand is; ``remainder`` when the divisor is;
  ``dynamic_slice``/``gather`` results when the sliced operand is; ``dynamic_update_slice``/``scatter`` results when
  operand and update are; ``sort``/``reduce``/``optimization_barrier``/``while`` results position-wise (a ``while``
  carry when its init and its body update are); a call result when the callee's returned value is bounded given
  the bounds of *that call site's* arguments (per-function summaries: JAX dedups helpers such as ``_where``,
  ``clip``, ``remainder``, ``_take`` into one private function shared by many callers, and one caller's unbounded
  argument does not taint another caller's result). An op inside a shared function is reported once if any call
  path reaches it with an unbounded index. ``@main`` arguments and results of any other op
  (``dot_general``, ``reduce`` of data, ``custom_call``, ``exponential``...) are unbounded. The violation message
  names the unbounded source. ``dynamic_slice``/``dynamic_update_slice`` are exempt (StableHLO clamps their start
  indices). It is a lint, not a proof: ``clamp(i, 0, n-1) + offset`` passes whatever ``offset`` is, as long as it is
  itself bounded.

  What JAX 0.10.0 emits for the usual indexing forms (``idx`` a program input):

  ========================================================  ====================================================  ====
  code                                                      lowering                                              S12
  ========================================================  ====================================================  ====
  ``x[idx]`` (array idx, default mode)                      ``select(idx < 0, idx + n, idx)`` then ``gather``     fail
  ``jnp.take(x, idx, axis=0, mode="clip")``                 ``gather`` straight on ``idx`` (XLA clamps natively)  fail
  ``jnp.take(x, idx, axis=0)`` (mode "fill")                normalise, ``gather``, mask + NaN ``select``          fail
  ``jnp.take_along_axis(x, idx, axis=1)``                   normalise, ``gather`` (batching dims), mask + fill    fail
  ``x.at[idx].set(v)`` / ``.add(v)``                        normalise, ``scatter``                                fail
  any of the above on ``jnp.clip(idx, 0, n - 1)``           ``call @clip`` (``maximum``/``minimum``) first        pass
  ``jnp.minimum(idx, n - 1)`` / ``lax.clamp(0, idx, n-1)``  ``minimum`` / ``clamp``                               pass
  ``x[i]`` with a scalar ``i``, ``lax.dynamic_slice``       ``dynamic_slice`` (exempt)                            pass
  indices from ``lax.top_k``, ``jnp.arange``, constants     ``top_k`` / ``iota`` / ``constant``                   pass
  ========================================================  ====================================================  ====

  So: clamp every data-dependent index explicitly (``jnp.clip(idx, 0, n - 1)``), then mask the invalid positions
  with a ``jnp.where`` on the result.
- S13 (covers S14) element types ``f8*``, ``f4*``, ``f6*`` (``f8E4M3FN``, ``f8E4M3``, ``f8E5M2``, ``*FNUZ``,
  ``f8E8M0FNU``, ``f4E2M1FN``...) in any op's type signature or ``@main``'s signature, except on the
  ``AwsNeuronCustomNativeKernel`` custom call itself; any ``bitcast_convert`` whose source or result element type is
  a float (this also flags ``jax.random``'s uniform, which bitcasts ui32 bits to f32).
- S15 ``shift_right_arithmetic`` on anything but 32-bit integers.
- N1  arithmetic/bitwise ops (``add``, ``subtract``, ``multiply``, ``divide``, ``remainder``, ``negate``, ``abs``,
  ``and``, ``or``, ``xor``, ``not``, shifts, ``maximum``/``minimum``, ``clamp``, ``popcnt``, ``sign``, ``power``,
  ``count_leading_zeros``; also a ``reduce ... applies <op>``) whose result element type is i8/ui8/i16/ui16.
  ``compare``, ``convert``, ``select``, reshapes, slices, ``gather``, ``dynamic_update_slice`` of 8-bit data are fine.
- S17 ``custom_call`` targets other than ``AwsNeuronCustomNativeKernel``, ``AwsNeuron*``, ``Sharding``,
  ``SPMDFullToShardShape``, ``SPMDShardToFullShape`` and ``xla.sdy.*`` markers. (With JAX 0.10.0's default Shardy
  partitioner sharding constraints and ``shard_map`` are ``sdy.*`` ops, not custom calls, so they never show up
  here.) ``jax.pure_callback``/``io_callback``/``debug.print`` lower to ``xla_ffi_python_cpu_callback``.
- S18 ``reduce_precision``; ``complex<...>`` or ``f64`` value types; threefry: a function whose name contains
  ``threefry`` (JAX 0.10.0 on CPU emits ``func.func private @threefry2x32``), a custom call naming threefry
  (``cu_threefry2x32`` on GPU), or the threefry key-schedule constant 0x1BD11BDA (466688986) as ``ui32``.
  ``rng_bit_generator`` (``jax.random.key(seed, impl="rbg")``) is allowed by this rule but S10/S13 still flag the
  ``ui64`` state and the ``bitcast_convert`` to f32 of ``jax.random.uniform``/``normal``.
- S19 number of ``@main`` arguments > ``max_args``.
- S20 each donated ``@main`` argument carries ``tf.aliasing_output = N`` (or ``jax.buffer_donor = true``, what JAX
  0.10.0 emits instead in multi-device lowerings; no in-place check is possible then); JAX 0.10.0 emits nothing for
  an unusable donation, and prunes unused arguments altogether (``check_lowered`` reports a donated
  argument that was pruned). For every aliased argument, the returned value at output N must be the argument updated
  in place: following ``dynamic_update_slice``/``scatter`` (their operand 0), ``while`` carries (body update, then
  init), calls, ``reshape`` and sharding constraints back to that same argument. A fresh buffer (e.g. the ``ys`` of a
  ``lax.scan``, built from a ``broadcast_in_dim`` of zeros), a whole-tensor ``select``/``add``/``concatenate`` or a
  different argument is reported.

Known blind spots: op counts are only a proxy for compiler instructions (S4); S5 matches a trip count, not intent;
S12 reports a gather inside a shared helper once (at the helper) however many callers pass an unbounded index,
ignores the predicate of a ``select`` (a ``where(valid, idx, 0)`` mask does not count as a clamp) and trusts any
clamp/min/max whatever its bounds; S11 does not prove values < 2^24; S13 does not see fp8 hidden behind an
integer bitcast chain outside custom calls (there is none without ``bitcast_convert``); S20 does not look inside
``case`` branches (S2 flags them anyway).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RULES", "Limits", "Report", "Violation", "check_lowered", "check_text"]

RULES: dict[str, str] = {
    "S1": "fully static shapes: no '?' dimension, no dynamic_* shape ops",
    "S2": "no conditionals: no stablehlo.if / stablehlo.case (lax.cond, lax.switch); use select",
    "S3": "every while loop has a static trip count (counter from a constant compared with a constant)",
    "S4": "bounded unrolled size: per-loop trip/body/trip*body budgets and a whole-program unrolled op budget",
    "S5": "no while loop whose trip count equals the routed-expert count",
    "S6": "no sort in decode programs; any sort comparator is a single compare LT/GT/LE/GE + return",
    "S7": "top-k operands are f32/bf16/f16",
    "S8": "no variadic reductions: reduce / reduce_window have exactly one input (no argmax/argmin)",
    "S9": "no dot_general / convolution with integer operands",
    "S10": "no i64 / ui64 value types",
    "S11": "no integer scatter with a computing update region, no integer all_reduce / reduce_scatter",
    "S12": "gather / scatter indices derive from clamp/min/max, constants or iotas",
    "S13": "no fp8/fp6/fp4 element types outside AwsNeuronCustomNativeKernel, no bitcast_convert to/from floats",
    "S14": "one fp8 variant per module: covered by S13 (no fp8 types admitted at all)",
    "S15": "shift_right_arithmetic only on 32-bit integers (uint8 codes decoded in f32 or 32-bit ints)",
    "N1": "narrow-integer arithmetic: no arithmetic/bitwise op with an i8/ui8/i16/ui16 result",
    "S16": "fp32 dots in mHC/gate/compressor/head scopes: not checked here (needs scope names; tests of those layers)",
    "S17": "custom_call targets only AwsNeuron*, Sharding/SPMD markers; no host callbacks",
    "S18": "no reduce_precision, complex or f64 types, no threefry (rng_bit_generator allowed)",
    "S19": "flattened @main argument count <= Limits.max_args",
    "S20": "donated arguments are aliased to an output (tf.aliasing_output) and updated in place",
    "S21": "one cache tensor per layer: not checked here (checked by tests of the compiled set / state layout)",
    "S22": "finite compile set: not checked here (checked by tests of the compiled set: jit cache size per bucket)",
    "S23": "no host syncs in decode: not checked here (checked by tracing with abstract values)",
}

# Rules that check_text does not evaluate on a single program's text.
NOT_CHECKED_HERE = ("S14", "S16", "S21", "S22", "S23")


@dataclass(frozen=True)
class Limits:
    """Budgets for S4 (loop unrolling, after neuronx-cc's while_loop_unroller) and S19."""

    max_args: int = 128  # S19
    loop_trip: int = 1000  # S4, per loop
    loop_body: int = 100_000  # S4, ops of one loop body (nested loops multiplied)
    loop_total: int = 800_000  # S4, trip * body ops of one loop
    program_ops: int = 2_000_000  # S4, whole program fully unrolled


@dataclass(frozen=True)
class Violation:
    """One rule violation: ``line`` is the 1-based line of the offending op in the text (0: not applicable)."""

    rule: str
    message: str
    line: int = 0


@dataclass
class Report:
    """Result of a check. ``stats``: n_args, n_ops, loops (list of (trip, body_ops); trip None if not static),
    unrolled_ops, donated, aliased."""

    name: str
    violations: list[Violation]
    stats: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def by_rule(self) -> dict[str, list[Violation]]:
        """Violations grouped by rule id, in RULES order."""
        order = {r: i for i, r in enumerate(RULES)}
        out: dict[str, list[Violation]] = {}
        for v in sorted(self.violations, key=lambda v: (order.get(v.rule, 99), v.line)):
            out.setdefault(v.rule, []).append(v)
        return out

    def format(self, max_per_rule: int = 5) -> str:
        """Human-readable summary: one header line, then per violated rule its count and the first examples."""
        s = self.stats
        loops = s.get("loops", [])
        head = (
            f"graphcheck {self.name}: {'OK' if self.ok else f'FAIL ({len(self.violations)} violations)'}; "
            f"args {s.get('n_args')}, ops {s.get('n_ops')}, unrolled ops {s.get('unrolled_ops')}, "
            f"loops {len(loops)} {[t for t, _ in loops]}, donated {s.get('donated')}, aliased {s.get('aliased')}"
        )
        lines = [head]
        for rule, vs in self.by_rule().items():
            lines.append(f"  {rule} x{len(vs)}: {RULES.get(rule, '')}")
            for v in vs[:max_per_rule]:
                lines.append(f"    line {v.line}: {v.message}")
            if len(vs) > max_per_rule:
                lines.append(f"    ... {len(vs) - max_per_rule} more")
        return "\n".join(lines)


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


_STR_RE = re.compile(r'"(?:[^"\\]|\\.)*"')
_OP_RE = re.compile(
    r'^(?:(?P<res>%[\w.$\-]+(?::\d+)?(?:\s*,\s*%[\w.$\-]+)*)\s*=\s*)?(?:"(?P<gname>[\w.$\-]+)"|(?P<name>[A-Za-z_][\w.$\-]*))'
)
_REF_RE = re.compile(r"%[\w.$\-]+(?:#\d+)?")
_DEF_RE = re.compile(r"(%[\w.$\-]+)\s*:\s*(?=[a-z!(])")
_ITER_RE = re.compile(r"(%[\w.$\-]+)\s*=\s*(%[\w.$\-]+(?:#\d+)?)")
_CALLEE_RE = re.compile(r"@([\w.$\-]+)")
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


def _strip_locs(s: str) -> str:
    """Remove ``loc(...)`` annotations (balanced parentheses); strings must already be blanked."""
    while True:
        i = s.find("loc(")
        if i < 0 or (i > 0 and (s[i - 1].isalnum() or s[i - 1] in "_.")):
            return s
        d, j = 0, i + 3
        while j < len(s):
            d += (s[j] == "(") - (s[j] == ")")
            if d == 0:
                break
            j += 1
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
        d, j = 0, i + 6
        while j < len(s):
            d += (s[j] == "<") - (s[j] == ">")
            if d == 0:
                break
            j += 1
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
    "S10": _s10, "S11": _s11, "S12": _s12, "S13": _s13, "S15": _s15, "N1": _n1, "S17": _s17, "S18": _s18,
    "S19": _s19, "S20": _s20,
}
assert set(_CHECKS) | set(NOT_CHECKED_HERE) == set(RULES)


def check_text(text: str, *, name: str = "program", donated: Sequence[bool] | None = None,
               n_experts: int | None = None, decode: bool = False, limits: Limits = Limits(),
               rules: Iterable[str] | None = None, _pruned_donated: Sequence[int] = ()) -> Report:
    """Check the StableHLO text of one program.

    ``donated``: one flag per ``@main`` argument (None skips the donation half of S20); ``n_experts``: routed-expert
    count for S5 (None skips); ``decode``: forbid any sort (S6); ``rules``: subset of rule ids to run (default all)."""
    return _check_module(Module(text), name=name, donated=donated, n_experts=n_experts, decode=decode,
                         limits=limits, rules=rules, pruned_donated=_pruned_donated)


def _check_module(mod: Module, *, name: str, donated: Sequence[bool] | None, n_experts: int | None, decode: bool,
                  limits: Limits, rules: Iterable[str] | None, pruned_donated: Sequence[int]) -> Report:
    _pruned_donated = pruned_donated
    an = _Analysis(mod)
    n_args = len(mod.main.func_args)
    if donated is not None and len(donated) != n_args:
        raise ValueError(f"donated has {len(donated)} flags but @main has {n_args} arguments")
    stats: dict[str, Any] = {
        "n_args": n_args,
        "n_ops": sum(1 for op in mod.ops if op.short not in ("return", "constant")),
        "loops": [(an.trip(op)[0], an.loop_body(op)) for op in mod.ops if op.short == "while"],
        "unrolled_ops": an.func_cost(mod.main.func_name),
        "donated": (sum(bool(d) for d in donated) + len(_pruned_donated)) if donated is not None else None,
        "aliased": sum(1 for _, _, a in mod.main.func_args if _ALIAS_RE.search(a)),
    }
    ctx = _Ctx(mod, an, limits, donated, n_experts, decode, tuple(_pruned_donated), stats)
    selected = set(rules) if rules is not None else set(_CHECKS)
    out: list[Violation] = []
    seen = set()
    for rid, fn in _CHECKS.items():
        if rid not in selected:
            continue
        for v in fn(ctx):
            key = (v.rule, v.line, v.message)
            if key not in seen:
                seen.add(key)
                out.append(v)
    return Report(name, out, stats)


def check_lowered(lowered: Any, *, name: str = "program", n_experts: int | None = None, decode: bool = False,
                  limits: Limits = Limits(), rules: Iterable[str] | None = None) -> Report:
    """Check a ``jax.stages.Lowered`` (``jax.jit(f, donate_argnums=...).lower(*args)``): its text plus the donation
    flags of its flattened arguments, mapped onto the ``@main`` arguments JAX kept (unused ones are pruned)."""
    import jax

    text = lowered.as_text()
    flags = [bool(getattr(a, "donated", False)) for a in jax.tree_util.tree_leaves(lowered.args_info)]
    kept = None
    try:
        kept = lowered._lowering.compile_args["kept_var_idx"]  # private, JAX 0.10.0
    except Exception:  # noqa: BLE001 - fall back to the flags as they are
        kept = None
    pruned: list[int] = []
    if kept is not None:
        kept = sorted(kept)
        pruned = [i for i, d in enumerate(flags) if d and i not in set(kept)]
        donated: list[bool] | None = [flags[i] for i in kept]
    else:
        donated = flags
    mod = Module(text)
    if len(donated) != len(mod.main.func_args):
        donated, pruned = None, []  # cannot map flags onto @main arguments (tokens, effects...): skip S20's half
    return _check_module(mod, name=name, donated=donated, n_experts=n_experts, decode=decode, limits=limits,
                         rules=rules, pruned_donated=pruned)
