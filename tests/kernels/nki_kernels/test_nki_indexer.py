"""The lightning-indexer kernels under nki.simulate (the real one, or tests/nki_emulation) against their jnp twins
(kernels/reference.py `index_scores`, `topk`), launched at trn2's LNC=2 (nki_testing.run) unless a case says LNC=1.

- topk is exact: values and indices equal lax.top_k's (descending, ties to the lower index, -inf entries last in
  index order), on rows with many exact ties (values from a small set), -inf and +inf entries, k from 1 to T,
  a full and a partial 128-row tile (one per core at LNC=2), and rows longer than one instruction reads (16384:
  chunks and merges). The JAX op the indexer calls, run on the neuron dispatch with the kernel on the host, breaks
  ties as lax.top_k on rows of equal values (ties within one max8 round, across rounds, across long-row chunks,
  -inf entries): nc_match_replace8's own dst_idx would give duplicates in descending position order.
- index_scores: fp32 results computed in another order than XLA's (per-head dot products on the PE array with fp32
  PSUM accumulation, the head sum as an fp32 matmul, also accumulated in fp32; relu is exact on the Scalar Engine),
  so both are held to the bound of the two fp32 sums against the exact (float64) score,
  γ_{DI+nI}·Σ_h |w_h|·Σ_d |q_hd k_d| with γ_n = n·u / (1 - n·u), u = 2⁻²⁴ (the q·k sum of DI products, then the
  head sum of nI products, relu being 1-Lipschitz: (1 + γ_DI)(1 + γ_nI) - 1 <= γ_{DI+nI}), and to twice that
  against each other; the -inf pattern (the visibility mask) is exact. bf16 products are exact in fp32, so bf16
  inputs have the same bound.
- the scores -> top-k chain selects the same set as the twin chain on rows with no near-tie at the k-th place
  (gap above the bound)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import nki
import numpy as np
import pytest
from nki_testing import run

from jdeep.kernels import reference, registry
from jdeep.kernels.nki import indexer, topk
from jdeep.platforms import logical_nc_config

BF16 = ml_dtypes.bfloat16


def _twin_topk(x: np.ndarray, k: int):
    v, i = jax.lax.top_k(jnp.asarray(x), k)
    return np.asarray(v), np.asarray(i)


def _tied_rows(rng, R: int, T: int) -> np.ndarray:
    """Rows of values from {-2, ..., 2} (+0 only), ~30 % -inf, a few +inf; an all -inf row and an all-equal row."""
    x = rng.integers(-2, 3, size=(R, T)).astype(np.float32)
    x[rng.random((R, T)) < 0.3] = -np.inf
    x[rng.random((R, T)) < 0.02] = np.inf
    x[0] = -np.inf
    x[-1] = 1.0
    return x


@pytest.mark.parametrize("R,T,ks,lnc", [
    (130, 20, (1, 7, 8, 9, 20), 2),       # a full and a partial row tile, k from 1 to T (padded to 8 per round)
    (130, 20, (9,), 1),                   # both row tiles on one core
    (3, 1024, (512,), 2),                 # the released index_topk on a 1024-entry row
])
def test_topk_exact_with_ties(R, T, ks, lnc):
    rng = np.random.default_rng(T)
    x = _tied_rows(rng, R, T)
    for k in ks:
        v, i = run(topk.topk_kernel, x, k, lnc=lnc)
        wv, wi = _twin_topk(x, k)
        assert v.dtype == np.float32 and i.dtype == np.int32
        np.testing.assert_array_equal(v, wv)
        np.testing.assert_array_equal(i, wi)


def test_topk_exact_on_distinct_values():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 3, 300)).astype(np.float32)
    v, i = run(topk.topk_kernel, x.reshape(6, 300), 37)
    wv, wi = _twin_topk(x, 37)
    np.testing.assert_array_equal(v.reshape(2, 3, 37), wv)
    np.testing.assert_array_equal(i.reshape(2, 3, 37), wi)


@pytest.mark.skipif(not getattr(nki, "EMULATED", False), reason="shapes from the emulation's nki.jit stand-in")
def test_jax_ops_have_their_twins_output_shapes():
    """The JAX ops (reshapes around the kernels' custom calls) give the twins' shapes and dtypes."""
    x = jax.ShapeDtypeStruct((2, 3, 40), jnp.bfloat16)
    for k in (1, 13, 40):
        assert jax.eval_shape(lambda a: topk.topk(a, k), x) == jax.eval_shape(lambda a: reference.topk(a, k), x)
    args = (jax.ShapeDtypeStruct((2, 3, 4, 32), jnp.bfloat16), jax.ShapeDtypeStruct((2, 21, 32), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, 3, 4), jnp.float32), jax.ShapeDtypeStruct((2, 3), jnp.int32))
    assert jax.eval_shape(indexer.index_scores, *args) == jax.eval_shape(reference.index_scores, *args)


@pytest.mark.parametrize("T,k", [
    (40000, 20),          # 5 chunks of 8192 (the last partial), one final merge
    (25000, 4100),        # 3 lists fill the candidate buffer: a merge inside the loop, then the final one with
                          # the last chunk (424 entries) padded to 4104
])
def test_topk_long_rows(T, k):
    """An all -inf row and a row of ties from a small set with -inf and +inf entries (rows of equal values:
    test_topk_op_ties_to_the_lower_index_on_the_neuron_path)."""
    rng = np.random.default_rng(k)
    x = _tied_rows(rng, 3, T)[:2]
    v, i = run(topk.topk_kernel, x, k)
    wv, wi = _twin_topk(x, k)
    np.testing.assert_array_equal(v, wv)
    np.testing.assert_array_equal(i, wi)


def _equal_rows(B: int, T: int) -> np.ndarray:
    """Indexer score rows [B, 1, T], B >= 5, full of equal values: all 1.0; all -inf (nothing visible); 1.0 at every
    64th entry, -inf elsewhere (the k-th place falls among -inf entries once the ones run out); 1.0 but 2.0 at the
    last three entries (each round takes 2.0s and ones together: on long rows the merge's rounds of 8 are not the
    chunks' rounds); the first T // 2 entries visible and alternating 0 / 1, the rest -inf."""
    x = np.full((B, 1, T), -np.inf, np.float32)
    x[0] = 1.0
    x[2, 0, ::64] = 1.0
    x[3] = 1.0
    x[3, 0, T - 3:] = 2.0
    x[4, 0, :T // 2] = np.arange(T // 2) % 2
    return x


@pytest.mark.skipif(not getattr(nki, "EMULATED", False), reason="host execution is the emulation's")
def test_topk_op_ties_to_the_lower_index_on_the_neuron_path(monkeypatch):
    """The indexer's call (layers/indexer.py: kernels.get("topk")(score [B, S, T], index_topk = 512)) on the
    neuron dispatch under jax.jit, the kernel executed on the host at the runtime's LNC (nki.host_execution),
    equals lax.top_k on rows of equal values: 64 rounds of 8 ties each over 20000 entries (3 chunks of <= 8192: ties
    across chunks, through the candidate buffer's merge; test_topk_exact_with_ties has the one-instruction rows)."""
    monkeypatch.setitem(registry._IMPLS["topk"], "neuron", topk.topk)
    monkeypatch.setattr(registry, "_NEURON_LOADED", True)
    monkeypatch.setattr(registry, "_backend", lambda: "neuron")
    op = registry.get("topk")
    assert op is topk.topk
    x = _equal_rows(5, 20000)
    nki.RECORDED.clear()
    with nki.host_execution():
        v, i = jax.jit(op, static_argnums=1)(jnp.asarray(x), 512)
    assert [(r["kernel"], r["grid"]) for r in nki.RECORDED] == [("topk_kernel", logical_nc_config())]
    wv, wi = _twin_topk(x, 512)
    np.testing.assert_array_equal(np.asarray(v), wv)
    np.testing.assert_array_equal(np.asarray(i), wi)


def _scores_bound(q, keys, w):
    """(exact float64 scores [B, S, T], the per-entry bound gamma) for unmasked scores."""
    q64, k64, w64 = (a.astype(np.float64) for a in (q, keys, w))
    s = np.einsum("bshd,btd->bsht", q64, k64)
    exact = np.einsum("bsht,bsh->bst", np.maximum(s, 0), w64)
    mag = np.einsum("bsht,bsh->bst", np.einsum("bshd,btd->bsht", np.abs(q64), np.abs(k64)), np.abs(w64))
    n = q.shape[-1] + q.shape[-2]                        # DI + nI
    return exact, n * 2.0 ** -24 / (1 - n * 2.0 ** -24) * mag


def _inputs(rng, B, S, nI, DI, T, dtype):
    q = rng.normal(size=(B, S, nI, DI)).astype(dtype)
    keys = rng.normal(size=(B, T, DI)).astype(dtype)
    w = (rng.normal(size=(B, S, nI)) * (DI ** -0.5 * nI ** -0.5)).astype(np.float32)
    vc = rng.integers(0, T + 1, size=(B, S)).astype(np.int32)
    vc[0, 0], vc[-1, -1] = 0, T                          # nothing visible; everything visible
    return q, keys, w, vc


@pytest.mark.parametrize("B,S,nI,DI,T,dtype,lnc", [
    (2, 3, 4, 32, 20, np.float32, 2),     # the tiny checkpoints: one token per group, 10 keys per core
    (1, 5, 16, 32, 21, BF16, 2),          # 11 and 10 keys
    (3, 1, 64, 128, 1026, BF16, 2),       # V4-Flash decode, batch 3: one token (a partial group of 2), 513 keys
                                          # per core (a full and a partial 512-key tile each)
    (2, 3, 64, 128, 700, BF16, 2),        # V4-Flash heads (groups of 2 tokens)
    (1, 131, 64, 128, 129, BF16, 1),      # a full and a partial 128-token tile, a partial group; all keys on one
                                          # core (at LNC=2 each core would repeat the 66 groups' setup for 65 keys)
    (2, 5, 32, 128, 600, np.float32, 2),  # V4.1-Flash heads (groups of 4), fp32 activations
])
def test_index_scores(B, S, nI, DI, T, dtype, lnc):
    rng = np.random.default_rng(S * T + nI)
    q, keys, w, vc = _inputs(rng, B, S, nI, DI, T, dtype)
    got = run(indexer.index_scores_kernel, q, keys, w, vc, lnc=lnc)
    want = np.asarray(reference.index_scores(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(w), jnp.asarray(vc)))
    assert got.shape == want.shape == (B, S, T) and got.dtype == want.dtype == np.float32
    masked = np.arange(T)[None, None, :] >= vc[..., None]
    assert masked.any() and (~masked).any()
    np.testing.assert_array_equal(np.isneginf(got), masked)
    np.testing.assert_array_equal(np.isneginf(want), masked)
    exact, gamma = _scores_bound(q, keys, w)
    got, want, exact, gamma = (a[~masked] for a in (got, want, exact, gamma))
    assert (np.abs(got - exact) <= gamma).all() and (np.abs(want - exact) <= gamma).all()
    assert (np.abs(got - want) <= 2 * gamma).all()


def test_scores_then_topk_selects_the_twin_chain_set():
    rng = np.random.default_rng(7)
    B, S, nI, DI, T, k = 2, 4, 64, 128, 1024, 512
    q, keys, w, vc = _inputs(rng, B, S, nI, DI, T, BF16)
    vc[:] = rng.integers(600, T + 1, size=(B, S))               # more visible entries than k
    got_s = run(indexer.index_scores_kernel, q, keys, w, vc)
    _, got_i = run(topk.topk_kernel, got_s.reshape(B * S, T), k)
    want_s = reference.index_scores(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(w), jnp.asarray(vc))
    want_v, want_i = reference.topk(want_s, k + 1)
    want_v, want_i = np.asarray(want_v).reshape(B * S, k + 1), np.asarray(want_i).reshape(B * S, k + 1)
    _, gamma = _scores_bound(q, keys, w)
    clear = want_v[:, k - 1] - want_v[:, k] > 4 * gamma.reshape(B * S, T).max(axis=1)   # no near-tie at k
    assert clear.sum() >= B * S // 2
    for r in np.flatnonzero(clear):
        assert set(got_i[r].tolist()) == set(want_i[r, :k].tolist())
