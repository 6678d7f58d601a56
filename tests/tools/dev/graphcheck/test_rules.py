"""Tests of jdeep.tools.dev.graphcheck: for every implemented rule a small JAX program (lowered on CPU with JAX 0.10.0) or a
hand-written StableHLO snippet that violates it, and compliant twins that pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jdeep.tools.dev import graphcheck as gc
from jdeep.tools.dev.graphcheck import Limits, analysis, check_lowered, check_text, mlir

F = jnp.float32
I = jnp.int32


def lower(f, *args, donate=()):
    return jax.jit(f, donate_argnums=donate).lower(*args)


def check(f, *args, donate=(), **kw) -> gc.Report:
    return check_lowered(lower(f, *args, donate=donate), **kw)


def rules(report: gc.Report) -> set[str]:
    return {v.rule for v in report.violations}


x8 = jnp.zeros((8, 3), F)
v4 = jnp.zeros((4,), F)
idx2 = jnp.zeros((2,), I)


# ------------------------------------------------------------------------------------------------ API / table


def test_rules_table_and_api():
    assert list(gc.RULES)[:2] == ["S1", "S2"]
    for rid in ("S1", "S2", "S3", "S4", "S5", "S6", "S7", "S8", "S9", "S10", "S11", "S12", "S13", "S14", "S15",
                "N1", "S16", "S17", "S18", "S19", "S20", "S21", "S22", "S23"):
        assert gc.RULES.get(rid)
    assert "S13" in gc.RULES["S14"]
    for rid in ("S16", "S21", "S22", "S23"):
        assert "not checked here" in gc.RULES[rid]
    r = check(lambda x: jnp.tanh(x) @ x.T, x8)
    assert r.ok and r.violations == []
    assert r.stats["n_args"] == 1 and r.stats["loops"] == [] and r.stats["n_ops"] >= 2
    assert r.stats["unrolled_ops"] == r.stats["n_ops"]
    assert "OK" in r.format()


def test_format_lists_rules_and_lines():
    r = check(lambda x, p: lax.cond(p, lambda: x + 1, lambda: x - 1), v4, True, name="condy")
    text = r.format()
    assert text.startswith("graphcheck condy: FAIL (1 violations)")
    assert "S2 x1" in text and f"line {r.violations[0].line}" in text
    assert r.violations[0].line > 0


def test_debug_info_locations_are_ignored():
    lo = lower(lambda x, i: (x[jnp.argmax(x[:, 0])] * 2, x[i]), x8, idx2)
    plain = check_text(lo.as_text())
    dbg = check_text(lo.as_text(debug_info=True))
    assert [(v.rule, v.message) for v in plain.violations] == [(v.rule, v.message) for v in dbg.violations]
    assert rules(plain) == {"S8", "S12"}


def test_donated_length_mismatch_raises():
    with pytest.raises(ValueError):
        check_text(lower(lambda x: x + 1, v4).as_text(), donated=[True, False])


def test_rules_subset():
    r = check_lowered(lower(jnp.argmax, v4), rules=["S2"])
    assert r.ok


# ------------------------------------------------------------------------------------------------ S1


def test_s1_symbolic_shape_export():
    from jax import export

    exp = export.export(jax.jit(lambda x: jnp.sin(x) + jnp.ones_like(x)))(
        jax.ShapeDtypeStruct(export.symbolic_shape("b, 4"), F))
    r = check_text(exp.mlir_module())
    msgs = [v.message for v in r.violations if v.rule == "S1"]
    assert any("tensor<?x4xf32>" in m for m in msgs)
    assert any("dynamic_broadcast_in_dim" in m for m in msgs)


S1_SNIPPET = """\
module @m {
  func.func public @main(%arg0: tensor<4xf32>, %arg1: tensor<1xi32>) -> tensor<?xf32> {
    %0 = stablehlo.dynamic_reshape %arg0, %arg1 : (tensor<4xf32>, tensor<1xi32>) -> tensor<?xf32>
    return %0 : tensor<?xf32>
  }
}
"""


def test_s1_snippet():
    r = check_text(S1_SNIPPET)
    assert rules(r) == {"S1"}
    assert {v.line for v in r.violations} == {2, 3}


# ------------------------------------------------------------------------------------------------ S2


def test_s2_cond_and_switch():
    assert rules(check(lambda x, p: lax.cond(p, lambda: x + 1, lambda: x - 1), v4, True)) == {"S2"}
    branches = [lambda x: x, lambda x: x * 2, lambda x: x - 1]
    assert rules(check(lambda x, i: lax.switch(i, branches, x), v4, I(0))) == {"S2"}
    assert check(lambda x, p: jnp.where(p, x + 1, x - 1), v4, True).ok


# ------------------------------------------------------------------------------------------------ S3


def test_s3_data_dependent_while_fails():
    r = check(lambda x: lax.while_loop(lambda c: c[0] < 10.0, lambda c: c * 2, x), v4)
    assert rules(r) == {"S3"}
    assert r.stats["loops"][0][0] is None


def test_s3_counter_with_data_dependent_stop_fails():
    def f(x):
        return lax.while_loop(lambda c: (c[0] < 10) & (c[1].sum() < 5.0), lambda c: (c[0] + 1, c[1] * 2), (0, x))[1]

    assert rules(check(f, v4)) == {"S3"}


def test_s3_fori_with_traced_bound_fails():
    r = check(lambda x, n: lax.fori_loop(0, n, lambda j, c: c * 2, x), v4, I(3))
    assert rules(r) == {"S3"}
    assert "not a constant" in r.violations[0].message


def test_s3_static_loops_pass_with_trip_counts():
    r = check(lambda x: lax.scan(lambda c, _: (c + 1, c), x, None, length=5), v4)
    assert r.ok and [t for t, _ in r.stats["loops"]] == [5]
    r = check(lambda x: lax.fori_loop(0, 7, lambda j, c: c * 2, x), v4)
    assert r.ok and [t for t, _ in r.stats["loops"]] == [7]
    # bounds as arrays: the bound becomes a loop-carried value passed through unchanged
    r = check(lambda x: lax.fori_loop(I(2), I(9), lambda j, c: c * 2, x), v4)
    assert r.ok and [t for t, _ in r.stats["loops"]] == [7]
    r = check(lambda x: lax.scan(lambda c, row: (c + row, c), x[0], x, reverse=True), x8)
    assert r.ok and [t for t, _ in r.stats["loops"]] == [8]
    # while_loop with a counter and a constant bound is static too
    r = check(lambda x: lax.while_loop(lambda c: c[0] < 6, lambda c: (c[0] + 2, c[1] + 1), (0, x))[1], v4)
    assert r.ok and [t for t, _ in r.stats["loops"]] == [3]


def test_trip_formula():
    tf = analysis._trip_formula
    assert tf(0, 1, 5, "LT") == 5
    assert tf(0, 2, 5, "LT") == 3
    assert tf(0, 1, 5, "LE") == 6
    assert tf(9, -1, 0, "GT") == 9
    assert tf(9, -1, 0, "GE") == 10
    assert tf(0, 2, 6, "NE") == 3
    assert tf(0, 2, 5, "NE") is None
    assert tf(0, -1, 5, "LT") is None


# ------------------------------------------------------------------------------------------------ S4


def test_s4_loop_trip_budget():
    r = check(lambda x: lax.scan(lambda c, _: (c * 1.5 + 1, None), x, None, length=2000)[0], v4)
    assert rules(r) == {"S4"}
    assert any("trip count 2000 > 1000" in v.message for v in r.violations)


def test_s4_nested_loops_multiply():
    def f(x):
        return lax.fori_loop(0, 3, lambda j, c: lax.fori_loop(0, 4, lambda k, d: d * 1.5 + 1.0, c), x)

    r = check(f, v4)
    assert r.ok
    (t_out, body_out), (t_in, body_in) = r.stats["loops"]
    assert (t_out, t_in) == (3, 4)
    assert body_out >= 4 * body_in
    assert r.stats["unrolled_ops"] >= 12 * body_in
    tiny = Limits(loop_total=2 * body_out, program_ops=10)
    r2 = check(f, v4, limits=tiny)
    assert rules(r2) == {"S4"}
    msgs = " ".join(v.message for v in r2.violations)
    assert "program unrolled size" in msgs and "trip x body" in msgs


def test_s4_loops_in_called_functions_count_per_call_site():
    def inner(x):
        return lax.fori_loop(0, 10, lambda j, c: jnp.sin(c) * 2.0, x)

    once = check(lambda x: inner(x), v4).stats["unrolled_ops"]
    twice = check(lambda x: jax.jit(inner)(x) + jax.jit(inner)(x * 2), v4).stats["unrolled_ops"]
    assert twice >= 2 * once


# ------------------------------------------------------------------------------------------------ S5


def test_s5_loop_over_experts():
    f = lambda x: lax.fori_loop(0, 8, lambda e, c: c + jnp.float32(1), x)
    r = check(f, v4, n_experts=8)
    assert rules(r) == {"S5"}
    assert check(f, v4).ok  # n_experts unknown: skipped
    assert check(f, v4, n_experts=16).ok


# ------------------------------------------------------------------------------------------------ S6


def test_s6_float_sort_fails():
    r = check(jnp.sort, v4)
    assert rules(r) == {"S6"}
    assert "TOTALORDER" in r.violations[0].message
    assert rules(check(jnp.argsort, v4)) == {"S6"}


def test_s6_int_sort_passes_except_in_decode():
    ints = jnp.zeros((4,), I)
    assert check(lax.sort, ints).ok
    assert check(lambda k, v: lax.sort((k, v), num_keys=1), ints, ints).ok
    r = check(lax.sort, ints, decode=True)
    assert rules(r) == {"S6"} and "decode" in r.violations[0].message


# ------------------------------------------------------------------------------------------------ S7


def test_s7_top_k_on_ints():
    assert rules(check(lambda x: lax.top_k(x, 2), jnp.zeros((4,), I))) == {"S7"}
    assert check(lambda x: lax.top_k(x, 2), v4).ok
    assert check(lambda x: lax.top_k(x, 2), jnp.zeros((4,), jnp.bfloat16)).ok
    assert check(lambda x: lax.top_k(x.astype(F), 2), jnp.zeros((4,), I)).ok


# ------------------------------------------------------------------------------------------------ S8


def test_s8_variadic_reductions():
    assert rules(check(jnp.argmax, v4)) == {"S8"}
    assert rules(check(lambda x: jnp.argmin(x, axis=1), x8)) == {"S8"}

    def window_argmax(x, i):
        return lax.reduce_window((x, i), (-jnp.inf, 0), lambda a, b: (lax.max(a[0], b[0]), lax.max(a[1], b[1])),
                                 (2, 1), (1, 1), "VALID")

    assert rules(check(window_argmax, x8, jnp.zeros((8, 3), I))) == {"S8"}
    # compliant twins: top_k(k=1), a single-input reduce, max-pool
    assert check(lambda x: lax.top_k(x, 1)[1], v4).ok
    assert check(lambda x: x.max(0) + x.sum(0), x8).ok
    assert check(lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (2, 1), (1, 1), "VALID"), x8).ok


# ------------------------------------------------------------------------------------------------ S9


def test_s9_integer_dot():
    a = jnp.zeros((2, 2), I)
    assert rules(check(lambda a, b: a @ b, a, a)) == {"S9"}
    assert rules(check(lambda a, b: a @ b, jnp.zeros((2, 2), jnp.int8), jnp.zeros((2, 2), jnp.int8))) == {"S9"}
    assert check(lambda a, b: a.astype(F) @ b.astype(F), a, a).ok


# ------------------------------------------------------------------------------------------------ S10


def test_s10_int64_with_x64():
    with jax.enable_x64(True):
        r = check(lambda a: a + 1, jnp.zeros((3,), jnp.int64))
    assert rules(r) == {"S10"}
    assert check(lambda a: a + 1, jnp.zeros((3,), I)).ok


S10_ATTR_SNIPPET = """\
module @m attributes {mhlo.num_partitions = 1 : i32} {
  func.func public @main(%arg0: tensor<8x3xf32>) -> (tensor<8x3xf32> {jax.result_info = "result"}) {
    %cst = stablehlo.constant dense<0xFF800000> : tensor<f32>
    %0 = "stablehlo.reduce_window"(%arg0, %cst) <{padding = dense<0> : tensor<2x2xi64>, window_dimensions = array<i64: 1, 1>}> ({
    ^bb0(%arg1: tensor<f32>, %arg2: tensor<f32>):
      %1 = stablehlo.maximum %arg1, %arg2 : tensor<f32>
      stablehlo.return %1 : tensor<f32>
    }) : (tensor<8x3xf32>, tensor<f32>) -> tensor<8x3xf32>
    %2 = stablehlo.custom_call @AwsNeuronRmsNorm(%0) {backend_config = "{}", mhlo.backend_config = {index = 0 : ui64}, operand_layouts = [dense<[1, 0]> : tensor<2xindex>]} : (tensor<8x3xf32>) -> tensor<8x3xf32>
    return %2 : tensor<8x3xf32>
  }
}
"""


def test_s10_ignores_attribute_types():
    assert check_text(S10_ATTR_SNIPPET).ok
    bad = S10_ATTR_SNIPPET.replace("tensor<8x3xf32>) -> tensor<8x3xf32>\n    return",
                                   "tensor<8x3xf32>) -> tensor<8x3xi64>\n    return")
    assert rules(check_text(bad)) == {"S10"}


# ------------------------------------------------------------------------------------------------ S11


def test_s11_integer_scatter_add():
    x = jnp.zeros((8,), I)
    r = check(lambda x, i: x.at[jnp.clip(i, 0, 7)].add(1), x, idx2)
    assert rules(r) == {"S11"}
    assert rules(check(lambda x, i: x.at[jnp.clip(i, 0, 7)].max(3), x, idx2)) == {"S11"}
    assert check(lambda x, i: x.at[jnp.clip(i, 0, 7)].set(1), x, idx2).ok
    assert check(lambda x, i: x.at[jnp.clip(i, 0, 7)].add(1.0), x.astype(F), idx2).ok


def test_s11_integer_all_reduce():
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    f = jax.shard_map(lambda a: lax.psum(a, "x"), mesh=mesh, in_specs=P("x"), out_specs=P())
    assert rules(check(f, jnp.zeros((4,), I))) == {"S11"}
    assert check(f, v4).ok


# ------------------------------------------------------------------------------------------------ S12


@pytest.mark.parametrize("fn", [
    lambda x, i: x[i],
    lambda x, i: jnp.take(x, i, axis=0, mode="clip"),
    lambda x, i: jnp.take(x, i, axis=0),
    lambda x, i: x.at[i].set(1.0),
    lambda x, i: x.at[i].add(1.0),
], ids=["getitem", "take-clip", "take-fill", "at-set", "at-add"])
def test_s12_unclamped_index_fails(fn):
    r = check(fn, x8, idx2)
    assert rules(r) == {"S12"}
    assert "@main argument %arg1" in r.violations[0].message


def test_s12_take_along_axis_fails():
    r = check(lambda x, i: jnp.take_along_axis(x, i, axis=1), x8, jnp.zeros((8, 2), I))
    assert rules(r) == {"S12"}


@pytest.mark.parametrize("fn", [
    lambda x, i: x[jnp.clip(i, 0, 7)],
    lambda x, i: jnp.take(x, jnp.clip(i, 0, 7), axis=0),
    lambda x, i: jnp.take(x, jnp.minimum(i, 7), axis=0, mode="clip"),
    lambda x, i: x[lax.clamp(0, i, 7)],
    lambda x, i: x.at[jnp.clip(i, 0, 7)].set(1.0),
    lambda x, i: jnp.where((i >= 0)[:, None], x[jnp.clip(i, 0, 7) + 0], 0.0),
    lambda x, i: x[lax.top_k(x[:, 0], 2)[1]],
    lambda x, i: x[jnp.arange(2) * 3 + 1],
    lambda x, i: x[i[0]],  # scalar index: dynamic_slice, exempt
], ids=["clip", "take-of-clip", "minimum", "lax.clamp", "at-set-clip", "masked", "top_k", "iota", "scalar"])
def test_s12_clamped_index_passes(fn):
    r = check(fn, x8, idx2)
    assert r.ok, r.format()


def test_s12_take_along_axis_clamped_passes():
    assert check(lambda x, i: jnp.take_along_axis(x, jnp.clip(i, 0, 2), axis=1), x8, jnp.zeros((8, 2), I)).ok


def test_s12_through_loops_and_calls():
    # indices from the scanned xs (a program input): unbounded inside the loop body
    bad = lambda x, ids: lax.scan(lambda c, i: (c + x[i[None]].sum(), None), 0.0, ids)[0]
    r = check(bad, x8, jnp.zeros((5,), I))
    assert rules(r) == {"S12"}
    good = lambda x, ids: lax.scan(lambda c, i: (c + x[jnp.clip(i, 0, 7)[None]].sum(), None), 0.0, ids)[0]
    assert check(good, x8, jnp.zeros((5,), I)).ok
    # the loop counter and values derived from it are bounded
    counter = lambda x: lax.fori_loop(0, 4, lambda j, c: c + x[jnp.stack([j, j + 1])].sum(), 0.0)
    assert check(counter, x8).ok
    # an accumulator that adds data is not
    acc = lambda x, d: lax.fori_loop(0, 4, lambda j, c: (c[0] + d, c[1] + x[c[0][None]].sum()), (I(0), 0.0))[1]
    assert rules(check(acc, x8, I(1))) == {"S12"}


def test_s12_data_index_source_named():
    r = check(lambda x, w: x[(w @ w).astype(I)[:, 0]], x8, jnp.zeros((2, 2), F))
    assert rules(r) == {"S12"}
    assert "dot_general" in r.violations[0].message


# ------------------------------------------------------------------------------------------------ S13


def test_s13_fp8():
    u8 = jnp.zeros((4,), jnp.uint8)
    r = check(lambda c: lax.bitcast_convert_type(c, jnp.float8_e4m3fn).astype(F), u8)
    assert rules(r) == {"S13"}
    assert any("bitcast_convert ui8 -> f8E4M3FN" in v.message for v in r.violations)
    assert rules(check(lambda x: x.astype(jnp.float8_e4m3fn).astype(F), v4)) == {"S13"}
    assert rules(check(lambda x: x.astype(jnp.float8_e4m3).astype(F), v4)) == {"S13"}
    assert rules(check(lambda x: x.astype(jnp.float4_e2m1fn).astype(F), v4)) == {"S13"}
    assert rules(check(lambda x: lax.bitcast_convert_type(x, I), v4)) == {"S13"}
    # int <-> int of the same width is fine, and so is decoding codes arithmetically
    assert check(lambda c: lax.bitcast_convert_type(c, jnp.int8), u8).ok
    assert check(lambda c: c.astype(F) * 0.5, u8).ok


def _nki_config(binary: str = __file__, grid: int | None = None) -> str:
    """A backend config as jax-neuronx writes it (base64 JSON), naming `binary` as the compiled kernel."""
    import base64
    import json

    from jdeep.platforms import logical_nc_config
    config = {"func_name": "m.k", "kernel_format": "bir", "kernel_version": 1, "grid": grid or logical_nc_config(),
              "klir_binary": {"binary": binary, "input_names": ["x"], "output_names": ["output0"]}}
    return base64.b64encode(json.dumps(config).encode()).decode()


S13_NKI_SNIPPET = """\
module @m {
  func.func public @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {
    %0 = stablehlo.custom_call @AwsNeuronCustomNativeKernel(%arg0) {backend_config = "CONFIG"} : (tensor<4xf32>) -> tensor<4xf8E4M3>
    %1 = stablehlo.custom_call @AwsNeuronCustomNativeKernel(%0) {backend_config = "CONFIG"} : (tensor<4xf8E4M3>) -> tensor<4xf32>
    %2 = "stablehlo.custom_call"(%1) <{call_target_name = "Sharding", mhlo.sharding = "{replicated}"}> : (tensor<4xf32>) -> tensor<4xf32>
    return %2 : tensor<4xf32>
  }
}
"""


def test_s13_nki_custom_call_exempt_and_s17_allowed_targets():
    text = S13_NKI_SNIPPET.replace("CONFIG", _nki_config())
    assert check_text(text).ok
    r = check_text(text.replace('"Sharding"', '"lapack_sgetrf_ffi"'))
    assert rules(r) == {"S17"} and r.violations[0].line == 5


def test_n2_nki_calls_name_a_present_kernel_at_the_runtime_lnc(tmp_path):
    """N2: an unreadable backend config, a launch at another LNC than the runtime's (a runtime error) and a compiled
    kernel file that is not on this host (NCC_EVRF059) are each reported."""
    from jdeep.platforms import logical_nc_config

    for config, why in (("eA==", "not base64 JSON"), (_nki_config(grid=3 - logical_nc_config()), "launched at LNC"),
                        (_nki_config(str(tmp_path / "gone.json")), "is missing")):
        r = check_text(S13_NKI_SNIPPET.replace("CONFIG", config))
        assert rules(r) == {"N2"} and why in r.violations[0].message, r.format()


# ------------------------------------------------------------------------------------------------ S15 / N1


def test_n1_uint8_nibble_arithmetic():
    u8 = jnp.zeros((4,), jnp.uint8)
    r = check(lambda c: (c >> 4) & 15, u8)
    assert rules(r) == {"N1"} and len(r.violations) == 2
    assert check(lambda c: (c.astype(I) >> 4) & 15, u8).ok
    assert check(lambda c: jnp.floor(c.astype(F) / 16.0), u8).ok
    # compare, select, convert, slicing of codes are fine
    assert check(lambda c: jnp.where(c > 3, c, jnp.uint8(0))[1:].astype(F), u8).ok
    # a reduction computing on int16
    assert rules(check(lambda c: c.sum(dtype=jnp.int16), jnp.zeros((4,), jnp.int16))) == {"N1"}


def test_s15_shift_right_arithmetic_width():
    r = check(lambda c: c >> 1, jnp.zeros((4,), jnp.int8))
    assert rules(r) == {"S15", "N1"}
    assert check(lambda c: c >> 1, jnp.zeros((4,), I)).ok


# ------------------------------------------------------------------------------------------------ S17


def test_s17_callback():
    f = lambda x: jax.pure_callback(lambda a: a, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    r = check(f, v4)
    assert rules(r) == {"S17"} and "callback" in r.violations[0].message
    r = check(lambda x: (jax.debug.print("{}", x), x + 1)[1], v4)
    assert "S17" in rules(r)


def test_s17_sharding_constraint_is_not_a_custom_call():
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    s = jax.sharding.NamedSharding(mesh, P("x"))
    assert check(lambda a: lax.with_sharding_constraint(a * 2, s), x8).ok


# ------------------------------------------------------------------------------------------------ S18


def test_s18_threefry():
    r = check(lambda k: jax.random.normal(k, (4,)), jax.random.key(0))
    assert "S18" in rules(r)
    assert any("threefry2x32" in v.message for v in r.violations if v.rule == "S18")
    # jax.random also trips S10 (ui64 iota) and S13 (bits bitcast to f32)
    assert rules(r) <= {"S18", "S10", "S13"}
    r = check(lambda k: jax.random.bits(k, (4,)), jax.random.PRNGKey(0))
    assert "S18" in rules(r)


def test_s18_rbg_passes_s18():
    r = check(lambda k: jax.random.bits(k, (4,)), jax.random.key(0, impl="rbg"))
    assert "S18" not in rules(r)
    assert "rng_bit_generator" in lower(lambda k: jax.random.bits(k, (4,)), jax.random.key(0, impl="rbg")).as_text()


def test_s18_reduce_precision_complex_f64():
    assert rules(check(lambda x: lax.reduce_precision(x, 5, 10), v4)) == {"S18"}
    assert rules(check(lambda x: jnp.fft.fft(x).real, v4)) == {"S18"}
    with jax.enable_x64(True):
        r = check(lambda x: x * 2.0, jnp.zeros((4,), jnp.float64))
    assert rules(r) == {"S18"}


# ------------------------------------------------------------------------------------------------ S19


def test_s19_argument_count():
    args = [jnp.zeros((2,), F)] * 200
    r = check(lambda *a: sum(a), *args)
    assert rules(r) == {"S19"} and "200 arguments" in r.violations[0].message
    assert check(lambda *a: sum(a), *args[:3]).ok
    assert rules(check(lambda *a: sum(a), *args[:3], limits=Limits(max_args=2))) == {"S19"}


# ------------------------------------------------------------------------------------------------ S20


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_s20_unusable_donation():
    r = check(lambda s, u: s.sum() + u, x8, jnp.ones((1, 3), F), donate=(0,))
    assert rules(r) == {"S20"}
    assert "not aliased" in r.violations[0].message
    assert r.stats["donated"] == 1 and r.stats["aliased"] == 0


def test_s20_pruned_donation():
    r = check(lambda s, u: u * 2, x8, jnp.ones((1, 3), F), donate=(0,))
    assert rules(r) == {"S20"} and "pruned" in r.violations[0].message


def test_s20_in_place_update_passes():
    def step(cache, new, pos):
        return lax.dynamic_update_slice(cache, new, (pos, 0)), new.sum()

    r = check(step, x8, jnp.ones((1, 3), F), I(2), donate=(0,))
    assert r.ok and r.stats["aliased"] == 1
    # the cache carried through a scan (layer loop) and updated in place in the body also passes
    def layers(cache, new):
        def body(c, j):
            return lax.dynamic_update_slice(c, new, (j, 0)), None
        return lax.scan(body, cache, jnp.arange(3))[0]

    assert check(layers, x8, jnp.ones((1, 3), F), donate=(0,)).ok


def test_s20_rebuilt_cache_fails():
    # whole-tensor select
    r = check(lambda c, m: jnp.where(m, c * 0.5, c), x8, jnp.zeros((8, 3), bool), donate=(0,))
    assert rules(r) == {"S20"} and "rebuilt by stablehlo.select" in r.violations[0].message
    # concatenate (shift-in ring buffer)
    r = check(lambda c, new: jnp.concatenate([c[1:], new]), x8, jnp.ones((1, 3), F), donate=(0,))
    assert rules(r) == {"S20"} and "concatenate" in r.violations[0].message

    # cache as scan xs -> ys: a fresh buffer each call
    def stacked(cache, new):
        return lax.scan(lambda c, row: (c, row + new[0]), 0.0, cache)[1]

    r = check(stacked, x8, jnp.ones((1, 3), F), donate=(0,))
    assert rules(r) == {"S20"} and "fresh buffer" in r.violations[0].message


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_s20_skipped_without_flags():
    text = lower(lambda s, u: s.sum() + u, x8, jnp.ones((1, 3), F), donate=(0,)).as_text()
    assert check_text(text).ok
    assert rules(check_text(text, donated=[True, False])) == {"S20"}


# ------------------------------------------------------------------------------------------------ parser details


def test_parser_types_and_values():
    mod = mlir.Module(lower(lambda x: lax.top_k(x, 2), v4).as_text())
    (op,) = [o for o in mod.ops if o.short == "top_k"]
    assert [v.type for v in op.results] == ["tensor<2xf32>", "tensor<2xi32>"]
    assert op.operands[0].kind == "arg" and op.operands[0].type == "tensor<4xf32>"
    assert mlir.tensor_dims_elem("tensor<2x?x3xcomplex<f32>>") == (["2", "?", "3"], "complex<f32>")
    assert mlir.elem_type("tensor<f8E4M3FN>") == "f8E4M3FN"


# sdy.manual_computation (shard_map over 2 devices) with a donated argument: JAX marks it jax.buffer_donor
SHARD_MAP_SNIPPET = """\
module @jit__lambda attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["x"=2]>
  func.func public @main(%arg0: tensor<8xf32> {jax.buffer_donor = true}, %arg1: tensor<2xf32>, %arg2: tensor<8xf32> {tf.aliasing_output = 1 : i32}, %arg3: tensor<2xi32>) -> (tensor<8xf32> {jax.result_info = "result[0]"}, tensor<8xf32> {jax.result_info = "result[1]"}) {
    %0:2 = sdy.manual_computation(%arg0, %arg1, %arg2, %arg3) in_shardings=[<@mesh, [{"x"}]>, <@mesh, [{"x"}]>, <@mesh, [{"x"}]>, <@mesh, [{"x"}]>] out_shardings=[<@mesh, [{"x"}]>, <@mesh, [{"x"}]>] manual_axes={"x"} (%arg4: tensor<4xf32>, %arg5: tensor<1xf32>, %arg6: tensor<4xf32>, %arg7: tensor<1xi32>) {
      %c = stablehlo.constant dense<0> : tensor<i32>
      %1 = stablehlo.dynamic_update_slice %arg4, %arg5, %c : (tensor<4xf32>, tensor<1xf32>, tensor<i32>) -> tensor<4xf32>
      %2 = "stablehlo.all_reduce"(%1) <{channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>, use_global_device_ids}> ({
      ^bb0(%arg8: tensor<f32>, %arg9: tensor<f32>):
        %3 = stablehlo.add %arg8, %arg9 : tensor<f32>
        stablehlo.return %3 : tensor<f32>
      }) : (tensor<4xf32>) -> tensor<4xf32>
      %4 = stablehlo.dynamic_update_slice %arg6, %arg5, %c : (tensor<4xf32>, tensor<1xf32>, tensor<i32>) -> tensor<4xf32>
      %5 = stablehlo.reshape %arg7 : (tensor<1xi32>) -> tensor<1x1xi32>
      %6 = "stablehlo.gather"(%4, %5) <{dimension_numbers = #stablehlo.gather<offset_dims = [1], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 1>, slice_sizes = array<i64: 1>}> : (tensor<4xf32>, tensor<1x1xi32>) -> tensor<1xf32>
      sdy.return %2, %4 : tensor<4xf32>, tensor<4xf32>
    } : (tensor<8xf32>, tensor<2xf32>, tensor<8xf32>, tensor<2xi32>) -> (tensor<8xf32>, tensor<8xf32>)
    return %0#0, %0#1 : tensor<8xf32>, tensor<8xf32>
  }
}
"""


def test_manual_computation_regions():
    r = check_text(SHARD_MAP_SNIPPET, donated=[True, False, True, False])
    # buffer_donor counts as a usable donation; %arg2 -> output 1 is updated in place inside the shard_map body;
    # the gather index comes from @main's %arg3 through the manual_computation block argument
    assert rules(r) == {"S12"}
    assert "@main argument %arg3" in r.violations[0].message
    assert r.stats["aliased"] == 1
    swapped = SHARD_MAP_SNIPPET.replace("sdy.return %2, %4", "sdy.return %2, %2")
    r = check_text(swapped, donated=[True, False, True, False])
    assert "S20" in rules(r) and any("all_reduce" in v.message for v in r.violations if v.rule == "S20")


def test_s12_shared_helpers_are_context_sensitive():
    # both jnp.where calls become one private @_where; only the second caller passes an unbounded value
    def f(x, i, pos):
        a = jnp.where(i > 0, jnp.clip(i, 0, 7), 0)
        b = jnp.where(pos > 0, pos, 0)
        return x[a], b

    text = lower(f, x8, idx2, idx2).as_text()
    assert text.count("call @_where(") == 2
    assert check_text(text).ok

    # a shared helper containing the gather is reported once, naming the unbounded caller's argument
    take = jax.jit(lambda x, i: x[i])
    r = check(lambda x, i, j: take(x, jnp.clip(i, 0, 7)) + take(x, j), x8, idx2, idx2)
    assert rules(r) == {"S12"} and len(r.violations) == 1
    assert "@main argument %arg2" in r.violations[0].message
    assert check(lambda x, i, j: take(x, jnp.clip(i, 0, 7)) + take(x, jnp.clip(j, 0, 7)), x8, idx2, idx2).ok
