"""Sparse attention with a sink as an NKI kernel (twin: kernels/reference.py `sparse_attention`, model-spec §4.4.6).

Per query token (b, s) the H <= 128 heads sit on partitions and its key list on the free axis: the shared keys
k_shared[b] (window ring + this chunk's keys, plus every visible compressed entry in V4 ratio-128 layers) followed
by its own selected keys k_sel[b, s] (indexer top-k), one softmax over both. K = V. Two entry points, as NKI has
no optional tensors: `sparse_attention_kernel` (shared and selected keys) and `sparse_attention_shared_kernel`
(shared keys only: window-only layers, the DSpark drafter).

Tiling (PE array: contraction on partitions, stationary free <= 128, moving free <= 512):
- keys come in blocks of <= 512, each as <= 4 row tiles [<= 128 keys, D] read with contiguous DMAs (the V
  operand) and transposed on the PE array (nc_transpose through PSUM) into Kᵀ [128 d, D/128, <= 512 keys];
  q [H, D] is read once per token and transposed the same way into Qᵀ [128 d, D/128, H].
- logits [H, <= 512 keys] = Σ over D/128 chunks of Qᵀ-stationary x Kᵀ-moving, accumulated in one fp32 PSUM bank,
  evacuated as psum · scale + mask bias into an fp32 SBUF row [H, T + K]. The bias is 0 for a visible key and
  _MASKED for a masked one (uint8 masks broadcast over the head partitions by a stride-0 DMA).
- softmax in fp32 as the twin: M = max(max_j l_j, sink) ([H, 1]), e = exp(l - M) with its row sum (one Scalar
  Engine activation with a per-partition bias and an add-reduce), denominator Σ e + exp(sink - M), p = e · (1 /
  denominator) · mask cast to q's dtype. The Scalar Engine's exp is a piece-wise approximation that does not
  return exactly 0 for a masked key's l - 30000 - M (only something in [0, FLT_MIN]), so the 0/1 mask multiplies
  p: a masked key's p is exactly 0, and a row whose keys are all masked (warm-up rows) gives exactly 0, as the
  twin's -inf does. (The denominator keeps the masked keys' <= FLT_MIN terms: a relative change below
  L·2⁻¹²⁶.) The multiply rides in the p instruction (a scalar_tensor_tensor with the uint8 mask tile as its
  second operand in place of a tensor_scalar): no extra instruction, one more [H, L] operand read.
- P·V: Pᵀ tiles [<= 128 keys, H] (nc_transpose) stationary x the key row tiles [<= 128 keys, D] moving,
  accumulated over every key tile into one PSUM tile [H, D] (D = 512 fp32: one 2 KiB bank), cast at evacuation.
- prefill (S > 1): the shared keys' row tiles are loaded once per sequence and reused by its S queries, their Kᵀ
  too while it fits _KT_CACHE_BYTES per partition (beyond that Kᵀ is rebuilt per query: PE work, no HBM).

LNC: the query tokens (b, s), flattened, are split over the launch's programs (`program_share`): each core reads
its tokens' keys and writes their outputs, so with B·S >= 2 (decode with two or more sequences, prefill) the key
stream and every engine's work split in two (an odd count leaves one core one token more). With a single query
(decode at B = 1) the heads are split instead (splitting its keys would need a cross-core merge of the softmax
statistics): each core computes its heads' softmax (the sink is per head) and P·V over all the keys, which halves
the q, mask and output DMAs but neither the key stream, read by both cores, nor the instruction count (an engine
instruction's time is set by its free size, keys or D, not by the partitions it covers).

HBM traffic per call: B·T·D·e (shared keys, once per sequence and core) + B·S·K·D·e (selected keys) + 2·B·S·H·D·e
(q, out) + B·S·H·(T + K) (mask bytes, read once per head partition) + 4·H (sink), with e = itemsize of q; a single
query split by heads reads its keys on both cores.
SBUF per partition: (T + K)·(D·e/128 + 4 + e + 1) bytes per query (key rows, fp32 logits, p, mask), plus the
cached shared Kᵀ (D/128·T·e)."""

from __future__ import annotations

import jax.numpy as jnp
import nki
import nki.isa as nisa
import nki.language as nl

from .launch import launch, program_share

__all__ = ["sparse_attention_kernel", "sparse_attention_shared_kernel", "sparse_attention"]

# A masked key's logit is offset by this: exactly representable, far below the row max (|l| is O(10) in these
# models), so its exp is at most FLT_MIN; the mask multiply then makes its p exactly 0.
_MASKED = -30000.0
_KT_CACHE_BYTES = 48 * 1024     # per partition, for the shared keys' Kᵀ kept across the queries of a sequence


def _transpose_rows(rows, subs, nb: int, D: int, dt):
    """Kᵀ [128 d, D/dc, nb] (SBUF) of a key block's row tiles rows [128, len(subs), D] (subs: keys per tile, nb in
    all)."""
    P = nl.tile_size.pmax
    dc = min(D, P)
    kt = nl.ndarray((dc, D // dc, nb), dt, buffer=nl.sbuf)
    for c in range(D // dc):
        pk = nl.ndarray((dc, nb), dt, buffer=nl.psum)
        for j in range(len(subs)):
            nt = subs[j]
            nisa.nc_transpose(dst=pk[:, j * P:j * P + nt], data=rows[0:nt, j, c * dc:(c + 1) * dc])
        nisa.tensor_copy(dst=kt[:, c, :], src=pk)
    return kt


def _key_blocks(keys, offset: int, n: int, D: int, dt, with_kt: bool):
    """The n key rows [n, D] at element `offset` of `keys` (HBM) as blocks of <= 512 keys: (first key, keys per row
    tile, keys in the block, row tiles [128, tiles, D], Kᵀ, or the row tiles again where with_kt is False)."""
    P, NB = nl.tile_size.pmax, nl.tile_size.gemm_moving_fmax
    blocks = []
    for k0 in range(0, n, NB):
        nb = min(NB, n - k0)
        subs = []
        for j0 in range(0, nb, P):
            subs.append(min(P, nb - j0))
        rows = nl.ndarray((P, len(subs), D), dt, buffer=nl.sbuf)
        for j in range(len(subs)):
            nisa.dma_copy(dst=rows[0:subs[j], j, :],
                          src=keys.ap([[D, subs[j]], [1, D]], offset=offset + (k0 + j * P) * D))
        kt = rows
        if with_kt:
            kt = _transpose_rows(rows, subs, nb, D, dt)
        blocks.append((k0, subs, nb, rows, kt))
    return blocks


def _query_head_t(q, tok: int, h0: int, hn: int, D: int, dt):
    """Qᵀ [128 d, D/dc, hn] of heads h0 .. h0+hn of query token tok = b·S + s (SBUF)."""
    dc = min(D, nl.tile_size.pmax)
    qs = nl.ndarray((hn, D), dt, buffer=nl.sbuf)
    nisa.dma_copy(dst=qs, src=q.ap([[D, hn], [1, D]], offset=(tok * q.shape[2] + h0) * D))
    pq = nl.ndarray((dc, D // dc, hn), dt, buffer=nl.psum)
    for c in range(D // dc):
        nisa.nc_transpose(dst=pq[:, c, :], data=qs[:, c * dc:(c + 1) * dc])
    qt = nl.ndarray((dc, D // dc, hn), dt, buffer=nl.sbuf)
    nisa.tensor_copy(dst=qt, src=pq)
    return qt


def _logits(lg, qt, blocks, cached: bool, base: int, scale: float, hn: int, D: int, dt):
    """lg[:, base + k] (holding the mask bias) += scale · q·k for every key of `blocks` (cached: their Kᵀ is
    built, else it is built here)."""
    dc = min(D, nl.tile_size.pmax)
    for blk in blocks:
        k0, subs, nb, rows, kt = blk
        if not cached:
            kt = _transpose_rows(rows, subs, nb, D, dt)
        ps = nl.ndarray((hn, nb), nl.float32, buffer=nl.psum)
        for c in range(D // dc):
            nisa.nc_matmul(dst=ps, stationary=qt[:, c, :], moving=kt[:, c, :], accumulate=c > 0)
        cols = lg[:, base + k0:base + k0 + nb]
        nisa.scalar_tensor_tensor(dst=cols, data=ps, op0=nl.multiply, operand0=float(scale), op1=nl.add,
                                  operand1=cols)


def _p_times_v(acc, p, blocks, base: int, first: bool, hn: int, dt) -> bool:
    """acc [hn, D] (PSUM) += Σ_k p[:, base + k] · v_k over `blocks`; returns whether acc is still unwritten."""
    P = nl.tile_size.pmax
    for blk in blocks:
        k0, subs, nb, rows, kt = blk
        ppt = nl.ndarray((P, len(subs), hn), dt, buffer=nl.psum)
        full = 0                                       # row tiles of 128 keys (all but a block's last)
        for j in range(len(subs)):
            nt = subs[j]
            c0 = base + k0 + j * P
            nisa.nc_transpose(dst=ppt[0:nt, j, :], data=p[:, c0:c0 + nt])
            if nt == P:
                full += 1
        pt = nl.ndarray((P, len(subs), hn), dt, buffer=nl.sbuf)
        if full:
            nisa.tensor_copy(dst=pt[:, 0:full, :], src=ppt[:, 0:full, :])
        if full < len(subs):                           # the block's last, partial row tile
            nt = subs[len(subs) - 1]
            nisa.tensor_copy(dst=pt[0:nt, full, :], src=ppt[0:nt, full, :])
        for j in range(len(subs)):
            nt = subs[j]
            nisa.nc_matmul(dst=acc, stationary=pt[0:nt, j, :], moving=rows[0:nt, j, :], accumulate=not first)
            first = False
    return first


def _attention(q, k_shared, mask_shared, sink, scale: float, k_sel, mask_sel, K: int):
    """The body of both entry points; K = 0: no selected keys (k_sel and mask_sel are not read)."""
    B, S, H, D = q.shape
    T = k_shared.shape[1]
    L = T + K
    dt = q.dtype
    assert k_shared.dtype == dt and mask_shared.shape == (B, S, T)
    assert H <= nl.tile_size.pmax, "heads sit on the partitions: H <= 128"
    assert D <= nl.tile_size.gemm_moving_fmax and (D <= 128 or D % 128 == 0), "P·V holds [H, D] in one PSUM bank"
    out = nl.ndarray((B, S, H, D), dt, buffer=nl.shared_hbm)
    programs = 1
    if nl.program_ndim() != 0:
        programs = nl.num_programs(axes=0)
    N = B * S
    tok0, ntok = program_share(N)                      # this core's query tokens (b·S + s) ...
    h0, hn = 0, H
    if N < programs:                                   # ... or, for a single query, its heads
        assert H >= programs, "a single query's heads are split over the cores"
        tok0, ntok = 0, N
        h0, hn = program_share(H)
    sink_t = nl.ndarray((hn, 1), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=sink_t, src=sink.ap([[1, hn], [1, 1]], offset=h0))
    e = 4 if dt == nl.float32 else 2
    keep_kt = S > 1 and (D // min(D, 128)) * T * e <= _KT_CACHE_BYTES
    for b in range(tok0 // S, (tok0 + ntok - 1) // S + 1):
        shared = _key_blocks(k_shared, b * T * D, T, D, dt, with_kt=keep_kt)
        for s in range(max(tok0 - b * S, 0), min(tok0 + ntok - b * S, S)):
            tok = b * S + s
            sel = []
            if K:
                sel = _key_blocks(k_sel, tok * K * D, K, D, dt, with_kt=True)
            # mask bias: 0 where visible, _MASKED where not, as the fp32 logits row it is then added into
            m8 = nl.ndarray((hn, L), nl.uint8, buffer=nl.sbuf)
            nisa.dma_copy(dst=m8[:, 0:T], src=mask_shared.ap([[0, hn], [1, T]], offset=tok * T))
            if K:
                nisa.dma_copy(dst=m8[:, T:L], src=mask_sel.ap([[0, hn], [1, K]], offset=tok * K))
            lg = nl.ndarray((hn, L), nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=lg, data=m8, op0=nl.subtract, operand0=1.0, op1=nl.multiply,
                               operand1=-_MASKED)
            qt = _query_head_t(q, tok, h0, hn, D, dt)
            _logits(lg, qt, shared, keep_kt, 0, scale, hn, D, dt)
            _logits(lg, qt, sel, True, T, scale, hn, D, dt)
            # softmax with the sink in the denominator only
            mx = nl.ndarray((hn, 1), nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=mx, op=nl.maximum, data=lg, axis=1)
            nisa.tensor_scalar(dst=mx, data=mx, op0=nl.maximum, operand0=sink_t, op1=nl.multiply, operand1=-1.0)
            den = nl.ndarray((hn, 1), nl.float32, buffer=nl.sbuf)
            nisa.activation_reduce(dst=lg, op=nl.exp, data=lg, reduce_op=nl.add, reduce_res=den, bias=mx)
            es = nl.ndarray((hn, 1), nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=es, op=nl.exp, data=sink_t, bias=mx)
            nisa.tensor_tensor(dst=den, data1=den, data2=es, op=nl.add)
            nisa.reciprocal(dst=den, data=den)
            p = nl.ndarray((hn, L), dt, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(dst=p, data=lg, op0=nl.multiply, operand0=den, op1=nl.multiply, operand1=m8)
            # P·V over both key lists into one fp32 PSUM tile
            acc = nl.ndarray((hn, D), nl.float32, buffer=nl.psum)
            first = _p_times_v(acc, p, shared, 0, True, hn, dt)
            _p_times_v(acc, p, sel, T, first, hn, dt)
            o = nl.ndarray((hn, D), dt, buffer=nl.sbuf)
            nisa.tensor_copy(dst=o, src=acc)
            nisa.dma_copy(dst=out.ap([[D, hn], [1, D]], offset=(tok * H + h0) * D), src=o)
    return out


def sparse_attention_kernel(q, k_shared, mask_shared, sink, scale: float, k_sel, mask_sel):
    """q [B, S, H, D], k_shared [B, T, D], mask_shared uint8 [B, S, T] (1 = visible), sink fp32 [H], k_sel
    [B, S, K, D], mask_sel uint8 [B, S, K] -> [B, S, H, D] in q's dtype. Keys in q's dtype."""
    assert k_sel.dtype == q.dtype and mask_sel.shape == k_sel.shape[0:3]
    return _attention(q, k_shared, mask_shared, sink, scale, k_sel, mask_sel, k_sel.shape[2])


def sparse_attention_shared_kernel(q, k_shared, mask_shared, sink, scale: float):
    """As sparse_attention_kernel without selected keys: q [B, S, H, D], k_shared [B, T, D], mask_shared uint8
    [B, S, T], sink fp32 [H] -> [B, S, H, D] in q's dtype."""
    return _attention(q, k_shared, mask_shared, sink, scale, None, None, 0)


_sparse_attention = nki.jit(sparse_attention_kernel)
_sparse_attention_shared = nki.jit(sparse_attention_shared_kernel)


def sparse_attention(q, k_shared, mask_shared, k_sel, mask_sel, sink, scale):
    """The JAX op (the reference's signature): q [B, S, H, D], keys in q's dtype, bool masks (k_sel, mask_sel both
    None: no selected keys) -> [B, S, H, D] in q's dtype. The masks go in as uint8, the sink as fp32."""
    args = (q, k_shared, mask_shared.astype(jnp.uint8), sink.astype(jnp.float32), float(scale))
    if k_sel is None:
        return launch(_sparse_attention_shared)(*args)
    return launch(_sparse_attention)(*args, k_sel, mask_sel.astype(jnp.uint8))
