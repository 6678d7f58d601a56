"""jdeep's native CPU product for few rows (kernels/cpu: rows_gemm.cc through XLA's FFI) against a float64 oracle,
where the kernel dispatch uses it, and what happens where it cannot be built."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdeep
from jdeep import kernels
from jdeep.config import ModelConfig
from jdeep.kernels import cpu
from jdeep.kernels.linear import linear, native_rows
from jdeep.model.scan import _split_in_place, slot_params
from jdeep.numerics import Numerics
from jdeep.tools.dev.programs import Target, model_programs

from conftest import golden_path

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu" or not cpu.available(),
                                reason="the native CPU kernels need the CPU backend and a C++ compiler")

NATIVE = Numerics(native_gemm_rows=cpu.MAX_ROWS)


def _bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """A float32 dot product's worst-case rounding for x [M, K] · w [N, K]ᵀ: K·u·(|x|·|w|ᵀ) (Higham's γ_K)."""
    u = np.finfo(np.float32).eps / 2
    return x.shape[1] * u * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T)


@pytest.mark.parametrize("M,N,K", [(1, 5, 3), (2, 2, 16), (3, 7, 33), (8, 512, 1024), (16, 130, 256), (17, 9, 48),
                                   (40, 31, 100)])
def test_rows_gemm_against_float64(M, N, K):
    rng = np.random.default_rng(M * 1000 + N)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((3, 2, N, K)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x, w, i: cpu.rows_gemm(x, w, (i, 1)))(x, w, 2))
    want = x.astype(np.float64) @ w[2, 1].astype(np.float64).T
    assert got.dtype == np.float32 and got.shape == (M, N)
    assert np.all(np.abs(got - want) <= _bound(x, w[2, 1]) + 1e-30)


def test_bf16_weights_as_values_and_as_bits():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 72)).astype(np.float32)
    wb = jnp.asarray(rng.standard_normal((4, 40, 72)), jnp.bfloat16)
    w64 = np.asarray(wb.astype(jnp.float32)).astype(np.float64)
    want = x.astype(np.float64) @ w64[3].T
    for w in (wb, jax.lax.bitcast_convert_type(wb, jnp.uint16)):
        got = np.asarray(jax.jit(lambda x, w: cpu.rows_gemm(x, w, (3,)))(x, w))
        assert np.all(np.abs(got - want) <= _bound(x, w64[3]) + 1e-30)


def test_indices_clamp_as_dynamic_slice():
    """Out-of-range stack indices read the nearest matrix, as lax.dynamic_slice clamps (graph rule S12)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 32)).astype(np.float32)
    w = rng.standard_normal((3, 5, 8, 32)).astype(np.float32)
    f = jax.jit(lambda x, w, i, j: cpu.rows_gemm(x, w, (i, j)))
    np.testing.assert_array_equal(np.asarray(f(x, w, 7, -2)), np.asarray(f(x, w, 2, 0)))
    with pytest.raises(ValueError, match="takes 2 indices"):
        cpu.rows_gemm(x, w, (1,))
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        cpu.rows_gemm(x, jnp.zeros((8, 32), jnp.int8))


def test_each_row_is_independent_of_the_others():
    """A row's result is the same bits whatever the other rows and their count (one fixed-order sum per output,
    whichever thread computes it): a batch's sequences do not change each other's logits."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 1024)).astype(np.float32)
    w = rng.standard_normal((4096, 1024)).astype(np.float32)
    f = jax.jit(cpu.rows_gemm)
    full = np.asarray(f(x, w))
    for rows in (1, 2, 5, 9):
        np.testing.assert_array_equal(np.asarray(f(x[:rows], w)), full[:rows])
    perm = rng.permutation(16)
    np.testing.assert_array_equal(np.asarray(f(x[perm], w)), full[perm])


def test_dispatch_rows_dtypes_and_platforms():
    w = jnp.zeros((64, 32), jnp.float32)
    assert not native_rows(jnp.zeros((1, 32)), w, NATIVE)                   # XLA's matrix-vector loop
    assert native_rows(jnp.zeros((2, 1, 32)), w, NATIVE) and native_rows(jnp.zeros((16, 32)), w, NATIVE)
    assert not native_rows(jnp.zeros((17, 32)), w, NATIVE)                  # prefill-sized: XLA's GEMM
    assert not native_rows(jnp.zeros((4, 32)), w, Numerics())               # off unless the numerics say so
    assert not native_rows(jnp.zeros((4, 32)), w.astype(jnp.int8), NATIVE)
    assert not native_rows(jnp.zeros((4, 32)), w, NATIVE, compute_dtype=jnp.bfloat16)   # a cast that rounds
    assert native_rows(jnp.zeros((4, 32)), w.astype(jnp.bfloat16), NATIVE, compute_dtype=jnp.float32)
    cfg = ModelConfig.from_file(golden_path("v4-tiny-q"))
    assert kernels.native_gemm_rows("cpu") == cpu.MAX_ROWS and kernels.native_gemm_rows("neuron") == 0
    assert Numerics.for_config(cfg, platform="neuron").native_gemm_rows == 0   # Neuron programs lowered on CPU
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 32)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(5).standard_normal((64, 32)), jnp.float32)
    assert "jdeep_rows_gemm" in jax.jit(lambda x, w: linear(x, w, NATIVE)).lower(x, w).as_text()
    assert "jdeep_rows_gemm" not in jax.jit(lambda x, w: linear(x, w, Numerics())).lower(x, w).as_text()
    np.testing.assert_allclose(np.asarray(linear(x, w, NATIVE)), np.asarray(linear(x, w)), rtol=0, atol=2e-5)


def _decode_logits(model, prompts):
    return jdeep.generate(model, prompts, max_new_tokens=4, return_logits=True, ignore_eos=True)


@pytest.mark.full
def test_model_decode_uses_it_and_agrees_with_xla():
    """The v4-tiny-q golden (fp8 + fp4 as published, DeepSeek's numerics) at batch 5: the decode program calls the
    native kernel, and its tokens and logits agree with XLA's products to fp32 rounding.

    Full tier: tests/kernels/test_cpu_rows_gemm.py::test_decode_program_reads_the_layer_weights_in_place covers the
    v4-tiny-q decode program of several rows calling jdeep_rows_gemm (with the layer weights read in place) in the
    default run, and tests/kernels/test_cpu_rows_gemm.py::test_dispatch_rows_dtypes_and_platforms covers linear()'s
    native product agreeing with XLA's."""
    folder = golden_path("v4-tiny-q")
    native = jdeep.load(folder)
    assert native.numerics.native_gemm_rows == cpu.MAX_ROWS
    xla = dataclasses.replace(native, numerics=dataclasses.replace(native.numerics, native_gemm_rows=0))
    prompts = [[0, 5, 9, 17, 33], [0, 250, 100], [0, 7, 3, 12, 65, 1, 2], [0, 44], [0, 8, 8, 8]]
    a, b = _decode_logits(native, prompts), _decode_logits(xla, prompts)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    scale = np.abs(b.logits).max(axis=-1, keepdims=True)
    assert np.all(np.abs(a.logits - b.logits) <= 1e-5 * scale)


def test_mesh_models_do_not_use_it():
    """XLA's partitioner cannot split a custom call (it would gather every weight): a model on a mesh keeps XLA's
    products (a one-device mesh takes the same path as any other)."""
    model = jdeep.load(golden_path("v4-tiny-q"), mesh="data=1")
    assert model.numerics.native_gemm_rows == 0


def _subprocess_status(env: dict) -> dict:
    code = ("import json, jdeep; from jdeep.kernels import cpu, native_gemm_rows; "
            "print(json.dumps([cpu.available(), cpu.status(), native_gemm_rows('cpu')]))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True, timeout=300)
    available, status, rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert "WARNING" not in out.stderr and "ERROR" not in out.stderr
    return {"available": available, "rows": rows, **status}


def test_without_a_compiler_or_switched_off_xla_runs(tmp_path):
    """No C++ compiler (and nothing cached): the kernels are unavailable with the reason, quietly, and the dispatch
    falls back to XLA's products; JDEEP_NATIVE_CPU=0 switches them off."""
    s = _subprocess_status({"JDEEP_CACHE_DIR": str(tmp_path), "CXX": "", "PATH": str(tmp_path)})
    assert not s["available"] and s["rows"] == 0 and s["state"] == "unavailable" and "compiler" in s["reason"]
    s = _subprocess_status({"JDEEP_NATIVE_CPU": "0"})
    assert not s["available"] and s["rows"] == 0 and s["state"] == "off"


def test_decode_program_reads_the_layer_weights_in_place():
    """A decode program of several sequences runs its products through the native kernel, with the layer scans'
    product weights passed whole (read in place at the layer's index: no copy sliced out per layer); one sequence
    and prefill chunks keep XLA's products."""
    model = jdeep.load(golden_path("v4-tiny-q"))
    programs = {p.name: p for p in model_programs(Target.of(model), batch_sizes=(1, 4), prefill_len=64, max_len=256)}
    assert "jdeep_rows_gemm" in programs["b4.decode"].lower().as_text()
    assert "jdeep_rows_gemm" not in programs["b1.decode"].lower().as_text()
    assert "jdeep_rows_gemm" not in programs["b4.prefill"].lower().as_text()     # 256 rows: XLA's GEMM
    slot = slot_params(model.params["segments"][0][0])[0]
    names = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(slot)[0]]
    scanned, resident, _ = _split_in_place(slot, model.numerics, 4)
    kept = {n for n, res in zip(names, resident) if res is not None}
    assert "['attn']['wq_a']['decoded']" in kept and "['ffn']['shared_experts']['w2']['decoded']" in kept
    assert "['attn']['q_norm']" not in kept and "['ffn']['gate']['weight']" not in kept
    assert all((sl is None) != (res is None) for sl, res in zip(scanned, resident))
    assert all(res is None for res in _split_in_place(slot, model.numerics, 1)[1])
