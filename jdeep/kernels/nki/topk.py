"""Exact top-k of fp32 rows as an NKI kernel (twin: kernels/reference.py `topk`, i.e. `jax.lax.top_k`).

Rows on partitions (128 per tile), the row on the free axis, fp32 in SBUF. The selection is R = ceil(k/8) rounds
on the Vector Engine of
- `max8`: the 8 largest values left in each partition, descending, duplicates included;
- `nc_find_index8`: their positions, each value matched to its first occurrence and duplicate values to the next
  occurrences in ascending order across the 8 columns (the NKI 0.6 instruction semantics);
- `nc_match_replace8` without `dst_idx`: the same first occurrences replaced by -inf. (Its own `dst_idx` would give
  duplicates in descending position order: it processes the 8 values in reverse.)
The rounds extract in (value descending, position ascending) order: lax.top_k's order, ties to the lower index.
For that the replacement must differ from every data value: the row is clamped to -FLT_MAX first (its -inf entries
become a finite sentinel, ranked last, ties by index as lax.top_k ranks -inf entries) and the sentinel is mapped
back to -inf in the output values. A row is padded with the sentinel to 8·R entries when shorter (the padding sits
after the row, so it ranks after every entry of the row: never among the first k <= T).

One instruction reads at most 16384 elements per partition. Longer rows are cut into chunks of 8192: each chunk's
top 8·R (values, global indices) goes to a candidate buffer of up to 16384 entries in chunk order; a full buffer is
reduced to its own top 8·R in place (slot 0) by the same rounds, the candidates' global indices carried along with
`nc_n_gather` (GpSimd, within the partition) at the buffer positions the rounds return. Equal values keep index
order through every merge: the buffer holds index ranges in ascending order, each list in (value desc, index asc)
order, so for equal values buffer position order is global index order, and the rounds pick ascending buffer
positions. For rows longer than 16384 the candidate buffer (2·4·16384 bytes per partition at most), a chunk, the
lists and the output rows must fit a partition's 224 KiB of SBUF: k <= 4464.

LNC: the row tiles are split over the launch's programs (`program_share`), each core writing its tiles' rows. At
decode the indexer's top-k has B·S <= 128 rows: one row tile, so program 1 has nothing to do (splitting a row
would need a cross-core merge of the candidate lists); prefill chunks of more than 128 rows use both cores.

Cost per 128-row tile (documented Vector Engine costs: max8, find_index8 and match_replace8 ~N cycles each for N
elements per partition): 3·R·max(T, 8R) cycles up to T = 16384, ~3·R·T + 3·R·16384 per merge beyond (T = 262144,
k = 512: ~56M cycles): the tile's rows run in parallel, so a decode call with a few rows pays the same as 128 rows
(docs/kernels.md: a row spread over partitions is the long-context layout). HBM traffic: T·4 bytes per row in,
k·8 out.

Contract: as lax.top_k for rows without NaN, without -FLT_MAX (ranked with the -inf entries) and without both
signs of zero (max8 and the match compare IEEE values: -0.0 == +0.0 ties by index, where lax.top_k's total order
puts +0.0 first).
"""

from __future__ import annotations

import jax.numpy as jnp
import nki
import nki.isa as nisa
import nki.language as nl
import numpy as np

from .launch import launch, program_share

__all__ = ["topk_kernel", "topk"]

_SENTINEL = -3.4028234663852886e38      # -FLT_MAX: what -inf entries become while extracting
_MAX_READ = 16384                       # elements per partition one max8 / find_index8 / match_replace8 reads
_CHUNK = 8192                           # chunk width of rows longer than _MAX_READ
_SBUF_BYTES = 224 * 1024                # per partition (trn2)


def _extract(vals, idx, cur, rounds: int):
    """rounds of max8 + find_index8 + match_replace8 over cur [p, W] (destroyed): the 8·rounds largest into vals
    [p, 8·rounds] (fp32) and their positions in cur into idx [p, 8·rounds] (uint32), in (value desc, position asc)
    order."""
    for r in range(rounds):
        v = vals[:, 8 * r:8 * r + 8]
        nisa.max8(dst=v, src=cur)
        nisa.nc_find_index8(dst=idx[:, 8 * r:8 * r + 8], data=cur, vals=v)
        nisa.nc_match_replace8(dst=cur, data=cur, vals=v, imm=float("-inf"))


def _load_chunk(cur, x, r0: int, n: int, c0: int, length: int, width: int):
    """cur[0:n, 0:width] = x[r0:r0+n, c0:c0+length] clamped to >= the sentinel, padded with the sentinel."""
    if width > length:
        nisa.memset(dst=cur[0:n, length:width], value=_SENTINEL)
    nisa.dma_copy(dst=cur[0:n, 0:length], src=x[r0:r0 + n, c0:c0 + length])
    nisa.tensor_scalar(dst=cur[0:n, 0:length], data=cur[0:n, 0:length], op0=nl.maximum, operand0=_SENTINEL)


def _store(out_v, out_i, vals, idx, r0: int, n: int, k: int):
    """The first k (values, indices) of rows r0.. to HBM, the sentinel as -inf: min(v, ±inf) with +inf where
    v > sentinel."""
    P = nl.tile_size.pmax
    sign = nl.ndarray((P, k), nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=sign[0:n], data=vals[0:n, 0:k], op0=nl.greater, operand0=_SENTINEL, op1=nl.subtract,
                       operand1=0.5)                                         # +0.5 kept, -0.5 sentinel
    v = nl.ndarray((P, k), nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=v[0:n], data=sign[0:n], op0=nl.multiply, operand0=float("inf"), op1=nl.minimum,
                              operand1=vals[0:n, 0:k])
    nisa.dma_copy(dst=out_v[r0:r0 + n, :], src=v[0:n])
    nisa.dma_copy(dst=out_i[r0:r0 + n, :], src=idx.view(nl.int32)[0:n, 0:k])


def _merge(bv, bi, width: int, n: int, rounds: int, vals, idx):
    """The top 8·rounds of the candidate buffer's first `width` entries into vals / idx (global indices)."""
    P = nl.tile_size.pmax
    pos = nl.ndarray((P, 8 * rounds), nl.uint32, buffer=nl.sbuf)
    _extract(vals[0:n], pos[0:n], bv[0:n, 0:width], rounds)
    nisa.nc_n_gather(dst=idx[0:n], data=bi[0:n, 0:width], indices=pos[0:n])


def _long_row_tile(out_v, out_i, x, vals, idx, r0: int, n: int, T: int, k: int, rounds: int):
    """Rows r0 .. r0+n of a row longer than _MAX_READ: chunks of _CHUNK into the candidate buffer, merged."""
    P = nl.tile_size.pmax
    L = 8 * rounds
    slots = _MAX_READ // L                          # lists the candidate buffer holds
    bv = nl.ndarray((P, slots * L), nl.float32, buffer=nl.sbuf)     # candidate values, chunk order
    bi = nl.ndarray((P, slots * L), nl.uint32, buffer=nl.sbuf)      # their global indices
    used = 0
    for c0 in range(0, T, _CHUNK):
        if used == slots:                           # full: reduce to one list in slot 0
            _merge(bv, bi, slots * L, n, rounds, vals, idx)
            nisa.tensor_copy(dst=bv[0:n, 0:L], src=vals[0:n])
            nisa.tensor_copy(dst=bi[0:n, 0:L], src=idx[0:n])
            used = 1
        length = min(_CHUNK, T - c0)
        width = max(length, L)
        cur = nl.ndarray((P, max(_CHUNK, L)), nl.float32, buffer=nl.sbuf)
        _load_chunk(cur, x, r0, n, c0, length, width)
        s0 = used * L
        _extract(bv[0:n, s0:s0 + L], bi[0:n, s0:s0 + L], cur[0:n, 0:width], rounds)
        if c0:
            nisa.tensor_scalar(dst=bi[0:n, s0:s0 + L], data=bi[0:n, s0:s0 + L], op0=nl.add,
                               operand0=c0)                                  # exact: < 2^24
        used += 1
    _merge(bv, bi, used * L, n, rounds, vals, idx)
    _store(out_v, out_i, vals, idx, r0, n, k)


def topk_kernel(x, k: int):
    """x fp32 [R, T], 1 <= k <= T -> (values fp32 [R, k] descending, indices int32 [R, k])."""
    R, T = x.shape
    assert x.dtype == nl.float32 and 1 <= k <= T and T < 2 ** 24
    out_v = nl.ndarray((R, k), nl.float32, buffer=nl.shared_hbm)
    out_i = nl.ndarray((R, k), nl.int32, buffer=nl.shared_hbm)
    P = nl.tile_size.pmax
    rounds = -(-k // 8)
    L = 8 * rounds                                      # entries extracted per list
    long = T > _MAX_READ
    slots = _MAX_READ // L
    # SBUF bytes per partition of the long-row path: candidate buffer, a chunk, vals / idx / merge positions, output
    assert not long or 8 * slots * L + 4 * max(_CHUNK, L) + 12 * L + 8 * k <= _SBUF_BYTES, \
        "rows longer than 16384 need k <= 4464"
    first, count = program_share(-(-R // P))            # this core's row tiles
    for tile in range(first, first + count):
        r0 = tile * P
        n = min(P, R - r0)
        vals = nl.ndarray((P, L), nl.float32, buffer=nl.sbuf)
        idx = nl.ndarray((P, L), nl.uint32, buffer=nl.sbuf)
        if long:
            _long_row_tile(out_v, out_i, x, vals, idx, r0, n, T, k, rounds)
        else:
            W = max(T, L)
            cur = nl.ndarray((P, W), nl.float32, buffer=nl.sbuf)
            _load_chunk(cur, x, r0, n, 0, T, W)
            _extract(vals[0:n], idx[0:n], cur[0:n], rounds)
            _store(out_v, out_i, vals, idx, r0, n, k)
    return out_v, out_i


_topk = nki.jit(topk_kernel)


def topk(x, k: int):
    """The JAX op (lax.top_k's contract, see the module docstring): x [..., T] -> (values [..., k] in x's dtype,
    indices int32 [..., k]). The rows go to the kernel as fp32 [rows, T] (exact for bf16 inputs)."""
    lead, T = x.shape[:-1], x.shape[-1]
    k = int(k)
    v, i = launch(_topk)(x.reshape(int(np.prod(lead, dtype=np.int64)), T).astype(jnp.float32), k)
    # the indices feed gathers: clamped in the graph (graphcheck S12; the kernel's are in range, XLA cannot know)
    i = jnp.clip(i, 0, T - 1)
    return v.reshape(lead + (k,)).astype(x.dtype), i.reshape(lead + (k,))
