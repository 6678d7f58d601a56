"""The host-side index arrays of one image for the tower's static-shape program (vision.tower): patch positions,
the aligner's r x r gathers and the span's row slots, padded to bucket sizes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .processor import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, ImagePatches, span_types

__all__ = ["TowerInputs", "tower_inputs", "bucket"]


def bucket(n: int, minimum: int = 16) -> int:
    """The padded size of n rows: the next power of two, at least `minimum` (one program per bucket)."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


@dataclass(frozen=True)
class TowerInputs:
    """patches float32 [N, 3p²] (zero rows after the image's), pos int32 [N, 2], valid bool [N], gather int32
    [T, r²] (N: the zero row), slots int32 [S]; n_tokens: the span's real length (S >= n_tokens)."""

    patches: np.ndarray
    pos: np.ndarray
    valid: np.ndarray
    gather: np.ndarray
    slots: np.ndarray
    n_tokens: int


def tower_inputs(img: ImagePatches, ratio: int) -> TowerInputs:
    """The tower's inputs for one processed image, padded to buckets (`bucket`) of its patch, aligner and span
    row counts."""
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
    # span: the k-th IMAGE position takes aligned row k; the delimiters rows T_b, T_b + 1, T_b + 2
    types = span_types(img.n_llm_h, img.n_llm_w)
    Tb = gather.shape[0]
    slots = np.full(bucket(len(types)), Tb, np.int32)
    slot = np.select([types == IMAGE_START, types == IMAGE_END, types == IMAGE_NEW_LINE],
                     [Tb, Tb + 1, Tb + 2], 0).astype(np.int32)
    is_image = types == IMAGE
    slot[is_image] = np.arange(int(is_image.sum()), dtype=np.int32)
    slots[:len(types)] = slot
    return TowerInputs(patches, pos, valid, gather, slots, len(types))
