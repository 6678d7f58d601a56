"""The host-side index arrays of one image for the tower's static-shape program (vision.tower): patch positions and
the aligner's r x r gathers, padded to bucket sizes (one compiled program per patch and aligner-row bucket)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .processor import ImagePatches, span_types
from .tower import ATTENTION_BLOCK

__all__ = ["TowerInputs", "tower_inputs", "bucket", "buckets_upto"]


def bucket(n: int, minimum: int = 16) -> int:
    """The padded size of n rows: the next power of two (at least `minimum`) up to ATTENTION_BLOCK, past it the next
    multiple of ATTENTION_BLOCK (the tower's attention runs whole query blocks there)."""
    if n > ATTENTION_BLOCK:
        return -(-n // ATTENTION_BLOCK) * ATTENTION_BLOCK
    return max(minimum, 1 << max(0, n - 1).bit_length())


def buckets_upto(n: int) -> list[int]:
    """Every bucket size a row count of 1..n can take, ascending."""
    out, m = [], 1
    while m <= n:
        out.append(bucket(m))
        m = out[-1] + 1
    return out


@dataclass(frozen=True)
class TowerInputs:
    """patches float32 [N, 3p²] (zero rows after the image's), pos int32 [N, 2], valid bool [N], gather int32
    [T, r²] (N: the zero row); types int8 [n_tokens]: the span's position types (processor.span_types)."""

    patches: np.ndarray
    pos: np.ndarray
    valid: np.ndarray
    gather: np.ndarray
    types: np.ndarray


def tower_inputs(img: ImagePatches, ratio: int) -> TowerInputs:
    """The tower's inputs for one processed image, padded to buckets (`bucket`) of its patch and aligner row counts."""
    n = img.n_vit_h * img.n_vit_w
    N = bucket(n)
    patches = np.zeros((N, img.patches.shape[1]), np.float32)
    patches[:n] = img.patches
    rows, cols = np.divmod(np.arange(N, dtype=np.int32), img.n_vit_w)
    pos = np.stack([rows, cols], axis=1).astype(np.int32)
    valid = np.arange(N) < n
    # aligner: text position (bi, bj) takes patches (bi·r + di, bj·r + dj), k = di·r + dj; outside the grid: zero
    T = img.n_llm_h * img.n_llm_w
    bi, bj = np.divmod(np.arange(T), img.n_llm_w)
    di, dj = np.divmod(np.arange(ratio * ratio), ratio)
    r_ = bi[:, None] * ratio + di[None, :]
    c_ = bj[:, None] * ratio + dj[None, :]
    inside = (r_ < img.n_vit_h) & (c_ < img.n_vit_w)
    gather = np.full((bucket(T), ratio * ratio), N, np.int32)
    gather[:T] = np.where(inside, r_ * img.n_vit_w + c_, N)
    return TowerInputs(patches, pos, valid, gather, span_types(img.n_llm_h, img.n_llm_w))
