"""The compressor's softmax-gated pooling as an NKI kernel (twin: kernels/reference.py `softmax_pool`).

out[g, c] = Σ_m softmax_m(score[g, :, c]) · kv[g, m, c], fp32, for N groups of m slots x C channels.

Tiling: groups on partitions, [m slots, channel chunk] on the free axis, fp32. With few groups (decode: one group
per sequence) each group's channels are split over several partition-rows (kernels/nki/rows.py), so a decode call
still fills the lanes. LNC: the partition-rows (group, channel block) are split over the launch's programs, each
core taking a contiguous run in tiles of up to 128 and writing its own output runs (decode, one group of C = 512:
32 partition-rows of 16 channels, 16 per core; prefill, 130 groups: 65 per core). Channels are chunked so that one
[m, chunk] tile is <= 32 KiB per partition (m = 128 slots, V4's ratio-128 compressor: at most 64 channels per chunk;
m <= 16: the whole C = 512). Per chunk: two DMAs in (score, kv: runs of chunk·4 contiguous bytes), then on the
Vector/Scalar Engines
- the max over slots: tensor_reduce over the last axis of the tile viewed [channels, slots] (a free-axis access
  pattern; SBUF reads any free-axis stride),
- score - max (broadcast over slots), exp, the sum over slots, e · kv and its sum over slots, one reciprocal and
  one product: num / den (the twin divides each weight first; a few fp32 ulps apart),
and one DMA out. A slot with score -inf weighs 0 (exp(-inf) = 0); a channel whose m scores are all -inf gives
NaN, as the twin does (the layer masks those groups out).
HBM traffic per call: 2·N·m·C·4 bytes in, N·C·4 out; the instruction count is ~9 per chunk: latency-bound at
decode, Vector-Engine-bound (about 4 passes over the m·C elements) at prefill."""

from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl

from .launch import launch, program_share
from .rows import programs, row_views, splits

__all__ = ["softmax_pool_kernel", "softmax_pool"]

_FREE = 8192             # fp32 elements of one [m, chunk] tile per partition (32 KiB)


def softmax_pool_kernel(score, kv):
    """score, kv fp32 [N, m, C] -> fp32 [N, C]: Σ_m softmax over m (per channel) · kv."""
    N, m, C = score.shape
    assert kv.shape == score.shape
    out = nl.ndarray((N, C), nl.float32, buffer=nl.shared_hbm)
    P = nl.tile_size.pmax
    s = splits(N, C, 4, P * programs())
    cb = C // s                                        # channels per partition-row
    cc = min(cb, max(1, _FREE // m))                   # channels per chunk
    q_first, q_count = program_share(N * s)            # this core's partition-rows (group g, block b) = g·s + b
    for q0 in range(q_first, q_first + q_count, P):
        rows = min(P, q_first + q_count - q0)
        for c0 in range(0, cb, cc):
            w = min(cc, cb - c0)
            sc = nl.ndarray((P, m, w), nl.float32, buffer=nl.sbuf)
            kt = nl.ndarray((P, m, w), nl.float32, buffer=nl.sbuf)
            for r, k, view in row_views(score, q0, rows, s, m * C, cb, [[C, m]], c0, w):
                nisa.dma_copy(dst=sc[r:r + k], src=view)
            for r, k, view in row_views(kv, q0, rows, s, m * C, cb, [[C, m]], c0, w):
                nisa.dma_copy(dst=kt[r:r + k], src=view)
            # the same tiles seen as [channels, slots]: the reductions over slots run over the last axis
            sc_t = sc.ap([[m * w, rows], [1, w], [w, m]])
            kt_t = kt.ap([[m * w, rows], [1, w], [w, m]])
            mx = nl.ndarray((P, w, 1), nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=mx[0:rows], op=nl.maximum, data=sc_t, axis=2, keepdims=True)
            nisa.tensor_tensor(dst=sc_t, data1=sc_t, data2=mx[0:rows].broadcast(2, m), op=nl.subtract)
            nisa.activation(dst=sc[0:rows], op=nl.exp, data=sc[0:rows])
            den = nl.ndarray((P, w), nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=den[0:rows], op=nl.add, data=sc_t, axis=2)
            nisa.tensor_tensor(dst=kt[0:rows], data1=kt[0:rows], data2=sc[0:rows], op=nl.multiply)
            num = nl.ndarray((P, w), nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=num[0:rows], op=nl.add, data=kt_t, axis=2)
            nisa.reciprocal(dst=den[0:rows], data=den[0:rows])
            nisa.tensor_tensor(dst=num[0:rows], data1=num[0:rows], data2=den[0:rows], op=nl.multiply)
            # partition-row q = (group g, block b) is out[g, b·cb + c0 : ...] = out's flat q·cb + c0: one view
            for r, k, view in row_views(out, q0, rows, 1, cb, cb, [], c0, w):
                nisa.dma_copy(dst=view, src=num[r:r + k])
    return out


_softmax_pool = nki.jit(softmax_pool_kernel)


def softmax_pool(score, kv):
    """The JAX op (the reference's signature): score, kv fp32 [..., m, C] -> fp32 [..., C]."""
    lead, (m, C) = score.shape[:-2], score.shape[-2:]
    return launch(_softmax_pool)(score.reshape(-1, m, C), kv.reshape(-1, m, C)).reshape(lead + (C,))
