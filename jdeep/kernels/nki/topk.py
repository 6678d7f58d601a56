"""Exact top-k of fp32 rows as an NKI kernel (twin: kernels/reference.py `topk`, i.e. `jax.lax.top_k`).

Rows on partitions (128 per tile), the row on the free axis, fp32 in SBUF. The selection is R = ceil(k/8) rounds
on the Vector Engine of
- `max8`: the 8 largest values left in each partition, descending, duplicates included;
- `nc_match_replace8` with `dst_idx`: their positions, each value matched to the first occurrence not yet replaced
  (so equal values get ascending positions), and those positions replaced by -inf.
The rounds extract in (value descending, position ascending) order: lax.top_k's order, ties to the lower index.
For that the replacement must differ from every data value: the row is clamped to -FLT_MAX first (its -inf entries
become a finite sentinel, ranked last, ties by index as lax.top_k ranks -inf entries) and the sentinel is mapped
back to -inf in the output values. A row is padded with the sentinel to 8·R entries when shorter.

One instruction reads at most 16384 elements per partition. Longer rows are cut into chunks of 8192: each chunk's
top 8·R (values, global indices) goes to a candidate buffer of up to 16384 entries in chunk order; a full buffer is
reduced to its own top 8·R in place (slot 0) by the same rounds, the candidates' global indices carried along with
`nc_n_gather` (GpSimd, within the partition) at the positions the rounds return. Equal values keep index order
through every merge (the buffer holds index ranges in ascending order, each in (value desc, index asc) order), so
the result is exact. Needs 2·8·R <= 16384 (k <= 8192) for rows longer than 16384.

Cost per 128-row tile (documented Vector Engine costs: max8 and match_replace8 ~N cycles each for N elements per
partition): 2·R·max(T, 8R) cycles up to T = 16384, ~2·R·T + 2·R·16384 per merge beyond (T = 262144, k = 512:
~36M cycles): the tile's rows run in parallel, so a decode call with a few rows pays the same as 128 rows
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

__all__ = ["topk_kernel", "topk"]

_SENTINEL = -3.4028234663852886e38      # -FLT_MAX: what -inf entries become while extracting
_MAX_READ = 16384                       # elements per partition one max8 / match_replace8 reads
_CHUNK = 8192                           # chunk width of rows longer than _MAX_READ


def _extract(vals, idx, cur, rounds: int):
    """rounds of max8 + match_replace8 over cur [p, W] (destroyed): the 8·rounds largest into vals [p, 8·rounds]
    (fp32) and their positions in cur into idx [p, 8·rounds] (uint32), in (value desc, position asc) order."""
    for r in range(rounds):
        v = vals[:, 8 * r:8 * r + 8]
        nisa.max8(dst=v, src=cur)
        nisa.nc_match_replace8(dst=cur, data=cur, vals=v, imm=float("-inf"), dst_idx=idx[:, 8 * r:8 * r + 8])


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
    assert not long or 2 * L <= _MAX_READ, "rows longer than 16384 need k <= 8192"
    for r0 in range(0, R, P):
        n = min(P, R - r0)
        vals = nl.ndarray((P, L), nl.float32, buffer=nl.sbuf)
        idx = nl.ndarray((P, L), nl.uint32, buffer=nl.sbuf)
        if not long:
            W = max(T, L)
            cur = nl.ndarray((P, W), nl.float32, buffer=nl.sbuf)
            _load_chunk(cur, x, r0, n, 0, T, W)
            _extract(vals[0:n], idx[0:n], cur[0:n], rounds)
            _store(out_v, out_i, vals, idx, r0, n, k)
            continue
        slots = _MAX_READ // L
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
            cur = nl.ndarray((P, max(_CHUNK, L)), nl.float32, buffer=nl.sbuf)
            _load_chunk(cur, x, r0, n, c0, length, max(length, L))
            s = slice(used * L, (used + 1) * L)
            _extract(bv[0:n, s], bi[0:n, s], cur[0:n, 0:max(length, L)], rounds)
            if c0:
                nisa.tensor_scalar(dst=bi[0:n, s], data=bi[0:n, s], op0=nl.add, operand0=c0)   # exact: < 2^24
            used += 1
        _merge(bv, bi, used * L, n, rounds, vals, idx)
        _store(out_v, out_i, vals, idx, r0, n, k)
    return out_v, out_i


_topk = nki.jit(topk_kernel)


def topk(x, k: int):
    """The JAX op (lax.top_k's contract, see the module docstring): x [..., T] -> (values [..., k] in x's dtype,
    indices int32 [..., k]). The rows go to the kernel as fp32 [rows, T] (exact for bf16 inputs)."""
    lead, T = x.shape[:-1], x.shape[-1]
    k = int(k)
    v, i = _topk(x.reshape(int(np.prod(lead, dtype=np.int64)), T).astype(jnp.float32), k)
    # the indices feed gathers: clamped in the graph (graphcheck S12; the kernel's are in range, XLA cannot know)
    i = jnp.clip(i, 0, T - 1)
    return v.reshape(lead + (k,)).astype(x.dtype), i.reshape(lead + (k,))
