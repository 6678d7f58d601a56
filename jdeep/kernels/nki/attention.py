"""Sparse attention with a sink as an NKI kernel (twin: kernels/reference.py `sparse_attention`, model-spec §4.4.6).

Per query token (b, s) the H <= 128 heads sit on partitions and its key list on the free axis: the shared keys
k_shared[b] (window ring + this chunk's keys, plus every visible compressed entry in V4 ratio-128 layers) followed
by its own selected keys k_sel[b, s] (indexer top-k), one softmax over both. K = V.

Tiling (PE array: contraction on partitions, stationary free <= 128, moving free <= 512):
- keys come in blocks of <= 512, each as <= 4 row tiles [<= 128 keys, D] read with contiguous DMAs (the V
  operand) and transposed on the PE array (nc_transpose through PSUM) into Kᵀ [128 d, D/128, <= 512 keys];
  q [H, D] is read once per token and transposed the same way into Qᵀ [128 d, D/128, H].
- logits [H, <= 512 keys] = Σ over D/128 chunks of Qᵀ-stationary x Kᵀ-moving, accumulated in one fp32 PSUM bank,
  evacuated as psum · scale + mask bias into an fp32 SBUF row [H, T + K]. The bias is 0 for a visible key and
  _MASKED for a masked one (uint8 masks broadcast over the head partitions by a stride-0 DMA).
- softmax in fp32 as the twin: M = max(max_j l_j, sink) ([H, 1]), e = exp(l - M) with its row sum (one Scalar
  Engine activation with a per-partition bias and an add-reduce), denominator Σ e + exp(sink - M), p = e · (1 /
  denominator) cast to q's dtype. A masked logit is l - 30000: exp gives exactly 0, and a row whose keys are all
  masked (warm-up rows) has M = sink, denominator 1 and output exactly 0, as the twin's -inf gives.
- P·V: Pᵀ tiles [<= 128 keys, H] (nc_transpose) stationary x the key row tiles [<= 128 keys, D] moving,
  accumulated over every key tile into one PSUM tile [H, D] (D = 512 fp32: one 2 KiB bank), cast at evacuation.
- prefill (S > 1): the shared keys' row tiles are loaded once per sequence and reused by its S queries, their Kᵀ
  too while it fits _KT_CACHE_BYTES per partition (beyond that Kᵀ is rebuilt per query: PE work, no HBM).

HBM traffic per call: B·T·D·e (shared keys, once per sequence) + B·S·K·D·e (selected keys) + 2·B·S·H·D·e (q, out)
+ B·S·H·(T + K) (mask bytes, read once per head partition) + 4·H (sink), with e = itemsize of q.
SBUF per partition: (T + K)·(D·e/128 + 4 + e + 1) bytes per query (key rows, fp32 logits, p, mask), plus the
cached shared Kᵀ (D/128·T·e)."""

from __future__ import annotations

import jax.numpy as jnp
import nki
import nki.isa as nisa
import nki.language as nl

__all__ = ["sparse_attention_kernel", "sparse_attention"]

# A masked key's logit is offset by this: exactly representable, exp(x) is exactly 0 in fp32 below about -104, and a
# masked key cannot win the row max unless logits differ by more than 30000 (|l| is O(10) in these models).
_MASKED = -30000.0
_KT_CACHE_BYTES = 48 * 1024     # per partition, for the shared keys' Kᵀ kept across the queries of a sequence


def _transpose_rows(rows, subs, D: int, dt):
    """Kᵀ [128 d, D/dc, nb] (SBUF) of a key block's row tiles rows [128, len(subs), D] (subs: keys per tile)."""
    P = nl.tile_size.pmax
    dc = min(D, P)
    nb = sum(subs)
    kt = nl.ndarray((dc, D // dc, nb), dt, buffer=nl.sbuf)
    for c in range(D // dc):
        pk = nl.ndarray((dc, nb), dt, buffer=nl.psum)
        for j, nt in enumerate(subs):
            nisa.nc_transpose(dst=pk[:, j * P:j * P + nt], data=rows[0:nt, j, c * dc:(c + 1) * dc])
        nisa.tensor_copy(dst=kt[:, c, :], src=pk)
    return kt


def _key_blocks(keys, offset: int, n: int, D: int, dt, with_kt: bool):
    """The n key rows [n, D] at element `offset` of `keys` (HBM) as blocks of <= 512 keys: (first key, keys per row
    tile, row tiles [128, tiles, D], Kᵀ or None)."""
    P, NB = nl.tile_size.pmax, nl.tile_size.gemm_moving_fmax
    blocks = []
    for k0 in range(0, n, NB):
        nb = min(NB, n - k0)
        subs = [min(P, nb - j) for j in range(0, nb, P)]
        rows = nl.ndarray((P, len(subs), D), dt, buffer=nl.sbuf)
        for j, nt in enumerate(subs):
            nisa.dma_copy(dst=rows[0:nt, j, :], src=keys.ap([[D, nt], [1, D]], offset=offset + (k0 + j * P) * D))
        blocks.append((k0, subs, rows, _transpose_rows(rows, subs, D, dt) if with_kt else None))
    return blocks


def _query_head_t(q, b: int, s: int, H: int, D: int, dt):
    """Qᵀ [128 d, D/dc, H] of token (b, s) (SBUF)."""
    dc = min(D, nl.tile_size.pmax)
    qs = nl.ndarray((H, D), dt, buffer=nl.sbuf)
    nisa.dma_copy(dst=qs, src=q.ap([[D, H], [1, D]], offset=(b * q.shape[1] + s) * H * D))
    pq = nl.ndarray((dc, D // dc, H), dt, buffer=nl.psum)
    for c in range(D // dc):
        nisa.nc_transpose(dst=pq[:, c, :], data=qs[:, c * dc:(c + 1) * dc])
    qt = nl.ndarray((dc, D // dc, H), dt, buffer=nl.sbuf)
    nisa.tensor_copy(dst=qt, src=pq)
    return qt


def _logits(lg, qt, blocks, base: int, scale: float, H: int, D: int, dt):
    """lg[:, base + k] (holding the mask bias) += scale · q·k for every key of `blocks`."""
    dc = min(D, nl.tile_size.pmax)
    for k0, subs, rows, kt in blocks:
        nb = sum(subs)
        kt = _transpose_rows(rows, subs, D, dt) if kt is None else kt
        ps = nl.ndarray((H, nb), nl.float32, buffer=nl.psum)
        for c in range(D // dc):
            nisa.nc_matmul(dst=ps, stationary=qt[:, c, :], moving=kt[:, c, :], accumulate=c > 0)
        cols = lg[:, base + k0:base + k0 + nb]
        nisa.scalar_tensor_tensor(dst=cols, data=ps, op0=nl.multiply, operand0=float(scale), op1=nl.add,
                                  operand1=cols)


def _p_times_v(acc, p, blocks, base: int, first: bool, H: int, D: int, dt) -> bool:
    """acc [H, D] (PSUM) += Σ_k p[:, base + k] · v_k over `blocks`; returns whether acc is still unwritten."""
    P = nl.tile_size.pmax
    for k0, subs, rows, _ in blocks:
        ppt = nl.ndarray((P, len(subs), H), dt, buffer=nl.psum)
        for j, nt in enumerate(subs):
            c0 = base + k0 + j * P
            nisa.nc_transpose(dst=ppt[0:nt, j, :], data=p[:, c0:c0 + nt])
        pt = nl.ndarray((P, len(subs), H), dt, buffer=nl.sbuf)
        full = sum(1 for nt in subs if nt == P)
        if full:
            nisa.tensor_copy(dst=pt[:, 0:full, :], src=ppt[:, 0:full, :])
        if full < len(subs):                           # the block's last, partial row tile
            nt = subs[-1]
            nisa.tensor_copy(dst=pt[0:nt, full, :], src=ppt[0:nt, full, :])
        for j, nt in enumerate(subs):
            nisa.nc_matmul(dst=acc, stationary=pt[0:nt, j, :], moving=rows[0:nt, j, :], accumulate=not first)
            first = False
    return first


def sparse_attention_kernel(q, k_shared, mask_shared, sink, scale: float, k_sel=None, mask_sel=None):
    """q [B, S, H, D], k_shared [B, T, D], mask_shared uint8 [B, S, T] (1 = visible), sink fp32 [H], k_sel
    [B, S, K, D] and mask_sel uint8 [B, S, K] or both None -> [B, S, H, D] in q's dtype. Keys in q's dtype."""
    B, S, H, D = q.shape
    T = k_shared.shape[1]
    K = 0 if k_sel is None else k_sel.shape[2]
    L = T + K
    dt = q.dtype
    assert k_shared.dtype == dt and (k_sel is None or k_sel.dtype == dt) and (k_sel is None) == (mask_sel is None)
    assert H <= nl.tile_size.pmax, "heads sit on the partitions: H <= 128"
    assert D <= nl.tile_size.gemm_moving_fmax and (D <= 128 or D % 128 == 0), "P·V holds [H, D] in one PSUM bank"
    out = nl.ndarray((B, S, H, D), dt, buffer=nl.shared_hbm)
    sink_t = nl.ndarray((H, 1), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=sink_t, src=sink.ap([[1, H], [1, 1]]))
    e = 4 if dt == nl.float32 else 2
    keep_kt = S > 1 and (D // min(D, 128)) * T * e <= _KT_CACHE_BYTES
    for b in range(B):
        shared = _key_blocks(k_shared, b * T * D, T, D, dt, with_kt=keep_kt)
        for s in range(S):
            sel = [] if k_sel is None else _key_blocks(k_sel, (b * S + s) * K * D, K, D, dt, with_kt=True)
            # mask bias: 0 where visible, _MASKED where not, as the fp32 logits row it is then added into
            m8 = nl.ndarray((H, L), nl.uint8, buffer=nl.sbuf)
            nisa.dma_copy(dst=m8[:, 0:T], src=mask_shared.ap([[0, H], [1, T]], offset=(b * S + s) * T))
            if K:
                nisa.dma_copy(dst=m8[:, T:L], src=mask_sel.ap([[0, H], [1, K]], offset=(b * S + s) * K))
            lg = nl.ndarray((H, L), nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=lg, data=m8, op0=nl.subtract, operand0=1.0, op1=nl.multiply,
                               operand1=-_MASKED)
            qt = _query_head_t(q, b, s, H, D, dt)
            _logits(lg, qt, shared, 0, scale, H, D, dt)
            _logits(lg, qt, sel, T, scale, H, D, dt)
            # softmax with the sink in the denominator only
            mx = nl.ndarray((H, 1), nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=mx, op=nl.maximum, data=lg, axis=1)
            nisa.tensor_scalar(dst=mx, data=mx, op0=nl.maximum, operand0=sink_t, op1=nl.multiply, operand1=-1.0)
            den = nl.ndarray((H, 1), nl.float32, buffer=nl.sbuf)
            nisa.activation_reduce(dst=lg, op=nl.exp, data=lg, reduce_op=nl.add, reduce_res=den, bias=mx)
            es = nl.ndarray((H, 1), nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=es, op=nl.exp, data=sink_t, bias=mx)
            nisa.tensor_tensor(dst=den, data1=den, data2=es, op=nl.add)
            nisa.reciprocal(dst=den, data=den)
            p = nl.ndarray((H, L), dt, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=p, data=lg, op0=nl.multiply, operand0=den)
            # P·V over both key lists into one fp32 PSUM tile
            acc = nl.ndarray((H, D), nl.float32, buffer=nl.psum)
            first = _p_times_v(acc, p, shared, 0, True, H, D, dt)
            _p_times_v(acc, p, sel, T, first, H, D, dt)
            o = nl.ndarray((H, D), dt, buffer=nl.sbuf)
            nisa.tensor_copy(dst=o, src=acc)
            nisa.dma_copy(dst=out.ap([[D, H], [1, D]], offset=(b * S + s) * H * D), src=o)
    return out


_sparse_attention = nki.jit(sparse_attention_kernel)


def sparse_attention(q, k_shared, mask_shared, k_sel, mask_sel, sink, scale):
    """The JAX op (the reference's signature): q [B, S, H, D], keys in q's dtype, bool masks -> [B, S, H, D] in
    q's dtype. The masks go in as uint8, the sink as fp32."""
    args = (q, k_shared, mask_shared.astype(jnp.uint8), sink.astype(jnp.float32), float(scale))
    if k_sel is None:
        return _sparse_attention(*args)
    return _sparse_attention(*args, k_sel, mask_sel.astype(jnp.uint8))
