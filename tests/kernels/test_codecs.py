"""Exhaustive checks of the uint8 codecs against float64 oracles (all 256 / 16 codes), in numpy and
in jax.numpy (the graph path), plus the exact power-of-two helpers."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jdeep.kernels import codecs

XPS = [pytest.param(np, id="numpy"), pytest.param(jnp, id="jnp")]


def _e4m3_oracle(code: int, trn2: bool) -> float:
    """float64 value of an 8-bit e4m3 code from its fields (bias 7)."""
    s, e, m = code >> 7, (code >> 3) & 15, code & 7
    if e == 15 and (trn2 or m == 7):
        return float("nan") if (m != 0 or not trn2) else (-1) ** s * float("inf")
    mag = m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return (-1) ** s * mag


def _grid(values: np.ndarray) -> np.ndarray:
    v = np.unique(values[np.isfinite(values)])
    return v


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("trn2", [False, True])
def test_e4m3_decode_all_codes(xp, trn2):
    codes = np.arange(256)
    got = np.asarray(codecs.e4m3_decode(xp, xp.asarray(codes), trn2=trn2), np.float64)
    want = np.array([_e4m3_oracle(c, trn2) for c in codes])
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(got[finite], want[finite])
    if not trn2:  # also agrees with ml_dtypes' float8_e4m3fn
        ref = codes.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        np.testing.assert_array_equal(got[finite], ref[finite])
    assert np.nanmax(np.abs(got[np.isfinite(got)])) == (240.0 if trn2 else 448.0)


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("fp8_max", [448.0, 240.0])
def test_e4m3_encode_round_trip_every_code(xp, fp8_max):
    codes = np.arange(256)
    vals = np.array([_e4m3_oracle(c, False) for c in codes])
    keep = np.isfinite(vals) & (np.abs(vals) <= fp8_max) & (codes != 0x80)   # -0 encodes as +0
    got = np.asarray(codecs.e4m3_encode(xp, xp.asarray(vals[keep].astype(np.float32)), fp8_max))
    np.testing.assert_array_equal(got, codes[keep])


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("fp8_max", [448.0, 240.0])
def test_e4m3_round_nearest_even_and_saturate(xp, fp8_max):
    grid = _grid(np.array([_e4m3_oracle(c, False) for c in range(256)]))
    grid = grid[np.abs(grid) <= fp8_max]
    mids = (grid[1:] + grid[:-1]) / 2                                  # exact ties
    rng = np.random.default_rng(0)
    x = np.concatenate([grid, mids, rng.uniform(-600, 600, 4000), rng.normal(0, 0.01, 4000),
                        [fp8_max * 1.01, -1e6, 1e-12]]).astype(np.float32)
    got = np.asarray(codecs.e4m3_round(xp, xp.asarray(x), fp8_max), np.float64)
    xc = np.clip(x.astype(np.float64), -fp8_max, fp8_max)
    idx = np.searchsorted(grid, xc)
    lo, hi = grid[np.clip(idx - 1, 0, len(grid) - 1)], grid[np.clip(idx, 0, len(grid) - 1)]
    dlo, dhi = np.abs(xc - lo), np.abs(hi - xc)
    # ties go to the neighbour with the even code
    code_of = {v: c for c, v in ((c, _e4m3_oracle(c, False)) for c in range(256)) if np.isfinite(v)}
    even_hi = np.array([code_of.get(h, 0) % 2 == 0 for h in hi])
    want = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(even_hi, hi, lo)))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("xp", XPS)
def test_e2m1_all_codes_and_ties(xp):
    codes = np.arange(16)
    vals = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float64)
    want = np.concatenate([vals, -vals])
    np.testing.assert_array_equal(np.asarray(codecs.e2m1_decode(xp, xp.asarray(codes))), want)
    enc = np.asarray(codecs.e2m1_encode(xp, xp.asarray(want[codes != 8].astype(np.float32))))
    np.testing.assert_array_equal(enc, codes[codes != 8])
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -2.5, -5.0], np.float32)
    np.testing.assert_array_equal(np.asarray(codecs.e2m1_round(xp, xp.asarray(ties))),
                                  [0, 1, 1, 2, 2, 4, 4, 6, -2, -4])


@pytest.mark.parametrize("xp", XPS)
def test_e2m1_packing_low_nibble_first(xp):
    codes = np.arange(32) % 16
    packed = np.asarray(codecs.pack_e2m1(xp, xp.asarray(codes)))
    assert packed.shape == (16,)
    np.testing.assert_array_equal(packed & 15, codes[0::2])
    np.testing.assert_array_equal(packed >> 4, codes[1::2])
    np.testing.assert_array_equal(np.asarray(codecs.unpack_e2m1(xp, xp.asarray(packed.astype(np.uint8)))), codes)
    # int8 storage (how the checkpoint holds them) unpacks the same
    np.testing.assert_array_equal(np.asarray(codecs.unpack_e2m1(xp, xp.asarray(packed.astype(np.uint8).view(np.int8)))), codes)


@pytest.mark.parametrize("xp", XPS)
def test_ue8m0_all_codes(xp):
    b = np.arange(255)
    got = np.asarray(codecs.ue8m0_decode(xp, xp.asarray(b)), np.float64)
    want = 2.0 ** (b.astype(np.float64) - 127)
    np.testing.assert_array_equal(got[1:], want[1:])      # b = 0 is 2^-127, a float32 subnormal
    assert np.isnan(np.asarray(codecs.ue8m0_decode(xp, xp.asarray([255])))[0])
    back = np.asarray(codecs.ue8m0_encode(xp, xp.asarray(want[1:].astype(np.float32))))
    np.testing.assert_array_equal(back, b[1:])


@pytest.mark.parametrize("xp", XPS)
def test_exact_log2_helpers(xp):
    e = np.arange(-126, 128)
    p = np.asarray(codecs.pow2(xp, xp.asarray(e)), np.float64)
    np.testing.assert_array_equal(p, 2.0 ** e)
    sub = 2.0 ** np.arange(-149, -126)
    bits = np.random.default_rng(0).integers(1, 0x7F800000, 20000, dtype=np.uint32)   # every positive finite
    v = np.concatenate([2.0 ** e, 2.0 ** e * 1.0000001, 2.0 ** e * 0.9999999, sub, sub * 3, sub * 1.5,
                        [3.0, 1000.0, 1e-30, 3.4028235e38], bits.view(np.float32)])
    tiny = 0 if xp is np else np.finfo(np.float32).tiny       # XLA:CPU flushes subnormals to zero
    v = v[(v >= tiny) & (v > 0) & (v < 3.5e38)].astype(np.float32)
    f = np.asarray(codecs.floor_log2(xp, xp.asarray(v)))
    c = np.asarray(codecs.ceil_log2(xp, xp.asarray(v)))
    v64 = v.astype(np.float64)
    np.testing.assert_array_equal(f, np.floor(np.log2(v64)).astype(int))
    np.testing.assert_array_equal(c, np.ceil(np.log2(v64)).astype(int))


def test_graph_decode_has_no_float_bitcast():
    import jax

    text = jax.jit(lambda c: codecs.e4m3_decode(jnp, c)).lower(jnp.zeros((4,), jnp.uint8)).as_text()
    text += jax.jit(lambda x: codecs.e4m3_encode(jnp, x)).lower(jnp.zeros((4,), jnp.float32)).as_text()
    assert "bitcast_convert" not in text and "f8E4M3" not in text
