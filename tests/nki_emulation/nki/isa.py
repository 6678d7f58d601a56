"""Emulated `nki.isa`: the instructions jdeep's kernels use, `dst` first, with their documented constraints."""

from __future__ import annotations

import enum

import numpy as np

from . import language as nl
from .language import NKIError, NkiTensor, _Op

_FLOAT8 = (nl.float8_e4m3, nl.float8_e5m2)
_MATMUL_DTYPES = (nl.float32, nl.bfloat16, nl.float16) + _FLOAT8


class dge_mode(enum.Enum):
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(enum.Enum):
    error = 0
    skip = 1


class reduce_cmd(enum.Enum):
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3


class matmul_perf_mode(enum.Enum):
    none = 0
    double_row = 1


def _f32(t: NkiTensor) -> np.ndarray:
    return t.data.astype(np.float32)


def _race(t: NkiTensor, what: str) -> np.ndarray | None:
    """The writer flags of a shared-HBM view, after checking no other program of the launch wrote it (cores of an
    LNC launch run concurrently: a second writer, or a reader of another core's output, is a race)."""
    flags = nl.writer(t)
    if flags is not None:
        pid = nl._LAUNCH.pid
        other = (flags >= 0) & (flags != pid)
        if other.any():
            raise NKIError(f"{what}: program {pid} touches {int(other.sum())} elements of shared-HBM tensor "
                           f"{t.shape} that program {int(flags[other].flat[0])} wrote (the cores of an LNC launch run "
                           "concurrently: split the work so each output element has one writer)")
    return flags


def _write(dst: NkiTensor, value: np.ndarray, by_matmul: bool = False) -> None:
    if not dst.writable:
        raise NKIError("dst is a broadcast or gathered view: it cannot be written")
    flags = _race(dst, "a write")
    if flags is not None:
        flags[...] = nl._LAUNCH.pid
    if dst.dtype.kind in "iub" and value.dtype.kind == "f":
        value = np.rint(value)         # fp32 -> int: round to nearest even [the hardware's mode is unconfirmed]
    dst.data[...] = value.astype(dst.dtype) if value.dtype != dst.dtype else value
    if dst.buffer is nl.psum and not by_matmul:
        nl.matmul_written(dst)[...] = 0


def _one_bit_pattern_type(what: str, *ts: NkiTensor) -> None:
    """Bit-vector ops treat elements as bit patterns without any data type casting: one integer dtype in and out."""
    if len({t.dtype for t in ts}) != 1:
        raise NKIError(f"{what}: bit-vector inputs and dst must share one integer dtype (no casting), got "
                       f"{', '.join(str(t.dtype) for t in ts)}")


def _exact_in_fp32(what: str, *values) -> None:
    """32-bit integer lanes on the Vector / Scalar / GpSimd engines: aws-neuron-sdk issue #1308 quotes the engines
    casting 32-bit types through fp32, so a 32-bit integer (tile element, immediate or result) that fp32 cannot hold
    exactly (above 2^24, unless a multiple of a large enough power of two) is refused here rather than silently
    rounded; 8- and 16-bit lanes are always exact."""
    for v in values:
        if isinstance(v, NkiTensor):
            v = v.data
        a = np.asarray(v)
        if a.dtype.kind not in "iu" or a.dtype.itemsize < 4:
            if isinstance(v, (int, np.integer)) and not -2 ** 24 <= int(v) <= 2 ** 24:
                a = np.asarray(v, np.int64)
            else:
                continue
        wide = a.astype(np.int64)
        back = wide.astype(np.float32).astype(np.float64)
        bad = back != wide.astype(np.float64)
        if bad.any():
            first = int(wide[bad].flat[0]) & 0xFFFFFFFF
            raise NKIError(f"{what}: the 32-bit integer 0x{first:08X} is not exact in fp32, and the engines cast 32-bit "
                           "integers through fp32 (issue #1308): use 8- or 16-bit lanes")


def _same_partitions(dst: NkiTensor, *srcs: NkiTensor, what: str) -> None:
    for s in srcs:
        if s.shape[0] != dst.shape[0] or s.data.size != dst.data.size:
            raise NKIError(f"{what}: {s.shape} and dst {dst.shape} differ in partitions or elements per partition")


def _on_chip(what: str, *ts: NkiTensor) -> None:
    for t in ts:
        if t.buffer not in (nl.sbuf, nl.psum):
            raise NKIError(f"{what} reads and writes SBUF/PSUM tiles, got a {t.buffer.name} tensor")


def _operand(op: _Op, x, data: NkiTensor, what: str):
    """A scalar or a [P, 1] tile broadcast along the free dims."""
    if isinstance(x, NkiTensor):
        if x.shape[0] != data.shape[0] or int(np.prod(x.shape[1:])) != 1:
            raise NKIError(f"{what}: a tile operand must be [P, 1] with P = {data.shape[0]}, got {x.shape}")
        if op.kind != "bitvec" and x.dtype != nl.float32:
            raise NKIError(f"{what}: an arithmetic operand tile must be float32, got {x.dtype}")
        v = x.data.reshape((x.shape[0],) + (1,) * (data.ndim - 1))
        return v.astype(np.float32) if op.kind != "bitvec" else v
    return np.float32(x) if op.kind != "bitvec" else x


def _apply(op: _Op, a, b, reverse: bool = False):
    a, b = (b, a) if reverse else (a, b)
    if op.kind == "bitvec":
        return op.fn(a, b)
    return np.asarray(op.fn(np.asarray(a, np.float32), np.asarray(b, np.float32)), np.float32)


# ---------------------------------------------------------------------- data movement
def dma_copy(dst: NkiTensor, src: NkiTensor, dge_mode=dge_mode.unknown, oob_mode=oob_mode.error, name=None,
             **kw) -> None:
    if "priority" in kw:
        raise NKIError("dma_copy priority= is NeuronCore-v4 only")
    if dst.buffer is nl.psum or src.buffer is nl.psum:
        raise NKIError("DMA cannot read or write PSUM (copy through SBUF with tensor_copy)")
    if dst.data.size != src.data.size:
        raise NKIError(f"dma_copy: {src.shape} -> {dst.shape} differ in element count")
    if dge_mode is globals()["dge_mode"].hwdge and dst.dtype != src.dtype:
        raise NKIError("hwdge DMA needs matching dtypes")
    _race(src, "a read")
    value = src.data.reshape(dst.shape)
    if dst.dtype != src.dtype:
        value = value.astype(np.float32)
    _write(dst, value)


def tensor_copy(dst: NkiTensor, src: NkiTensor, engine=None, name=None) -> None:
    _on_chip("tensor_copy", dst, src)
    _same_partitions(dst, src, what="tensor_copy")
    if dst.dtype.kind in "iu" and src.dtype.kind in "iu":
        _exact_in_fp32("tensor_copy", src)
    value = src.data.reshape(dst.shape)
    _write(dst, value if value.dtype == dst.dtype else value.astype(np.float32))


def memset(dst: NkiTensor, value, engine=None, name=None) -> None:
    _on_chip("memset", dst)
    if dst.dtype.kind in "iu" and not isinstance(value, (int, np.integer)):
        raise NKIError("memset of an integer tile needs an integer value")
    _write(dst, np.full(dst.shape, value, dst.dtype))


def iota(dst: NkiTensor, pattern, offset: int = 0, channel_multiplier: int = 0, name=None) -> None:
    if dst.buffer is not nl.sbuf:
        raise NKIError("iota writes SBUF")
    if int(np.prod([n for _, n in pattern])) != dst.data.size // dst.shape[0]:
        raise NKIError(f"iota: the pattern {pattern} does not cover the {dst.data.size // dst.shape[0]} elements per "
                       "partition of dst")
    p = np.arange(dst.shape[0])[:, None]
    value = offset + p * channel_multiplier + nl._ramp([s for s, _ in pattern], [n for _, n in pattern])[None, :]
    _write(dst, value.reshape(dst.shape).astype(np.int32).astype(np.float32) if dst.dtype.kind == "f"
           else value.reshape(dst.shape))


# ---------------------------------------------------------------------- tensor engine
def nc_matmul(dst: NkiTensor, stationary: NkiTensor, moving: NkiTensor, is_stationary_onezero=False,
              is_moving_onezero=False, is_transpose=False, accumulate=None, tile_position=(), tile_size=(),
              perf_mode=matmul_perf_mode.none, name=None) -> None:
    """dst[M, N] (PSUM, fp32) = stationary[K, M].T @ moving[K, N] (SBUF); fp32 accumulation."""
    if stationary.buffer is not nl.sbuf or moving.buffer is not nl.sbuf:
        raise NKIError("nc_matmul reads its operands from SBUF")
    if dst.buffer is not nl.psum or dst.dtype != nl.float32:
        raise NKIError(f"nc_matmul writes a float32 PSUM tile on trn2, got {dst.dtype} in {dst.buffer.name}")
    for t in (stationary, moving):
        if t.dtype not in _MATMUL_DTYPES:
            raise NKIError(f"nc_matmul does not take {t.dtype} on trn2 (float8_e4m3, float8_e5m2, bfloat16, "
                           "float16, float32)")
    if (stationary.dtype == nl.float32) != (moving.dtype == nl.float32):
        raise NKIError("nc_matmul: a float32 operand needs a float32 partner")
    if stationary.ndim != 2 or moving.ndim != 2:
        raise NKIError("nc_matmul operands are 2-D [K, M] and [K, N]")
    K, M = stationary.shape
    K2, N = moving.shape
    if K != K2 or K > 128 or M > nl.tile_size.gemm_stationary_fmax or N > nl.tile_size.gemm_moving_fmax:
        raise NKIError(f"nc_matmul shapes: stationary {stationary.shape}, moving {moving.shape} (K <= 128 on both, "
                       "stationary free <= 128, moving free <= 512)")
    if dst.shape != (M, N):
        raise NKIError(f"nc_matmul dst must be {(M, N)}, got {dst.shape}")
    # products and sums in fp32 (the PE array's fp32 accumulation; bf16 / fp8 products are exact in fp32)
    prod = np.matmul(stationary.data.astype(np.float32).T, moving.data.astype(np.float32))
    written = nl.matmul_written(dst)
    acc = written.astype(bool) if accumulate is None else np.full(dst.shape, bool(accumulate))
    if accumulate and not written.all():
        raise NKIError("nc_matmul accumulate=True onto PSUM not written by a matmul is undefined on trn2")
    _write(dst, np.where(acc, dst.data + prod, prod).astype(np.float32), by_matmul=True)
    written[...] = 1


# ---------------------------------------------------------------------- vector / scalar engines
# The Scalar Engine approximates activation functions with piece-wise polynomials (nki.api.shared.rst, "Supported
# Activation Functions"); their accuracy is not documented. The emulation assumes a relative error of at most
# ACTIVATION_REL_ERROR and returns a value anywhere in that band, chosen deterministically from the input's bits (the
# same input always gives the same output, as hardware would); an exp that underflows fp32's normal range comes back
# as a value in [0, FLT_MIN] rather than exactly 0. Inputs outside a function's documented valid range are refused
# ("the Scalar Engine will generate invalid output results"). Identity, relu, square and abs are exact.
ACTIVATION_REL_ERROR = 2.0 ** -16
_FLT_MIN = np.float32(2.0 ** -126)
_EXP_UNDERFLOW = np.float32(-87.33654)      # log(FLT_MIN)


def _unit(x: np.ndarray) -> np.ndarray:
    """A deterministic value in [-1, 1) per fp32 input (a hash of its bits)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    h = (bits * np.uint64(0x9E3779B1) + np.uint64(0x7F4A7C15)) & np.uint64(0xFFFFFFFF)
    h ^= h >> np.uint64(15)
    h = (h * np.uint64(0x2C1B3C6D)) & np.uint64(0xFFFFFFFF)
    return (h.astype(np.float64) / 2.0 ** 31 - 1.0).astype(np.float32)


def scalar_engine(op: _Op, x: np.ndarray) -> np.ndarray:
    """op(x) as the emulated Scalar Engine computes it (fp32 in, fp32 out)."""
    x = np.asarray(x, np.float32)
    if op.valid is not None:
        lo, hi = op.valid
        mag = np.abs(x) if op.name == "reciprocal" else x
        bad = (mag < lo) | (mag > hi)
        if bad.any():
            raise NKIError(f"activation {op}: input {float(x[bad].flat[0])!r} is outside its valid range "
                           f"[{lo!r}, {hi!r}] (the Scalar Engine returns invalid results there)")
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        y = np.asarray(op.fn(x), np.float32)
        if not op.approx:
            return y
        u = _unit(x)
        y = (y * (np.float32(1) + np.float32(ACTIVATION_REL_ERROR) * u)).astype(np.float32)
        if op.name == "exp":
            tiny = np.isfinite(x) & (x < _EXP_UNDERFLOW)
            y = np.where(tiny, _FLT_MIN * (np.float32(0.5) + np.float32(0.5) * u), y).astype(np.float32)
    return y


def activation(dst: NkiTensor, op: _Op, data: NkiTensor, bias=None, scale=1.0, reduce_op=None, reduce_res=None,
               reduce_cmd=reduce_cmd.idle, name=None) -> None:
    """dst = op(data * scale + bias), fp32 math; scale: a scalar or [P, 1]; bias: [P, 1] or a scalar."""
    _on_chip("activation", dst, data)
    _same_partitions(dst, data, what="activation")
    if op.kind != "act":
        raise NKIError(f"activation takes an activation function, got {op}")
    x = _f32(data)
    x = x * (_operand(nl.multiply, scale, data, "activation scale") if isinstance(scale, NkiTensor) else np.float32(scale))
    if bias is not None:
        x = x + _operand(nl.add, bias, data, "activation bias")
    y = scalar_engine(op, x)
    _write(dst, y.reshape(dst.shape))
    if reduce_op is not None:
        if reduce_op is not nl.add or reduce_res is None:
            raise NKIError("activation reduces with nl.add into a [P, 1] reduce_res")
        _write(reduce_res, y.reshape(y.shape[0], -1).sum(axis=1, dtype=np.float32).reshape(reduce_res.shape))


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None) -> None:
    activation(dst, op, data, bias, scale, reduce_op, reduce_res, reduce_cmd.reset_reduce)


def tensor_tensor(dst: NkiTensor, data1: NkiTensor, data2: NkiTensor, op: _Op, engine=None, name=None) -> None:
    _on_chip("tensor_tensor", dst, data1, data2)
    _same_partitions(dst, data1, data2, what="tensor_tensor")
    if data1.buffer is nl.psum and data2.buffer is nl.psum:
        raise NKIError("tensor_tensor: at most one input may be in PSUM")
    if op.kind == "act":
        raise NKIError(f"tensor_tensor takes an ALU op, got {op}")
    if op.kind == "bitvec" and any(t.dtype.kind not in "iu" for t in (dst, data1, data2)):
        raise NKIError(f"{op} needs integer tiles")
    if op.kind == "bitvec":
        _one_bit_pattern_type(f"tensor_tensor {op}", dst, data1, data2)
        _exact_in_fp32(f"tensor_tensor {op}", data1, data2)
    a, b = data1.data.reshape(dst.shape), data2.data.reshape(dst.shape)
    y = _apply(op, a, b)
    if op.kind == "bitvec":
        _exact_in_fp32(f"tensor_tensor {op} result", y.astype(dst.dtype))
    _write(dst, y)


def tensor_scalar(dst: NkiTensor, data: NkiTensor, op0: _Op, operand0, reverse0: bool = False, op1: _Op | None = None,
                  operand1=None, reverse1: bool = False, engine=None, name=None) -> None:
    """(data op0 operand0) op1 operand1 with scalar or [P, 1] operands."""
    _on_chip("tensor_scalar", dst, data)
    _same_partitions(dst, data, what="tensor_scalar")
    if op1 is not None and (op0.kind == "bitvec") != (op1.kind == "bitvec"):
        raise NKIError("tensor_scalar: op0 and op1 must be both arithmetic or both bitvec")
    if op0.kind == "bitvec" and (data.dtype.kind not in "iu" or dst.dtype.kind not in "iu"):
        raise NKIError(f"{op0} needs integer tiles")
    if op0.kind == "bitvec":
        _one_bit_pattern_type(f"tensor_scalar {op0}", dst, data)
    x = data.data if op0.kind == "bitvec" else _f32(data)
    o0 = _operand(op0, operand0, data, "tensor_scalar operand0")
    if op0.kind == "bitvec":
        _exact_in_fp32(f"tensor_scalar {op0}", x, o0)
    y = _apply(op0, x, o0, reverse0)
    if op1 is not None:
        o1 = _operand(op1, operand1, data, "tensor_scalar operand1")
        if op1.kind == "bitvec":
            _exact_in_fp32(f"tensor_scalar {op0}/{op1}", np.asarray(y).astype(dst.dtype), o1)
        y = _apply(op1, y, o1, reverse1)
    if op0.kind == "bitvec":
        _exact_in_fp32(f"tensor_scalar {op0} result", np.asarray(y).astype(dst.dtype))
    _write(dst, np.asarray(y).reshape(dst.shape))


def scalar_tensor_tensor(dst: NkiTensor, data: NkiTensor, op0: _Op, operand0, op1: _Op, operand1: NkiTensor,
                         reverse0: bool = False, reverse1: bool = False, name=None) -> None:
    """(data op0 operand0) op1 operand1; operand0 a scalar or [P, 1], operand1 a tile like data."""
    _on_chip("scalar_tensor_tensor", dst, data, operand1)
    _same_partitions(dst, data, operand1, what="scalar_tensor_tensor")
    if data.buffer is nl.psum and operand1.buffer is nl.psum:
        raise NKIError("scalar_tensor_tensor: data and operand1 cannot both be in PSUM")
    if "bitvec" in (op0.kind, op1.kind):
        raise NKIError(f"scalar_tensor_tensor does not take bit-vector operators, got {op0}, {op1}")
    y = _apply(op0, _f32(data), _operand(op0, operand0, data, "scalar_tensor_tensor operand0"), reverse0)
    y = _apply(op1, y, _f32(operand1).reshape(y.shape), reverse1)
    _write(dst, y.reshape(dst.shape))


def tensor_reduce(dst: NkiTensor, op: _Op, data: NkiTensor, axis, negate: bool = False, keepdims: bool = False,
                  name=None) -> None:
    """Reduce the last free axes of data (axis must name them: (ndim-1,), (ndim-2, ndim-1), ...)."""
    _on_chip("tensor_reduce", dst, data)
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    if 0 in axes or sorted(axes) != list(range(data.ndim - len(axes), data.ndim)):
        raise NKIError(f"tensor_reduce reduces the last free axes only, got axis={axis} of a {data.ndim}-D tile")
    ufunc = {"add": np.add, "maximum": np.maximum, "minimum": np.minimum, "multiply": np.multiply}.get(op.name)
    if ufunc is None:
        raise NKIError(f"tensor_reduce does not reduce with {op}")
    y = ufunc.reduce(_f32(data), axis=axes, keepdims=keepdims)
    if negate:
        y = -y
    if y.size != dst.data.size or dst.shape[0] != data.shape[0]:
        raise NKIError(f"tensor_reduce dst {dst.shape} does not hold the result {y.shape}")
    _write(dst, y.reshape(dst.shape))


def reciprocal(dst: NkiTensor, data: NkiTensor, name=None) -> None:
    _on_chip("reciprocal", dst, data)
    _same_partitions(dst, data, what="reciprocal")
    _write(dst, (np.float32(1) / _f32(data)).reshape(dst.shape))


def nc_transpose(dst: NkiTensor, data: NkiTensor, engine=None, name=None) -> None:
    """[P, F] -> [F, P] through the PE array (SBUF -> PSUM, both <= 128, same dtype)."""
    if data.buffer is not nl.sbuf or dst.buffer is not nl.psum:
        raise NKIError("nc_transpose (Tensor Engine) reads SBUF and writes PSUM")
    if data.ndim != 2 or max(data.shape) > 128 or dst.shape != data.shape[::-1] or dst.dtype != data.dtype:
        raise NKIError(f"nc_transpose: {data.shape} {data.dtype} -> {dst.shape} {dst.dtype}")
    _write(dst, data.data.T.copy())


# ---------------------------------------------------------------------- top-k primitives
def max8(dst: NkiTensor, src: NkiTensor, name=None) -> None:
    """The 8 largest values of each partition, descending: dst [P, 8]."""
    _on_chip("max8", dst, src)
    x = _f32(src).reshape(src.shape[0], -1)
    if not 8 <= x.shape[1] <= 16384 or dst.shape != (src.shape[0], 8):
        raise NKIError(f"max8: src {src.shape} (8..16384 per partition), dst {dst.shape} must be [P, 8]")
    _write(dst, -np.sort(-x, axis=1)[:, :8])


def _index_dst(what: str, t: NkiTensor, P: int) -> None:
    if t.dtype not in (nl.uint16, nl.uint32) or t.shape[0] != P or t.data.size != 8 * P:
        raise NKIError(f"{what}: the index tile must be uint16/uint32 [P, 8] with P = {P}, got {t.shape} {t.dtype}")


def _eight_vals(what: str, data: NkiTensor, vals: NkiTensor, least: int) -> tuple[np.ndarray, np.ndarray]:
    """data [P, n] and vals [P, 8] as fp32, with the documented limits (least..16384 elements per partition)."""
    P = data.shape[0]
    if vals.shape[0] != P or vals.data.size != 8 * P:
        raise NKIError(f"{what}: vals must hold exactly 8 values per partition of data's {P}, got {vals.shape}")
    x = _f32(data).reshape(P, -1)
    if not least <= x.shape[1] <= 16384:
        raise NKIError(f"{what}: data has {x.shape[1]} elements per partition ({least}..16384)")
    return x, _f32(vals).reshape(P, 8)


def nc_find_index8(dst: NkiTensor, data: NkiTensor, vals: NkiTensor, name=None) -> None:
    """The position of each of the 8 values per partition (uint16/uint32 [P, 8]): its first occurrence; a value
    repeated in vals takes the next occurrences in turn, in ascending order across the dst columns (the NKI 0.6
    stub of nc_match_replace8: "nc_find_index8 ... pairs duplicate vals with their matching positions in ascending
    order"); a value absent from its partition gives the all-ones sentinel (0xFFFFFFFF / 0xFFFF)."""
    _on_chip("nc_find_index8", dst, data, vals)
    x, v = _eight_vals("nc_find_index8", data, vals, 8)
    _index_dst("nc_find_index8", dst, data.shape[0])
    rows = np.arange(x.shape[0])
    taken = np.zeros(x.shape, bool)
    pos = np.zeros(v.shape, np.int64)
    absent = np.int64(0xFFFF if dst.dtype == nl.uint16 else 0xFFFFFFFF)
    for j in range(8):
        hit = (x == v[:, j:j + 1]) & ~taken
        found = hit.any(axis=1)
        pos[:, j] = np.where(found, np.argmax(hit, axis=1), absent)
        taken[rows[found], pos[found, j]] = True
    _write(dst, pos.astype(dst.dtype).reshape(dst.shape))


def nc_match_replace8(dst: NkiTensor, data: NkiTensor, vals: NkiTensor, imm: float, dst_idx=None, name=None) -> None:
    """The NKI 0.6 stub: the first occurrence of each of the 8 values in data is replaced by imm and, with dst_idx
    (uint16/uint32 [P, 8]), its position written there. The values are processed in reverse order (i = 7 .. 0),
    each taking the first occurrence not yet replaced: among duplicate vals the smallest position goes to the
    highest dst_idx slot (vals [3, 8 x 7] over data [1, 2, 3, 4, 8 x 7] give [2, 10, 9, 8, 7, 6, 5, 4]), the opposite
    of nc_find_index8. data <= 16384 elements per partition; dst has data's shape."""
    _on_chip("nc_match_replace8", dst, data, vals)
    x, v = _eight_vals("nc_match_replace8", data, vals, 1)
    x = x.copy()
    if dst.shape[0] != data.shape[0] or dst.data.size != data.data.size:
        raise NKIError(f"nc_match_replace8: dst {dst.shape} must have data's shape {data.shape}")
    if dst_idx is not None:
        _on_chip("nc_match_replace8 dst_idx", dst_idx)
        _index_dst("nc_match_replace8 dst_idx", dst_idx, data.shape[0])
    rows = np.arange(x.shape[0])
    pos = np.zeros(v.shape, np.int64)
    for j in range(7, -1, -1):
        hit = x == v[:, j:j + 1]
        if not hit.any(axis=1).all():
            raise NKIError("nc_match_replace8: a value is absent from its partition (undefined on hardware)")
        pos[:, j] = np.argmax(hit, axis=1)
        x[rows, pos[:, j]] = np.float32(imm)
    _write(dst, x.reshape(dst.shape))
    if dst_idx is not None:
        _write(dst_idx, pos.astype(np.uint32).reshape(dst_idx.shape))


def nc_n_gather(dst: NkiTensor, data: NkiTensor, indices: NkiTensor, name=None) -> None:
    """GpSimd gather within each partition: dst[p, j] = data[p, indices[p, j]] over data's flattened free dims.
    All tiles in SBUF; indices uint32 in [0, elements per partition of data); dst in data's dtype with as many
    elements per partition as indices."""
    for t in (dst, data, indices):
        if t.buffer is not nl.sbuf:
            raise NKIError(f"nc_n_gather reads and writes SBUF (GpSimd cannot access PSUM), got {t.buffer.name}")
    P = data.shape[0]
    if dst.shape[0] != P or indices.shape[0] != P:
        raise NKIError(f"nc_n_gather: partitions of dst {dst.shape}, data {data.shape}, indices {indices.shape} differ")
    if dst.dtype != data.dtype or indices.dtype != nl.uint32:
        raise NKIError(f"nc_n_gather: dst must have data's dtype ({data.dtype}, got {dst.dtype}) and indices be uint32 "
                       f"(got {indices.dtype})")
    idx = indices.data.reshape(P, -1).astype(np.int64)
    if dst.data.size != idx.size:
        raise NKIError(f"nc_n_gather: dst {dst.shape} and indices {indices.shape} differ in elements per partition")
    x = data.data.reshape(P, -1)
    if (idx >= x.shape[1]).any():
        raise NKIError(f"nc_n_gather: an index is outside [0, {x.shape[1]})")
    _write(dst, np.take_along_axis(x, idx, axis=1).reshape(dst.shape))


# ---------------------------------------------------------------------- registers (dynamic addressing)
class VirtualRegister:
    """An engine-sequencer register (nisa.register_alloc): one 32-bit integer, known only at run time on hardware;
    here it holds the value its last register_load / register_alloc(x) gave it."""

    def __init__(self, value: int | None = None):
        self._value = value

    def read(self) -> int:
        if self._value is None:
            raise NKIError("read of a register that was never loaded (register_alloc() leaves it uninitialised)")
        return self._value

    def __repr__(self) -> str:
        return f"VirtualRegister({self._value})"


def _int32(v) -> int:
    v = int(v)
    if not -2 ** 31 <= v < 2 ** 31:
        raise NKIError(f"a register holds a 32-bit integer, got {v}")
    return v


def register_alloc(x=None) -> VirtualRegister:
    """A new register, uninitialised (x=None) or holding the compile-time integer x."""
    if x is not None and not isinstance(x, (int, np.integer)):
        raise NKIError(f"register_alloc initialises a register with an integer, got {x!r}")
    return VirtualRegister(None if x is None else _int32(x))


def register_load(dst: VirtualRegister, src: NkiTensor) -> None:
    """dst = the single (up to 32-bit) value of src, a one-element tensor in HBM or SBUF."""
    if not isinstance(dst, VirtualRegister):
        raise NKIError(f"register_load writes a register (nisa.register_alloc), got {type(dst).__name__}")
    if not isinstance(src, NkiTensor) or src.data.size != 1:
        raise NKIError(f"register_load reads a tensor with exactly one element, got {src!r}")
    if src.buffer is nl.psum:
        raise NKIError("register_load reads HBM or SBUF, not PSUM")
    if src.dtype.kind not in "iu" or src.dtype.itemsize > 4:
        raise NKIError(f"register_load of a {src.dtype} value is not emulated: it loads a 32-bit integer here "
                       "(the docs do not say how other types convert)")
    dst._value = _int32(src.data.reshape(-1)[0])
