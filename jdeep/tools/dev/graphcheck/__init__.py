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
- N2  each ``AwsNeuronCustomNativeKernel`` call: its ``backend_config`` decodes (base64 JSON with
  ``klir_binary.binary``), its ``grid`` equals the LNC the Neuron runtime runs at (``NEURON_LOGICAL_NC_CONFIG``,
  else the generation's default: a mismatch is a runtime error), and the compiled kernel file it names exists on
  this host (else neuronx-cc fails with NCC_EVRF059; ``jdeep export`` carries the files to another host).
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

from collections.abc import Iterable, Sequence
from typing import Any

import jax

from .analysis import _Analysis
from .mlir import Module
from .report import NOT_CHECKED_HERE, RULES, Limits, Report, Violation
from .rules import _ALIAS_RE, _CHECKS, _Ctx

__all__ = ["RULES", "NOT_CHECKED_HERE", "Limits", "Report", "Violation", "check_lowered", "check_text"]


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
