"""Quantized weights kept as codes or decoded at load (model/weights.py): the same logits bit for bit, the bytes
each form holds, the option's checks and the platforms' defaults."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jdeep
from jdeep.kernels import weight_format
from jdeep.kernels.linear import is_quantized_leaf
from jdeep.model.weights import is_decoded_leaf, resident_bytes, weight_bytes, weight_leaves
from jdeep.param_spec import abstract_params

from conftest import golden_path

PROMPT = [0, 5, 9, 17, 33, 65, 12, 7, 3, 250, 100]


@pytest.fixture(scope="module")
def both():
    folder = golden_path("v41-tiny-q")     # fp8 linears, fp4 experts, Engram, DeepSeek's numerics
    return {w: jdeep.load(folder, weights=w) for w in ("codes", "decoded")}


def test_decoded_weights_give_the_logits_of_codes_bit_for_bit(both):
    codes, decoded = both["codes"], both["decoded"]
    assert codes.numerics == decoded.numerics and decoded.numerics.quantize_activations
    quantized = [w for w in weight_leaves(codes.params) if is_quantized_leaf(w)]
    values = [w for w in weight_leaves(decoded.params) if is_decoded_leaf(w)]
    assert len(quantized) == len(values) > 0 and not any(map(is_quantized_leaf, weight_leaves(decoded.params)))
    assert all(v["decoded"].dtype == np.float32 for v in values)
    # the same products on both sides: the codes' fp8 GEMM is XLA's dot, so the decoded weights' too (the native
    # CPU product of few rows sums in another order; tests/kernels/test_cpu_rows_gemm.py holds it to its oracle)
    decoded = dataclasses.replace(decoded, numerics=decoded.numerics.portable())
    codes = dataclasses.replace(codes, numerics=codes.numerics.portable())
    np.testing.assert_array_equal(jdeep.forward(decoded, PROMPT), jdeep.forward(codes, PROMPT))


def test_resident_bytes_of_each_form(both):
    codes, decoded = both["codes"], both["decoded"]
    tree = abstract_params(codes.config, codes.plan, np.float32)
    held_codes, held_decoded = weight_bytes(codes.params), weight_bytes(decoded.params)
    assert held_codes["decoded"] == 0 and held_decoded["codes"] == 0
    assert held_codes["float"] == held_decoded["float"]
    assert resident_bytes(tree, "codes", np.float32) == sum(held_codes.values())
    assert resident_bytes(tree, "decoded", np.float32) == sum(held_decoded.values())
    # per weight: fp8 1 byte -> 4 (x4), fp4 1/2 byte -> 4 (x8); the scales are dropped
    assert 4 * 0.9 * held_codes["codes"] < held_decoded["decoded"] < 8 * held_codes["codes"]


def test_the_option_is_checked():
    with pytest.raises(ValueError, match="weights must be one of 'codes', 'decoded'"):
        jdeep.load(golden_path("v4-tiny-q"), weights="fp8")


def test_platform_defaults():
    assert weight_format("neuron") == "codes"            # the NKI GEMMs read codes
    assert weight_format("cpu") == weight_format("gpu") == "decoded"
