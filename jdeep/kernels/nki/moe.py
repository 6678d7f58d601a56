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
shared: one expert, weight 1, tiles of 128 rows) and combine the per-row outputs in jnp; they launch the kernels at
the runtime's LNC (`launch`).

LNC (work split over the launch's programs, `_share`): with n row tiles over p programs, each program takes
n // p whole tiles (all output columns, `program_share`), and the n % p tiles left over are split by output columns
instead: each program computes a contiguous run of their 128-column tiles (gate-up: the I columns of W1 and W3;
down: the d columns of W2), so it reads only that part of the expert's weights. Decode is weight-bound: the shared
expert at decode (one tile) and an odd gather tile count give both cores half of each left-over expert's bytes and
decode work; the 6 gather tiles of one token give each core 3 whole experts. Each output element has one writer.

PE layout: the weights are the stationary operand and the rows the moving one, so the outputs come out with the
weight's N (I or d) on PSUM partitions and the rows on the free axis. That puts the block scales of quantized weights
(per output row n and k block) on partitions, where one multiply applies them:
- weight tile Wᵀ [128 k, 128 n] read with a transposing access pattern over W's rows (K contiguous in HBM: a strided
  DMA with 1-byte elements, the cost gemm.py notes too), 512 output columns per slab;
- quantized weights: fp8 codes go to the PE array as trn2 float8_e4m3 as stored; fp4 codes are decoded in SBUF by 4
  bit-vector instructions on uint16 lanes (2 codes per lane): an e2m1 nibble c becomes the e4m3 byte
  ((c & 7) << 2) | ((c & 8) << 4), whose value is exactly e2m1(c)·2⁻⁶ (the 2⁶ goes into the scale). 16-bit lanes
  because the engines carry 32-bit integers through fp32 (aws-neuron-sdk #1308): masks such as 0xF0F0F0F0 would not
  survive, while every uint16 value, immediate and result is exact. In a tile each 32-partition quadrant holds one
  32-k block: its 16 packed bytes DMA'd twice, low nibbles (even k) on the first 16 partitions, high nibbles (odd k)
  on the next 16, and the rows are loaded with the same k permutation;
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
dominate at decode. fp4 costs the Vector Engine two element-ops per weight (4 ops per uint16 lane of 2 codes: twice
the element-ops of 32-bit lanes), ~1/128 cycle per weight at 256 elements per cycle and 0.96 GHz: ~205 µs per
V4-Flash expert (288 µs at V4.1-Flash) on one core against 37 µs (52 µs) of its HBM reads at 0.36 TB/s per core,
so ~5.5× its HBM time; an LNC=2 launch halves both per core. Re-encoding the fp4 nibbles to e4m3 bytes at load (the
same exact map, scales kept) would remove the decode for 26.0 MB per V4-Flash expert (72 µs per core, 36.5 MB /
101 µs at V4.1-Flash): docs/kernels.md has the per-shape budget and the bounds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import nki
import nki.isa as nisa
import nki.language as nl

from ..linear import stack_dims
from ..reference import dense_weight, expert_groups, group_rows, moe_input, stacked_experts, ungroup_rows
from .launch import launch, program_share
from .moe_tiles import SLAB, Stack, fp4_lanes, load_rows, load_scales, load_slab, project
from .moe_tiles import P as _P
from .swiglu import swiglu_tile

__all__ = ["expert_gate_up_kernel", "expert_down_kernel", "moe_experts_gather", "moe_experts_grouped",
           "moe_experts_dense", "shared_expert"]

def _share(n_tiles: int, n_cols: int):
    """This program's work in a launch over n_tiles row tiles x n_cols output columns (module docstring): whole
    tiles first..first+count (all columns), then every tile from `split` on, columns c_lo..c_hi (whole 128-column
    tiles) -> (first, count, split, c_lo, c_hi)."""
    programs = 1
    if nl.program_ndim() != 0:
        programs = nl.num_programs(axes=0)
    split = n_tiles - n_tiles % programs
    first, count = program_share(split)
    c_first, c_count = program_share(-(-n_cols // _P))
    return first, count, split, c_first * _P, min(n_cols, (c_first + c_count) * _P)


def _tile_ids(tile_expert, src, rows: int, s: Stack):
    """The row tiles' expert ids, int32 [1, n_tiles] in SBUF (src [N, K]: `rows` rows of one expert per tile)."""
    n_tiles = tile_expert.shape[0]
    assert s.K == src.shape[1] and rows <= _P and n_tiles == -(-src.shape[0] // rows)
    ids = nl.ndarray((1, n_tiles), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=ids, src=tile_expert.ap(pattern=[[n_tiles, 1], [1, n_tiles]]))
    return ids


def _tile(src, ids, t: int, rows: int, s: Stack):
    """Row tile t of src [N, K]: (first row, its rows m, a register holding the tile's expert id, the rows as the
    moving operand [128 k, KT, nb·m])."""
    r0 = t * rows
    m = min(rows, src.shape[0] - r0)
    reg = nisa.register_alloc()
    nisa.register_load(reg, ids[0:1, t:t + 1])
    return r0, m, reg, load_rows(src, r0, m, s)


def _gate_up_tile(out, x, row_weight, ids, t: int, rows: int, c_lo: int, c_hi: int, w1, w1_scale, w3, w3_scale,
                  limit: float, s: Stack, lanes):
    """Output columns c_lo..c_hi of row tile t of expert_gate_up_kernel."""
    I = s.N
    r0, m, reg, xin = _tile(x, ids, t, rows, s)
    wb = nl.ndarray((_P, m), nl.float32, buffer=nl.sbuf)                 # the row weights on every partition
    nisa.dma_copy(dst=wb, src=row_weight.ap(pattern=[[0, _P], [1, m]], offset=r0))
    for c0 in range(c_lo, c_hi, SLAB):
        cn = min(SLAB, c_hi - c0)
        slab1 = load_slab(w1, reg, c0, cn, s, lanes)
        slab3 = load_slab(w3, reg, c0, cn, s, lanes)
        for n0 in range(c0, c0 + cn, _P):
            nn = min(_P, c0 + cn - n0)
            h1 = project(slab1, n0 - c0, nn, load_scales(w1_scale, reg, n0, nn, s), xin, m, s)
            h3 = project(slab3, n0 - c0, nn, load_scales(w3_scale, reg, n0, nn, s), xin, m, s)
            g = nl.ndarray((_P, m), nl.float32, buffer=nl.sbuf)
            u = nl.ndarray((_P, m), nl.float32, buffer=nl.sbuf)
            swiglu_tile(g[0:nn], h1[0:nn], h3[0:nn], u[0:nn], limit)            # the fused SwiGLU epilogue
            nisa.tensor_tensor(dst=g[0:nn], data1=g[0:nn], data2=wb[0:nn], op=nl.multiply)
            nisa.dma_copy(dst=out.ap(pattern=[[1, nn], [I, m]], offset=r0 * I + n0), src=g[0:nn])


def expert_gate_up_kernel(x, row_weight, tile_expert, w1, w1_scale, w3, w3_scale, limit: float, rows: int,
                          fmt: str, block):
    """x [N, d] (bf16 / fp32), row_weight fp32 [N], tile_expert int32 [ceil(N/rows)] (row tile t = rows
    t·rows.. of one expert, an index into the stacks), w1, w3 [R·E, I, d] float, fp8 codes uint8 (scales uint8
    [R·E, ceil(I/bn), ceil(d/bk)]) or fp4 packed uint8 [R·E, I, d/2] (scales uint8 [R·E, I, d/32]); block = (bn, bk)
    -> a fp32 [N, I] = silu(min(x W1ᵀ, limit)) · clamp(x W3ᵀ, ±limit) · row_weight."""
    N = x.shape[0]
    s = Stack(w1, w1_scale, fmt, block, x.dtype)
    I = s.N
    out = nl.ndarray((N, I), nl.float32, buffer=nl.shared_hbm)
    lanes = None
    if fmt == "fp4":
        lanes = fp4_lanes()
    ids = _tile_ids(tile_expert, x, rows, s)
    n_tiles = tile_expert.shape[0]
    first, count, split, c_lo, c_hi = _share(n_tiles, I)
    for t in range(first, first + count):
        _gate_up_tile(out, x, row_weight, ids, t, rows, 0, I, w1, w1_scale, w3, w3_scale, limit, s, lanes)
    for t in range(split, n_tiles if c_hi > c_lo else split):
        _gate_up_tile(out, x, row_weight, ids, t, rows, c_lo, c_hi, w1, w1_scale, w3, w3_scale, limit, s, lanes)
    return out


def _down_tile(out, a, ids, t: int, rows: int, c_lo: int, c_hi: int, w2, w2_scale, s: Stack, lanes):
    """Output columns c_lo..c_hi of row tile t of expert_down_kernel."""
    d = s.N
    r0, m, reg, ain = _tile(a, ids, t, rows, s)
    for c0 in range(c_lo, c_hi, SLAB):
        cn = min(SLAB, c_hi - c0)
        slab = load_slab(w2, reg, c0, cn, s, lanes)
        for n0 in range(c0, c0 + cn, _P):
            nn = min(_P, c0 + cn - n0)
            y = project(slab, n0 - c0, nn, load_scales(w2_scale, reg, n0, nn, s), ain, m, s)
            if s.fmt == "float":                           # DMA does not read PSUM
                ys = nl.ndarray((_P, m), nl.float32, buffer=nl.sbuf)
                nisa.tensor_copy(dst=ys[0:nn], src=y[0:nn])
                y = ys
            nisa.dma_copy(dst=out.ap(pattern=[[1, nn], [d, m]], offset=r0 * d + n0), src=y[0:nn])


def expert_down_kernel(a, tile_expert, w2, w2_scale, rows: int, fmt: str, block):
    """a [N, I] (bf16 / fp32, act-quantised), tile_expert int32 [ceil(N/rows)], w2 [R·E, d, I] (formats as in
    expert_gate_up_kernel) -> y fp32 [N, d] = a W2ᵀ."""
    N = a.shape[0]
    s = Stack(w2, w2_scale, fmt, block, a.dtype)
    d = s.N
    out = nl.ndarray((N, d), nl.float32, buffer=nl.shared_hbm)
    lanes = None
    if fmt == "fp4":
        lanes = fp4_lanes()
    ids = _tile_ids(tile_expert, a, rows, s)
    n_tiles = tile_expert.shape[0]
    first, count, split, c_lo, c_hi = _share(n_tiles, d)
    for t in range(first, first + count):
        _down_tile(out, a, ids, t, rows, 0, d, w2, w2_scale, s, lanes)
    for t in range(split, n_tiles if c_hi > c_lo else split):
        _down_tile(out, a, ids, t, rows, c_lo, c_hi, w2, w2_scale, s, lanes)
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
    a = launch(_gate_up)(rows, row_weight.astype(jnp.float32), tile_ids, v1, s1, v3, s3, float(limit),
                         int(per_tile), fmt, block)
    a = moe_input(a.astype(dtype), numerics, isinstance(w2, dict))
    return launch(_down)(a, tile_ids, v2, s2, int(per_tile), fmt, block)


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
    rows = jnp.repeat(moe_input(x, numerics, isinstance(w1, dict)), k, axis=0)          # [T*k, d]
    y = _ffn(rows, weight.reshape(-1), _stack_ids(w1, layer, idx.reshape(-1)), 1, w1, w2, w3, limit, numerics,
             x.dtype, True)
    return jnp.sum(y.reshape(T, k, -1), axis=1)


def moe_experts_grouped(x: jax.Array, idx: jax.Array, weight: jax.Array, w1, w2, w3, layer: jax.Array,
                        limit: float, numerics=None) -> jax.Array:
    """The reference's contract: rows sorted by expert in padded groups (`expert_groups`), one expert per tile."""
    T, k = idx.shape
    g = expert_groups(idx, stacked_experts(w1))
    rows, wts = group_rows(moe_input(x, numerics, isinstance(w1, dict)), weight, g)
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
    xa = jnp.pad(moe_input(x, numerics, isinstance(w1, dict)), ((0, Tp - T), (0, 0)))
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
    xt = moe_input(x.reshape(-1, shape[-1]), numerics, isinstance(w1, dict))
    T = xt.shape[0]
    per_tile = min(T, 128)
    ids = jnp.zeros((-(-T // per_tile),), jnp.int32)
    y = _ffn(xt, jnp.ones((T,), jnp.float32), ids, per_tile, w1, w2, w3, limit, numerics, x.dtype, False)
    return y.reshape(shape[:-1] + (y.shape[-1],))
