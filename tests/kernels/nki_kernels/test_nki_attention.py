"""The sparse-attention-with-sink NKI kernels (jdeep/kernels/nki/attention.py: with and without selected keys) under
nki.simulate at trn2's LNC=2 (nki_testing.run: the query tokens split over the two cores, a single query's heads)
equal their jnp twin (kernels/reference.py `sparse_attention`) at the tiny checkpoints' shapes and the released
models' tile patterns (H = 64 / 128 heads of D = 512, window 128 + the new token, 512 selected entries, V4
ratio-128 compressed entries, a prefill chunk), masks with partial rows, rows with every key masked and queries
that only see selected keys; and they reproduce DeepSeek's own kernel on the golden vectors. Tolerances
(u = 2⁻²⁴; Σp|k| is the float64 Σ_j p_j·|k_jd| per output element; ACT_REL the Scalar Engine activations' relative
error, nki_testing.ACT_REL):
- float32: the inputs are random multiples of 2⁻⁵ in [-2, 2], so every product and partial sum of the logits is
  exact in fp32 (< 2²¹ units) and both sides compute the same logits bit for bit; what differs is the softmax's
  and P·V's summation order and the exp implementation. First-order bound for the twin against the float64
  oracle: the one rounding of l = dot · scale and of l - max moves each exp's argument by <= 4u·lmax (lmax: the
  row's largest |logit| or |sink|), exp is within 4u, the denominator's L + 1 positive terms within that +
  γ_{L+1}, p (divide, or multiply by a reciprocal) within twice that + 3u, P·V (fp32 sums: XLA's, and the kernel's
  fp32 PSUM accumulation) within γ_L: |o - o₆₄| <= (2·γ_L + 14u + 8u·lmax)·Σp|k| + L·2⁻¹²⁶·max|k| (exp's
  underflow) with γ_n = n·u. The kernel's exp, of each l - M and of sink - M, is the Scalar Engine's, within
  ACT_REL + 4u: p = e · (1 / denominator) takes 2·ACT_REL more (the kernel's own roundings come to 11u at first
  order, and the 3u left of the 14u covers the second-order terms, 2·ACT_REL² = u / 128 the largest); its masked
  keys' p is exactly 0 (the mask multiplies p) while their exps, each <= 2⁻¹²⁶, stay in the denominator, one more
  L·2⁻¹²⁶·max|k|. Asserted for kernel and twin; they agree within the sum of the two bounds.
- bfloat16 (random normal inputs): the logits are no longer exact, each within λ_j = γ_D·scale·Σ_d |q_d k_jd| (the
  fp32 sum of D exact bf16 products; a shift common to a row cancels in p). Each side's fp32 p_j is within
  δ_j = λ_j + max_i λ_i + 8u·lmax + 2·a + (L + 14)·u of the exact p_j, relative, with a the exp's error beyond 4u
  (ACT_REL for the kernel, 0 for XLA's) and the rest as for float32; its bf16 p_j lies between the bf16 roundings
  of p_j·(1 ± δ_j) (rounding is monotonic); the fp32 P·V of those (bf16 products are exact in fp32) is within
  γ_L of its exact value, and the output lies between the bf16 roundings of that range's ends (widened by
  2L·2⁻¹²⁶·max|k| for exps that underflow). Asserted per element for kernel and twin. Where no p_j is near a bf16
  rounding boundary the range is a single bf16 value (for most outputs at the tiny shapes), so a p off by 0.2 %
  fails.
- rows whose keys are all masked: exactly 0 on both sides (the twin: max = sink, numerator 0; the kernel: p =
  e · (1 / denominator) · 0).
- golden vectors (fp32, DeepSeek's kernel, general fp32 inputs): the twin is within 2e-6 of DeepSeek's output (its
  own tolerance, test_kernel_vectors.py) and the kernel within the two bounds above of the twin, each widened by
  the logits' rounding, which these inputs do not avoid: a logit within λ = γ_D·scale·max_j Σ_d |q_d k_jd| of the
  exact one moves p by <= 2λ relative."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import nki
import numpy as np
import pytest
from conftest import golden_path
from nki_testing import ACT_REL, run

from jdeep.kernels import reference
from jdeep.kernels.nki import attention
from jdeep.platforms import logical_nc_config

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


def _kernel(q, ks, ms, kl, ml, sink, scale, lnc: int = 2) -> np.ndarray:
    args = (q, ks, ms.astype(np.uint8), sink, scale)
    if kl is None:
        return run(attention.sparse_attention_shared_kernel, *args, lnc=lnc)
    return run(attention.sparse_attention_kernel, *args, kl, ml.astype(np.uint8), lnc=lnc)


def _twin(q, ks, ms, kl, ml, sink, scale) -> np.ndarray:
    j = lambda a: None if a is None else jnp.asarray(a)      # noqa: E731
    return np.asarray(reference.sparse_attention(j(q), j(ks), j(ms), j(kl), j(ml), j(sink), scale))


def _softmax64(q, ks, ms, kl, ml, sink, scale, with_lam: bool = True):
    """float64: the keys [B, S, L, D] of each query, its unrounded p [B, S, H, L] (0 where masked), the largest
    |logit| of each row (sink included) [B, S, H, 1] and each logit's λ_j = γ_D·scale·Σ_d |q_d k_jd| (0 where
    masked) [B, S, H, L] (0 without with_lam)."""
    q64, keys = q.astype(np.float64), np.broadcast_to(ks.astype(np.float64)[:, None], q.shape[:2] + ks.shape[1:])
    mask = ms
    if kl is not None:
        keys, mask = np.concatenate([keys, kl.astype(np.float64)], 2), np.concatenate([ms, ml], 2)
    vis = mask[:, :, None, :]
    kt = keys.transpose(0, 1, 3, 2)
    logit = np.where(vis, q64 @ kt * scale, -np.inf)
    s = sink.astype(np.float64)[None, None, :]
    mx = np.maximum(logit.max(-1), s)
    e = np.exp(logit - mx[..., None])
    p = e / (e.sum(-1) + np.exp(s - mx))[..., None]
    lmax = np.maximum(np.where(vis, np.abs(logit), 0).max(-1), np.abs(s))[..., None]
    D = q.shape[-1]
    lam = np.where(vis, D * U / (1 - D * U) * scale * (np.abs(q64) @ np.abs(kt)), 0) if with_lam else 0
    return keys, p, lmax, lam


def _bounds(inputs, exact_logits: bool = True):
    """float32 inputs: (float64 output, the twin's bound, the kernel's bound) per output element (module
    docstring)."""
    keys, p, lmax, lam = _softmax64(*inputs, with_lam=not exact_logits)
    L = keys.shape[2]
    pk = p @ np.abs(keys)
    kmax = np.abs(keys).max()
    tiny = L * 2.0 ** -126 * kmax                              # exp's underflow: e within 2⁻¹²⁶, denominator >= 1
    twin = (2 * L + 14 + 8 * lmax) * U * pk + tiny
    if not exact_logits:
        twin = twin + 2 * lam.max(-1, keepdims=True) * pk
    return p @ keys, twin, twin + 2 * ACT_REL * pk + tiny     # + the masked exps in the kernel's denominator


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round to fp32, then to bf16 (as a kernel rounds an fp32 value), back as float64: monotonic."""
    return x.astype(np.float32).astype(BF16).astype(np.float64)


def _bf16_intervals(inputs, act_rels):
    """bfloat16 inputs: per exp error a (act_rels) beyond 4u, [lo, hi] per output element that a side with that exp
    can return (module docstring): each fp32 p_j within δ_j of the exact p_j, its bf16 rounding between those of
    p_j(1 ± δ_j), the fp32 P·V of those within γ_L of their exact sum, the bf16 rounding of that."""
    keys, p, lmax, lam = _softmax64(*inputs)
    L = keys.shape[2]
    akeys = np.abs(keys)
    out = []
    for act_rel in act_rels:
        delta = lam + lam.max(-1, keepdims=True) + 8 * U * lmax + 2 * act_rel + (L + 14) * U
        lo, hi = _bf16(p * (1 - delta)), _bf16(p * (1 + delta))
        mid, half = (lo + hi) / 2 @ keys, (hi - lo) / 2 @ akeys       # p ranges over [lo, hi] key by key
        slack = 1.01 * L * U / (1 - L * U) * (hi @ akeys) + 2 * L * 2.0 ** -126 * akeys.max()
        out.append((_bf16(mid - half - slack), _bf16(mid + half + slack)))
    return out


def _check(inputs, got=None) -> np.ndarray:
    got = _kernel(*inputs) if got is None else got
    want = _twin(*inputs)
    q, ks, ms, kl, ml = inputs[:5]
    assert got.shape == want.shape == q.shape and got.dtype == want.dtype == q.dtype
    if q.dtype == np.float32:
        exact, bound_t, bound_k = _bounds(inputs)
        assert (np.abs(got - exact) <= bound_k).all(), np.max(np.abs(got - exact) / bound_k)
        assert (np.abs(want - exact) <= bound_t).all(), np.max(np.abs(want - exact) / bound_t)
        assert (np.abs(got - want) <= bound_k + bound_t).all()
    else:
        for out, (lo, hi) in zip((got, want), _bf16_intervals(inputs, (ACT_REL, 0.0))):
            out = out.astype(np.float64)
            inside = (lo <= out) & (out <= hi)
            assert inside.all(), (int((~inside).sum()), np.argwhere(~inside)[:3])
    visible = ms.any(-1) if kl is None else ms.any(-1) | ml.any(-1)
    assert visible.any() and (visible.size == 1 or not visible.all())
    np.testing.assert_array_equal(got[~visible], 0)
    np.testing.assert_array_equal(want[~visible], 0)
    return got


@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("D,K", [(64, 0), (64, 8), (128, 0), (128, 12)])
def test_tiny(D, K, dtype):
    """The tiny checkpoints: 4 heads of 64 or 128, a window of 16 + 4 chunk keys, 8-12 selected entries; 3 sequences
    of 2 queries, so core 0 takes sequence 0 and half of sequence 1."""
    _check(_inputs(3, 2, 4, D, 20, K, dtype, seed=D + K))


def test_tiny_one_core():
    """The same at LNC=1: one program takes every query."""
    inputs = _inputs(3, 2, 4, 64, 20, 8, np.float32, seed=72)
    _check(inputs, _kernel(*inputs, lnc=1))


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_large_logits(dtype):
    """Logits in the hundreds (q x 64, an exact power of two): without the row max subtracted exp overflows."""
    q, *rest = _inputs(3, 2, 4, 64, 20, 8, dtype, seed=7)
    q = (q.astype(np.float32) * 64).astype(dtype)
    got = _check((q, *rest))
    assert np.isfinite(got.astype(np.float32)).all()


@pytest.mark.parametrize("H,B,T,K,dtype", [
    (64, 2, 129, 512, BF16),             # V4-Flash ratio-4 / V4.1-Flash decode: window 128 + the token, top-512
    (64, 2, 129, 512, np.float32),
    (64, 2, 129 + 448, 0, BF16),         # V4 ratio-128 decode: + 448 compressed entries (a partial 512-key block)
    (64, 1, 129, 0, BF16),               # window-only layers; one query: its heads split over the cores
    (128, 1, 129, 512, BF16),            # V4-Pro: 128 heads
])
def test_released_decode(H, B, T, K, dtype):
    """Decode: one query per sequence (B = 2: one per core; B = 1: 32 or 64 heads per core)."""
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
    _, bound_t, bound_k = _bounds(inputs, exact_logits=False)
    err = np.abs(got - kv["attn_o"])
    assert (err <= 2e-6 + bound_t + bound_k).all(), np.max(err - bound_t - bound_k)


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
    assert rec["kernel"] == ("sparse_attention_kernel" if K else "sparse_attention_shared_kernel")
    assert rec["outputs"] == [((B, S, H, D), "bfloat16")] and rec["grid"] == logical_nc_config()
    dtypes = [d for _, d in rec["inputs"]]
    assert dtypes == ["bfloat16", "bfloat16", "uint8", "float32"] + (["bfloat16", "uint8"] if K else [])
