"""mHC (model-spec.md §4.2, §4.6) against float64 NumPy oracles written from the spec.

Tolerances: float32 inputs of O(1) magnitude, fp32 compute in jdeep, float64 oracle:
rtol = 1e-5, atol = 1e-5 x max|oracle| (2e-5 for the 20-iteration Sinkhorn matrix).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jdeep.layers.mhc import hc_collapse, hc_expand, hc_head_collapse, hc_mixes


def close(actual, expected, rtol=1e-5, atol=1e-5):
    expected = np.asarray(expected, np.float64)
    scale = max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol * scale)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


# ----------------------------------------------------------------------------------------- oracles
def mixes_np(X, fn, base, scale, norm_eps, hc_eps, iters):
    """Spec §4.2, token by token in float64, written with explicit loops."""
    X = np.asarray(X, np.float64)
    fn, base, scale = (np.asarray(a, np.float64) for a in (fn, base, scale))
    lead, (n, d) = X.shape[:-2], X.shape[-2:]
    flat = X.reshape(-1, n * d)
    pres, posts, combs = [], [], []
    for xb in flat:
        mu = (fn @ xb) / np.sqrt(np.mean(xb * xb) + norm_eps)
        pre = sigmoid(scale[0] * mu[:n] + base[:n]) + hc_eps
        post = 2.0 * sigmoid(scale[1] * mu[n:2 * n] + base[n:2 * n])
        C0 = np.empty((n, n))
        for j in range(n):
            for k in range(n):
                C0[j, k] = scale[2] * mu[2 * n + j * n + k] + base[2 * n + j * n + k]
        C = np.exp(C0 - C0.max(axis=1, keepdims=True))
        C = C / C.sum(axis=1, keepdims=True) + hc_eps          # softmax over k of each row, + eps
        C = C / (C.sum(axis=0, keepdims=True) + hc_eps)        # column normalisation
        for _ in range(iters - 1):
            C = C / (C.sum(axis=1, keepdims=True) + hc_eps)    # rows
            C = C / (C.sum(axis=0, keepdims=True) + hc_eps)    # columns (last op)
        pres.append(pre), posts.append(post), combs.append(C)
    return (np.array(pres).reshape(lead + (n,)), np.array(posts).reshape(lead + (n,)),
            np.array(combs).reshape(lead + (n, n)))


def collapse_np(X, pre):
    X = np.asarray(X, np.float64)
    return np.einsum("...i,...id->...d", np.asarray(pre, np.float64), X)


def expand_np(y, post, C, X):
    X, C = np.asarray(X, np.float64), np.asarray(C, np.float64)
    n = X.shape[-2]
    out = np.empty_like(X)
    for k in range(n):
        acc = np.asarray(post, np.float64)[..., k, None] * np.asarray(y, np.float64)
        for j in range(n):
            acc = acc + C[..., j, k, None] * X[..., j, :]
        out[..., k, :] = acc
    return out


def _params(rng, n, d, mag=1.0):
    fn = (rng.normal(size=((2 + n) * n, n * d)) * mag / np.sqrt(n * d)).astype(np.float32)
    base = rng.normal(size=((2 + n) * n,)).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, size=(3,)).astype(np.float32)
    return fn, base, scale


# ------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("hc_eps,iters,mag", [(1e-6, 20, 1.0), (1e-6, 20, 8.0), (0.05, 20, 3.0),
                                              (0.05, 1, 3.0), (1e-3, 3, 5.0)])
def test_hc_mixes_matches_oracle(hc_eps, iters, mag):
    rng = np.random.default_rng(10)
    B, S, n, d = 2, 3, 4, 16
    X = (rng.normal(size=(B, S, n, d)) * rng.uniform(0.1, 5.0, size=(B, S, 1, 1))).astype(np.float32)
    fn, base, scale = _params(rng, n, d, mag)
    pre, post, comb = hc_mixes(jnp.asarray(X), jnp.asarray(fn), jnp.asarray(base), jnp.asarray(scale),
                               norm_eps=1e-6, hc_eps=hc_eps, sinkhorn_iters=iters)
    assert pre.shape == (B, S, n) and post.shape == (B, S, n) and comb.shape == (B, S, n, n)
    assert pre.dtype == post.dtype == comb.dtype == jnp.float32
    e_pre, e_post, e_comb = mixes_np(X, fn, base, scale, 1e-6, hc_eps, iters)
    close(pre, e_pre)
    close(post, e_post)
    close(comb, e_comb, rtol=2e-5, atol=2e-5)
    # the last Sinkhorn step is a column normalisation: column sums are s/(s+eps) <= 1, and ~1 for tiny eps
    colsum = np.asarray(comb, np.float64).sum(axis=-2)
    assert np.all(colsum <= 1 + 1e-5)
    if hc_eps == 1e-6 and iters == 20:
        close(colsum, np.ones_like(colsum), rtol=0, atol=1e-4)
    assert np.all(np.asarray(pre) >= hc_eps * (1 - 1e-3)) and np.all(np.asarray(pre) < 1 + hc_eps + 1e-6)
    assert np.all(np.asarray(post) > 0) and np.all(np.asarray(post) < 2)


def test_hc_mixes_order_and_layout_are_observable():
    """Sanity of the oracle's power: row-last Sinkhorn, the transposed C0 layout or an unscaled
    μ would give clearly different results, and jdeep agrees with the spec variant."""
    rng = np.random.default_rng(11)
    n, d = 4, 8
    X = rng.normal(size=(5, n, d)).astype(np.float32)
    fn, base, scale = _params(rng, n, d, 6.0)
    _, _, comb = hc_mixes(jnp.asarray(X), jnp.asarray(fn), jnp.asarray(base), jnp.asarray(scale),
                          norm_eps=1e-6, hc_eps=0.05, sinkhorn_iters=2)
    comb = np.asarray(comb, np.float64)
    _, _, good = mixes_np(X, fn, base, scale, 1e-6, 0.05, 2)
    close(comb, good)
    # transposed layout of C0 (C0[j,k] = element 2n + k*n + j)
    perm = np.arange((2 + n) * n)
    perm[2 * n:] = (2 * n + np.arange(n * n).reshape(n, n).T.reshape(-1))
    _, _, transposed = mixes_np(X, fn[perm], base[perm], scale, 1e-6, 0.05, 2)
    assert np.max(np.abs(comb - transposed)) > 1e-2
    # one extra row normalisation at the end
    wrong = good / (good.sum(axis=-1, keepdims=True) + 0.05)
    assert np.max(np.abs(comb - wrong)) > 1e-2


def test_hc_mixes_scale_invariance_of_mu():
    # μ = (φ x̄) · rsqrt(mean x̄² + eps): scaling X by c leaves the mixes unchanged (eps negligible)
    rng = np.random.default_rng(12)
    n, d = 4, 16
    X = rng.normal(size=(3, n, d)).astype(np.float32)
    fn, base, scale = _params(rng, n, d, 3.0)
    args = (jnp.asarray(fn), jnp.asarray(base), jnp.asarray(scale))
    kw = dict(norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
    a = hc_mixes(jnp.asarray(X), *args, **kw)
    b = hc_mixes(jnp.asarray(X * 37.0), *args, **kw)
    for u, v in zip(a, b):
        close(u, v, atol=3e-5)


def test_hc_collapse():
    rng = np.random.default_rng(13)
    X = rng.normal(size=(2, 3, 4, 16)).astype(np.float32)
    pre = rng.uniform(0, 1, size=(2, 3, 4)).astype(np.float32)
    y = hc_collapse(jnp.asarray(X), jnp.asarray(pre))
    assert y.shape == (2, 3, 16) and y.dtype == jnp.float32
    close(y, collapse_np(X, pre))
    # bf16 streams: fp32 accumulation, one rounding to bf16
    Xb = jnp.asarray(X, jnp.bfloat16)
    yb = hc_collapse(Xb, jnp.asarray(pre))
    assert yb.dtype == jnp.bfloat16
    expect = collapse_np(np.asarray(Xb.astype(jnp.float32)), pre)
    np.testing.assert_allclose(np.asarray(yb.astype(jnp.float32)), expect, rtol=2 ** -8, atol=1e-6)


def test_hc_expand_uses_comb_transposed():
    rng = np.random.default_rng(14)
    B, S, n, d = 2, 3, 4, 16
    X = rng.normal(size=(B, S, n, d)).astype(np.float32)
    y = rng.normal(size=(B, S, d)).astype(np.float32)
    post = rng.uniform(0, 2, size=(B, S, n)).astype(np.float32)
    C = rng.uniform(0, 1, size=(B, S, n, n)).astype(np.float32)           # not symmetric
    out = hc_expand(jnp.asarray(y), jnp.asarray(post), jnp.asarray(C), jnp.asarray(X))
    assert out.shape == X.shape and out.dtype == jnp.float32
    expect = expand_np(y, post, C, X)
    close(out, expect)
    wrong = expand_np(y, post, np.swapaxes(C, -1, -2), X)                 # C X instead of Cᵀ X
    assert np.max(np.abs(np.asarray(out) - wrong)) > 1e-2
    # a one-hot C moves stream j into slot k
    Cp = np.zeros((n, n), np.float32)
    Cp[2, 0] = Cp[0, 1] = Cp[3, 2] = Cp[1, 3] = 1.0
    o = np.asarray(hc_expand(jnp.zeros((d,)), jnp.zeros((n,)), jnp.asarray(Cp), jnp.asarray(X[0, 0])))
    np.testing.assert_array_equal(o, X[0, 0][[2, 0, 3, 1]])
    # bf16 stream
    ob = hc_expand(jnp.asarray(y, jnp.bfloat16), jnp.asarray(post), jnp.asarray(C), jnp.asarray(X, jnp.bfloat16))
    assert ob.dtype == jnp.bfloat16


def test_hc_head_collapse():
    rng = np.random.default_rng(15)
    B, S, n, d = 2, 3, 4, 16
    X = rng.normal(size=(B, S, n, d)).astype(np.float32) * 3
    fn = (rng.normal(size=(n, n * d)) / 4).astype(np.float32)
    base = rng.normal(size=(n,)).astype(np.float32)
    scale = np.array([1.7], np.float32)
    hc_eps, norm_eps = 1e-3, 1e-6
    out = hc_head_collapse(jnp.asarray(X), jnp.asarray(fn), jnp.asarray(base), jnp.asarray(scale),
                           norm_eps=norm_eps, hc_eps=hc_eps)
    assert out.shape == (B, S, d)
    X64 = X.astype(np.float64)
    flat = X64.reshape(B, S, n * d)
    mu = np.einsum("kf,bsf->bsk", fn.astype(np.float64), flat) / np.sqrt(np.mean(flat ** 2, -1, keepdims=True) + norm_eps)
    pre = sigmoid(mu * 1.7 + base) + hc_eps
    close(out, collapse_np(X64, pre))
