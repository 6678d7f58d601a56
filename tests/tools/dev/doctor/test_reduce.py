"""The doctor's reducer: a failing program cut down to the smallest sub-program the compiler still fails on."""

from __future__ import annotations

import re
import sys
import pathlib

import jax
import jax.numpy as jnp
import pytest
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir

from jdeep.tools.dev.doctor.compiler import Compiler
from jdeep.tools.dev.doctor.reduce import reduce_failure

FAKE = str(pathlib.Path(__file__).with_name("fake_compiler.py"))


def _program(x, w):
    """~100 ops: a scanned body with a sort buried in the middle, stages named as jdeep's layers name them."""
    with jax.named_scope("norm"):
        x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)

    def body(h, _):
        with jax.named_scope("projection"):
            h = jnp.tanh(h @ w) + 1.0
        with jax.named_scope("moe.router"):
            order = jnp.argsort(h[:, 0])                  # the op the fake compiler "crashes" on
            h = h[order] * 0.5
        with jax.named_scope("mhc"):
            h = jax.nn.softmax(h, axis=-1) @ w.T
        return h, h.sum()
    h, s = jax.lax.scan(body, x, None, length=3)
    return jnp.exp(h).sum(0) + s.sum()


def _text():
    return jax.jit(_program).lower(jax.ShapeDtypeStruct((8, 16), jnp.float32),
                                   jax.ShapeDtypeStruct((16, 16), jnp.float32)).as_text(debug_info=True)


def _n_ops(text: str) -> int:
    with mlir.make_ir_context():
        m = ir.Module.parse(text)
        count = 0

        def walk(op):
            nonlocal count
            count += 1
            for r in op.regions:
                for b in r.blocks:
                    for o in b.operations:
                        walk(o)
        walk(m.operation)
    return count


def _main_ops(text: str) -> list[str]:
    """The op names of the reproducer's @main body, its return left out."""
    with mlir.make_ir_context():
        m = ir.Module.parse(text)
        main = [op for op in m.body.operations if ir.StringAttr(op.attributes["sym_name"]).value == "main"][0]
        return [op.operation.name for op in main.regions[0].blocks[0].operations][:-1]


def _fake(tmp_path, *extra):
    return Compiler([sys.executable, FAKE, "--fail-on", r"stablehlo\.sort", *extra], timeout_s=60)


def test_reducer_finds_the_failing_op_inside_the_loop(tmp_path):
    text = _text()
    compiler = _fake(tmp_path)
    assert compiler.fails(text, str(tmp_path))
    rep = reduce_failure(text, lambda t: compiler.fails(t, str(tmp_path)), max_tests=80)
    assert "stablehlo.sort" in rep.text
    assert compiler.fails(rep.text, str(tmp_path))                 # the reproducer is standalone and still fails
    assert _main_ops(rep.text) == ["stablehlo.sort"]                # the sort (and its comparator), nothing else
    assert "while.body" in rep.path and rep.stage.startswith("moe.router")
    assert "stablehlo.tanh" not in rep.text and "stablehlo.exponential" not in rep.text


def test_reducer_keeps_what_a_failure_needs(tmp_path):
    """A failure needing two ops (tanh then exp in one program) keeps the range holding both, and only it."""
    text = _text()

    def fails(t):
        return "stablehlo.tanh" in t and "stablehlo.exponential" in t

    rep = reduce_failure(text, fails, max_tests=200)
    assert fails(rep.text) and rep.n_ops < _n_ops(text) // 2
    with mlir.make_ir_context():
        ir.Module.parse(rep.text)


def test_reducer_finds_an_intermittent_crash(tmp_path):
    """The crash shows in half of the compiles: with 10 tries per candidate (a failing candidate looks clean with
    probability 2^-10) the reduction still ends at the sort."""
    compiler = _fake(tmp_path, "--rate", "0.5", "--seed", "3", "--counter", str(tmp_path / "n"))
    rep = reduce_failure(_text(), lambda t: compiler.fails(t, str(tmp_path), "NCC_IINL902", tries=10), max_tests=80)
    assert _main_ops(rep.text) == ["stablehlo.sort"]


def test_reducer_refuses_a_program_that_compiles(tmp_path):
    with pytest.raises(RuntimeError, match="did not show again"):
        reduce_failure(_text(), lambda t: False)


def test_reducer_stops_at_its_budget(tmp_path):
    calls = []

    def fails(t):
        calls.append(1)
        return "stablehlo.sort" in t
    rep = reduce_failure(_text(), fails, max_tests=3)
    assert len(calls) == 4 and rep.tests == 3 and "stablehlo.sort" in rep.text    # the whole, then 3 candidates


def test_reproducer_arguments_carry_the_types_of_the_cut_values(tmp_path):
    rep = reduce_failure(_text(), lambda t: "stablehlo.sort" in t)
    args = re.search(r"@main\((.*?)\) ->", rep.text).group(1)
    assert re.fullmatch(r"(%in\d+: tensor<[^>]+>(, )?)+", args), rep.text
