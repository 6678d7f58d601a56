"""Reference kernels (sparse attention with sink, routed/shared experts), MoE routing and the
lightning indexer's selection, against float64 NumPy oracles written from model-spec.md §4.4-§4.5.

Tolerances: float32 inputs of O(1), fp32 compute in jdeep, float64 oracles:
rtol = 1e-5, atol = 1e-5 x max|oracle| (2e-5 for the expert MLPs, which chain three matmuls).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdeep import kernels
from jdeep.kernels.reference import (moe_experts_dense, moe_experts_gather, moe_experts_grouped,
                                     moe_experts_grouped_nosort, shared_expert, sparse_attention)
from jdeep.layers.chunk import make_chunk
from jdeep.layers.indexer import index_select
from jdeep.layers.moe import route
from jdeep.numerics import Numerics
from jdeep.config.presets import preset


def close(actual, expected, rtol=1e-5, atol=1e-5):
    expected = np.asarray(expected, np.float64)
    scale = max(1.0, float(np.max(np.abs(expected)))) if expected.size else 1.0
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol * scale)


def test_registry_exposes_reference_ops():
    reg = kernels.registered()
    for name in ("sparse_attention", "moe_experts_gather", "moe_experts_grouped", "moe_experts_dense", "shared_expert"):
        assert "reference" in reg[name]
    if jax.default_backend() == "cpu":
        assert kernels.get("sparse_attention") is sparse_attention


# ---------------------------------------------------------------------------------- sparse attention
def attention_np(q, k_shared, m_shared, k_sel, m_sel, sink, scale):
    """Per (b, s, h): logits over [shared keys | selected keys | sink]; softmax; drop the sink's
    probability; values are the keys."""
    q, k_shared, sink = (np.asarray(a, np.float64) for a in (q, k_shared, sink))
    B, S, H, D = q.shape
    out = np.zeros((B, S, H, D))
    for b in range(B):
        for s in range(S):
            keys = [k_shared[b]]
            mask = [np.asarray(m_shared[b, s], bool)]
            if k_sel is not None:
                keys.append(np.asarray(k_sel[b, s], np.float64))
                mask.append(np.asarray(m_sel[b, s], bool))
            K = np.concatenate(keys, axis=0)
            M = np.concatenate(mask, axis=0)
            for h in range(H):
                logits = np.where(M, K @ q[b, s, h] * scale, -np.inf)
                allv = np.append(logits, sink[h])
                e = np.exp(allv - allv.max())
                p = e / e.sum()
                out[b, s, h] = p[:-1] @ K
    return out


def _attn_inputs(rng, B=2, S=3, H=4, D=32, T=7, K=5, qmag=4.0):
    q = (rng.normal(size=(B, S, H, D)) * qmag).astype(np.float32)
    ks = rng.normal(size=(B, T, D)).astype(np.float32)
    ms = rng.uniform(size=(B, S, T)) < 0.6
    ksel = rng.normal(size=(B, S, K, D)).astype(np.float32)
    msel = rng.uniform(size=(B, S, K)) < 0.6
    sink = rng.normal(size=(H,)).astype(np.float32) * 2
    return q, ks, ms, ksel, msel, sink


@pytest.mark.parametrize("with_sel", [False, True])
def test_sparse_attention_matches_oracle(with_sel):
    rng = np.random.default_rng(30)
    q, ks, ms, ksel, msel, sink = _attn_inputs(rng)
    ms[0, 0] = False                                    # a query that sees no shared key
    if with_sel:
        msel[0, 0] = False                              # ... and nothing at all: only the sink -> output 0
        msel[1, 2] = True
    scale = 32 ** -0.5
    args = (jnp.asarray(q), jnp.asarray(ks), jnp.asarray(ms),
            jnp.asarray(ksel) if with_sel else None, jnp.asarray(msel) if with_sel else None,
            jnp.asarray(sink), scale)
    out = sparse_attention(*args)
    assert out.shape == q.shape and out.dtype == jnp.float32
    expect = attention_np(q, ks, ms, ksel if with_sel else None, msel if with_sel else None, sink, scale)
    assert np.all(np.isfinite(np.asarray(out)))
    close(out, expect)
    if with_sel:
        np.testing.assert_array_equal(np.asarray(out)[0, 0], 0.0)


def test_sparse_attention_sink_semantics():
    rng = np.random.default_rng(31)
    q, ks, ms, _, _, _ = _attn_inputs(rng, B=1, S=2, H=3, T=6)
    ms[:] = True
    scale = 32 ** -0.5
    run = lambda sink: np.asarray(sparse_attention(jnp.asarray(q), jnp.asarray(ks), jnp.asarray(ms), None, None,  # noqa: E731
                                                   jnp.asarray(sink, jnp.float32), scale), np.float64)
    # sink -> -inf: ordinary softmax attention
    plain = run(np.full(3, -1e30))
    logits = np.einsum("bshd,btd->bsht", q.astype(np.float64), ks.astype(np.float64)) * scale
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    close(plain, np.einsum("bsht,btd->bshd", p, ks))
    # a finite sink only rescales the output by Σe^l / (Σe^l + e^s), direction unchanged
    sink = np.array([0.0, 3.0, -2.0])
    out = run(sink)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    factor = 1.0 / (1.0 + np.exp(sink[None, None, :] - lse))
    close(out, plain * factor[..., None])
    # a huge sink drives the output to zero
    assert np.max(np.abs(run(np.full(3, 80.0)))) < 1e-20


def test_sparse_attention_shared_and_selected_are_one_softmax():
    # splitting the same key set between the shared and the selected operands changes nothing
    rng = np.random.default_rng(32)
    q, ks, ms, _, _, sink = _attn_inputs(rng, B=1, S=2, H=2, T=8)
    ms[:] = True
    scale = 0.3
    full = sparse_attention(jnp.asarray(q), jnp.asarray(ks), jnp.asarray(ms), None, None, jnp.asarray(sink), scale)
    sel = np.broadcast_to(ks[:, None, 5:], (1, 2, 3, ks.shape[-1]))
    split = sparse_attention(jnp.asarray(q), jnp.asarray(ks[:, :5]), jnp.asarray(ms[:, :, :5]),
                             jnp.asarray(sel), jnp.ones((1, 2, 3), bool), jnp.asarray(sink), scale)
    close(split, full)


# --------------------------------------------------------------------------------------- experts
def swiglu_np(g, u, limit):
    g = np.minimum(g, limit)                       # g clamped from above only
    u = np.clip(u, -limit, limit)                  # u clamped on both sides
    return g / (1.0 + np.exp(-g)) * u


def experts_np(x, idx, weight, w1, w2, w3, layer, limit):
    x = np.asarray(x, np.float64)
    T, k = idx.shape
    out = np.zeros((T, w2.shape[2]))
    for t in range(T):
        for j in range(k):
            e = idx[t, j]
            W1, W2, W3 = (np.asarray(w[layer, e], np.float64) for w in (w1, w2, w3))
            a = swiglu_np(W1 @ x[t], W3 @ x[t], limit) * weight[t, j]      # weight before w2
            out[t] += W2 @ a
    return out


def _expert_weights(rng, R=2, E=8, I=12, d=16, mag=3.0):
    w1 = (rng.normal(size=(R, E, I, d)) * mag / np.sqrt(d)).astype(np.float32)
    w3 = (rng.normal(size=(R, E, I, d)) * mag / np.sqrt(d)).astype(np.float32)
    w2 = (rng.normal(size=(R, E, d, I)) / np.sqrt(I)).astype(np.float32)
    return w1, w2, w3


@pytest.mark.parametrize("T", [1, 5, 23])
def test_routed_experts_match_oracle(T):
    rng = np.random.default_rng(33 + T)
    R, E, k, d, limit, layer = 2, 8, 3, 16, 2.5, 1
    w1, w2, w3 = _expert_weights(rng, R, E, d=d)
    x = rng.normal(size=(T, d)).astype(np.float32)
    if T >= 5:   # uneven group sizes: expert 3 in every row, experts 6 and 7 never used
        idx = np.stack([np.concatenate([[3], rng.choice([0, 1, 2, 4, 5], size=k - 1, replace=False)])
                        for _ in range(T)]).astype(np.int32)
    else:
        idx = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]).astype(np.int32)
    weight = rng.uniform(0.1, 1.5, size=(T, k)).astype(np.float32)
    expect = experts_np(x, idx, weight, w1, w2, w3, layer, limit)
    # the clamps are exercised: some |g|, |u| exceed the limit
    h1 = np.einsum("td,tkid->tki", x.astype(np.float64), w1[layer, idx].astype(np.float64))
    assert np.any(h1 > limit) and np.any(h1 < -limit)
    args = tuple(jnp.asarray(a) for a in (x, idx, weight, w1, w2, w3)) + (jnp.asarray(layer, jnp.int32), limit)
    ga = moe_experts_gather(*args)
    gr = moe_experts_grouped(*args)
    de = moe_experts_dense(*args)
    assert ga.shape == gr.shape == de.shape == (T, d) and ga.dtype == gr.dtype == de.dtype == jnp.float32
    close(ga, expect, rtol=2e-5, atol=2e-5)
    close(gr, expect, rtol=2e-5, atol=2e-5)
    close(de, expect, rtol=2e-5, atol=2e-5)
    close(ga, gr, rtol=1e-5, atol=1e-5)
    # the other stacked layer gives a different answer (layer really selects the weights)
    other = moe_experts_gather(*args[:-2], jnp.asarray(0, jnp.int32), limit)
    assert np.max(np.abs(np.asarray(other) - np.asarray(ga))) > 1e-3


@pytest.mark.parametrize("T,k", [(40, 2), (64, 1)])
def test_grouped_experts_with_every_row_on_few_experts(T, k):
    """Skewed routing (all rows on experts 0..k-1, groups of T): the tiled grouped matmul's padding and its
    unused trailing tiles (mapped to the last expert, zero rows) leave the result exact."""
    rng = np.random.default_rng(50 + T)
    R, E, d, limit = 1, 8, 16, 2.5
    w1, w2, w3 = _expert_weights(rng, R, E, d=d)
    x = rng.normal(size=(T, d)).astype(np.float32)
    idx = np.tile(np.arange(k, dtype=np.int32), (T, 1))
    weight = rng.uniform(0.1, 1.5, size=(T, k)).astype(np.float32)
    args = tuple(jnp.asarray(a) for a in (x, idx, weight, w1, w2, w3)) + (jnp.asarray(0, jnp.int32), limit)
    close(moe_experts_grouped(*args), experts_np(x, idx, weight, w1, w2, w3, 0, limit), rtol=2e-5, atol=2e-5)


def test_routing_weight_applied_before_w2_and_act_rounding():
    """bf16 activations: a = bf16(silu(g) u w) is formed with the routing weight BEFORE w2 (spec §4.5,
    gotcha 7). Weighting after w2 is the same map in exact arithmetic but rounds differently, so the
    bf16 result is much closer to the 'before' oracle than to the 'after' one. A zero weight
    removes that expert's contribution exactly."""
    rng = np.random.default_rng(40)
    R, E, d, limit, T = 1, 4, 16, 1.0, 6
    w1, w2, w3 = _expert_weights(rng, R, E, d=d)
    x = jnp.asarray(rng.normal(size=(T, d)), jnp.bfloat16)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    idx = np.array([[0, 2], [1, 3], [2, 1], [3, 0], [0, 1], [2, 3]], np.int32)
    weight = rng.uniform(0.3, 3.0, size=(T, 2)).astype(np.float32)
    weight[0, 0] = 0.0
    bf16 = lambda v: np.asarray(jnp.asarray(v, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)  # noqa: E731
    before = np.zeros((T, d))
    after = np.zeros((T, d))
    for t in range(T):
        for j in range(2):
            e = idx[t, j]
            act = swiglu_np(w1[0, e].astype(np.float64) @ x64[t], w3[0, e].astype(np.float64) @ x64[t], limit)
            before[t] += w2[0, e].astype(np.float64) @ bf16(act * weight[t, j])
            after[t] += (w2[0, e].astype(np.float64) @ bf16(act)) * weight[t, j]
    args = (x, jnp.asarray(idx), jnp.asarray(weight), jnp.asarray(w1), jnp.asarray(w2),
            jnp.asarray(w3), jnp.asarray(0, jnp.int32), limit)
    assert np.max(np.abs(before - after)) > 1e-3
    for fn in (moe_experts_gather, moe_experts_grouped, moe_experts_grouped_nosort, moe_experts_dense):
        y = np.asarray(fn(*args), np.float64)
        err_before, err_after = np.max(np.abs(y - before)), np.max(np.abs(y - after))
        assert err_before < 1e-4 < err_after, (fn.__name__, err_before, err_after)
        only = experts_np(x64[:1], idx[:1, 1:], weight[:1, 1:], w1, w2, w3, 0, limit)
        close(y[:1], only, rtol=1e-2, atol=1e-2)   # expert 0 of token 0 has weight 0


def test_shared_expert_matches_oracle():
    rng = np.random.default_rng(41)
    d, I, limit = 16, 24, 1.5
    w1 = (rng.normal(size=(I, d)) * 3 / np.sqrt(d)).astype(np.float32)
    w3 = (rng.normal(size=(I, d)) * 3 / np.sqrt(d)).astype(np.float32)
    w2 = (rng.normal(size=(d, I)) / np.sqrt(I)).astype(np.float32)
    x = rng.normal(size=(2, 5, d)).astype(np.float32)
    y = shared_expert(jnp.asarray(x), jnp.asarray(w1), jnp.asarray(w2), jnp.asarray(w3), limit)
    assert y.shape == x.shape and y.dtype == jnp.float32
    x64 = x.astype(np.float64)
    a = swiglu_np(x64 @ w1.T.astype(np.float64), x64 @ w3.T.astype(np.float64), limit)
    close(y, a @ w2.T.astype(np.float64), rtol=2e-5, atol=2e-5)


# --------------------------------------------------------------------------------------- routing
def _route_config(E, k, scale):
    return preset("v4-flash").replace(n_routed_experts=E, n_activated_experts=k, route_scale=scale)


def route_np(x, W, bias, tid2eid, tokens, k, route_scale):
    logits = np.asarray(x, np.float64) @ np.asarray(W, np.float64).T
    s = np.sqrt(np.log1p(np.exp(logits)))                         # sqrtsoftplus
    if tid2eid is not None:
        idx = np.asarray(tid2eid)[tokens]
    else:
        idx = np.argsort(-(s + bias), axis=-1, kind="stable")[:, :k]   # bias only steers the choice
    w = np.take_along_axis(s, idx, axis=-1)
    return idx, route_scale * w / w.sum(-1, keepdims=True), s


def _by_expert(idx, w):
    return [dict(zip(map(int, i), map(float, ww))) for i, ww in zip(np.asarray(idx), np.asarray(w))]


def test_route_bias_steered_topk():
    rng = np.random.default_rng(42)
    T, d, E, k, scale = 32, 16, 16, 4, 1.5
    x = rng.normal(size=(T, d)).astype(np.float32)
    W = (rng.normal(size=(E, d)) / 2).astype(np.float32)
    bias = (rng.normal(size=(E,)) * 0.5).astype(np.float32)
    idx, w = route(jnp.asarray(x), jnp.zeros((T,), jnp.int32), {"weight": jnp.asarray(W), "bias": jnp.asarray(bias)},
                   config=_route_config(E, k, scale), hash_moe=False)
    assert idx.shape == w.shape == (T, k) and idx.dtype == jnp.int32 and w.dtype == jnp.float32
    e_idx, e_w, s = route_np(x, W, bias, None, None, k, scale)
    # the bias matters for this input (otherwise the test would not see it)
    plain = np.argsort(-s, axis=-1)[:, :k]
    assert any(set(a) != set(b) for a, b in zip(plain, e_idx))
    got, want = _by_expert(idx, w), _by_expert(e_idx, e_w)
    for g, wnt in zip(got, want):
        assert set(g) == set(wnt)
        close([g[e] for e in sorted(g)], [wnt[e] for e in sorted(wnt)])
    close(np.asarray(w).sum(-1), np.full(T, scale))


def test_route_hash_uses_tid2eid_and_score_weights():
    rng = np.random.default_rng(43)
    T, d, E, k, V, scale = 10, 16, 16, 3, 50, 2.5
    x = rng.normal(size=(T, d)).astype(np.float32)
    W = (rng.normal(size=(E, d)) / 2).astype(np.float32)
    tid2eid = np.stack([rng.choice(E, size=k, replace=False) for _ in range(V)]).astype(np.int32)
    tokens = rng.integers(0, V, size=(T,)).astype(np.int32)
    idx, w = route(jnp.asarray(x), jnp.asarray(tokens), {"weight": jnp.asarray(W), "tid2eid": jnp.asarray(tid2eid)},
                   config=_route_config(E, k, scale), hash_moe=True)
    e_idx, e_w, _ = route_np(x, W, None, tid2eid, tokens, k, scale)
    np.testing.assert_array_equal(np.asarray(idx), e_idx)
    close(w, e_w)
    assert np.std(np.asarray(w)) > 1e-3         # weights are the scores, not uniform


# --------------------------------------------------------------------------------------- indexer
IDX_D, IDX_DI, IDX_H, IDX_R, IDX_M = 12, 16, 8, 8, 4
IDX_FREQS = (160000.0 ** (-2.0 * np.arange(IDX_R // 2) / IDX_R)).astype(np.float32)


def _rope_np(v, t, f):
    v = np.asarray(v, np.float64).copy()
    r, D = 2 * len(f), v.shape[-1]
    ang = (np.float32(t) * np.asarray(f, np.float32)).astype(np.float64)
    a, b = v[..., D - r::2].copy(), v[..., D - r + 1::2].copy()
    v[..., D - r::2] = a * np.cos(ang) - b * np.sin(ang)
    v[..., D - r + 1::2] = a * np.sin(ang) + b * np.cos(ang)
    return v


def _index_keys_np(x, p, m, eps):
    """Indexer compressor (ratio m, overlap), spec §4.4.4/4.4.5 without the fp4/Hadamard simulation."""
    x = np.asarray(x, np.float64)
    a = x @ p["wkv"].T.astype(np.float64)
    z = x @ p["wgate"].T.astype(np.float64) + p["ape"].astype(np.float64)[np.arange(len(x)) % m]
    Dc = p["norm"].shape[0]
    keys = []
    for j in range(len(x) // m):
        cur = slice(j * m, (j + 1) * m)
        pa = a[(j - 1) * m:j * m, :Dc] if j else np.zeros((m, Dc))
        pz = z[(j - 1) * m:j * m, :Dc] if j else np.full((m, Dc), -np.inf)
        A, Z = np.concatenate([pa, a[cur, Dc:]]), np.concatenate([pz, z[cur, Dc:]])
        w = np.exp(Z - Z.max(0))
        pooled = (w / w.sum(0) * A).sum(0)
        e = p["norm"] * pooled / np.sqrt(np.mean(pooled ** 2) + eps)
        keys.append(_rope_np(e, j * m, IDX_FREQS))
    return np.array(keys).reshape(-1, Dc)


def test_index_select():
    rng = np.random.default_rng(44)
    topk, max_len, q_lora, eps = 3, 40, 10, 1e-6
    config = preset("v4-flash").replace(index_n_heads=IDX_H, index_head_dim=IDX_DI, index_topk=topk,
                                        rope_head_dim=IDX_R, norm_eps=eps)
    p = {
        "compressor": {"wkv": (rng.normal(size=(2 * IDX_DI, IDX_D)) / 3).astype(np.float32),
                       "wgate": rng.normal(size=(2 * IDX_DI, IDX_D)).astype(np.float32) / 2,
                       "ape": rng.normal(size=(IDX_M, 2 * IDX_DI)).astype(np.float32),
                       "norm": rng.uniform(0.5, 1.5, size=(IDX_DI,)).astype(np.float32)},
        "wq_b": (rng.normal(size=(IDX_H * IDX_DI, q_lora)) / 3).astype(np.float32),
        "weights_proj": rng.normal(size=(IDX_H, IDX_D)).astype(np.float32),
    }
    pj = jax.tree_util.tree_map(jnp.asarray, p)
    tc = max_len // IDX_M
    R, B, layer = 2, 2, 1
    st = {"ikeys": jnp.zeros((R, B, tc + 1, IDX_DI), jnp.float32),
          "ibuf_kv": jnp.zeros((R, B, 2 * IDX_M + 1, 2 * IDX_DI), jnp.float32),
          "ibuf_score": jnp.full((R, B, 2 * IDX_M + 1, 2 * IDX_DI), -jnp.inf, jnp.float32)}
    T = [33, 26]
    xs = [rng.normal(size=(n, IDX_D)).astype(np.float32) for n in T]
    qs = [rng.normal(size=(n, q_lora)).astype(np.float32) for n in T]
    keys_np = [_index_keys_np(xs[b], p["compressor"], IDX_M, eps) for b in range(B)]

    @jax.jit
    def step(x, ql, st, positions):
        chunk = make_chunk(jnp.zeros(positions.shape, jnp.int32), positions, 1000)
        return index_select(x, ql, pj, st, jnp.asarray(layer, jnp.int32), chunk, config=config,
                            numerics=Numerics(), ratio=IDX_M,
                            freqs=IDX_FREQS)

    S = 11
    plans = [[11, 5, 11, 6], [3, 11, 1, 11]]
    done = [0, 0]
    n_checked = n_exact = 0
    for i in range(4):
        x = np.zeros((B, S, IDX_D), np.float32)
        ql = np.zeros((B, S, q_lora), np.float32)
        pos = np.full((B, S), -1, np.int32)
        for b in range(B):
            n = plans[b][i]
            x[b, :n], ql[b, :n] = xs[b][done[b]:done[b] + n], qs[b][done[b]:done[b] + n]
            pos[b, :n] = np.arange(done[b], done[b] + n)
        idx, sel, st, _ = step(jnp.asarray(x), jnp.asarray(ql), st, jnp.asarray(pos))
        idx, sel = np.asarray(idx), np.asarray(sel)
        assert idx.shape == sel.shape == (B, S, min(topk, tc + 1))
        for b in range(B):
            for s in range(plans[b][i]):
                t = done[b] + s
                vis = (t + 1) // IDX_M
                # oracle score(t, j) = Σ_h w_h relu(q_h · K_j), w = (W_w x) · DI^-1/2 · nI^-1/2, j < vis
                q = _rope_np((qs[b][t].astype(np.float64) @ p["wq_b"].T.astype(np.float64)).reshape(IDX_H, IDX_DI),
                             t, IDX_FREQS)
                w = (p["weights_proj"].astype(np.float64) @ xs[b][t]) * IDX_DI ** -0.5 * IDX_H ** -0.5
                score = (np.maximum(q @ keys_np[b][:vis].T, 0.0) * w[:, None]).sum(0)       # [vis]
                picked = idx[b, s][sel[b, s]]
                n_sel = min(topk, vis)
                assert len(picked) == n_sel and len(set(picked.tolist())) == n_sel
                assert np.all(picked < vis)
                if n_sel:
                    order = np.sort(score)[::-1]
                    kth = order[n_sel - 1]
                    assert np.all(score[picked] >= kth - 1e-5 * max(1.0, abs(kth)))      # tie-aware
                    if n_sel == vis or order[n_sel - 1] - order[n_sel] > 1e-4:
                        assert set(picked.tolist()) == set(np.argsort(-score)[:n_sel].tolist())
                        n_exact += 1
                n_checked += 1
        for b in range(B):
            done[b] += plans[b][i]
    assert n_checked == sum(T) and n_exact > sum(T) // 2
    # the indexer key cache holds the compressed keys
    ikeys = np.asarray(st["ikeys"])
    for b in range(B):
        close(ikeys[layer, b, :len(keys_np[b])], keys_np[b], rtol=2e-5, atol=2e-5)
