"""Partition layouts shared by the row-wise kernels (pool, hc_collapse, hc_expand).

A kernel that works on R independent rows (tokens, pooling groups) of some width puts the rows on partitions.
With R < 65 rows that would leave most of the 128 lanes idle and make every Vector Engine instruction walk the
whole width on a few lanes (decode: 1-8 tokens, ~4096 elements per instruction); so each row is split into s column
blocks and partition (row r, block b) holds columns [b·width/s, (b+1)·width/s) of row r. From 65 rows on s = 1:
plain rows on partitions, 128 per tile. Per-row scalars (mixing weights) are broadcast to the s partitions of their
row by a stride-0 access pattern."""

from __future__ import annotations

import nki.language as nl

__all__ = ["splits", "row_views"]

_MIN_RUN = 64            # bytes per partition and stream row at the least (DMA runs; 16 fp32 or 32 bf16 columns)


def splits(rows: int, width: int, itemsize: int) -> int:
    """The column blocks per row: the largest power of two s with rows·s <= 128 partitions, s | width and
    width / s >= 64 bytes of `itemsize` elements (1 from 65 rows on, or for narrow rows)."""
    s, least = 1, max(1, _MIN_RUN // itemsize)
    while rows * 2 * s <= nl.tile_size.pmax and width % (2 * s) == 0 and width // (2 * s) >= least:
        s *= 2
    return s


def row_views(t, r0: int, nr: int, s: int, stride: int, block: int, inner: list, col0: int, cols: int):
    """HBM views of rows r0 .. r0+nr-1 of `t` in the (row, block) partition layout, as [(first partition,
    partitions, view)]: each view is [partitions, *inner nums, cols]; rows `stride` elements apart, then the
    `inner` access pattern ([[step, num], ...]), then `cols` contiguous elements from col0 + b·block (block 0:
    every block of a row reads the same elements, a partition broadcast). One view for all rows when s == 1,
    one per row otherwise (partition b of a row is then the pattern's outer dim)."""
    if s == 1:
        return [(0, nr, t.ap([[stride, nr]] + inner + [[1, cols]], offset=r0 * stride + col0))]
    return [(i * s, s, t.ap([[block, s]] + inner + [[1, cols]], offset=(r0 + i) * stride + col0))
            for i in range(nr)]
