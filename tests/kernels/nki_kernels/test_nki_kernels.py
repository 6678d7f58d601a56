"""Each NKI kernel under nki.simulate (the real one, or tests/nki_emulation) on random inputs of the tiny and
the released models' tile patterns equals its jnp twin (kernels/reference.py). Tolerances per kernel:
- float32 outputs: the kernels compute in fp32 like the twins but in another order (per-tile statistics,
  per-block partial sums), so they agree to a few fp32 ulps; the GEMM sums K products in another order than
  XLA's dot, so each is held to the worst-case bound of an fp32 sum of K terms against the exact (float64)
  product, K·2⁻²⁴·Σ|x||w|, and the two to twice that;
- bfloat16 outputs: the same fp32 values rounded once, so at most 1 bf16 ulp apart where the fp32 values sit
  on either side of a rounding boundary, equal elsewhere (asserted: >= 99 % identical); for the GEMM, 1 ulp
  plus the fp32 sums' disagreement (cancellation can make that larger than an ulp of a small result)."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import nki
import numpy as np
import pytest

from jdeep.kernels import reference
from jdeep.kernels.nki import gemm, mhc, norm, swiglu

BF16 = ml_dtypes.bfloat16


def _close_bf16(got: np.ndarray, want: np.ndarray, slack: np.ndarray | float = 0.0) -> None:
    got, want = got.astype(np.float32), want.astype(np.float32)
    ulp = np.abs(want) * 2.0 ** -7 + slack + 1e-30
    assert (np.abs(got - want) <= ulp).all(), np.max(np.abs(got - want) / ulp)
    assert np.mean(got == want) >= 0.99


@pytest.mark.parametrize("T,D,dtype", [(5, 128, np.float32), (130, 4096, np.float32), (130, 4096, BF16),
                                       (3, 7168, BF16)])
def test_rms_norm(T, D, dtype):
    rng = np.random.default_rng(T + D)
    x = (rng.normal(size=(T, D)) * 3).astype(dtype)
    w = (1 + 0.1 * rng.normal(size=D)).astype(np.float32)
    got = nki.simulate(norm.rmsnorm_kernel)(x, w, 1e-6)
    want = np.asarray(reference.rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6))
    assert got.shape == want.shape and got.dtype == want.dtype
    if dtype == np.float32:
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
    else:
        _close_bf16(got, want)


@pytest.mark.parametrize("T,F", [(4, 64), (130, 2048 + 256)])     # tiny; V4-Flash expert width + a partial chunk
def test_swiglu(T, F):
    rng = np.random.default_rng(F)
    g, u = (rng.normal(size=(2, T, F)) * 8).astype(np.float32)     # beyond the clamp (limit 10) at times
    got = nki.simulate(swiglu.swiglu_kernel)(g, u, 10.0)
    want = np.asarray(reference.swiglu(jnp.asarray(g), jnp.asarray(u), 10.0))
    assert (np.abs(g) > 10).any() and got.dtype == want.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)


def _trn2_codes(rng, shape) -> np.ndarray:
    """Random e4m3 codes trn2 reads as finite numbers (exponent field < 15: |w| <= 240)."""
    c = rng.integers(0, 256, size=shape).astype(np.uint8)
    return np.where((c & 0x78) == 0x78, c & 0xF7, c).astype(np.uint8)


@pytest.mark.parametrize("T,N,K,block,dtype", [
    (4, 64, 128, (32, 32), np.float32),          # the tiny checkpoints' block size
    (5, 1024, 4096, (128, 128), BF16),           # V4-Flash decode: a [1024, 4096] projection
    (130, 640, 384, (128, 128), np.float32),     # two token tiles, a partial 512-column tile
    (130, 640, 384, (128, 128), BF16),
])
def test_fp8_linear(T, N, K, block, dtype):
    rng = np.random.default_rng(N + K + T)
    x = rng.normal(size=(T, K)).astype(dtype)
    codes = _trn2_codes(rng, (N, K))
    scale = rng.integers(118, 130, size=(-(-N // block[0]), -(-K // block[1]))).astype(np.uint8)
    got = nki.simulate(gemm.fp8_linear_kernel)(x, codes, scale, block[0], block[1])
    want = np.asarray(reference.fp8_linear(jnp.asarray(x), jnp.asarray(codes), jnp.asarray(scale), block, True))
    assert got.shape == want.shape == (T, N) and got.dtype == want.dtype
    w = np.asarray(reference.fp8_linear(jnp.eye(K, dtype=jnp.float32), jnp.asarray(codes), jnp.asarray(scale),
                                        block, True)).T              # the decoded weights [N, K]
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    gamma = K * 2.0 ** -24 * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T)
    if dtype == np.float32:
        assert (np.abs(got - exact) <= gamma).all() and (np.abs(want - exact) <= gamma).all()
        assert (np.abs(got - want) <= 2 * gamma).all()
    else:
        _close_bf16(got, want, slack=2 * gamma)


@pytest.mark.parametrize("T", [3, 130])                # decode; a full and a partial token tile
def test_hc_split_sinkhorn(T):
    n, eps, iters = 4, 1e-6, 20                       # the released models' hc_mult, hc_eps, hc_sinkhorn_iters
    rng = np.random.default_rng(T)
    mu = (rng.normal(size=(T, (2 + n) * n)) * 2).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, size=3).astype(np.float32)
    base = rng.normal(size=(2 + n) * n).astype(np.float32)
    got = nki.simulate(mhc.hc_sinkhorn_kernel)(mu, scale, base, n, eps, iters)
    want = reference.hc_split_sinkhorn(jnp.asarray(mu), jnp.asarray(scale), jnp.asarray(base), n=n, hc_eps=eps,
                                       sinkhorn_iters=iters)
    for g, w in zip(got, want):
        w = np.asarray(w).reshape(g.shape)
        assert g.dtype == w.dtype == np.float32
        # the kernel multiplies by reciprocals where the twin divides: 1-2 ulps per step, over 20 iterations
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-7)
    comb = got[2].reshape(T, n, n)
    np.testing.assert_allclose(comb.sum(axis=1), 1, atol=1e-4)         # doubly stochastic (columns last)
