"""Lightning-indexer scores as an NKI kernel (twin: kernels/reference.py `index_scores`).

score[b, s, t] = Σ_h w[b, s, h] · relu(q[b, s, h] · keys[b, t]) in fp32, -inf where t >= visible_count[b, s].

Tiling, per batch row b and tile of <= 128 of its tokens (s on the output partitions), per tile of <= 512 keys:
- the tokens go to the PE array in groups of g = 128 / nI (2 for nI = 64, 4 for nI = 32; 1 when nI is not a
  multiple of 32): one `nc_matmul` per group, stationary qᵀ [DI, g·nI] (a transposing access pattern over q's
  rows), moving keysᵀ [DI, <= 512] (DI = 128 on partitions; the key tile is loaded once per token tile) ->
  PSUM [g·nI, keys] fp32, the per-head dot products (fp32 accumulation of the activation-dtype products);
- relu on the Scalar Engine, PSUM -> SBUF fp32;
- the weighted sum over heads is a cross-partition reduction, done on the PE array in fp32 (both operands fp32,
  as the twin sums): stationary S_j [g·nI, tokens] that is zero except column g·j + i = w[b, s, :] on the rows of
  group slot i, moving relu [g·nI, keys]; accumulating the groups of the tile in one PSUM tile lands token s's
  score row on partition s. The S_j are built once per token tile, one `tensor_scalar` each:
  (v == g·j) · wᵀ[:, j], v[p, c] = c - p // nI from an iota;
- PSUM evacuation with the visibility mask: min(score, ±inf), +inf for t < visible_count (from
  (visible_count - 0.5 - t) · inf with t from an iota): exact, no NaN, -inf where not visible;
- one DMA out of [tokens, keys] fp32: rows ready for the top-k (kernels/nki/topk.py).
LNC: the keys (the output columns) are split over the launch's programs (`program_share`: two contiguous halves at
LNC=2, each tiled by 512): a key's score row entries depend on nothing else, so each core streams half the keys and
does half the PE work at decode (S = 1) as in prefill, writing its own columns; the token setup (q, w, the S_j) is
repeated on both cores (S·nI·(DI·itemsize + 4) bytes, small beside the keys).
HBM traffic per call, per batch row: ceil(S/128)·T·DI·itemsize (keys), S·nI·(DI·itemsize + 4) per core (q, w),
S·T·4 (out).
PE time per (token group, 512 keys): 512 cycles (bf16 q·k) + 4·512 (fp32 head sum): at decode (S = 1, one group)
that is ~5 PE cycles per key, more than the key stream's HBM time on one core (docs/kernels.md); each core of
an LNC=2 launch pays it for its half of the keys."""

from __future__ import annotations

import jax.numpy as jnp
import nki
import nki.isa as nisa
import nki.language as nl

from .launch import launch, program_share

__all__ = ["index_scores_kernel", "index_scores"]


def _group(nI: int) -> int:
    """Tokens per q·k matmul: g·nI <= 128 rows, slot starts on 32-partition boundaries."""
    return nl.tile_size.pmax // nI if nI % 32 == 0 else 1


def _token_tile(out, q, keys, weights, visible_count, v, col, b: int, s0: int, n: int, key0: int, nkeys: int):
    """Scores of batch row b's tokens s0 .. s0+n for keys key0 .. key0+nkeys (tiles of <= 512)."""
    _, S, nI, DI = q.shape
    T = keys.shape[1]
    P = nl.tile_size.pmax
    NT = nl.tile_size.gemm_moving_fmax
    g = _group(nI)
    GR = g * nI
    wide = nl.float32 == q.dtype or nl.float32 == keys.dtype     # an fp32 operand needs an fp32 partner
    qdt = q.dtype
    kdt = keys.dtype
    if wide:
        qdt = nl.float32
        kdt = nl.float32
    ng = -(-n // g)
    tok0 = b * S + s0                                    # first token row of the tile
    qt = nl.ndarray((DI, ng, GR), qdt, buffer=nl.sbuf)   # qᵀ per group: DI on partitions
    wt = nl.ndarray((GR, ng), nl.float32, buffer=nl.sbuf)  # wt[i·nI + h, j] = w[b, s0 + g·j + i, h]
    full = n // g
    if full:
        nisa.dma_copy(dst=qt[:, 0:full, :], src=q.ap([[1, DI], [GR * DI, full], [DI, GR]], offset=tok0 * nI * DI))
        nisa.dma_copy(dst=wt[:, 0:full], src=weights.ap([[1, GR], [GR, full]], offset=tok0 * nI))
    if full < ng:                                        # the last, partial group
        rows = (n - full * g) * nI
        nisa.dma_copy(dst=qt[:, full, 0:rows], src=q.ap([[1, DI], [DI, rows]], offset=(tok0 + full * g) * nI * DI))
        nisa.dma_copy(dst=wt[0:rows, full:full + 1],
                      src=weights.ap([[1, rows], [1, 1]], offset=(tok0 + full * g) * nI))
    st = nl.ndarray((GR, ng, P), nl.float32, buffer=nl.sbuf)   # the head-sum stationaries S_j
    for j in range(ng):
        nisa.tensor_scalar(dst=st[:, j, 0:n], data=v[:, 0:n], op0=nl.equal, operand0=float(g * j),
                           op1=nl.multiply, operand1=wt[:, j:j + 1])
    vc = nl.ndarray((P, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=vc[0:n], src=visible_count.ap([[1, n], [1, 1]], offset=tok0))
    vcf = nl.ndarray((P, 1), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=vcf[0:n], src=vc[0:n])
    for t0 in range(key0, key0 + nkeys, NT):
        nk = min(NT, key0 + nkeys - t0)
        kt = nl.ndarray((DI, nk), kdt, buffer=nl.sbuf)   # keysᵀ: DI on partitions
        nisa.dma_copy(dst=kt, src=keys.ap([[1, DI], [DI, nk]], offset=(b * T + t0) * DI))
        ps = nl.ndarray((P, nk), nl.float32, buffer=nl.psum)
        for j in range(ng):
            rows = min(g, n - g * j) * nI
            pq = nl.ndarray((GR, nk), nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=pq[0:rows], stationary=qt[:, j, 0:rows], moving=kt)
            r = nl.ndarray((GR, nk), nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=r[0:rows], op=nl.relu, data=pq[0:rows])
            nisa.nc_matmul(dst=ps[0:n], stationary=st[0:rows, j, 0:n], moving=r[0:rows])
        # ±inf: (visible_count - 0.5 - t) · inf, never 0 · inf
        lim = nl.ndarray((P, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=lim[0:n], data=vcf[0:n], op0=nl.subtract, operand0=t0 + 0.5)
        pen = nl.ndarray((P, nk), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=pen[0:n], data=col[0:n, 0:nk], op0=nl.subtract, operand0=lim[0:n],
                           reverse0=True, op1=nl.multiply, operand1=float("inf"))
        o = nl.ndarray((P, nk), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=o[0:n], data1=ps[0:n], data2=pen[0:n], op=nl.minimum)
        nisa.dma_copy(dst=out[b, s0:s0 + n, t0:t0 + nk], src=o[0:n])


def index_scores_kernel(q, keys, weights, visible_count):
    """q [B, S, nI, DI] (bf16/fp16/fp32), keys [B, T, DI], weights fp32 [B, S, nI], visible_count int32 [B, S]
    -> fp32 [B, S, T]."""
    B, S, nI, DI = q.shape
    T = keys.shape[1]
    assert keys.shape == (B, T, DI) and weights.shape == (B, S, nI) and visible_count.shape == (B, S)
    assert DI <= 128 and nI <= 128 and weights.dtype == nl.float32 and T < 2 ** 22
    out = nl.ndarray((B, S, T), nl.float32, buffer=nl.shared_hbm)
    P, NT = nl.tile_size.pmax, nl.tile_size.gemm_moving_fmax
    key0, nkeys = program_share(T)                       # this core's keys (output columns)
    if nkeys:
        g = _group(nI)
        v = nl.ndarray((g * nI, P), nl.float32, buffer=nl.sbuf)  # v[p, c] = c - p // nI
        for i in range(g):
            nisa.iota(dst=v[i * nI:(i + 1) * nI], pattern=[[1, P]], offset=-i)
        col = nl.ndarray((P, NT), nl.float32, buffer=nl.sbuf)   # col[p, c] = c
        nisa.iota(dst=col, pattern=[[1, NT]], offset=0)
        for b in range(B):
            for s0 in range(0, S, P):
                _token_tile(out, q, keys, weights, visible_count, v, col, b, s0, min(P, S - s0), key0, nkeys)
    return out


_index_scores = nki.jit(index_scores_kernel)


def index_scores(q, keys, weights, visible_count):
    """The JAX op (the twin's signature): q [B, S, nI, DI], keys [B, T, DI], weights [B, S, nI] (scaled),
    visible_count int32 [B, S] -> fp32 scores [B, S, T]."""
    return launch(_index_scores)(q, keys, weights.astype(jnp.float32), visible_count.astype(jnp.int32))
