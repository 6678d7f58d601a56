"""Host-side weight transforms for quantized checkpoints."""

from __future__ import annotations

import numpy as np

from ..kernels import codecs

__all__ = ["trn2_rescale", "halving_lut"]


def halving_lut(fp8_max: float = codecs.E4M3_TRN2_MAX) -> np.ndarray:
    """uint8 [256]: e4m3fn code -> trn2 e4m3 code of half its value (round to nearest even)."""
    values = codecs.e4m3_decode(np, np.arange(256))
    values = np.where(np.isnan(values), 0.0, values).astype(np.float32)
    return codecs.e4m3_encode(np, values / 2, fp8_max).astype(np.uint8)


def trn2_rescale(codes: np.ndarray, scale: np.ndarray, block: tuple[int, int],
                 fp8_max: float = codecs.E4M3_TRN2_MAX) -> tuple[np.ndarray, np.ndarray]:
    """Map e4m3fn weight codes into Trainium2's e4m3 range (|x| <= fp8_max) block by block.

    codes uint8 [..., N, K]; scale ue8m0 bytes [..., ceil(N/bn), ceil(K/bk)]. A block whose largest
    |value| exceeds fp8_max has every code halved (one vectorised LUT lookup) and its exponent byte
    raised by one, so code*scale is unchanged; other blocks are untouched. Halving is exact except
    for the odd codes of the two lowest binades (|x| < 2^-5, the subnormal grid has no room for
    them): those round to nearest even, an error below 2^-10 of the block scale.
    """
    lead = codes.shape[:-2]
    N, K = codes.shape[-2:]
    bn, bk = block
    gn, gk = scale.shape[-2:]
    mags = codecs.e4m3_decode(np, np.arange(256)).astype(np.float32)
    too_big = np.abs(np.nan_to_num(mags)) > fp8_max
    pad = np.zeros(lead + (gn * bn, gk * bk), np.uint8)
    pad[..., :N, :K] = codes
    tiles = pad.reshape(lead + (gn, bn, gk, bk))
    needs = too_big[tiles].any(axis=(-3, -1))                       # [..., gn, gk]
    if not needs.any():
        return codes, scale
    halved = halving_lut(fp8_max)[tiles]
    tiles = np.where(needs[..., :, None, :, None], halved, tiles)
    new_codes = tiles.reshape(lead + (gn * bn, gk * bk))[..., :N, :K]
    if np.any(scale[needs] >= 254):
        raise ValueError("trn2_rescale: a block scale would overflow the ue8m0 range")
    return np.ascontiguousarray(new_codes), (scale + needs.astype(np.uint8)).astype(np.uint8)
