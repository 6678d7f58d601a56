"""bfloat16 models in the scan mode on CPU (kernels.registry.bf16_weights_as_bits): the layer stack's bf16 weights ride
as uint16 bit patterns and the output head in float32, which gives the logits of plain bf16 weights, and the compiled
step no longer converts a stacked weight to float32 outside the layer loops (XLA:CPU's float normalisation did that at
every step: docs/performance.md)."""

from __future__ import annotations

import re

import jax
import ml_dtypes
import numpy as np
import pytest

import jdeep
from jdeep import kernels
from jdeep.model.weights import from_cpu_bf16

from conftest import golden_path

PROMPT = [0, 5, 9, 17, 33, 65, 12, 7, 3, 250, 100]


@pytest.fixture(scope="module")
def pair():
    """The tiny V4 golden in bf16: as CPU loads it (bits), and with plain bf16 leaves (the rule switched off). The
    rule is set explicitly both ways, so the pair is the same on any default backend."""
    folder = golden_path("v4-tiny-hf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "bf16_weights_as_bits", lambda backend=None: True)
        bits = jdeep.load(folder, dtype="bfloat16")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "bf16_weights_as_bits", lambda backend=None: False)
        plain = jdeep.load(folder, dtype="bfloat16")
    return bits, plain


def _leaf_dtypes(tree) -> set[str]:
    return {str(a.dtype) for a in jax.tree_util.tree_leaves(tree)}


def test_layer_weights_are_bits_and_the_head_float32(pair):
    bits, plain = pair
    assert "uint16" in _leaf_dtypes(bits.params["segments"]) and "bfloat16" not in _leaf_dtypes(bits.params["segments"])
    assert "uint16" not in _leaf_dtypes(plain.params["segments"])
    assert bits.params["head"].dtype == np.float32 and plain.params["head"].dtype == ml_dtypes.bfloat16
    back = from_cpu_bf16(bits.params, bits.dtype)     # what `jdeep convert` stores: the plain bf16 tree
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(plain.params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bits_give_the_logits_of_plain_bf16(pair):
    """Same weight values, same fp32 head product: the tokens agree and the logits up to fp32 rounding (the converts
    fuse into other products, which sum in another order; measured 2.4e-7 at logits of magnitude 2.2)."""
    bits, plain = pair
    a = jdeep.generate(bits, [PROMPT], max_new_tokens=6, return_logits=True, ignore_eos=True)
    b = jdeep.generate(plain, [PROMPT], max_new_tokens=6, return_logits=True, ignore_eos=True)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logits, b.logits, rtol=0, atol=1e-5 * float(np.abs(b.logits).max()))


def test_no_stacked_weight_is_converted_outside_the_loops(pair):
    """The compiled decode step holds no float32 array of a stacked layer weight's shape (the hoisted upcast; a
    one-layer segment's [1, ...] slice inside its loop is no stack)."""
    bits, plain = pair
    cpu = jax.devices("cpu")[0]          # the program is compiled for XLA:CPU whatever the default backend
    stacked = {tuple(a.shape) for a in jax.tree_util.tree_leaves(plain.params["segments"])   # [R > 1, ...] or experts
               if a.dtype == ml_dtypes.bfloat16 and (a.ndim >= 4 or (a.ndim == 3 and a.shape[0] > 1))}
    assert stacked

    def upcasts(model) -> set[tuple]:
        args = jax.device_put((model.params, model.init_state(1, 64), np.ones((1, 1), np.int32)), cpu)
        text = model.step_fn(all_logits=False).lower(args[0], args[1], args[2], args[2], None).compile().as_text()
        shapes = {tuple(int(d) for d in m.split(",") if d) for m in re.findall(r"= f32\[([\d,]*)\]", text)}
        return shapes & stacked

    assert upcasts(plain), "the check sees XLA:CPU's upcast of plain bf16 stacked weights"
    assert not upcasts(bits)
