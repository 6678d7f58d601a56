"""Tile-level building blocks of the expert GEMM kernels (kernels/nki/moe.py), NKI kernel code: the static tiling
of one weight stack (`Stack`), the fp4 decode's per-partition lanes, the moving-operand row loads, the stationary
weight slabs (fp8 codes as stored, fp4 decoded on uint16 lanes, float weights), the ue8m0 block scales and the
block-scaled projection of one 128-row output tile. moe.py's docstring has the layout, the decode and the costs."""

from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

__all__ = ["Stack", "fp4_lanes", "load_rows", "load_slab", "load_scales", "psum_chunks", "project", "P", "SLAB"]

P = 128             # partitions (k per tile, n per output tile)
SLAB = 512          # weight columns loaded (and fp4-decoded) at once
_Q = 32             # a partition quadrant: one 32-k block of an fp4 tile
_PSUM_COLS = 512    # fp32 columns of one PSUM bank


class Stack(nl.NKIObject):
    """Static tiling of one weight stack: `fmt` float / fp8 / fp4, N output features, K contraction, (bn, bk) scale
    block (fp4: (1, 32)), `op` the PE operand dtype of the moving rows (fp32 if the rows or float weights are)."""

    def __init__(self, w, scale, fmt: str, block, x_dtype):
        self.fmt = fmt
        self.N = w.shape[1]
        self.K = w.shape[2] * (2 if fmt == "fp4" else 1)
        self.KT = -(-self.K // P)
        self.op = x_dtype
        if x_dtype == nl.float32 or (fmt == "float" and w.dtype == nl.float32):
            self.op = nl.float32
        self.bn, self.bk, self.nb, self.KB = 1, P, 1, self.KT
        if fmt != "float":
            self.bn, self.bk = int(block[0]), int(block[1])
            assert P % self.bk == 0 and self.bk % _Q == 0, "k blocks of 32, 64 or 128"
            self.nb, self.KB = P // self.bk, -(-self.K // self.bk)
            if fmt == "fp4":      # even N: the decode's uint16 lanes hold the codes of 2 output rows
                assert self.bn == 1 and self.K % self.bk == 0 and self.N % 2 == 0
                assert scale.shape[1:] == (self.N, self.KB)
            else:
                assert scale.shape[1:] == (-(-self.N // self.bn), self.KB)

    def kk(self, kt: int) -> int:
        return min(P, self.K - kt * P)

    def blocks(self, kt: int) -> int:
        return -(-self.kk(kt) // self.bk)


def fp4_lanes():
    """[128, 1] uint16 (shift, mask) per partition for the decode: on the low-nibble half of each quadrant shift 4
    and mask 0x0F0F (the low nibble of each byte, moved to the byte's high half), on the high-nibble half 0 and
    0xF0F0."""
    p = nl.ndarray((P, 1), nl.int32, buffer=nl.sbuf)
    nisa.iota(dst=p, pattern=[[0, 1]], offset=0, channel_multiplier=1)
    nisa.tensor_scalar(dst=p, data=p, op0=nl.right_shift, operand0=2, op1=nl.bitwise_and, operand1=4)
    nisa.tensor_scalar(dst=p, data=p, op0=nl.bitwise_xor, operand0=4)
    shift = nl.ndarray((P, 1), nl.uint16, buffer=nl.sbuf)    # bit-vector ops keep one integer type in and out
    nisa.tensor_copy(dst=shift, src=p)
    mask = nl.ndarray((P, 1), nl.uint16, buffer=nl.sbuf)
    nisa.memset(dst=mask, value=0xF0F0)
    nisa.tensor_scalar(dst=mask, data=mask, op0=nl.right_shift, operand0=shift)
    return shift, mask


def load_rows(src, r0: int, m: int, s: Stack):
    """Rows r0..r0+m of src [N, K] as the moving operand [128 k, KT, nb·m] (op dtype): k on partitions (fp4: the
    quadrant permutation), block-diagonal over the tile's k blocks when they are smaller than the tile."""
    xq = nl.ndarray((P, s.KT, m), s.op, buffer=nl.sbuf)
    for kt in range(s.KT):
        k0 = kt * P
        kk = s.kk(kt)
        pattern = [[1, kk], [s.K, m]]
        if s.fmt == "fp4":      # partition 32j + 16h + q <- k = k0 + 32j + 2q + h
            pattern = [[_Q, kk // _Q], [1, 2], [2, _Q // 2], [s.K, m]]
        nisa.dma_copy(dst=xq[0:kk, kt, :], src=src.ap(pattern=pattern, offset=r0 * s.K + k0))
    if s.nb == 1:
        return xq
    xb = nl.ndarray((P, s.KT, s.nb * m), s.op, buffer=nl.sbuf)
    nisa.memset(dst=xb, value=0.0)
    for j in range(s.nb):
        p0 = j * s.bk
        p1 = p0 + s.bk
        nisa.tensor_copy(dst=xb[p0:p1, :, j * m:(j + 1) * m], src=xq[p0:p1, :, :])
    return xb


def load_slab(w, reg, c0: int, cn: int, s: Stack, lanes):
    """Columns c0..c0+cn of the tile's expert matrix as stationary tiles [128 k, KT, cn]: fp8 codes (fp4 decoded
    to them, `lanes` from fp4_lanes) or float weights; widened to fp32 when the rows are fp32."""
    if s.fmt == "float":
        wt = nl.ndarray((P, s.KT, cn), s.op, buffer=nl.sbuf)
        for kt in range(s.KT):
            nisa.dma_copy(dst=wt[0:s.kk(kt), kt, :], src=w.ap(pattern=[[1, s.kk(kt)], [s.K, cn]],
                                                               offset=c0 * s.K + kt * P, scalar_offset=reg,
                                                               indirect_dim=0))
        return wt
    codes = nl.ndarray((P, s.KT, cn), nl.float8_e4m3, buffer=nl.sbuf)
    if s.fmt == "fp8":
        for kt in range(s.KT):
            nisa.dma_copy(dst=codes.view(nl.uint8)[0:s.kk(kt), kt, :],
                          src=w.ap(pattern=[[1, s.kk(kt)], [s.K, cn]], offset=c0 * s.K + kt * P, scalar_offset=reg,
                                   indirect_dim=0))
    else:
        half = s.K // 2                                    # packed bytes per row
        pk = nl.ndarray((P, s.KT, cn), nl.uint8, buffer=nl.sbuf)
        for kt in range(s.KT):                             # quadrant j: its 16 bytes twice (low, high nibbles)
            nq = s.kk(kt) // _Q
            nisa.dma_copy(dst=pk[0:s.kk(kt), kt, :],
                          src=w.ap(pattern=[[_Q // 2, nq], [0, 2], [1, _Q // 2], [half, cn]],
                                   offset=c0 * half + kt * (P // 2), scalar_offset=reg, indirect_dim=0))
        # e2m1 nibble -> e4m3 byte, 2 bytes per uint16 lane: each byte's bits stay in its byte (the nibble is masked
        # before the left shift; the right shift only moves bits out of a byte's zeroed low half)
        shift, mask = lanes
        t = nl.ndarray((P, s.KT, cn // 2), nl.uint16, buffer=nl.sbuf)
        c16 = codes.view(nl.uint16)
        nisa.tensor_scalar(dst=t, data=pk.view(nl.uint16), op0=nl.bitwise_and, operand0=mask,
                           op1=nl.left_shift, operand1=shift)                # the nibble in bits 7..4
        nisa.tensor_scalar(dst=c16, data=t, op0=nl.right_shift, operand0=2, op1=nl.bitwise_and,
                           operand1=0x1C1C)                                 # (c & 7) << 2
        nisa.tensor_scalar(dst=t, data=t, op0=nl.bitwise_and, operand0=0x8080)   # the sign, bit 7
        nisa.tensor_tensor(dst=c16, data1=c16, data2=t, op=nl.bitwise_or)
    if s.op == nl.float32:                                 # an fp32 operand needs an fp32 partner (exact)
        wide = nl.ndarray((P, s.KT, cn), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=wide, src=codes)
        return wide
    return codes


def load_scales(scale, reg, n0: int, nn: int, s: Stack):
    """The ue8m0 scales of output rows n0..n0+nn, one row per partition: fp32 [128, KB] = 2^(b-127) (fp4: times 2⁶,
    undoing the decode's 2⁻⁶), from (b [+ 6]) << 23 as float32 bits (exact for b in 1..254 [248 for fp4]); None
    for float weights."""
    if s.fmt == "float":
        return None
    s8 = nl.ndarray((P, s.KB), nl.uint8, buffer=nl.sbuf)
    if s.fmt == "fp4":
        nisa.dma_copy(dst=s8[0:nn], src=scale.ap(pattern=[[s.KB, nn], [1, s.KB]], offset=n0 * s.KB,
                                                   scalar_offset=reg, indirect_dim=0))
    else:                                                  # rows of one n block share its scales
        for b in range(n0 // s.bn, -(-(n0 + nn) // s.bn)):
            p0 = max(b * s.bn, n0) - n0
            p1 = min((b + 1) * s.bn, n0 + nn) - n0
            nisa.dma_copy(dst=s8[p0:p1], src=scale.ap(pattern=[[0, p1 - p0], [1, s.KB]], offset=b * s.KB,
                                                       scalar_offset=reg, indirect_dim=0))
    s32 = nl.ndarray((P, s.KB), nl.int32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=s32[0:nn], src=s8[0:nn])
    if s.fmt == "fp4":
        nisa.tensor_scalar(dst=s32[0:nn], data=s32[0:nn], op0=nl.add, operand0=6)
    sc = nl.ndarray((P, s.KB), nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=sc.view(nl.int32)[0:nn], data=s32[0:nn], op0=nl.left_shift, operand0=23)
    return sc


def psum_chunks(s: Stack, m: int):
    """Consecutive k tiles [(t0, t1, k blocks), ...] whose partial sums (blocks · rows fp32 columns) fit one PSUM
    bank."""
    out = []
    t0 = 0
    nkb = 0
    for kt in range(s.KT):
        c = s.blocks(kt)
        if nkb > 0 and (nkb + c) * m > _PSUM_COLS:
            out.append((t0, kt, nkb))
            t0 = kt
            nkb = 0
        nkb = nkb + c
    out.append((t0, s.KT, nkb))
    return out


def project(slab, c: int, nn: int, sc, xin, m: int, s: Stack):
    """One output tile [nn, m] fp32 = W[n0:n0+nn] · rowsᵀ (n on partitions): in PSUM for float weights, else in SBUF
    with the block scales applied."""
    if s.fmt == "float":
        ps = nl.ndarray((P, m), nl.float32, buffer=nl.psum)
        for kt in range(s.KT):
            kk = s.kk(kt)
            nisa.nc_matmul(dst=ps[0:nn], stationary=slab[0:kk, kt, c:c + nn], moving=xin[0:kk, kt, 0:m])
        return ps
    acc = nl.ndarray((P, m), nl.float32, buffer=nl.sbuf)
    chunks = psum_chunks(s, m)
    for i in range(len(chunks)):
        t0, t1, nkb = chunks[i]
        kb0 = t0 * s.nb
        ps = nl.ndarray((P, nkb * m), nl.float32, buffer=nl.psum)
        for kt in range(t0, t1):                           # the partial sums of each k block, side by side
            kk = s.kk(kt)
            col = (kt * s.nb - kb0) * m
            cols = s.blocks(kt) * m
            nisa.nc_matmul(dst=ps[0:nn, col:col + cols], stationary=slab[0:kk, kt, c:c + nn],
                           moving=xin[0:kk, kt, 0:cols])
        prod = nl.ndarray((P, nkb, m), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=prod[0:nn], data1=ps[0:nn].reshape((nn, nkb, m)),
                           data2=sc.ap(pattern=[[s.KB, nn], [1, nkb], [0, m]], offset=kb0), op=nl.multiply)
        red = acc
        if i > 0:
            red = nl.ndarray((P, m), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=red[0:nn], op=nl.add, data=prod.ap(pattern=[[nkb * m, nn], [1, m], [m, nkb]]),
                           axis=2)                         # sum over the blocks, per row
        if i > 0:
            nisa.tensor_tensor(dst=acc[0:nn], data1=acc[0:nn], data2=red[0:nn], op=nl.add)
    return acc
