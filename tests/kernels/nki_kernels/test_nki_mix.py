"""The compressor's pooling and the mHC collapse / expand / mix-logits kernels under nki.simulate (the real one, or
tests/nki_emulation), launched at trn2's LNC (two programs sharing the outputs; one case per kernel also at LNC=1),
against their jnp twins (kernels/reference.py), on random inputs of the tiny checkpoints' sizes and the released
models' tile patterns; and the layers' dispatch to them on Neuron.

Tolerances (u = 2⁻²⁴, one fp32 rounding; a = ACT_REL, the relative error a Scalar Engine activation may carry,
nki_testing.py; "exact" = float64 from the same inputs). Each kernel and its twin compute the same fp32 formula in
another order, so each is held to a worst-case rounding bound against the exact value and the two to the sum of
their bounds; bf16 outputs are that fp32 value rounded once, so the two are 1 bf16 ulp apart at most (plus the fp32
bounds, where cancellation makes a result small) and >= 99 % identical:
- hc_collapse (n terms) and hc_expand (n + 1 terms): an fp32 sum of N products is within (N + 1)·u·Σ|terms| of
  exact (in any order, with or without fused multiply-adds);
- softmax_pool over m slots: the exponent argument s - max is the same rounded fp32 value in both (the max is
  exact, the subtraction correctly rounded), so "exact" uses it; then exp (<= 4 ulps), the m-term sums of e and
  e·kv and the final division: (2m + 10)·u·Σ_m p_m|kv_m|. The kernel's exps carry a relative error a on top: each
  weight e_m(1 + δ_m) / Σ e(1 + δ) is within g = 2a / (1 - a) of p_m relatively, so its sum moves by at most
  g·Σ_m p_m|kv_m| and its rounding bound grows by the factor (1 + g);
- hc_mix_logits, K = n·d: the twin's GEMM and its sum of squares are K-term fp32 sums (XLA's order unknown), so
  K·u·A + (K/2 + 16)·u·|mu| with A = rsqrt(mean x² + eps)·Σ_k |x_k||fn_k|, the sum of squares' relative error
  entering the scale halved by the rsqrt; the kernel sums 128-term partial products (one PE pass, fp32) and then
  the K/128 partials in fp32 PSUM, and its squares as K/128-term free-axis sums then one 128-term matmul, so it is
  held to the much tighter B = (128 + K/128 + 2)·u·A + ((K/128 + 128)/2 + 16)·u·|mu| (tight enough to see one
  missing k column); its rsqrt carries a relative error a, which scales each row: (1 + a)·B + a·|mu|.
Whole -inf pooling columns (groups the layer masks out) are NaN in the twin; the kernel's value there is not
checked."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import nki
import numpy as np
import pytest
from nki_testing import ACT_REL, run

from jdeep import kernels
from jdeep.kernels import nki as nki_kernels
from jdeep.kernels import reference, registry
from jdeep.kernels.nki import mhc, pool

BF16 = ml_dtypes.bfloat16
U = 2.0 ** -24


def _close_bf16(got: np.ndarray, want: np.ndarray, slack: np.ndarray) -> None:
    got, want = got.astype(np.float32), want.astype(np.float32)
    ulp = np.abs(want) * 2.0 ** -7 + slack + 1e-30
    assert (np.abs(got - want) <= ulp).all(), np.max(np.abs(got - want) / ulp)
    assert np.mean(got == want) >= 0.99


def _check(got: np.ndarray, want: np.ndarray, exact: np.ndarray, bound_got, bound_want) -> None:
    """fp32 outputs: each within its bound of the exact value, the two within the sum; bf16: 1 ulp + that."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == np.float32:
        assert (np.abs(got - exact) <= bound_got).all(), np.max(np.abs(got - exact) / bound_got)
        assert (np.abs(want - exact) <= bound_want).all(), np.max(np.abs(want - exact) / bound_want)
        assert (np.abs(got - want) <= bound_got + bound_want).all()
    else:
        _close_bf16(got, want, slack=bound_got + bound_want)


# ------------------------------------------------------------------------------------------------ collapse / expand
HC_CASES = [                  # (at LNC=2 the (token, column block) partition-rows split over two cores)
    (3, 128, np.float32, 2),     # tiny checkpoints (d = 128): 3 tokens, each over 8 partitions (token 1 on both)
    (1, 4096, BF16, 2),          # V4-Flash decode, batch 1: d over 128 partition-rows, 64 per core
    (8, 5120, BF16, 2),          # V4.1-Flash decode, batch 8
    (5, 7168, np.float32, 2),    # V4-Pro width
    (130, 4096, np.float32, 2),  # prefill: 65 tokens per core, two d chunks
    (130, 5120, BF16, 2),        # ... and a partial d chunk (2048 + 2048 + 1024)
    (3, 128, np.float32, 1),
]


def _streams(rng, T, d, dtype, n=4):
    return (rng.normal(size=(T, n, d)) * rng.uniform(0.5, 4, size=(T, 1, 1))).astype(dtype)


@pytest.mark.parametrize("T,d,dtype,lnc", HC_CASES)
def test_hc_collapse(T, d, dtype, lnc):
    n = 4
    rng = np.random.default_rng(T + d)
    X = _streams(rng, T, d, dtype)
    pre = rng.uniform(0, 1.2, size=(T, n)).astype(np.float32)
    got = run(mhc.hc_collapse_kernel, X, pre, lnc=lnc)
    want = np.asarray(reference.hc_collapse(jnp.asarray(X), jnp.asarray(pre)))
    terms = pre.astype(np.float64)[:, :, None] * X.astype(np.float64)
    bound = (n + 1) * U * np.abs(terms).sum(axis=1)
    _check(got, want, terms.sum(axis=1), bound, bound)


@pytest.mark.parametrize("T,d,dtype,lnc", HC_CASES)
def test_hc_expand(T, d, dtype, lnc):
    n = 4
    rng = np.random.default_rng(T + d + 1)
    X = _streams(rng, T, d, dtype)
    y = (rng.normal(size=(T, d)) * 2).astype(dtype)
    post = rng.uniform(0, 2, size=(T, n)).astype(np.float32)
    comb = rng.uniform(0, 1, size=(T, n, n)).astype(np.float32)          # not symmetric: Cᵀ X is observable
    got = run(mhc.hc_expand_kernel, y, post, comb.reshape(T, n * n).copy(), X, lnc=lnc)
    want = np.asarray(reference.hc_expand(jnp.asarray(y), jnp.asarray(post), jnp.asarray(comb), jnp.asarray(X)))
    X64, y64 = X.astype(np.float64), y.astype(np.float64)
    mixed = np.einsum("tjk,tjd->tkd", comb.astype(np.float64), X64)
    yterm = post.astype(np.float64)[:, :, None] * y64[:, None, :]
    size = np.einsum("tjk,tjd->tkd", comb.astype(np.float64), np.abs(X64)) + np.abs(yterm)
    bound = (n + 2) * U * size
    _check(got, want, yterm + mixed, bound, bound)


# ------------------------------------------------------------------------------------------------------ mix logits
@pytest.mark.parametrize("T,d,W,dtype,lnc", [   # (at LNC=2: the mixes split while x is no larger than fn, else tokens)
    (3, 128, 24, np.float32, 2),    # tiny checkpoints: K = 512
    (2, 48, 24, np.float32, 2),     # K = 192: one k column per partition plus a rest of 64 elements
    (1, 4096, 24, BF16, 2),         # V4-Flash decode: K = 16384
    (8, 5120, 24, BF16, 2),         # V4.1-Flash decode, batch 8: K = 20480
    (130, 4096, 24, BF16, 2),       # prefill: 65 tokens per core, k chunks of 63 columns
    (1, 7168, 4, np.float32, 2),    # V4-Pro head collapse (W = n)
    (2, 48, 24, np.float32, 1),
])
def test_hc_mix_logits(T, d, W, dtype, lnc):
    n, eps = 4, 1e-6
    K = n * d
    rng = np.random.default_rng(T + d + W)
    X = _streams(rng, T, d, dtype)
    fn = (rng.normal(size=(W, K)) / np.sqrt(K)).astype(np.float32)
    got = run(mhc.hc_mix_logits_kernel, X.reshape(T, K).copy(), fn, eps, lnc=lnc)
    want = np.asarray(reference.hc_mix_logits(jnp.asarray(X), jnp.asarray(fn), eps))
    assert got.shape == want.shape == (T, W) and got.dtype == want.dtype == np.float32
    x64, fn64 = X.reshape(T, K).astype(np.float64), fn.astype(np.float64)
    r = 1 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + eps)
    exact = (x64 @ fn64.T) * r
    A = (np.abs(x64) @ np.abs(fn64).T) * r
    kt = K // 128
    b_kernel = (128 + kt + 2) * U * A + ((kt + 128) / 2 + 16) * U * np.abs(exact)
    b_kernel = (1 + ACT_REL) * b_kernel + ACT_REL * np.abs(exact)          # the rsqrt's error
    b_twin = K * U * A + (K / 2 + 16) * U * np.abs(exact)
    _check(got, want, exact, b_kernel, b_twin)


# ---------------------------------------------------------------------------------------------------------- pooling
@pytest.mark.parametrize("N,m,C,lnc", [
    (3, 2, 32, 2), (4, 8, 64, 2), (2, 16, 128, 2),   # tiny checkpoints: ratios 2, 4 (overlap: 8 slots), 16
    (1, 8, 512, 2),                            # V4 ratio-4 compressor, decode batch 1: 16 partition-rows per core
    (130, 8, 512, 2),                          # ... prefill: 130 groups, 65 per core
    (3, 128, 512, 2),                          # V4 ratio 128: 96 partition-rows of 16 channels
    (8, 2, 512, 2),                            # V4.1 ratio 2, decode batch 8
    (8, 8, 128, 2),                            # V4 indexer's compressor (8 slots x 128)
    (3, 2, 32, 1),
])
@pytest.mark.filterwarnings("ignore:invalid value encountered")     # -inf - (-inf) in the dead group
def test_softmax_pool(N, m, C, lnc):
    rng = np.random.default_rng(N * m + C)
    score = (rng.normal(size=(N, m, C)) * 3).astype(np.float32)
    kv = rng.normal(size=(N, m, C)).astype(np.float32)
    # slots before the sequence start are -inf (whole slots, as the overlap's previous half for group 0), single
    # entries too (columns partly -inf), and the last group wholly (one the layer masks out)
    score[0, : max(1, m // 2)] = -np.inf
    score[rng.random(size=score.shape) < 0.2] = -np.inf
    if N > 1:
        score[N - 1] = -np.inf
    got = run(pool.softmax_pool_kernel, score, kv, lnc=lnc)
    want = np.asarray(reference.softmax_pool(jnp.asarray(score), jnp.asarray(kv)))
    assert got.shape == want.shape == (N, C) and got.dtype == want.dtype == np.float32
    valid = np.isfinite(score).any(axis=1)                                # [N, C]: some slot is not -inf
    assert np.isnan(want[~valid]).all() and valid.any() and (N == 1 or not valid[N - 1].any())
    with np.errstate(invalid="ignore"):
        d32 = (score - score.max(axis=1, keepdims=True)).astype(np.float64)   # the same rounded fp32 value in both
        e = np.exp(d32)
        p = e / e.sum(axis=1, keepdims=True)
    exact = np.sum(p * kv, axis=1)[valid]
    size = np.sum(p * np.abs(kv), axis=1)[valid]
    g = 2 * ACT_REL / (1 - ACT_REL)                                      # the exps' error in the weights
    bound = (2 * m + 10) * U * size
    got, want = got[valid], want[valid]
    assert np.isfinite(got).all()
    _check(got, want, exact, (1 + g) * bound + g * size, bound)


# ------------------------------------------------------------------------------------ the JAX ops and the dispatch
def test_jax_ops_reshape_leading_dims_like_their_twins():
    """The JAX ops (run here on numpy arrays, which nki.jit simulates, at the LNC `launch` reads) take the twins'
    [..., n, d] / [..., m, C] (rtol 1e-4 covers the kernels' rounding and activation error, <= 2·ACT_REL + a few
    hundred ulps at these sizes)."""
    rng = np.random.default_rng(0)
    B, S, n, d = 2, 3, 4, 128
    # separate arrays: the emulation's access patterns address an input's own storage
    X = rng.normal(size=(B, S, n, d)).astype(np.float32)
    pre = rng.uniform(0, 1, size=(B, S, n)).astype(np.float32)
    post = rng.uniform(0, 2, size=(B, S, n)).astype(np.float32)
    comb = rng.uniform(0, 1, size=(B, S, n, n)).astype(np.float32)
    y = rng.normal(size=(B, S, d)).astype(np.float32)
    fn = (rng.normal(size=((2 + n) * n, n * d)) / 16).astype(np.float32)
    sc = rng.normal(size=(B, 5, 8, 64)).astype(np.float32)
    kv = rng.normal(size=(B, 5, 8, 64)).astype(np.float32)
    pairs = [(mhc.hc_collapse(X, pre), reference.hc_collapse(X, pre)),
             (mhc.hc_expand(y, post, comb, X), reference.hc_expand(y, post, comb, X)),
             (mhc.hc_mix_logits(X, fn, 1e-6), reference.hc_mix_logits(X, fn, 1e-6)),
             (pool.softmax_pool(sc, kv), reference.softmax_pool(sc, kv))]
    for got, want in pairs:
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, np.asarray(want), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not getattr(nki, "EMULATED", False), reason="the recording stand-in is the emulation's")
def test_layers_dispatch_to_the_kernels_on_neuron(monkeypatch):
    """Traced with the dispatch answering as on Neuron, the mHC layer functions and the compressor's pooling emit
    one NKI custom call per op (layers/mhc.py, layers/compressor.py go through kernels.get)."""
    from jdeep.layers import mhc as hc_layer
    from jdeep.layers.chunk import make_chunk
    from jdeep.layers.compressor import pool_chunk

    for op in ("hc_mix_logits", "hc_split_sinkhorn", "hc_collapse", "hc_expand", "softmax_pool"):
        kernels.register(op, "neuron")(getattr(nki_kernels.module(op), nki_kernels.KERNELS[op][1]))
    monkeypatch.setattr(registry, "_backend", lambda: "neuron")
    nki.RECORDED.clear()
    B, S, n, d, dc, m = 2, 8, 4, 128, 32, 4
    X = jnp.zeros((B, S, n, d), jnp.bfloat16)
    fn, base, scale = jnp.zeros(((2 + n) * n, n * d)), jnp.zeros(((2 + n) * n,)), jnp.ones((3,))

    def block_like(X, fn, base, scale):
        pre, post, comb = hc_layer.hc_mixes(X, fn, base, scale, norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=3)
        h = hc_layer.hc_collapse(X, pre)
        X = hc_layer.hc_expand(h, post, comb, X)
        return hc_layer.hc_head_collapse(X, fn[:n], base[:n], scale[:1], norm_eps=1e-6, hc_eps=1e-6)

    hlo = jax.jit(block_like).lower(X, fn, base, scale).as_text()
    chunk = make_chunk(jnp.zeros((B, S), jnp.int32), jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)), 16)
    a = jnp.zeros((B, S, 2 * dc))
    buf = jnp.zeros((1, B, 2 * m + 1, 2 * dc))

    def pool_only(a, buf):
        return pool_chunk(a, a, buf, buf, jnp.int32(0), chunk, ratio=m, overlap=True, n_entries=4)[0]

    hlo += jax.jit(pool_only).lower(a, buf).as_text()
    names = [r["kernel"] for r in nki.RECORDED]
    assert names == ["hc_mix_logits_kernel", "hc_sinkhorn_kernel", "hc_collapse_kernel", "hc_expand_kernel",
                     "hc_mix_logits_kernel", "hc_collapse_kernel", "softmax_pool_kernel"]
    assert hlo.count(f"custom_call @{nki.CUSTOM_CALL_TARGET}") == len(names)
    assert [r["grid"] for r in nki.RECORDED] == [nki.expected_lnc()] * len(names)    # launched at the runtime's LNC
    pooled = nki.RECORDED[-1]
    assert pooled["inputs"] == [((B * 2, 2 * m, dc), "float32")] * 2 and pooled["outputs"] == [((B * 2, dc),
                                                                                                 "float32")]
