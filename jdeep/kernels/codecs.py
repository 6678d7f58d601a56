"""Low-precision number formats as integer/float arithmetic on uint8 codes (model-spec.md §6.1).

Every function takes the array module (`numpy` on the host, `jax.numpy` in graphs) as `xp` and uses
only comparisons, selects, 32-bit integer bit ops and multiplications by exact powers of two: no
bitcast of a float (Neuron rejects bitcasts and float8 graph types, neuron-notes.md §9 S13/S15).
Codes are produced as int32 and narrowed to uint8 by the caller once, at the store.

Formats
- e4m3fn (OCP, DeepSeek's fp8): bias 7, 3 mantissa bits, no inf, max ±448 (0x7F/0xFF are NaN).
- e4m3 as trn2 reads it (IEEE-style): same bits, exponent field 15 reserved (inf/NaN), max ±240.
- e2m1 (fp4): codes 0..7 -> 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign. Packed two per byte, low nibble first.
- ue8m0: an exponent byte b meaning 2^(b-127).
Encoders round to nearest, ties to even, and saturate at the format's maximum.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["pow2", "floor_log2", "ceil_log2", "e4m3_decode", "e4m3_round", "e4m3_encode", "e2m1_decode",
           "e2m1_round", "e2m1_encode", "pack_e2m1", "unpack_e2m1", "ue8m0_decode", "ue8m0_encode",
           "E4M3FN_MAX", "E4M3_TRN2_MAX", "E2M1_MAX"]

E4M3FN_MAX = 448.0
E4M3_TRN2_MAX = 240.0
E2M1_MAX = 6.0


_POW2_MIN, _POW2_MAX = -150, 128
# 2**e for e in [-150, 128]: 0 below float32's smallest subnormal (2**-149), inf above the largest finite power
_POW2_TABLE = np.concatenate([[0.0], np.ldexp(1.0, np.arange(-149, 128)), [np.inf]]).astype(np.float32)


def _lookup(xp: Any, table: np.ndarray, i: Any) -> Any:
    """table[i] for int32 indices already inside the table (a bare gather: no negative-index fix-up)."""
    if xp is np:
        return table[i]
    return xp.asarray(table).at[i].get(mode="promise_in_bounds")


def pow2(xp: Any, e: Any) -> Any:
    """2**e as float32 for integer e: exact for e in [-149, 127], 0 below, inf above.

    A lookup in a constant table of the 279 powers (no bitcast, one gather): the repeated-multiplication
    form costs ~90 ops per call and made quantized graphs several times larger."""
    e = xp.clip(xp.asarray(e).astype(xp.int32), _POW2_MIN, _POW2_MAX) - _POW2_MIN
    return _lookup(xp, _POW2_TABLE, e)


def floor_log2(xp: Any, v: Any) -> Any:
    """Exact floor(log2(v)) as int32 for positive finite float32 v (normal v in graphs: XLA flushes subnormals).

    log2's estimate is corrected by one step either way (it is off by at most one near powers of two);
    both corrections compare against the one power p looked up (v - p >= p is v >= 2p without overflow:
    v - p is exact below 2p by Sterbenz's lemma, and rounds to a value >= p above it)."""
    v = xp.asarray(v, xp.float32)
    e = xp.floor(xp.log2(v)).astype(xp.int32)
    p = pow2(xp, e)
    return e - (p > v).astype(xp.int32) + (v - p >= p).astype(xp.int32)


def ceil_log2(xp: Any, v: Any) -> Any:
    """Exact ceil(log2(v)) as int32 for positive finite float32 v."""
    e = floor_log2(xp, v)
    return e + (pow2(xp, e) < xp.asarray(v, xp.float32)).astype(xp.int32)


# ---------------------------------------------------------------------------------------------- fp8
def _e4m3_table(trn2: bool) -> np.ndarray:
    b = np.arange(256)
    e, m = (b >> 3) & 15, (b & 7).astype(np.float64)
    mag = np.where(e == 0, m * 2.0 ** -9, (m + 8) * np.ldexp(1.0, e - 10))
    if trn2:
        mag = np.where(e == 15, np.where(m == 0, np.inf, np.nan), mag)
    else:
        mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return np.where(b >> 7, -mag, mag).astype(np.float32)


# every code's value, built by the field arithmetic of §6.1 (tested against ml_dtypes)
_E4M3_TABLES = {False: _e4m3_table(False), True: _e4m3_table(True)}


def e4m3_decode(xp: Any, codes: Any, trn2: bool = False) -> Any:
    """uint8 codes -> float32 values. e4m3fn: 0x7F/0xFF -> NaN; trn2: exponent field 15 -> ±inf / NaN.

    One lookup in the 256 values (no bitcast): the field arithmetic is ~12 ops per call."""
    return _lookup(xp, _E4M3_TABLES[trn2], xp.asarray(codes).astype(xp.int32) & 255)


def _e4m3_steps(xp: Any, x: Any, fp8_max: float) -> tuple[Any, Any, Any]:
    """(n, e, q): |x| saturated at fp8_max is n * q on the e4m3 grid, q = 2^(e-3) the quantum of its
    binade (e >= -6: subnormals share 2^-6's quantum), n the integer count of quanta (ties to even)."""
    a = xp.minimum(xp.abs(xp.asarray(x, xp.float32)), xp.float32(fp8_max))
    e = floor_log2(xp, xp.maximum(a, xp.float32(2.0 ** -6)))
    q = pow2(xp, e - 3)
    return xp.round(a / q), e, q


def e4m3_round(xp: Any, x: Any, fp8_max: float = E4M3FN_MAX) -> Any:
    """Round float32 x onto the e4m3 grid (ties to even), saturating at ±fp8_max."""
    n, _, q = _e4m3_steps(xp, x, fp8_max)
    r = n * q
    return xp.where(xp.asarray(x, xp.float32) < 0, -r, r)


def e4m3_encode(xp: Any, x: Any, fp8_max: float = E4M3FN_MAX) -> Any:
    """float32 x -> int32 codes 0..255 (round to nearest even, saturate). fp8_max 448 (e4m3fn) or 240 (trn2).

    In binade e the code is ((e + 7) << 3) + n - 8 = ((e + 6) << 3) + n, n in [8, 16]; the subnormals
    (e = -6, n in [0, 8)) give n itself, and n = 16 (a round-up into the next binade) carries into the
    exponent field, so one sum covers every case."""
    n, e, _ = _e4m3_steps(xp, x, fp8_max)
    sign = (xp.asarray(x, xp.float32) < 0).astype(xp.int32)     # negatives that round to 0 keep the sign
    return (sign << 7) | (((e + 6) << 3) + n.astype(xp.int32))


# ---------------------------------------------------------------------------------------------- fp4
def e2m1_decode(xp: Any, codes: Any) -> Any:
    """int codes 0..15 -> float32 values."""
    c = xp.asarray(codes).astype(xp.int32)
    e = (c >> 1) & 3
    m = (c & 1).astype(xp.float32)
    mag = xp.where(e == 0, m * xp.float32(0.5), (m + 2) * pow2(xp, e - 2))
    return xp.where((c >> 3) == 1, -mag, mag)


def e2m1_round(xp: Any, x: Any) -> Any:
    """Round float32 x onto the e2m1 grid (ties to even code), saturating at ±6."""
    x = xp.clip(xp.asarray(x, xp.float32), -E2M1_MAX, E2M1_MAX)
    a = xp.abs(x)
    q = xp.where(a < 2, xp.float32(0.5), xp.where(a < 4, xp.float32(1.0), xp.float32(2.0)))
    r = xp.round(a / q) * q
    return xp.where(x < 0, -r, r)


def e2m1_encode(xp: Any, x: Any) -> Any:
    """float32 x -> int32 codes 0..15."""
    r = e2m1_round(xp, x)
    a = xp.abs(r)
    code = xp.where(a < 2, a * 2, xp.where(a < 4, a + 2, a / 2 + 4)).astype(xp.int32)
    return code | ((xp.asarray(x, xp.float32) < 0).astype(xp.int32) << 3)   # -0.25 -> code 8 (-0)


def pack_e2m1(xp: Any, codes: Any) -> Any:
    """int codes [..., K] -> int32 bytes [..., K/2]; element 2c in the low nibble, 2c+1 in the high one."""
    c = xp.asarray(codes).astype(xp.int32)
    return (c[..., 0::2] & 15) | ((c[..., 1::2] & 15) << 4)


def unpack_e2m1(xp: Any, packed: Any) -> Any:
    """uint8/int8 bytes [..., K/2] -> int32 codes [..., K]."""
    b = xp.asarray(packed).astype(xp.int32) & 255
    lo, hi = b & 15, (b >> 4) & 15
    return xp.stack([lo, hi], axis=-1).reshape(b.shape[:-1] + (2 * b.shape[-1],))


# ---------------------------------------------------------------------------------------------- ue8m0
def ue8m0_decode(xp: Any, codes: Any) -> Any:
    """Exponent bytes -> 2^(b-127) as float32 (b = 255 is NaN; 2^-127 is subnormal)."""
    b = xp.asarray(codes).astype(xp.int32)
    return xp.where(b == 255, xp.float32(np.nan), pow2(xp, b - 127))


def ue8m0_encode(xp: Any, scale: Any) -> Any:
    """Positive power-of-two float32 scales -> int32 exponent bytes (non powers of two round down)."""
    return floor_log2(xp, scale) + 127
