"""RMSNorm and RoPE (model-spec.md §3.1, §3.2) against float64 NumPy oracles written from the spec.

Tolerances: inputs are float32 with O(1) magnitudes; jdeep computes in float32, the oracles in
float64. We allow rtol = 1e-5 and atol = 1e-5 x (largest magnitude of the oracle) unless stated.
RoPE angles are formed in float32 exactly as the spec says ("fp32 math": angle = fp32(t) * fp32(f_i));
the oracle does that product in float32 too and everything after it in float64.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jdeep.config import RopeConfig, YarnConfig
from jdeep.layers.norm import rms, rms_norm
from jdeep.layers.rope import apply_rope, inv_freq


def close(actual, expected, rtol=1e-5, atol=1e-5):
    expected = np.asarray(expected, np.float64)
    scale = max(1.0, float(np.max(np.abs(expected)))) if expected.size else 1.0
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol * scale)


# ----------------------------------------------------------------------------------------- oracles
def rms_np(x, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def inv_freq_np(theta, r, yarn=None):
    """f_i = theta^(-2i/r); YaRN ramp per §3.2 (yarn = (factor, L0, beta_fast, beta_slow))."""
    i = np.arange(r // 2, dtype=np.float64)
    f = theta ** (-2.0 * i / r)
    if yarn is None:
        return f
    factor, L0, bf, bs = yarn

    def cd(k):
        return r * math.log(L0 / (2 * math.pi * k)) / (2 * math.log(theta))

    low = max(math.floor(cd(bf)), 0)
    high = min(math.ceil(cd(bs)), r - 1)
    width = 0.001 if high == low else high - low
    ramp = np.clip((i - low) / width, 0.0, 1.0)
    return (f / factor) * ramp + f * (1.0 - ramp)


def rope_np(x, pos, f, inverse=False):
    """Interleaved pairs on the last r = 2*len(f) dims; pos broadcastable to x.shape[:-1]."""
    x = np.asarray(x, np.float64).copy()
    f32 = np.asarray(f, np.float32)
    r = 2 * f32.shape[0]
    D = x.shape[-1]
    ang = (np.asarray(pos).astype(np.float32)[..., None] * f32).astype(np.float64)  # fp32 angle
    if inverse:
        ang = -ang
    a = x[..., D - r::2].copy()
    b = x[..., D - r + 1::2].copy()
    x[..., D - r::2] = a * np.cos(ang) - b * np.sin(ang)
    x[..., D - r + 1::2] = a * np.sin(ang) + b * np.cos(ang)
    return x


# ------------------------------------------------------------------------------------------- norm
@pytest.mark.parametrize("eps", [1e-6, 1e-20, 0.5])
def test_rms_matches_oracle(eps):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, 64)).astype(np.float32) * rng.uniform(0.01, 10, size=(3, 5, 1)).astype(np.float32)
    y = rms(jnp.asarray(x), eps)
    assert y.dtype == jnp.float32 and y.shape == x.shape
    close(y, rms_np(x, eps))


def test_rms_eps_inside_the_root():
    # mean(x^2) ~ 1e-8 << eps = 1e-4: the result is ~ x / sqrt(eps), not x / (rms + eps) or x / rms.
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(4, 32)) * 1e-4).astype(np.float32)
    y = np.asarray(rms(jnp.asarray(x), 1e-4))
    close(y, rms_np(x, 1e-4))
    assert np.max(np.abs(y)) < 0.1          # a plain x/rms(x) would be O(1)


def test_rms_norm_weight_and_dtype():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 7, 48)).astype(np.float32)
    w = rng.normal(size=(48,)).astype(np.float32)
    y = rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6)
    assert y.dtype == jnp.float32
    close(y, w.astype(np.float64) * rms_np(x, 1e-6))

    # bf16 activations: statistics in fp32, one rounding back to bf16 at the end.
    xb = jnp.asarray(x, jnp.bfloat16)
    yb = rms_norm(xb, jnp.asarray(w), 1e-6)
    assert yb.dtype == jnp.bfloat16
    expect = w.astype(np.float64) * rms_np(np.asarray(xb.astype(jnp.float32)), 1e-6)
    expect_bf16 = np.asarray(jnp.asarray(expect.astype(np.float32)).astype(jnp.bfloat16).astype(jnp.float32))
    # exactly one bf16 rounding of the fp32 product: at most 1 bf16 ulp apart from the rounded oracle
    diff = np.abs(np.asarray(yb.astype(jnp.float32)) - expect_bf16)
    assert np.all(diff <= 2.0 ** -7 * np.abs(expect_bf16) + 1e-30)


# ------------------------------------------------------------------------------------- frequencies
def test_inv_freq_plain():
    f = inv_freq(RopeConfig(theta=10000.0), 64)
    assert f.shape == (32,) and f.dtype == np.float32
    close(f, 10000.0 ** (-2.0 * np.arange(32) / 64), rtol=1e-6, atol=0)
    assert f[0] == 1.0


def test_inv_freq_yarn_v4_compress_table():
    """θ = 160000, L0 = 65536, r = 64, factor 16, β 32/1: low = 15, high = 25 (spec §3.2)."""
    theta, r, factor = 160000.0, 64, 16.0
    cd = lambda k: r * math.log(65536 / (2 * math.pi * k)) / (2 * math.log(theta))  # noqa: E731
    assert math.floor(cd(32)) == 15 and math.ceil(cd(1)) == 25

    f = inv_freq(RopeConfig(theta, YarnConfig(factor=factor, original_seq_len=65536, beta_fast=32, beta_slow=1)), r)
    plain = theta ** (-2.0 * np.arange(32) / r)
    assert f.shape == (32,) and f.dtype == np.float32
    close(f[:16], plain[:16], rtol=1e-6, atol=0)                 # i <= low: unchanged
    close(f[25:], plain[25:] / factor, rtol=1e-6, atol=0)        # i >= high: divided by the factor
    i = np.arange(16, 25)
    ramp = (i - 15) / 10.0
    close(f[16:25], plain[16:25] / factor * ramp + plain[16:25] * (1 - ramp), rtol=1e-6, atol=0)
    assert np.all(np.diff(f.astype(np.float64)) < 0)             # still strictly decreasing
    close(f, inv_freq_np(theta, r, (factor, 65536, 32, 1)), rtol=1e-6, atol=0)


def _beta_for_cd(cd_value, theta, r, L0):
    """The beta k with cd(k) = cd_value."""
    return L0 / (2 * math.pi) * math.exp(-cd_value * 2 * math.log(theta) / r)


@pytest.mark.parametrize("theta,r,yarn", [
    (10000.0, 64, (40.0, 4096, 32, 1)),
    (160000.0, 32, (4.0, 65536, 32, 1)),
    (10000.0, 16, (8.0, 10, 32, 1)),              # cd(beta_fast) < 0: low clamps to 0
    (10000.0, 16, (8.0, 10 ** 30, 32, 1)),        # cd(beta_slow) > r-1: high clamps to r-1
    (160000.0, 64, (16.0, 65536, "zero-width", None)),
])
def test_inv_freq_yarn_general(theta, r, yarn):
    factor, L0, bf, bs = yarn
    if bf == "zero-width":                        # floor(cd(bf)) == ceil(cd(bs)) == 15 -> width 0.001
        bf, bs = _beta_for_cd(15.5, theta, r, L0), _beta_for_cd(14.5, theta, r, L0)
    f = inv_freq(RopeConfig(theta, YarnConfig(factor=factor, original_seq_len=L0, beta_fast=bf, beta_slow=bs)), r)
    expect = inv_freq_np(theta, r, (factor, L0, bf, bs))
    close(f, expect, rtol=1e-6, atol=0)
    if yarn[2] == "zero-width":
        plain = inv_freq_np(theta, r)
        close(f[:16], plain[:16], rtol=1e-6, atol=0)
        close(f[16:], plain[16:] / factor, rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------------- RoPE
def test_apply_rope_heads_interleaved_tail():
    rng = np.random.default_rng(3)
    B, S, H, D, r = 2, 5, 3, 24, 8
    f = inv_freq_np(10000.0, r).astype(np.float32)
    x = rng.normal(size=(B, S, H, D)).astype(np.float32)
    pos = rng.integers(0, 3000, size=(B, S)).astype(np.int32)
    y = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos)[..., None], f))
    assert y.shape == x.shape and y.dtype == np.float32
    np.testing.assert_array_equal(y[..., : D - r], x[..., : D - r])       # head dims untouched, bitwise
    close(y, rope_np(x, pos[..., None], f))
    # per-pair norms are preserved (a rotation), and it is not rotate-half
    n_in = x[..., D - r::2] ** 2 + x[..., D - r + 1::2] ** 2
    n_out = y[..., D - r::2] ** 2 + y[..., D - r + 1::2] ** 2
    close(n_out, n_in)
    # positions broadcast over heads: same as rotating each head separately
    for h in range(H):
        yh = np.asarray(apply_rope(jnp.asarray(x[:, :, h]), jnp.asarray(pos), f))
        np.testing.assert_allclose(y[:, :, h], yh, rtol=0, atol=1e-6)


def test_apply_rope_explicit_pair_rotation():
    # one vector, one pair non-zero: (a, b) -> (a cos φ - b sin φ, a sin φ + b cos φ) in dims (D-r+2i, D-r+2i+1)
    D, r, t = 16, 8, 7
    f = np.array([1.0, 0.5, 0.25, 0.125], np.float32)
    for i in range(4):
        x = np.zeros((1, D), np.float32)
        x[0, D - r + 2 * i], x[0, D - r + 2 * i + 1] = 0.6, -0.8
        y = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray([t], jnp.int32), f))[0]
        phi = t * float(f[i])
        expect = np.zeros(D)
        expect[D - r + 2 * i] = 0.6 * math.cos(phi) + 0.8 * math.sin(phi)
        expect[D - r + 2 * i + 1] = 0.6 * math.sin(phi) - 0.8 * math.cos(phi)
        close(y, expect)


def test_apply_rope_inverse_and_relative():
    rng = np.random.default_rng(4)
    B, S, D, r = 3, 6, 32, 16
    f = inv_freq_np(160000.0, r, (16.0, 65536, 32, 1)).astype(np.float32)
    x = rng.normal(size=(B, S, D)).astype(np.float32)
    pos = rng.integers(0, 1 << 20, size=(B, S)).astype(np.int32)       # up to max_position_embeddings
    xj, pj = jnp.asarray(x), jnp.asarray(pos)
    fwd = apply_rope(xj, pj, f)
    close(fwd, rope_np(x, pos, f))
    inv = apply_rope(xj, pj, f, inverse=True)
    close(inv, rope_np(x, pos, f, inverse=True))
    close(apply_rope(fwd, pj, f, inverse=True), x)                     # R(-t) R(t) = I
    close(apply_rope(inv, pj, f), x)
    # position 0 is the identity
    np.testing.assert_allclose(np.asarray(apply_rope(xj, jnp.zeros_like(pj), f)), x, rtol=0, atol=0)
    # q.k after rotation depends only on the position difference (tail dims)
    q, k = x[0, 0], x[0, 1]
    dots = []
    for t in (5, 105, 1005):
        qr = rope_np(q[None], np.array([t + 3]), f)[0]
        kr = rope_np(k[None], np.array([t]), f)[0]
        dots.append(qr @ kr)
        qj = np.asarray(apply_rope(jnp.asarray(q[None]), jnp.asarray([t + 3]), f))[0].astype(np.float64)
        kj = np.asarray(apply_rope(jnp.asarray(k[None]), jnp.asarray([t]), f))[0].astype(np.float64)
        close(qj @ kj, qr @ kr, atol=1e-4)
    close(dots, [dots[0]] * 3, atol=1e-4)


def test_apply_rope_bf16_rounds_tail_only():
    rng = np.random.default_rng(5)
    D, r = 16, 8
    f = inv_freq_np(10000.0, r).astype(np.float32)
    x = jnp.asarray(rng.normal(size=(4, D)), jnp.bfloat16)
    pos = jnp.arange(4, dtype=jnp.int32) * 11
    y = apply_rope(x, pos, f)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y[:, : D - r]), np.asarray(x[:, : D - r]))
    expect = rope_np(np.asarray(x.astype(jnp.float32)), np.asarray(pos), f)
    np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), expect, rtol=2 ** -8, atol=1e-6)
