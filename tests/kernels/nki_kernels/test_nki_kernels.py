"""Each NKI kernel under nki.simulate (the real one, or tests/nki_emulation), launched at trn2's LNC (two programs
sharing the outputs; one case per kernel also at LNC=1), on random inputs of the tiny and the released models' tile
patterns equals its jnp twin (kernels/reference.py). Tolerances per kernel (u = 2⁻²⁴; a = ACT_REL, the relative
error a Scalar Engine activation may carry, nki_testing.py):
- float32 outputs: the kernels compute in fp32 like the twins but in another order (per-tile statistics,
  per-block partial sums), so they agree to a few fp32 ulps; the GEMM sums K products in another order than
  XLA's dot (its PSUM accumulates in fp32), so each is held to the worst-case bound of an fp32 sum of K terms
  against the exact (float64) product, K·u·Σ|x||w|, and the two to twice that;
- an activation's relative error a enters as follows: rms_norm multiplies every output of a row by one rsqrt, and
  swiglu every output by one silu, so each output carries a relative error a on top of the rounding tolerance
  ρ: (1 + ρ)(1 + a) - 1; the Sinkhorn's gates (sigmoid, then + eps or · 2) carry a on pre and post; its n² exps
  feed the row softmax and 20 Sinkhorn iterations, which may damp or amplify their error: the bound is the
  response of a float64 run of the same iterations to each exp perturbed by ±a alone, summed in absolute value
  over the n² exps (first order in a; a² ≈ 2⁻³² is far below the rounding tolerance). On the test's inputs the
  iterations amplify: that bound is 2.3-5 a relative (median, max), not damped below the exps' own a;
- bfloat16 outputs: the same fp32 values (within the fp32 tolerance above) rounded once, so at most 1 bf16 ulp
  plus that tolerance apart (rounding is monotone: |rd(x) - rd(y)| <= |x - y| + 1 ulp), and >= 99 % identical
  (an fp32 shift of up to a = 2⁻¹⁶ relative crosses a bf16 rounding boundary, 2⁻⁸..2⁻⁷ relative apart, with a
  chance of at most a / 2⁻⁸ ≈ 0.4 % per element); for the GEMM, 1 ulp plus the fp32 sums' disagreement (cancellation can make that larger than
  an ulp of a small result)."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from nki_testing import ACT_REL, run

from jdeep.kernels import codecs, reference
from jdeep.kernels.nki import gemm, mhc, norm, swiglu

BF16 = ml_dtypes.bfloat16


def _grow(rtol: float) -> float:
    """A rounding tolerance rtol with one more activation's relative error ACT_REL on top."""
    return (1 + rtol) * (1 + ACT_REL) - 1


def _close_bf16(got: np.ndarray, want: np.ndarray, slack: np.ndarray | float = 0.0) -> None:
    got, want = got.astype(np.float32), want.astype(np.float32)
    ulp = np.abs(want) * 2.0 ** -7 + slack + 1e-30
    assert (np.abs(got - want) <= ulp).all(), np.max(np.abs(got - want) / ulp)
    assert np.mean(got == want) >= 0.99


@pytest.mark.parametrize("T,D,dtype,lnc", [(5, 128, np.float32, 2), (130, 4096, np.float32, 2),
                                           (130, 4096, BF16, 2), (3, 7168, BF16, 2), (5, 128, np.float32, 1)])
def test_rms_norm(T, D, dtype, lnc):
    rng = np.random.default_rng(T + D)
    x = (rng.normal(size=(T, D)) * 3).astype(dtype)
    w = (1 + 0.1 * rng.normal(size=D)).astype(np.float32)
    got = run(norm.rmsnorm_kernel, x, w, 1e-6, lnc=lnc)
    want = np.asarray(reference.rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6))
    assert got.shape == want.shape and got.dtype == want.dtype
    rtol = _grow(2e-6)                               # a few fp32 ulps of another order, and the rsqrt's error
    if dtype == np.float32:
        np.testing.assert_allclose(got, want, rtol=rtol, atol=0)
    else:
        _close_bf16(got, want, slack=rtol * (1 + 2.0 ** -8) * np.abs(want.astype(np.float32)))


@pytest.mark.parametrize("T,F,lnc", [(4, 64, 2), (130, 2048 + 256, 2), (4, 64, 1)])  # tiny; V4-Flash expert width
def test_swiglu(T, F, lnc):
    rng = np.random.default_rng(F)
    g, u = (rng.normal(size=(2, T, F)) * 8).astype(np.float32)     # beyond the clamp (limit 10) at times
    got = run(swiglu.swiglu_kernel, g, u, 10.0, lnc=lnc)
    want = np.asarray(reference.swiglu(jnp.asarray(g), jnp.asarray(u), 10.0))
    assert (np.abs(g) > 10).any() and got.dtype == want.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=_grow(1e-6), atol=1e-30)


def _trn2_codes(rng, shape) -> np.ndarray:
    """Random e4m3 codes trn2 reads as finite numbers (exponent field < 15: |w| <= 240)."""
    c = rng.integers(0, 256, size=shape).astype(np.uint8)
    return np.where((c & 0x78) == 0x78, c & 0xF7, c).astype(np.uint8)


@pytest.mark.parametrize("T,N,K,block,dtype,lnc", [
    (4, 64, 128, (32, 32), np.float32, 2),       # the tiny checkpoints' block size: one 32-column block per core
    (5, 1024, 4096, (128, 128), BF16, 2),        # V4-Flash decode: a [1024, 4096] projection, a tile per core
    (130, 640, 384, (128, 128), np.float32, 2),  # two token tiles; 3 and 2 n blocks (a partial 512-column tile)
    (130, 640, 384, (128, 128), BF16, 2),
    (4, 64, 128, (32, 32), np.float32, 1),
])
def test_fp8_linear(T, N, K, block, dtype, lnc):
    rng = np.random.default_rng(N + K + T)
    x = rng.normal(size=(T, K)).astype(dtype)
    codes = _trn2_codes(rng, (N, K))
    scale = rng.integers(118, 130, size=(-(-N // block[0]), -(-K // block[1]))).astype(np.uint8)
    got = run(gemm.fp8_linear_kernel, x, codes, scale, block[0], block[1], lnc=lnc)
    want = np.asarray(reference.fp8_linear(jnp.asarray(x), jnp.asarray(codes), jnp.asarray(scale), block, True))
    assert got.shape == want.shape == (T, N) and got.dtype == want.dtype
    # the decoded weights [N, K] (exact in fp32), with the twin's codecs (on numpy)
    s = np.repeat(np.repeat(codecs.ue8m0_decode(np, scale), block[0], axis=0), block[1], axis=1)[:N, :K]
    w = codecs.e4m3_decode(np, codes, trn2=True) * s
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    gamma = K * 2.0 ** -24 * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T)
    if dtype == np.float32:
        assert (np.abs(got - exact) <= gamma).all() and (np.abs(want - exact) <= gamma).all()
        assert (np.abs(got - want) <= 2 * gamma).all()
    else:
        _close_bf16(got, want, slack=2 * gamma)


def _sinkhorn64(logits: np.ndarray, eps: float, iters: int) -> np.ndarray:
    """The twin's comb in float64 from the softmax's exps: logits [..., n, n] are exp(c - max) already."""
    c = logits / logits.sum(axis=-1, keepdims=True) + eps
    c = c / (c.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(axis=-1, keepdims=True) + eps)
        c = c / (c.sum(axis=-2, keepdims=True) + eps)
    return c


def _comb_exp_bound(c: np.ndarray, eps: float, iters: int) -> np.ndarray:
    """|Δcomb| for the n² exps of each token each off by up to ACT_REL relative: Σ over the exps of the float64
    response to that exp alone at ±ACT_REL (the larger of the two), first order in ACT_REL. c [T, n, n]."""
    e = np.exp(c - c.max(axis=-1, keepdims=True))
    base = _sinkhorn64(e, eps, iters)
    bound = np.zeros_like(base)
    n = c.shape[-1]
    for i in range(n):
        for j in range(n):
            worst = np.zeros_like(base)
            for sign in (1, -1):
                p = e.copy()
                p[:, i, j] *= 1 + sign * ACT_REL
                worst = np.maximum(worst, np.abs(_sinkhorn64(p, eps, iters) - base))
            bound += worst
    return bound


@pytest.mark.parametrize("T,lnc", [(3, 2), (130, 2), (3, 1)])     # decode; a full and a partial token tile
def test_hc_split_sinkhorn(T, lnc):
    """Against the twin: the kernel multiplies by reciprocals where the twin divides (1-2 ulps per step over 20
    iterations: rtol 2e-5, atol 1e-7), plus the activations' error (module docstring): a relative on pre and post,
    and on comb the float64 response to the exps' error."""
    n, eps, iters = 4, 1e-6, 20                       # the released models' hc_mult, hc_eps, hc_sinkhorn_iters
    rng = np.random.default_rng(T)
    mu = (rng.normal(size=(T, (2 + n) * n)) * 2).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, size=3).astype(np.float32)
    base = rng.normal(size=(2 + n) * n).astype(np.float32)
    got = run(mhc.hc_sinkhorn_kernel, mu, scale, base, n, eps, iters, lnc=lnc)
    want = reference.hc_split_sinkhorn(jnp.asarray(mu), jnp.asarray(scale), jnp.asarray(base), n=n, hc_eps=eps,
                                       sinkhorn_iters=iters)
    logits = (mu[:, 2 * n:] * scale[2] + base[2 * n:]).astype(np.float64).reshape(T, n, n)
    act = [ACT_REL * np.abs(np.asarray(want[0])), ACT_REL * np.abs(np.asarray(want[1])),
           _comb_exp_bound(logits, eps, iters).reshape(T, n * n)]
    for g, w, a in zip(got, want, act):
        w = np.asarray(w).reshape(g.shape)
        assert g.dtype == w.dtype == np.float32
        np.testing.assert_array_less(np.abs(g - w), 2e-5 * np.abs(w) + 1e-7 + a)
    comb = got[2].reshape(T, n, n)
    np.testing.assert_allclose(comb.sum(axis=1), 1, atol=1e-4)         # doubly stochastic (columns last)
