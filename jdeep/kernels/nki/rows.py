"""Partition layouts shared by the row-wise kernels (pool, hc_collapse, hc_expand), and how their work splits over
the launch's logical cores.

A kernel that works on R independent rows (tokens, pooling groups) of some width puts the rows on partitions.
With few rows that would leave most of the 128 lanes idle and make every Vector Engine instruction walk the whole
width on a few lanes (decode: 1-8 tokens, ~4096 elements per instruction); so each row is split into s column
blocks and partition-row q = r·s + b (row r, block b) holds columns [b·width/s, (b+1)·width/s) of row r. s is
chosen for all the launch's partitions (128 per logical core): the largest power of two with R·s <= 128·programs
(and runs of at least 64 bytes), so from 65·programs rows on s = 1, plain rows on partitions.

LNC: the R·s partition-rows are independent (one output run each), so the launch's programs take contiguous runs
of them (launch.program_share), each program in tiles of up to 128 partitions; a run may start or end inside a
row (that row's blocks then lie on both cores, each block written by one). A decode call (one row, s = 128 at a
width of 4096 bf16 elements) thus gives each core 64 partition-rows. Per-row scalars (mixing weights) are
broadcast to the partitions of their row by a stride-0 access pattern."""

from __future__ import annotations

import nki.language as nl

__all__ = ["programs", "splits", "row_views"]

_MIN_RUN = 64            # bytes per partition and stream row at the least (DMA runs; 16 fp32 or 32 bf16 columns)


def programs() -> int:
    """Kernel code: the logical cores of the launch (1 without a launch grid)."""
    if nl.program_ndim() == 0:
        return 1
    return nl.num_programs(axes=0)


def splits(rows: int, width: int, itemsize: int, partitions: int) -> int:
    """The column blocks per row: the largest power of two s with rows·s <= partitions, s | width and
    width / s >= 64 bytes of `itemsize` elements (1 for many rows, or for narrow rows)."""
    s = 1
    least = max(1, _MIN_RUN // itemsize)
    while rows * 2 * s <= partitions and width % (2 * s) == 0 and width // (2 * s) >= least:
        s *= 2
    return s


def row_views(t, q0: int, nq: int, s: int, stride: int, block: int, inner: list, col0: int, cols: int):
    """HBM views of partition-rows q0 .. q0+nq-1 of `t` in the (row, block) layout, as a list of (first partition
    counted from q0, partitions, view): each view is [partitions, *inner nums, cols]; rows `stride` elements
    apart, then the `inner` access pattern ([[step, num], ...]), then `cols` contiguous elements from
    col0 + b·block (block 0: every block of a row reads the same elements, a partition broadcast). One view for
    all partitions when s == 1, else one per row the run touches (its blocks are the pattern's outer dim)."""
    views = []
    if s == 1:
        views.append((0, nq, t.ap([[stride, nq]] + inner + [[1, cols]], offset=q0 * stride + col0)))
        return views
    q = q0
    end = q0 + nq
    while q < end:
        r = q // s
        b = q - r * s
        k = min(s - b, end - q)
        views.append((q - q0, k, t.ap([[block, k]] + inner + [[1, cols]], offset=r * stride + b * block + col0)))
        q += k
    return views
