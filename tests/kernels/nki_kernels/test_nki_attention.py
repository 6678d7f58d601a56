"""The sparse-attention-with-sink NKI kernel (jdeep/kernels/nki/attention.py) under nki.simulate equals its jnp twin
(kernels/reference.py `sparse_attention`) at the tiny checkpoints' shapes and the released models' tile patterns
(H = 64 / 128 heads of D = 512, window 128 + the new token, 512 selected entries, V4 ratio-128 compressed entries,
a prefill chunk), masks with partial rows, rows with every key masked and queries that only see selected keys; and
it reproduces DeepSeek's own kernel on the golden vectors. Tolerances (u = 2⁻²⁴; Σp|k| is the float64
Σ_j p_j·|k_jd| per output element):
- float32: the inputs are random multiples of 2⁻⁵ in [-2, 2], so every product and partial sum of the logits is
  exact in fp32 (< 2²¹ units) and both sides compute the same logits bit for bit; what differs is the softmax's
  and P·V's summation order and the exp implementation. First-order bound for each side against the float64
  oracle: the one rounding of l = dot · scale and of l - max moves each exp's argument by <= 4u·lmax (lmax: the
  row's largest |logit| or |sink|), exp is within 4u, the denominator's L + 1 positive terms within that +
  γ_{L+1}, p (divide, or multiply by a reciprocal) within twice that + 3u, P·V within γ_L:
  |o - o₆₄| <= (2·γ_L + 14u + 8u·lmax)·Σp|k| + L·2⁻¹²⁶·max|k| (exp's underflow) with γ_n = n·u. Asserted for
  kernel and twin; they agree within twice that.
- bfloat16 (random normal inputs): both sides compute fp32 p within far less than a bf16 ulp of each other, so
  their bf16 p differ by at most one ulp (<= 2⁻⁷·p) where the two fp32 values straddle a rounding boundary; the
  fp32 P·V sums then differ by <= (2⁻⁷ + 2γ_L)·Σp|k|, and the two final casts add half a bf16 ulp each.
  Asserted, and >= 99 % of the outputs identical (the p flips and straddled output roundings are rare).
- rows whose keys are all masked: exactly 0 on both sides (max = sink, denominator 1, numerator 0).
- golden vectors (fp32, DeepSeek's kernel): atol 2e-6, the twin's own tolerance (test_kernel_vectors.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import nki
import numpy as np
import pytest
from conftest import golden_path

from jdeep.kernels import reference
from jdeep.kernels.nki import attention

BF16 = ml_dtypes.bfloat16
U = 2.0 ** -24


def _values(rng, shape, dtype) -> np.ndarray:
    if dtype == np.float32:                    # exact fp32 logits in any summation order (see the docstring)
        return (rng.integers(-64, 65, size=shape) / 32).astype(np.float32)
    return rng.normal(size=shape).astype(dtype)


def _inputs(B, S, H, D, T, K, dtype, seed):
    """Random q, keys, sink and masks with partial rows. With two queries or more, the first sees nothing (a
    warm-up row); with four or more, the second sees only selected keys and the third only shared ones."""
    rng = np.random.default_rng(seed)
    q, ks = _values(rng, (B, S, H, D), dtype), _values(rng, (B, T, D), dtype)
    ms = rng.random((B, S, T)) < 0.7
    sink = rng.normal(size=H).astype(np.float32)
    kl, ml = (_values(rng, (B, S, K, D), dtype), rng.random((B, S, K)) < 0.6) if K else (None, None)
    rows_s, rows_k = ms.reshape(B * S, T), (None if ml is None else ml.reshape(B * S, K))   # views, query-major
    if B * S >= 2:
        rows_s[0] = False
        if K:
            rows_k[0] = False
    if B * S >= 4 and K:
        rows_s[1] = False
        rows_k[2] = False
        assert rows_k[1].any() and rows_s[2].any()
    return q, ks, ms, kl, ml, sink, D ** -0.5


def _kernel(q, ks, ms, kl, ml, sink, scale) -> np.ndarray:
    args = (q, ks, ms.astype(np.uint8), sink, scale)
    if kl is not None:
        args += (kl, ml.astype(np.uint8))
    return nki.simulate(attention.sparse_attention_kernel)(*args)


def _twin(q, ks, ms, kl, ml, sink, scale) -> np.ndarray:
    j = lambda a: None if a is None else jnp.asarray(a)      # noqa: E731
    return np.asarray(reference.sparse_attention(j(q), j(ks), j(ms), j(kl), j(ml), j(sink), scale))


def _oracle(q, ks, ms, kl, ml, sink, scale):
    """float64 (o, Σ_j p_j |k_jd|, the largest |logit| of each row, sink included) with unrounded p."""
    q64, keys = q.astype(np.float64), np.broadcast_to(ks.astype(np.float64)[:, None], q.shape[:2] + ks.shape[1:])
    mask = np.broadcast_to(ms, ms.shape)
    if kl is not None:
        keys, mask = np.concatenate([keys, kl.astype(np.float64)], 2), np.concatenate([ms, ml], 2)
    logit = np.where(mask[:, :, None, :], q64 @ keys.transpose(0, 1, 3, 2) * scale, -np.inf)
    s = sink.astype(np.float64)[None, None, :]
    mx = np.maximum(logit.max(-1), s)
    e = np.exp(logit - mx[..., None])
    p = e / (e.sum(-1) + np.exp(s - mx))[..., None]
    lmax = np.maximum(np.where(np.isfinite(logit), np.abs(logit), 0).max(-1), np.abs(s))
    return p @ keys, p @ np.abs(keys), lmax[..., None]


def _check(inputs, got=None) -> np.ndarray:
    got = _kernel(*inputs) if got is None else got
    want = _twin(*inputs)
    q, ks, ms, kl, ml = inputs[:5]
    assert got.shape == want.shape == q.shape and got.dtype == want.dtype == q.dtype
    L = ks.shape[1] + (0 if kl is None else kl.shape[2])
    exact, pk, lmax = _oracle(*inputs)
    if q.dtype == np.float32:
        kmax = max(np.abs(ks).max(), 0 if kl is None else np.abs(kl).max())
        tiny = L * 2.0 ** -126 * kmax                           # exp's underflow: e within 2⁻¹²⁶, denominator >= 1
        bound = (2 * L + 14 + 8 * lmax) * U * pk + tiny
        assert (np.abs(got - exact) <= bound).all(), np.max(np.abs(got - exact) / bound)
        assert (np.abs(want - exact) <= bound).all(), np.max(np.abs(want - exact) / bound)
        assert (np.abs(got - want) <= 2 * bound).all()
    else:
        g, w = got.astype(np.float32), want.astype(np.float32)
        # the fp32 sums' disagreement, then each side's final rounding (<= half an ulp <= 2⁻⁸ of the value); 1.02: p
        # here is float64's, theirs fp32's, and the rounding of g's larger value
        bound = np.abs(w) * 2.0 ** -7 + (2.0 ** -7 + 2 * L * U) * pk * 1.02
        assert (np.abs(g - w) <= bound).all(), np.max(np.abs(g - w) / bound)
        assert np.mean(g == w) >= 0.99, np.mean(g == w)
    visible = ms.any(-1) if kl is None else ms.any(-1) | ml.any(-1)
    assert visible.any() and (visible.size == 1 or not visible.all())
    np.testing.assert_array_equal(got[~visible], 0)
    np.testing.assert_array_equal(want[~visible], 0)
    return got


@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("D,K", [(64, 0), (64, 8), (128, 0), (128, 12)])
def test_tiny(D, K, dtype):
    """The tiny checkpoints: 4 heads of 64 or 128, a window of 16 + 4 chunk keys, 8-12 selected entries."""
    _check(_inputs(2, 3, 4, D, 20, K, dtype, seed=D + K))


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_large_logits(dtype):
    """Logits in the hundreds (q x 64, an exact power of two): without the row max subtracted exp overflows."""
    q, *rest = _inputs(2, 3, 4, 64, 20, 8, dtype, seed=7)
    q = (q.astype(np.float32) * 64).astype(dtype)
    got = _check((q, *rest))
    assert np.isfinite(got.astype(np.float32)).all()


@pytest.mark.parametrize("H,B,T,K,dtype", [
    (64, 2, 129, 512, BF16),             # V4-Flash ratio-4 / V4.1-Flash decode: window 128 + the token, top-512
    (64, 2, 129, 512, np.float32),
    (64, 2, 129 + 448, 0, BF16),         # V4 ratio-128 decode: + 448 compressed entries (a partial 512-key block)
    (64, 1, 129, 0, BF16),               # window-only layers
    (128, 1, 129, 512, BF16),            # V4-Pro: 128 heads
])
def test_released_decode(H, B, T, K, dtype):
    _check(_inputs(B, 1, H, 512, T, K, dtype, seed=H + T + K))


@pytest.mark.parametrize("K", [0, 64])
def test_prefill_chunk(K, monkeypatch):
    """16 queries of one chunk share the window + chunk keys (T = 128 + 16): their rows and Kᵀ are kept across
    the queries; rebuilding Kᵀ per query (beyond the SBUF budget) gives the same bits. (64 selected entries per
    query: the 512-entry tile pattern is test_released_decode's.)"""
    inputs = _inputs(1, 16, 64, 512, 128 + 16, K, BF16, seed=16 + K)
    got = _check(inputs)
    if not K:
        monkeypatch.setattr(attention, "_KT_CACHE_BYTES", 0)
        np.testing.assert_array_equal(_kernel(*inputs), got)


def test_golden_kernel_vectors():
    """DeepSeek's sparse attention kernel on its fixed vectors (-1 indices masked), fed as in
    tests/kernels/test_kernel_vectors.py: one fully masked shared key, the indexed entries as selected keys."""
    kv = np.load(golden_path("v4-tiny-q") / "kernel_vectors.npz")
    q, keys, idx = kv["attn_q"], kv["attn_kv"], kv["attn_idx"]
    assert (idx < 0).any() and q.dtype == np.float32
    sel = np.ascontiguousarray(np.take_along_axis(keys[:, None], np.clip(idx, 0, None)[..., None], axis=2))
    shared = np.ascontiguousarray(keys[:, :1])
    inputs = (q, shared, np.zeros((1, q.shape[1], 1), bool), sel, idx >= 0, kv["attn_sink"], float(kv["attn_scale"]))
    got = _kernel(*inputs)
    np.testing.assert_allclose(got, kv["attn_o"], rtol=0, atol=2e-6)


@pytest.mark.skipif(not getattr(nki, "EMULATED", False), reason="the recording stand-in is the emulation's")
@pytest.mark.parametrize("K", [0, 8])
def test_jax_op_lowers_to_one_custom_call(K):
    """Under jax.jit the JAX op is one NKI custom call fed uint8 masks and an fp32 sink (no float8 in the graph)."""
    B, S, H, D, T = 2, 3, 4, 64, 20
    f = jax.ShapeDtypeStruct
    args = (f((B, S, H, D), jnp.bfloat16), f((B, T, D), jnp.bfloat16), f((B, S, T), jnp.bool_),
            f((B, S, K, D), jnp.bfloat16) if K else None, f((B, S, K), jnp.bool_) if K else None, f((H,), jnp.bfloat16))
    nki.RECORDED.clear()
    text = jax.jit(lambda *a: attention.sparse_attention(*a, D ** -0.5)).lower(*args).as_text()
    assert text.count(f"custom_call @{nki.CUSTOM_CALL_TARGET}") == 1 and "f8E" not in text
    (rec,) = nki.RECORDED
    assert rec["kernel"] == "sparse_attention_kernel" and rec["outputs"] == [((B, S, H, D), "bfloat16")]
    dtypes = [d for _, d in rec["inputs"]]
    assert dtypes == ["bfloat16", "bfloat16", "uint8", "float32"] + (["bfloat16", "uint8"] if K else [])
