"""The MoE expert GEMMs as NKI kernels: routed experts with fp4, fp8 or float weights and the shared expert
(twins: kernels/reference.py `moe_experts_gather`, `moe_experts_grouped`, `moe_experts_dense`, `shared_expert`).

Two grouped-GEMM kernels serve all four ops. Rows come in tiles of <= 128 (a tile = consecutive rows that use one
expert); a per-tile expert id (int32, = layer·E + e into the [R·E, ...] stacks) is loaded into a register and every
weight read of the tile is a DMA whose start is that register (`ap(scalar_offset=reg, indirect_dim=0)`):
- `expert_gate_up_kernel`: a = swiglu(x W1ᵀ, x W3ᵀ) · row weight, fp32 [N, I], the SwiGLU (clamps, silu, the
  routing weight) fused as the epilogue of the two GEMMs;
- `expert_down_kernel`: y = a W2ᵀ, fp32 [N, d], for `a` cast and act-quantised in jnp between the two (as the
  references do).
The JAX ops prepare the rows exactly as the references (gather: one (token, expert) pair per tile; grouped: the
rows sorted by expert in padded groups, `reference.expert_groups`; dense: every local expert on every token;
shared: one expert, weight 1, tiles of 128 rows) and combine the per-row outputs in jnp.

PE layout: the weights are the stationary operand and the rows the moving one, so the outputs come out with the
weight's N (I or d) on PSUM partitions and the rows on the free axis. That puts the block scales of quantized weights
(per output row n and k block) on partitions, where one multiply applies them:
- weight tile Wᵀ [128 k, 128 n] read with a transposing access pattern over W's rows (K contiguous in HBM: a strided
  DMA with 1-byte elements, the cost gemm.py notes too), 512 output columns per slab;
- quantized weights: fp8 codes go to the PE array as trn2 float8_e4m3 as stored; fp4 codes are decoded in SBUF by 4
  bit-vector instructions on uint32 lanes (4 codes per lane): an e2m1 nibble c becomes the e4m3 byte
  ((c & 7) << 2) | ((c & 8) << 4), whose value is exactly e2m1(c)·2⁻⁶ (the 2⁶ goes into the scale). In a tile each
  32-partition quadrant holds one 32-k block: its 16 packed bytes DMA'd twice, low nibbles (even k) on the first 16
  partitions, high nibbles (odd k) on the next 16, and the rows are loaded with the same k permutation;
- per-k-block partial sums without per-block matmuls: the moving operand is block-diagonal over the tile's k
  blocks (columns (block j, row), zero outside block j's partitions), so one K = 128 matmul yields the 4 partial
  sums of a 32-k-block tile side by side; all k tiles' partial sums go into one PSUM region (<= 512 fp32 per
  partition, else in chunks), then one multiply by the decoded ue8m0 scales (broadcast over rows) and one add-reduce
  over the blocks give the output tile: DeepSeek's order (fp32 partial sums per block times the block scale). With
  128-k blocks (V4 fp8) the moving operand is the plain rows; float weights accumulate in PSUM over k;
- fp32 activations (CPU tests) need fp32 on the PE: decoded codes are widened (exact), float weights DMA-cast.

HBM traffic per call: every row tile reads its expert's three matrices (3·I·d weights at 0.53 B (fp4 + scales),
1 B (fp8) or 2 B (bf16) each: 13.4 MB per fp4 expert at V4-Flash, 18.8 MB at V4.1-Flash; the fp8 shared expert 25.2 /
35.4 MB), plus the rows: x N·d in, a N·I·4 out (then N·I in after the jnp act-quant), y N·d·4 out. The weight bytes
dominate at decode. fp4 costs the Vector Engine one element-op per weight (4 ops per uint32 of 4 codes, ~1/256 cycle
per weight), more than the weight bytes' HBM time: docs/kernels.md has the per-shape budget and the bounds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import nki
import nki.isa as nisa
import nki.language as nl

from ..linear import stack_dims
from ..reference import _act, dense_weight, expert_groups, group_rows, stacked_experts, ungroup_rows
from .swiglu import swiglu_tile

__all__ = ["expert_gate_up_kernel", "expert_down_kernel", "moe_experts_gather", "moe_experts_grouped",
           "moe_experts_dense", "shared_expert"]

_P = 128            # partitions (k per tile, n per output tile)
_SLAB = 512         # weight columns loaded (and fp4-decoded) at once
_Q = 32             # a partition quadrant: one 32-k block of an fp4 tile
_PSUM_COLS = 512    # fp32 columns of one PSUM bank


class _Stack:
    """Static tiling of one weight stack: `fmt` float / fp8 / fp4, N output features, K contraction, (bn, bk) scale
    block (fp4: (1, 32)), `op` the PE operand dtype of the moving rows (fp32 if the rows or float weights are)."""

    def __init__(self, w, scale, fmt: str, block, x_dtype):
        self.fmt = fmt
        self.N = w.shape[1]
        self.K = w.shape[2] * (2 if fmt == "fp4" else 1)
        self.KT = -(-self.K // _P)
        self.op = nl.float32 if x_dtype == nl.float32 or (fmt == "float" and w.dtype == nl.float32) else x_dtype
        if fmt == "float":
            self.bn, self.bk, self.nb, self.KB = 1, _P, 1, self.KT
            return
        self.bn, self.bk = int(block[0]), int(block[1])
        assert _P % self.bk == 0 and self.bk % _Q == 0, "k blocks of 32, 64 or 128"
        self.nb, self.KB = _P // self.bk, -(-self.K // self.bk)
        if fmt == "fp4":
            assert self.bn == 1 and self.K % self.bk == 0 and self.N % 4 == 0 and scale.shape[1:] == (self.N, self.KB)
        else:
            assert scale.shape[1:] == (-(-self.N // self.bn), self.KB)

    def kk(self, kt: int) -> int:
        return min(_P, self.K - kt * _P)

    def blocks(self, kt: int) -> int:
        return -(-self.kk(kt) // self.bk)


def _fp4_shift():
    """[128, 1] uint32 shift per partition: 4 on the low-nibble half of each quadrant (moves the nibble to the byte's
    high half), 0 on the high-nibble half."""
    p = nl.ndarray((_P, 1), nl.int32, buffer=nl.sbuf)
    nisa.iota(dst=p, pattern=[[0, 1]], offset=0, channel_multiplier=1)
    nisa.tensor_scalar(dst=p, data=p, op0=nl.right_shift, operand0=2, op1=nl.bitwise_and, operand1=4)
    nisa.tensor_scalar(dst=p, data=p, op0=nl.bitwise_xor, operand0=4)
    sh = nl.ndarray((_P, 1), nl.uint32, buffer=nl.sbuf)     # bit-vector ops keep one integer type in and out
    nisa.tensor_copy(dst=sh, src=p)
    return sh


def _load_rows(src, r0: int, m: int, s: _Stack):
    """Rows r0..r0+m of src [N, K] as the moving operand [128 k, KT, nb·m] (op dtype): k on partitions (fp4: the
    quadrant permutation), block-diagonal over the tile's k blocks when they are smaller than the tile."""
    xq = nl.ndarray((_P, s.KT, m), s.op, buffer=nl.sbuf)
    for kt in range(s.KT):
        k0, kk = kt * _P, s.kk(kt)
        if s.fmt == "fp4":      # partition 32j + 16h + q <- k = k0 + 32j + 2q + h
            pattern = [[_Q, kk // _Q], [1, 2], [2, _Q // 2], [s.K, m]]
        else:
            pattern = [[1, kk], [s.K, m]]
        nisa.dma_copy(dst=xq[0:kk, kt, :], src=src.ap(pattern=pattern, offset=r0 * s.K + k0))
    if s.nb == 1:
        return xq
    xb = nl.ndarray((_P, s.KT, s.nb * m), s.op, buffer=nl.sbuf)
    nisa.memset(dst=xb, value=0.0)
    for j in range(s.nb):
        p0, p1 = j * s.bk, (j + 1) * s.bk
        nisa.tensor_copy(dst=xb[p0:p1, :, j * m:(j + 1) * m], src=xq[p0:p1, :, :])
    return xb


def _load_slab(w, reg, c0: int, cn: int, s: _Stack, shift):
    """Columns c0..c0+cn of the tile's expert matrix as stationary tiles [128 k, KT, cn]: fp8 codes (fp4 decoded
    to them) or float weights; widened to fp32 when the rows are fp32."""
    if s.fmt == "float":
        wt = nl.ndarray((_P, s.KT, cn), s.op, buffer=nl.sbuf)
        for kt in range(s.KT):
            nisa.dma_copy(dst=wt[0:s.kk(kt), kt, :], src=w.ap(pattern=[[1, s.kk(kt)], [s.K, cn]],
                                                               offset=c0 * s.K + kt * _P, scalar_offset=reg,
                                                               indirect_dim=0))
        return wt
    codes = nl.ndarray((_P, s.KT, cn), nl.float8_e4m3, buffer=nl.sbuf)
    if s.fmt == "fp8":
        for kt in range(s.KT):
            nisa.dma_copy(dst=codes.view(nl.uint8)[0:s.kk(kt), kt, :],
                          src=w.ap(pattern=[[1, s.kk(kt)], [s.K, cn]], offset=c0 * s.K + kt * _P, scalar_offset=reg,
                                   indirect_dim=0))
    else:
        half = s.K // 2                                    # packed bytes per row
        pk = nl.ndarray((_P, s.KT, cn), nl.uint8, buffer=nl.sbuf)
        for kt in range(s.KT):                             # quadrant j: its 16 bytes twice (low, high nibbles)
            nq = s.kk(kt) // _Q
            nisa.dma_copy(dst=pk[0:s.kk(kt), kt, :],
                          src=w.ap(pattern=[[_Q // 2, nq], [0, 2], [1, _Q // 2], [half, cn]],
                                   offset=c0 * half + kt * (_P // 2), scalar_offset=reg, indirect_dim=0))
        # e2m1 nibble -> e4m3 byte, 4 bytes per uint32 lane (masks keep each byte's bits in its byte)
        t = nl.ndarray((_P, s.KT, cn // 4), nl.uint32, buffer=nl.sbuf)
        c32 = codes.view(nl.uint32)
        nisa.tensor_scalar(dst=t, data=pk.view(nl.uint32), op0=nl.left_shift, operand0=shift,
                           op1=nl.bitwise_and, operand1=0xF0F0F0F0)          # the nibble in bits 7..4
        nisa.tensor_scalar(dst=c32, data=t, op0=nl.right_shift, operand0=2, op1=nl.bitwise_and,
                           operand1=0x1C1C1C1C)                             # (c & 7) << 2
        nisa.tensor_scalar(dst=t, data=t, op0=nl.bitwise_and, operand0=0x80808080)   # the sign, bit 7
        nisa.tensor_tensor(dst=c32, data1=c32, data2=t, op=nl.bitwise_or)
    if s.op == nl.float32:                                 # an fp32 operand needs an fp32 partner (exact)
        wide = nl.ndarray((_P, s.KT, cn), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=wide, src=codes)
        return wide
    return codes


def _load_scales(scale, reg, n0: int, nn: int, s: _Stack):
    """The ue8m0 scales of output rows n0..n0+nn, one row per partition: fp32 [128, KB] = 2^(b-127) (fp4: times 2⁶,
    undoing the decode's 2⁻⁶), from (b [+ 6]) << 23 as float32 bits (exact for b in 1..254 [248 for fp4])."""
    s8 = nl.ndarray((_P, s.KB), nl.uint8, buffer=nl.sbuf)
    if s.fmt == "fp4":
        nisa.dma_copy(dst=s8[0:nn], src=scale.ap(pattern=[[s.KB, nn], [1, s.KB]], offset=n0 * s.KB,
                                                   scalar_offset=reg, indirect_dim=0))
    else:                                                  # rows of one n block share its scales
        for b in range(n0 // s.bn, -(-(n0 + nn) // s.bn)):
            p0, p1 = max(b * s.bn, n0) - n0, min((b + 1) * s.bn, n0 + nn) - n0
            nisa.dma_copy(dst=s8[p0:p1], src=scale.ap(pattern=[[0, p1 - p0], [1, s.KB]], offset=b * s.KB,
                                                       scalar_offset=reg, indirect_dim=0))
    s32 = nl.ndarray((_P, s.KB), nl.int32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=s32[0:nn], src=s8[0:nn])
    if s.fmt == "fp4":
        nisa.tensor_scalar(dst=s32[0:nn], data=s32[0:nn], op0=nl.add, operand0=6)
    sc = nl.ndarray((_P, s.KB), nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=sc.view(nl.int32)[0:nn], data=s32[0:nn], op0=nl.left_shift, operand0=23)
    return sc


def _chunks(s: _Stack, m: int):
    """Consecutive k tiles whose partial sums (blocks · rows fp32 columns) fit one PSUM bank."""
    out, t0, cols = [], 0, 0
    for kt in range(s.KT):
        c = s.blocks(kt) * m
        if cols and cols + c > _PSUM_COLS:
            out.append((t0, kt))
            t0, cols = kt, 0
        cols += c
    out.append((t0, s.KT))
    return out


def _project(slab, c: int, nn: int, sc, xin, m: int, s: _Stack):
    """One output tile [nn, m] fp32 = W[n0:n0+nn] · rowsᵀ (n on partitions): in PSUM for float weights, else in SBUF
    with the block scales applied."""
    if s.fmt == "float":
        ps = nl.ndarray((_P, m), nl.float32, buffer=nl.psum)
        for kt in range(s.KT):
            kk = s.kk(kt)
            nisa.nc_matmul(dst=ps[0:nn], stationary=slab[0:kk, kt, c:c + nn], moving=xin[0:kk, kt, 0:m])
        return ps
    acc = nl.ndarray((_P, m), nl.float32, buffer=nl.sbuf)
    for i, (t0, t1) in enumerate(_chunks(s, m)):
        kb0 = t0 * s.nb
        nkb = sum(s.blocks(kt) for kt in range(t0, t1))
        ps = nl.ndarray((_P, nkb * m), nl.float32, buffer=nl.psum)
        for kt in range(t0, t1):                           # the partial sums of each k block, side by side
            kk, col, cols = s.kk(kt), (kt * s.nb - kb0) * m, s.blocks(kt) * m
            nisa.nc_matmul(dst=ps[0:nn, col:col + cols], stationary=slab[0:kk, kt, c:c + nn],
                           moving=xin[0:kk, kt, 0:cols])
        prod = nl.ndarray((_P, nkb, m), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=prod[0:nn], data1=ps[0:nn].reshape((nn, nkb, m)),
                           data2=sc.ap(pattern=[[s.KB, nn], [1, nkb], [0, m]], offset=kb0), op=nl.multiply)
        red = acc if i == 0 else nl.ndarray((_P, m), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=red[0:nn], op=nl.add, data=prod.ap(pattern=[[nkb * m, nn], [1, m], [m, nkb]]),
                           axis=2)                         # sum over the blocks, per row
        if i:
            nisa.tensor_tensor(dst=acc[0:nn], data1=acc[0:nn], data2=red[0:nn], op=nl.add)
    return acc


def _row_tiles(src, tile_expert, rows: int, s: _Stack):
    """Per row tile of src [N, K] (`rows` rows of one expert each): (first row, its rows m, a register holding the
    tile's expert id, the rows as the moving operand [128 k, KT, nb·m])."""
    N = src.shape[0]
    n_tiles = tile_expert.shape[0]
    assert s.K == src.shape[1] and rows <= _P and n_tiles == -(-N // rows)
    ids = nl.ndarray((1, n_tiles), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=ids, src=tile_expert.ap(pattern=[[n_tiles, 1], [1, n_tiles]]))
    for t in range(n_tiles):
        r0 = t * rows
        m = min(rows, N - r0)
        reg = nisa.register_alloc()
        nisa.register_load(reg, ids[0:1, t:t + 1])
        yield r0, m, reg, _load_rows(src, r0, m, s)


def expert_gate_up_kernel(x, row_weight, tile_expert, w1, w1_scale, w3, w3_scale, limit: float, rows: int,
                          fmt: str, block):
    """x [N, d] (bf16 / fp32), row_weight fp32 [N], tile_expert int32 [ceil(N/rows)] (row tile t = rows
    t·rows.. of one expert, an index into the stacks), w1, w3 [R·E, I, d] float, fp8 codes uint8 (scales uint8
    [R·E, ceil(I/bn), ceil(d/bk)]) or fp4 packed uint8 [R·E, I, d/2] (scales uint8 [R·E, I, d/32]); block = (bn, bk)
    -> a fp32 [N, I] = silu(min(x W1ᵀ, limit)) · clamp(x W3ᵀ, ±limit) · row_weight."""
    N = x.shape[0]
    s = _Stack(w1, w1_scale, fmt, block, x.dtype)
    I = s.N
    out = nl.ndarray((N, I), nl.float32, buffer=nl.shared_hbm)
    shift = _fp4_shift() if fmt == "fp4" else None
    for r0, m, reg, xin in _row_tiles(x, tile_expert, rows, s):
        wb = nl.ndarray((_P, m), nl.float32, buffer=nl.sbuf)             # the row weights on every partition
        nisa.dma_copy(dst=wb, src=row_weight.ap(pattern=[[0, _P], [1, m]], offset=r0))
        for c0 in range(0, I, _SLAB):
            cn = min(_SLAB, I - c0)
            slabs = [_load_slab(w, reg, c0, cn, s, shift) for w in (w1, w3)]
            for n0 in range(c0, c0 + cn, _P):
                nn = min(_P, I - n0)
                h1, h3 = (_project(slab, n0 - c0, nn, None if fmt == "float" else _load_scales(sc, reg, n0, nn, s),
                                   xin, m, s) for slab, sc in zip(slabs, (w1_scale, w3_scale)))
                g = nl.ndarray((_P, m), nl.float32, buffer=nl.sbuf)
                u = nl.ndarray((_P, m), nl.float32, buffer=nl.sbuf)
                swiglu_tile(g[0:nn], h1[0:nn], h3[0:nn], u[0:nn], limit)        # the fused SwiGLU epilogue
                nisa.tensor_tensor(dst=g[0:nn], data1=g[0:nn], data2=wb[0:nn], op=nl.multiply)
                nisa.dma_copy(dst=out.ap(pattern=[[1, nn], [I, m]], offset=r0 * I + n0), src=g[0:nn])
    return out


def expert_down_kernel(a, tile_expert, w2, w2_scale, rows: int, fmt: str, block):
    """a [N, I] (bf16 / fp32, act-quantised), tile_expert int32 [ceil(N/rows)], w2 [R·E, d, I] (formats as in
    expert_gate_up_kernel) -> y fp32 [N, d] = a W2ᵀ."""
    N = a.shape[0]
    s = _Stack(w2, w2_scale, fmt, block, a.dtype)
    d = s.N
    out = nl.ndarray((N, d), nl.float32, buffer=nl.shared_hbm)
    shift = _fp4_shift() if fmt == "fp4" else None
    for r0, m, reg, ain in _row_tiles(a, tile_expert, rows, s):
        for c0 in range(0, d, _SLAB):
            cn = min(_SLAB, d - c0)
            slab = _load_slab(w2, reg, c0, cn, s, shift)
            for n0 in range(c0, c0 + cn, _P):
                nn = min(_P, d - n0)
                y = _project(slab, n0 - c0, nn, None if fmt == "float" else _load_scales(w2_scale, reg, n0, nn, s),
                             ain, m, s)
                if fmt == "float":                         # DMA does not read PSUM
                    ys = nl.ndarray((_P, m), nl.float32, buffer=nl.sbuf)
                    nisa.tensor_copy(dst=ys[0:nn], src=y[0:nn])
                    y = ys
                nisa.dma_copy(dst=out.ap(pattern=[[1, nn], [d, m]], offset=r0 * d + n0), src=y[0:nn])
    return out


_gate_up = nki.jit(expert_gate_up_kernel)
_down = nki.jit(expert_down_kernel)


# ---------------------------------------------------------------------------------------------- the JAX ops
def _operands(w, numerics, stacked: bool):
    """One weight (a stack [R, E, ...] flattened to [R·E, ...], or one matrix as a stack of 1) -> (values, scale,
    fmt, block) for the kernels."""
    def flat(a):
        return a.reshape((-1,) + a.shape[2:]) if stacked else a[None]

    if not isinstance(w, dict) or "decoded" in w:
        return flat(w["decoded"] if isinstance(w, dict) else w), None, "float", (1, 1)
    if "packed" in w:
        return flat(w["packed"]), flat(w["scale"]), "fp4", (1, int(numerics.fp4_block))
    if not numerics.trn2_weights:
        raise ValueError("the NKI expert GEMMs read fp8 codes as trn2 e4m3: load the checkpoint with fp8_max=240")
    return flat(w["codes"]), flat(w["scale"]), "fp8", tuple(int(b) for b in numerics.weight_block)


def _ffn(rows, row_weight, tile_ids, per_tile: int, w1, w2, w3, limit, numerics, dtype, stacked: bool):
    """Both kernels on prepared rows [N, d] (act-quantised), the jnp act-quant of `a` between them -> fp32 [N, d]."""
    v1, s1, fmt, block = _operands(w1, numerics, stacked)
    v3, s3, _, _ = _operands(w3, numerics, stacked)
    v2, s2, _, _ = _operands(w2, numerics, stacked)
    a = _gate_up(rows, row_weight.astype(jnp.float32), tile_ids, v1, s1, v3, s3, float(limit), int(per_tile), fmt,
                 block)
    a = _act(a.astype(dtype), numerics, isinstance(w2, dict))
    return _down(a, tile_ids, v2, s2, int(per_tile), fmt, block)


def _stack_ids(w1, layer, experts):
    """Tile ids into the flattened [R·E, ...] stacks, clamped as the references' dynamic slices clamp."""
    R, E = stack_dims(w1, 2)
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, R - 1)
    return layer * E + jnp.clip(experts.astype(jnp.int32), 0, E - 1)


def moe_experts_gather(x: jax.Array, idx: jax.Array, weight: jax.Array, w1, w2, w3, layer: jax.Array,
                       limit: float, numerics=None) -> jax.Array:
    """The reference's contract (x [T, d], idx int32 / weight fp32 [T, k], stacks [R, E, ...]) -> fp32 [T, d]: one
    (token, expert) pair per row tile."""
    T, k = idx.shape
    rows = jnp.repeat(_act(x, numerics, isinstance(w1, dict)), k, axis=0)          # [T*k, d]
    y = _ffn(rows, weight.reshape(-1), _stack_ids(w1, layer, idx.reshape(-1)), 1, w1, w2, w3, limit, numerics,
             x.dtype, True)
    return jnp.sum(y.reshape(T, k, -1), axis=1)


def moe_experts_grouped(x: jax.Array, idx: jax.Array, weight: jax.Array, w1, w2, w3, layer: jax.Array,
                        limit: float, numerics=None) -> jax.Array:
    """The reference's contract: rows sorted by expert in padded groups (`expert_groups`), one expert per tile."""
    T, k = idx.shape
    g = expert_groups(idx, stacked_experts(w1))
    rows, wts = group_rows(_act(x, numerics, isinstance(w1, dict)), weight, g)
    y = _ffn(rows, wts, _stack_ids(w1, layer, g.tile_expert), g.tile, w1, w2, w3, limit, numerics, x.dtype, True)
    return ungroup_rows(y, g, T, k)


def moe_experts_dense(x: jax.Array, idx: jax.Array, weight: jax.Array, w1, w2, w3, layer: jax.Array,
                      limit: float, numerics=None) -> jax.Array:
    """The reference's contract: each expert of the stack on every token (tiles of <= 128 tokens) with the token's
    routing weight for it (0 where not routed), summed over the experts in the reference's order."""
    T, d = x.shape
    E = stacked_experts(w1)
    per_tile = min(T, 128)
    tiles = -(-T // per_tile)
    Tp = tiles * per_tile
    xa = jnp.pad(_act(x, numerics, isinstance(w1, dict)), ((0, Tp - T), (0, 0)))
    rows = jnp.broadcast_to(xa[None], (E, Tp, d)).reshape(E * Tp, d)
    wts = jnp.pad(jax.vmap(lambda e: dense_weight(idx, weight, e))(jnp.arange(E)), ((0, 0), (0, Tp - T)))
    ids = _stack_ids(w1, layer, jnp.repeat(jnp.arange(E, dtype=jnp.int32), tiles))
    y = _ffn(rows, wts.reshape(-1), ids, per_tile, w1, w2, w3, limit, numerics, x.dtype, True)
    y, _ = jax.lax.scan(lambda acc, ye: (acc + ye, None), jnp.zeros((T, d), jnp.float32),
                        y.reshape(E, Tp, d)[:, :T])
    return y


def shared_expert(x: jax.Array, w1, w2, w3, limit: float, numerics=None) -> jax.Array:
    """The reference's contract: x [..., d] -> fp32 [..., d], one expert (unstacked [I, d] weights), weight 1."""
    shape = x.shape
    xt = _act(x.reshape(-1, shape[-1]), numerics, isinstance(w1, dict))
    T = xt.shape[0]
    per_tile = min(T, 128)
    ids = jnp.zeros((-(-T // per_tile),), jnp.int32)
    y = _ffn(xt, jnp.ones((T,), jnp.float32), ids, per_tile, w1, w2, w3, limit, numerics, x.dtype, False)
    return y.reshape(shape[:-1] + (y.shape[-1],))
