"""The rule table, budgets and reports of the compile-safety checker (see jdeep/graphcheck)."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    "N2": "NKI kernel calls: a base64 JSON backend config, launched at the runtime's LNC, the compiled file present",
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
