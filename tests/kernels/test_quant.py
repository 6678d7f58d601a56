"""The GEMM input of DeepSeek's numerics (kernels.quant.gemm_input): fp8 act_quant, written out before the product on
CPU so that XLA:CPU does not redo the rounding inside its matrix-vector loop (docs/performance.md)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdeep
from jdeep import kernels
from jdeep.config import ModelConfig
from jdeep.kernels.quant import FENCE_MAX_ROWS, fp8_fake_quant, gemm_input, written_out
from jdeep.layers.linear import dense
from jdeep.numerics import Numerics

from conftest import golden_path

QA = Numerics(quantize_activations=True)


@pytest.mark.parametrize("shape", [(1, 1024), (8, 512), (2, 3, 256)])
def test_fenced_input_is_the_fake_quant_bit_for_bit(shape):
    x = jnp.asarray(np.random.default_rng(0).standard_normal(shape).astype(np.float32) * 3)
    want = jax.jit(lambda x: fp8_fake_quant(x, 128))(x)
    got = jax.jit(lambda x: gemm_input(x, dataclasses.replace(QA, fence_gemm_inputs=True)))(x)
    assert got.dtype == x.dtype and got.shape == x.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(jax.jit(written_out)(x)), np.asarray(x))
    assert gemm_input(x, Numerics()) is x                      # float numerics: the input as it is


def _fusions_with_a_dot(hlo: str) -> list[str]:
    """The bodies of the compiled module's computations that hold a dot."""
    bodies = re.split(r"\n(?=\S)", hlo)
    return [b for b in bodies if " dot(" in b]


def _compiled_layers(fence: bool, rows: int = 1) -> str:
    """The compiled HLO of a layer scan of quantized Linears as the model runs them (the weight a dynamic slice of a
    stacked [L, N, K] array, the input `rows` rows)."""
    nx = dataclasses.replace(QA, fence_gemm_inputs=fence)

    def layers(x, ws):
        return jax.lax.scan(lambda h, w: (h + dense(h, {"decoded": w}, nx), None), x, ws)[0]

    # placed on the CPU device: the program is compiled for XLA:CPU, whose fusion the fence is about, on any backend
    ws, x = jax.device_put((jnp.full((3, 512, 512), 0.01, jnp.float32), jnp.ones((rows, 512), jnp.float32)),
                           jax.devices("cpu")[0])
    return jax.jit(layers).lower(x, ws).compile().as_text()


def _dot_bodies_round(fence: bool, rows: int = 1) -> bool:
    """Whether a computation holding a dot rounds, in _compiled_layers."""
    hlo = _compiled_layers(fence, rows)
    with_dot = [b for b in re.split(r"\n(?=\S)", hlo) if " dot(" in b]
    assert with_dot and "round-nearest-even" in hlo            # the product and the act_quant are both there
    return any("round-nearest-even" in b for b in with_dot)


def test_the_rounding_stays_out_of_the_cpu_product():
    """XLA:CPU fuses the act_quant's rounding into the matrix-vector product of a layer scan (redone for every output
    row: 4.3 against 0.96 ms at [1, 1024] x [4096, 1024]^T); the fence keeps it out."""
    assert _dot_bodies_round(fence=False)                      # what the fence is for, on this XLA
    assert not _dot_bodies_round(fence=True)


def test_prefill_sized_inputs_are_not_fenced():
    """A product of more than FENCE_MAX_ROWS rows takes XLA:CPU's GEMM path, which does not fuse the rounding in
    even unfenced; there the fence (a scatter) would be one more copy, so gemm_input leaves it out (-11% on a
    256-token chunk of v4-bench-small in the published format, docs/performance.md)."""
    rows = FENCE_MAX_ROWS * 4
    assert not _dot_bodies_round(fence=False, rows=rows)
    assert "scatter" not in _compiled_layers(fence=True, rows=rows)
    assert "scatter" in _compiled_layers(fence=True, rows=1)


def test_platforms_fence():
    cfg = ModelConfig.from_file(golden_path("v4-tiny-q"))
    assert kernels.fence_gemm_inputs("cpu") and not kernels.fence_gemm_inputs("neuron")
    assert Numerics.for_config(cfg, platform="cpu").fence_gemm_inputs
    assert not Numerics.for_config(cfg, platform="neuron").fence_gemm_inputs   # Neuron programs lowered on CPU


@pytest.mark.full
def test_fenced_model_gives_the_same_logits():
    """The v4-tiny-q golden (fp8 + fp4, DeepSeek's numerics) with and without the fence: identical logits.

    Full tier: tests/kernels/test_quant.py::test_fenced_input_is_the_fake_quant_bit_for_bit covers gemm_input's
    fenced branch giving fp8_fake_quant's values bit for bit (test_prefill_sized_inputs_are_not_fenced the unfenced
    branch above FENCE_MAX_ROWS) in the default run; the fenced numerics (the CPU default) run every default-run
    v4-tiny-q / v41-tiny-q golden test (e.g. tests/model/test_weights.py::test_decoded_weights_give_the_logits_of_codes_bit_for_bit)."""
    folder = golden_path("v4-tiny-q")
    fenced = jdeep.load(folder)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jdeep.numerics, "fence_gemm_inputs", lambda platform=None: False)
        plain = jdeep.load(folder)
    assert fenced.numerics.fence_gemm_inputs != plain.numerics.fence_gemm_inputs
    prompt = [[0, 5, 9, 17, 33, 65, 12, 7, 3, 250, 100]]
    a = jdeep.generate(fenced, prompt, max_new_tokens=4, return_logits=True, ignore_eos=True)
    b = jdeep.generate(plain, prompt, max_new_tokens=4, return_logits=True, ignore_eos=True)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logits, b.logits)
