"""Emulated `nki.language`: buffers, dtypes, tile sizes, tensors (numpy views tagged with their buffer), ops."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable

import ml_dtypes
import numpy as np


class NKIError(Exception):
    """What neuronx-cc or NKI's own checks would refuse."""


class NKIObject:
    """Base class of the classes a kernel may use (the language guide: "must inherit from NKIObject and no other
    classes")."""

    def __init__(self, **kwargs):
        for k, v in kwargs.items():
            setattr(self, k, v)


# ------------------------------------------------------------------------------------------- the launch in progress
SBUF_PARTITION_BYTES = 224 * 1024      # trn2 (NeuronCore-v3): 28 MiB of SBUF = 128 partitions x 224 KiB
PSUM_BANK_BYTES = 2048


@dataclass
class _Launch:
    """One program of a launch: its grid position, the shared-HBM tensors of the launch (program i's k-th shared
    allocation is program 0's k-th: the kernel's outputs are one tensor for all cores), and this core's on-chip
    memory in use."""
    ndim: int = 0
    num: int = 1
    pid: int = 0
    shared: list = field(default_factory=list)
    n_shared: int = 0
    live: dict = field(default_factory=lambda: {"sbuf": 0, "psum": 0})
    peak: dict = field(default_factory=lambda: {"sbuf": 0, "psum": 0})


_LAUNCH = _Launch()


def program_ndim() -> int:
    """Dimensions of the launch grid: 0 for kernel(...), 1 for kernel[lnc](...)."""
    return _LAUNCH.ndim


def num_programs(axes=0) -> int:
    """Programs along axis 0 of the grid (1 without a grid, as the LNC guide says)."""
    if axes not in (0, (0,), None):
        raise NKIError(f"num_programs: the emulated grids are 1-D, got axes={axes!r}")
    return _LAUNCH.num


def program_id(axis=0) -> int:
    if axis != 0:
        raise NKIError(f"program_id: the emulated grids are 1-D, got axis={axis!r}")
    return _LAUNCH.pid


def _on_chip_bytes(shape, dtype, buffer) -> int:
    per_partition = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(dtype).itemsize
    if buffer is psum:                                  # PSUM is handed out in 2 KiB banks
        per_partition = -(-per_partition // PSUM_BANK_BYTES) * PSUM_BANK_BYTES
    return per_partition


def _allocate(data: np.ndarray, buffer) -> None:
    """Count an SBUF/PSUM allocation against this core's capacity until its storage is freed (when the last view
    goes: a tile's lifetime is its Python lifetime here, never shorter than the compiler's liveness)."""
    name = buffer.name
    n = _on_chip_bytes(data.shape, data.dtype, buffer)
    launch = _LAUNCH
    launch.live[name] += n
    launch.peak[name] = max(launch.peak[name], launch.live[name])
    cap = SBUF_PARTITION_BYTES if buffer is sbuf else PSUM_PARTITION_BYTES
    if launch.live[name] > cap:
        launch.live[name] -= n
        raise NKIError(f"{name} over capacity: allocating {n} bytes per partition ({data.shape} {data.dtype}) with "
                       f"{launch.live[name]} in use exceeds the {cap} bytes of a partition")

    def release(launch=launch, name=name, n=n):
        launch.live[name] -= n
    weakref.finalize(data, release)


def _shared_output(shape, dtype) -> "NkiTensor | None":
    """Program > 0 of a launch: the shared-HBM tensor program 0 allocated at this point, else None."""
    launch = _LAUNCH
    k = launch.n_shared
    launch.n_shared += 1
    if launch.pid == 0:
        return None
    if k >= len(launch.shared):
        raise NKIError(f"program {launch.pid} allocates shared-HBM tensor #{k} that program 0 did not: the programs "
                       "of one launch must allocate the same outputs")
    t = launch.shared[k]
    if t.shape != tuple(shape) or t.dtype != np.dtype(dtype):
        raise NKIError(f"program {launch.pid} allocates shared-HBM tensor #{k} as {tuple(shape)} {np.dtype(dtype)}, "
                       f"program 0 as {t.shape} {t.dtype}")
    return t


@dataclass(frozen=True)
class _Buffer:
    name: str

    def __repr__(self) -> str:
        return f"nl.{self.name}"


sbuf, psum, hbm, shared_hbm = _Buffer("sbuf"), _Buffer("psum"), _Buffer("hbm"), _Buffer("shared_hbm")
private_hbm = hbm
_ON_CHIP = (sbuf, psum)

float32, float16, bfloat16, tfloat32 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), \
    np.dtype(np.float32)
float8_e4m3, float8_e5m2 = np.dtype(ml_dtypes.float8_e4m3), np.dtype(ml_dtypes.float8_e5m2)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)
int8, int16, int32, uint8, uint16, uint32 = (np.dtype(t) for t in (np.int8, np.int16, np.int32, np.uint8, np.uint16,
                                                                    np.uint32))
bool_ = np.dtype(np.bool_)


class tile_size:
    pmax = 128
    psum_bank_fmax = 512
    psum_bank_fmax_bytes = 2048
    psum_num_banks = 8
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512
    sbuf_fmax_bytes = 224 * 1024


PSUM_PARTITION_BYTES = tile_size.psum_bank_fmax_bytes * tile_size.psum_num_banks


class NkiTensor:
    """A tensor: a numpy view of some storage, with the buffer it lives in. Views share storage."""

    def __init__(self, data: np.ndarray, buffer: _Buffer, name: str = "", writable: bool = True):
        self.data, self.buffer, self.name, self.writable = data, buffer, name, writable
        if buffer in _ON_CHIP:
            if data.ndim < 2:
                raise NKIError(f"an {buffer.name} tensor needs a partition and a free dim, got shape {data.shape}")
            if data.shape[0] > tile_size.pmax:
                raise NKIError(f"{buffer.name} tensor partition dimension {data.shape[0]} exceeds maximum "
                               f"{tile_size.pmax}")

    shape = property(lambda self: tuple(self.data.shape))
    dtype = property(lambda self: self.data.dtype)
    ndim = property(lambda self: self.data.ndim)

    def _view(self, data: np.ndarray, writable: bool | None = None) -> "NkiTensor":
        return NkiTensor(data, self.buffer, self.name, self.writable if writable is None else writable)

    def __getitem__(self, idx) -> "NkiTensor":
        idx = idx if isinstance(idx, tuple) else (idx,)
        if self.buffer in _ON_CHIP:
            if idx and isinstance(idx[0], slice) and idx[0].step not in (None, 1):
                raise NKIError("the partition dim cannot be strided")
            if idx and isinstance(idx[0], (int, np.integer)):   # an int on the partition dim keeps it (size 1)
                idx = (slice(int(idx[0]), int(idx[0]) + 1),) + idx[1:]
            out = self.data[idx]
            while out.ndim < 2:
                out = out[..., None]
            return self._view(out)
        return self._view(self.data[idx])

    def slice(self, dim: int, start: int, end: int, step: int = 1) -> "NkiTensor":
        idx = [slice(None)] * self.ndim
        idx[dim] = slice(start, end, step)
        return self[tuple(idx)]

    def view(self, dtype) -> "NkiTensor":
        """Bit reinterpretation; the last dim rescales by the itemsize ratio."""
        return self._view(self.data.view(np.dtype(dtype)))

    def reshape(self, shape) -> "NkiTensor":
        shape = tuple(shape)
        if int(np.prod(shape)) != self.data.size:
            raise NKIError(f"reshape {self.shape} -> {shape} changes the element count")
        if self.buffer in _ON_CHIP and shape[0] != self.shape[0]:
            raise NKIError("reshape of an on-chip tensor must keep the partition dim")
        out = self.data.reshape(shape)
        if not np.shares_memory(out, self.data):
            raise NKIError("reshape needs contiguous dims")
        return self._view(out)

    def expand_dim(self, dim: int) -> "NkiTensor":
        return self._view(np.expand_dims(self.data, dim))

    def broadcast(self, dim: int, size: int) -> "NkiTensor":
        if self.shape[dim] != 1:
            raise NKIError(f"broadcast needs a size-1 dim, dim {dim} has {self.shape[dim]}")
        shape = list(self.shape)
        shape[dim] = size
        return self._view(np.broadcast_to(self.data, shape), writable=False)

    def ap(self, pattern, offset: int = 0, vector_offset: "NkiTensor | None" = None, indirect_dim: int = 0,
           scalar_offset=None) -> "NkiTensor":
        """Access pattern [[step, num], ...] (elements, outermost first) over the tensor's storage from `offset`;
        vector_offset: a [P, 1] index tile choosing the row (dim indirect_dim) per partition (HBM tensors only);
        scalar_offset: a run-time index (a register, or a one-element integer SBUF tile) on dim indirect_dim of the
        tensor, moving the start by index * that dim's stride (HBM tensors only here); out-of-bounds raises, as
        oob_mode.error (the default) does on hardware."""
        base = self.data
        while base.base is not None and isinstance(base.base, np.ndarray):
            base = base.base
        flat = base.reshape(-1)
        steps, nums = [p[0] for p in pattern], [p[1] for p in pattern]
        if self.buffer in _ON_CHIP and steps[0] != int(np.prod(base.shape[1:])):
            raise NKIError("an on-chip access pattern's partition step must be the free size (contiguous partitions)")
        if scalar_offset is not None:
            if vector_offset is not None:
                raise NKIError("at most one of scalar_offset and vector_offset can be given")
            offset = offset + _dynamic_start(scalar_offset, base, self.buffer, indirect_dim)
        if vector_offset is not None:
            if self.buffer in _ON_CHIP or indirect_dim != 0:
                raise NKIError("vector_offset (indirect rows) needs an HBM tensor and indirect_dim=0")
            rows = vector_offset.data.reshape(-1).astype(np.int64)
            if rows.shape[0] != nums[0]:
                raise NKIError(f"vector_offset has {rows.shape[0]} rows for a pattern of {nums[0]}")
            row = int(np.prod(base.shape[1:]))
            if (rows < 0).any() or (rows >= base.shape[0]).any():
                raise NKIError("vector_offset row out of bounds")
            idx = offset + rows[:, None] * row + _ramp(steps[1:], nums[1:])[None, :]
            return NkiTensor(flat[idx.reshape([nums[0]] + nums[1:])], self.buffer, self.name, writable=False)
        idx = offset + _ramp(steps, nums)
        if idx.size and (idx.min() < 0 or idx.max() >= flat.size):
            raise NKIError("access pattern out of bounds")
        strides = tuple(s * flat.itemsize for s in steps)
        out = np.lib.stride_tricks.as_strided(flat[offset:], shape=tuple(nums), strides=strides)
        return self._view(out, writable=0 not in steps)

    def __repr__(self) -> str:
        return f"NkiTensor({self.shape}, {self.dtype}, {self.buffer})"


def _dynamic_start(scalar_offset, base: np.ndarray, buffer: _Buffer, indirect_dim: int) -> int:
    """The element offset a scalar_offset adds: its run-time value times the stride of dim indirect_dim."""
    from .isa import VirtualRegister

    if buffer in _ON_CHIP:
        raise NKIError("scalar_offset on an SBUF/PSUM tensor is not emulated (HBM tensors only)")
    if not 0 <= indirect_dim < base.ndim:
        raise NKIError(f"indirect_dim {indirect_dim} is not a dim of a {base.ndim}-D tensor")
    if isinstance(scalar_offset, VirtualRegister):
        value = scalar_offset.read()
    elif isinstance(scalar_offset, NkiTensor):
        if scalar_offset.buffer is not sbuf or scalar_offset.data.size != 1 or scalar_offset.dtype.kind not in "iu":
            raise NKIError(f"a tensor scalar_offset is one integer element in SBUF, got {scalar_offset!r}")
        value = int(scalar_offset.data.reshape(-1)[0])
    else:
        raise NKIError(f"scalar_offset must be a register (nisa.register_alloc) or an SBUF element, got "
                       f"{type(scalar_offset).__name__} (a compile-time offset goes in offset=)")
    if not 0 <= value < base.shape[indirect_dim]:
        raise NKIError(f"scalar_offset {value} is out of bounds for dim {indirect_dim} of size "
                       f"{base.shape[indirect_dim]} (oob_mode.error)")
    return value * int(np.prod(base.shape[indirect_dim + 1:], dtype=np.int64))


def _ramp(steps, nums) -> np.ndarray:
    idx = np.zeros((), np.int64)
    for s, n in zip(steps, nums):
        idx = idx[..., None] + s * np.arange(n)
    return idx.reshape(-1) if idx.ndim else idx.reshape(1)


def ndarray(shape, dtype, buffer: _Buffer = sbuf, name: str = "") -> NkiTensor:
    """Uninitialised storage (filled with NaN / a sentinel, as the simulator does)."""
    if not isinstance(buffer, _Buffer):
        raise NKIError(f"buffer must be an nl buffer object (nl.sbuf, nl.psum, nl.hbm, nl.shared_hbm), got {buffer!r}")
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in shape)
    if buffer is psum and int(np.prod(shape[1:])) * dtype.itemsize > PSUM_PARTITION_BYTES:
        raise NKIError(f"psum tensor of {shape} {dtype} exceeds the {PSUM_PARTITION_BYTES} bytes of a partition")
    if buffer is shared_hbm:
        t = _shared_output(shape, dtype)
        if t is not None:
            return t
    fill = np.nan if dtype.kind == "f" or dtype in (bfloat16, float8_e4m3, float8_e5m2, float8_e4m3fn) else 4
    t = NkiTensor(np.full(shape, fill, dtype), buffer, name)
    if buffer is psum:
        key = id(t.data)                    # (no strong reference: a PSUM tile's bank is free once it is gone)
        _MATMUL_WRITTEN[key] = (None, np.zeros(t.data.size, np.int8))
        weakref.finalize(t.data, _MATMUL_WRITTEN.pop, key, None)
    if buffer in _ON_CHIP:
        _allocate(t.data, buffer)
    if buffer is shared_hbm:
        _WRITER[id(t.data)] = (t.data, np.full(t.data.size, -1, np.int8))
        _LAUNCH.shared.append(t)
    return t


def zeros(shape, dtype, buffer: _Buffer = sbuf, name: str = "") -> NkiTensor:
    t = ndarray(shape, dtype, buffer, name)
    t.data[...] = 0
    return t


_MATMUL_WRITTEN: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # psum storage -> per-element "a matmul wrote it"


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


_WRITER: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # shared-HBM storage -> per-element writing program (-1)


def _aligned(flags: np.ndarray, root: np.ndarray, view: np.ndarray) -> np.ndarray:
    item = root.itemsize
    start = (view.__array_interface__["data"][0] - root.__array_interface__["data"][0]) // item
    return np.lib.stride_tricks.as_strided(flags[start:], shape=view.shape,
                                           strides=tuple(s // item for s in view.strides))


def matmul_written(t: NkiTensor) -> np.ndarray:
    """Writable int8 flags aligned with the PSUM view t: 1 where a matmul wrote since the last other write."""
    root = _root(t.data)
    _, flags = _MATMUL_WRITTEN[id(root)]
    return _aligned(flags, root, t.data)


def writer(t: NkiTensor) -> np.ndarray | None:
    """Writable int8 flags aligned with a shared-HBM view t: the program that wrote each element (-1: none yet);
    None for other tensors."""
    if t.buffer is not shared_hbm:
        return None
    ptr = t.data.__array_interface__["data"][0]
    for root, flags in _WRITER.values():           # by address: access-pattern views (as_strided) lose .base
        start = root.__array_interface__["data"][0]
        if start <= ptr < start + max(root.nbytes, 1):
            return _aligned(flags, root, t.data)
    return None


def ds(start: int, size: int) -> slice:
    return slice(start, start + size)


def affine_range(*args):
    return range(*args)


sequential_range = static_range = affine_range


@dataclass(frozen=True)
class _Op:
    name: str
    fn: Callable
    kind: str          # "arith", "bitvec", "compare" or "act"
    approx: bool = False            # activations: a piece-wise polynomial on the Scalar Engine (see isa.activation)
    valid: tuple | None = None      # activations: the documented valid input range (|x| for reciprocal)

    def __repr__(self) -> str:
        return f"nl.{self.name}"


def _silu(x):
    return x / (1 + np.exp(-x))


add = _Op("add", np.add, "arith")
subtract = _Op("subtract", np.subtract, "arith")
multiply = _Op("multiply", np.multiply, "arith")
maximum = _Op("maximum", np.maximum, "arith")
minimum = _Op("minimum", np.minimum, "arith")
divide = _Op("divide", np.divide, "arith")
equal = _Op("equal", lambda a, b: (a == b).astype(np.float32), "compare")
not_equal = _Op("not_equal", lambda a, b: (a != b).astype(np.float32), "compare")
greater = _Op("greater", lambda a, b: (a > b).astype(np.float32), "compare")
greater_equal = _Op("greater_equal", lambda a, b: (a >= b).astype(np.float32), "compare")
less = _Op("less", lambda a, b: (a < b).astype(np.float32), "compare")
less_equal = _Op("less_equal", lambda a, b: (a <= b).astype(np.float32), "compare")
bitwise_and = _Op("bitwise_and", np.bitwise_and, "bitvec")
bitwise_or = _Op("bitwise_or", np.bitwise_or, "bitvec")
bitwise_xor = _Op("bitwise_xor", np.bitwise_xor, "bitvec")
left_shift = _Op("left_shift", np.left_shift, "bitvec")
right_shift = _Op("right_shift", lambda a, b: (a.view(np.uint32 if a.dtype.itemsize == 4 else np.dtype(f"u{a.dtype.itemsize}"))
                                                >> b).view(a.dtype), "bitvec")       # logical
copy = _Op("copy", lambda x: x, "act")
exp = _Op("exp", np.exp, "act", approx=True)
silu = _Op("silu", _silu, "act", approx=True)
sigmoid = _Op("sigmoid", lambda x: 1 / (1 + np.exp(-x)), "act", approx=True)
square = _Op("square", np.square, "act")
rsqrt = _Op("rsqrt", lambda x: 1 / np.sqrt(x), "act", approx=True, valid=(2.0 ** -87, 2.0 ** 97))
sqrt = _Op("sqrt", np.sqrt, "act", approx=True, valid=(2.0 ** -116, 2.0 ** 118))
reciprocal = _Op("reciprocal", lambda x: 1 / x, "act", approx=True, valid=(2.0 ** -42, 2.0 ** 42))
relu = _Op("relu", lambda x: np.maximum(x, 0), "act")
tanh = _Op("tanh", np.tanh, "act", approx=True)
softplus = _Op("softplus", lambda x: np.logaddexp(0, x), "act", approx=True)
abs = _Op("abs", np.abs, "act")  # noqa: A001
