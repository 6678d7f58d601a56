"""DeepSeek-V4.1 building blocks against float64 numpy oracles written from model-spec.md §5-§6:
the fp4 quantiser with e4m3 scales (compressed KV), the two-level candidate blocks, the Engram gated
update, and image-token routing with bias_vl (gate temperature, 1e-20 guard)."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jdeep.kernels.quant import fp4e4_fake_quant
from jdeep.layers.engram import decode_rows, engram_update
from jdeep.layers.moe import route
from jdeep.layers.shared_attention import candidate_blocks, candidate_mask
from jdeep.numerics import Numerics
from jdeep.config.presets import preset


# ------------------------------------------------------------------------------ Qfp4e4 (compressed KV)
def fp4e4_np(x, block=16):
    xb = np.asarray(x, np.float32).reshape(*x.shape[:-1], -1, block)
    amax = np.maximum(np.abs(xb).max(-1, keepdims=True), 6 * 2.0 ** -9)
    s = (amax / 6).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)     # e4m3fn scale, round to nearest
    q = np.clip(xb / s, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
    return (q * s).reshape(x.shape)


@pytest.mark.parametrize("scale", [1e-4, 1.0, 300.0])
def test_fp4e4_fake_quant_matches_oracle(scale):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((6, 64)) * scale).astype(np.float32)
    x[0, :16] = 0.0                                    # an all-zero block (the amax floor)
    x[1, :16] = np.linspace(-1, 1, 16) * 6 * 0.75      # values on e2m1 ties
    got = np.asarray(fp4e4_fake_quant(jnp.asarray(x), 16))
    np.testing.assert_array_equal(got, fp4e4_np(x).astype(np.float32))


# ------------------------------------------------------------------------------ candidate blocks
def candidates_np(score, visible, block, top):
    """Per query: block max, newest visible block pinned, best `top` finite blocks -> bool [T]."""
    T = score.shape[-1]
    nb = -(-T // block)
    out = np.zeros(score.shape, bool)
    for q in np.ndindex(score.shape[:-1]):
        row = np.full(nb * block, -np.inf)
        row[:T] = score[q]
        pooled = row.reshape(nb, block).max(-1)
        if visible[q] > 0:
            pooled[(visible[q] - 1) // block] = np.inf
        order = sorted(range(nb), key=lambda j: (-pooled[j], j))[:top]   # ties -> lower block
        for j in order:
            if pooled[j] > -np.inf:
                out[q][j * block:(j + 1) * block] = True
    return out[..., :T]


@pytest.mark.parametrize("top", [2, 3, 50])
def test_candidate_blocks_match_oracle(top):
    rng = np.random.default_rng(2)
    B, S, T, blk = 2, 9, 27, 4
    visible = rng.integers(0, T + 1, size=(B, S))
    score = rng.standard_normal((B, S, T)).astype(np.float32)
    score[0, 0, :8] = 0.0                                      # exact ties
    score = np.where(np.arange(T) < visible[..., None], score, -np.inf).astype(np.float32)
    blocks, kept = candidate_blocks(jnp.asarray(score), jnp.asarray(visible), block=blk, top_blocks=top)
    assert blocks.shape == (B, S, top)
    got = np.asarray(candidate_mask(blocks, kept, T, blk))
    np.testing.assert_array_equal(got, candidates_np(score, visible, blk, top))


# ------------------------------------------------------------------------------ Engram gate
def engram_np(X, rows, wkv, qw, kw, eps, dead):
    B, S, n, d = X.shape
    kv = rows.reshape(B, S, -1) @ wkv.T
    keys, value = kv[..., :n * d].reshape(B, S, n, d), kv[..., n * d:]
    xn = X / np.sqrt((X ** 2).mean(-1, keepdims=True) + eps)
    kn = keys / np.sqrt((keys ** 2).mean(-1, keepdims=True) + eps)
    dot = (xn * qw * kn * kw).sum(-1) / np.sqrt(d)
    gate = 1 / (1 + np.exp(-np.copysign(np.sqrt(np.maximum(np.abs(dot), 1e-6)), dot)))
    gate = np.where(dead[..., None], 0.0, gate)
    return X + gate[..., None] * value[:, :, None, :]


def test_engram_update_matches_oracle():
    rng = np.random.default_rng(3)
    B, S, n, d, R, hd = 2, 5, 4, 32, 3, 32
    X = rng.standard_normal((B, S, n, d)).astype(np.float32)
    codes = rng.integers(0, 256, size=(B, S, R, hd)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0                           # no NaN codes
    scales = rng.integers(120, 130, size=(B, S, R, hd // 32)).astype(np.uint8)
    wkv = (rng.standard_normal(((n + 1) * d, R * hd)) / np.sqrt(R * hd) / 50).astype(np.float32)
    qw, kw = (1 + 0.1 * rng.standard_normal((2, n, d))).astype(np.float32)
    dead = np.zeros((B, S), bool)
    dead[1, 2] = True
    rows = (codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
            * np.repeat(2.0 ** (scales.astype(np.float64) - 127), 32, axis=-1))
    np.testing.assert_array_equal(np.asarray(decode_rows(jnp.asarray(codes), jnp.asarray(scales), jnp.float32)),
                                  rows.astype(np.float32))
    got = engram_update(jnp.asarray(X), {"wkv": jnp.asarray(wkv), "q_weight": jnp.asarray(qw),
                                         "k_weight": jnp.asarray(kw)},
                        jnp.asarray(codes), jnp.asarray(scales), eps=1e-20, numerics=Numerics(), dead=jnp.asarray(dead))
    want = engram_np(X.astype(np.float64), rows, wkv, qw, kw, 1e-20, dead)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(got)[1, 2], X[1, 2])        # an image token's streams are untouched


# ------------------------------------------------------------------------------ routing
def test_image_tokens_route_with_bias_vl():
    cfg = preset("v41-flash").replace(n_routed_experts=16, n_activated_experts=4, gate_temp=2.0)
    rng = np.random.default_rng(4)
    T, d, E, k = 12, 8, 16, 4
    x = rng.standard_normal((T, d)).astype(np.float32)
    W = rng.standard_normal((E, d)).astype(np.float32)
    bias, bias_vl = rng.standard_normal((2, E)).astype(np.float32) * 3
    tokens = rng.integers(0, 100, size=T)
    tokens[::3] = cfg.image_token_id
    idx, w = route(jnp.asarray(x), jnp.asarray(tokens, jnp.int32),
                   {"weight": jnp.asarray(W), "bias": jnp.asarray(bias), "bias_vl": jnp.asarray(bias_vl)},
                   config=cfg, hash_moe=False)
    s = np.sqrt(np.log1p(np.exp((x.astype(np.float64) @ W.T) / cfg.gate_temp)))
    for t in range(T):
        b = bias_vl if tokens[t] == cfg.image_token_id else bias
        want = np.argsort(-(s[t] + b), kind="stable")[:k]
        assert set(np.asarray(idx[t]).tolist()) == set(want.tolist())
        ww = s[t][want]
        np.testing.assert_allclose(sorted(np.asarray(w[t])), sorted(cfg.route_scale * ww / (ww.sum() + 1e-20)),
                                   rtol=1e-5)
