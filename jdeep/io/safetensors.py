"""The safetensors format: reading one file or a checkpoint folder of them tensor by tensor, and writing one.

Files are parsed here (header + positioned reads or a memory map) rather than through a framework binding, so
each tensor is read lazily as raw bytes, whatever its dtype (bf16 and the fp8 codes included). Malformed
files and folders raise CheckpointError.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["CheckpointError", "SafetensorsFile", "CheckpointReader", "write_safetensors", "FLOAT_DTYPES",
           "INT_DTYPES"]

# safetensors dtype name -> numpy dtype (fp8 codes are read as raw uint8 bytes, never as float8)
_ST_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(np.uint8), "F8_E5M2": np.dtype(np.uint8), "F8_E8M0": np.dtype(np.uint8),
}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})   # safetensors names of the float dtypes
INT_DTYPES = frozenset({"I64", "I32", "I16"})            # ... and of the integer index dtypes

# numpy dtype -> safetensors dtype name (writing)
_NP_TO_ST = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
             np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int8): "I8",
             np.dtype(np.uint8): "U8", np.dtype(np.float64): "F64",
             np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(ml_dtypes.float8_e8m0fnu): "F8_E8M0"}


class CheckpointError(ValueError):
    """A checkpoint folder does not match its config; the message names every offending tensor."""


@dataclass(frozen=True)
class _Entry:
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


class SafetensorsFile:
    """One .safetensors file. `get(name)` reads one tensor with a positioned read into a fresh numpy
    array (no memory map: mapped pages would stay in the process's resident set while loading);
    `view(name)` returns a read-only memory-mapped view, for callers that touch only a few rows."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            size = os.fstat(f.fileno()).st_size
            if n > size - 8:
                raise CheckpointError(f"{path}: corrupt safetensors header length {n}")
            try:
                header = json.loads(f.read(n))
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from None
        self._data_start = 8 + n
        self.metadata = header.pop("__metadata__", None) or {}
        self.entries: dict[str, _Entry] = {}
        for name, e in header.items():
            start, end = e["data_offsets"]
            self.entries[name] = _Entry(e["dtype"], tuple(e["shape"]), start, end)
            if self._data_start + end > size:
                raise CheckpointError(f"{path}: tensor {name!r} extends past the end of the file (truncated?)")
        self._mmap: mmap.mmap | None = None

    def _buffer(self) -> mmap.mmap:
        if self._mmap is None:
            with open(self.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._mmap

    def _checked(self, name: str) -> tuple[_Entry, np.dtype, int]:
        e = self.entries[name]
        if e.dtype not in _ST_DTYPES:
            raise CheckpointError(f"tensor {name!r} in {self.path} has unsupported dtype {e.dtype}")
        dt = _ST_DTYPES[e.dtype]
        count = int(np.prod(e.shape, dtype=np.int64))
        if count * dt.itemsize != e.end - e.start:
            raise CheckpointError(f"tensor {name!r} in {self.path}: {e.end - e.start} bytes for shape {e.shape} {e.dtype}")
        return e, dt, count

    def get(self, name: str) -> np.ndarray:
        e, dt, count = self._checked(name)
        return self.read_range(name, 0, count * dt.itemsize).reshape(e.shape)

    def read_range(self, name: str, start: int, stop: int) -> np.ndarray:
        """Bytes [start, stop) of tensor `name`'s data as a flat array of its dtype (positioned reads)."""
        e, dt, _ = self._checked(name)
        out = np.empty((stop - start) // dt.itemsize, dt)
        raw = memoryview(out.view(np.uint8))
        with open(self.path, "rb", buffering=0) as f:
            done, offset = 0, self._data_start + e.start + start
            while done < len(raw):
                n = os.preadv(f.fileno(), [raw[done:done + (1 << 30)]], offset + done)
                if n <= 0:
                    raise CheckpointError(f"tensor {name!r}: unexpected end of {self.path}")
                done += n
        return out

    def read_slice(self, name: str, sl: tuple[slice, ...]) -> np.ndarray:
        """tensor[sl] (slices with explicit start and stop) without reading the rest: the whole tensor or a row
        range is one positioned read; other slices are copied out of a memory map (only the touched pages are
        read)."""
        e, dt, _ = self._checked(name)
        full = all(s.start == 0 and s.stop == n for s, n in zip(sl[1:], e.shape[1:]))
        if not sl or (full and sl[0].start == 0 and sl[0].stop == e.shape[0]):
            return self.get(name)
        if full:
            row = int(np.prod(e.shape[1:], dtype=np.int64)) * dt.itemsize
            return self.read_range(name, sl[0].start * row, sl[0].stop * row).reshape((sl[0].stop - sl[0].start,)
                                                                                      + e.shape[1:])
        return np.array(self.view(name)[sl])

    def view(self, name: str, random_access: bool = False) -> np.ndarray:
        """Read-only memory-mapped view of one tensor. `random_access`: tell the kernel the region is read at
        scattered rows (MADV_RANDOM), so a page fault reads that page, not a read-ahead window of MiBs around
        it (for Engram tables gathered a few rows at a time)."""
        e, dt, count = self._checked(name)
        buf = self._buffer()
        start = self._data_start + e.start
        if random_access and hasattr(mmap, "MADV_RANDOM") and e.end > e.start:
            page = mmap.PAGESIZE
            buf.madvise(mmap.MADV_RANDOM, start - start % page, self._data_start + e.end - (start - start % page))
        arr = np.frombuffer(buf, dtype=dt, count=count, offset=start)
        return arr.reshape(e.shape)

    def close(self) -> None:
        self._mmap = None


class CheckpointReader:
    """All tensors of a checkpoint folder (`model.safetensors.index.json` or every *.safetensors)."""

    def __init__(self, folder: str):
        self.folder = folder
        index_path = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index_path):
            try:
                with open(index_path, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index_path} is malformed: {e!r}") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p for p in os.listdir(folder) if p.endswith(".safetensors"))
            weight_map = None
        if not files:
            raise CheckpointError(f"no .safetensors files in {folder}")
        self.files: dict[str, SafetensorsFile] = {}
        for fn in files:
            full = os.path.join(folder, fn)
            if not os.path.exists(full):
                raise CheckpointError(f"{fn}, listed in model.safetensors.index.json, is missing from {folder}")
            self.files[fn] = SafetensorsFile(full)
        self._where: dict[str, str] = {}
        for fn, f in self.files.items():
            for name in f.entries:
                if name in self._where:
                    raise CheckpointError(f"tensor {name!r} appears in both {self._where[name]} and {fn}")
                self._where[name] = fn
        if weight_map is not None:
            for name, fn in weight_map.items():
                if self._where.get(name) != fn:
                    raise CheckpointError(f"tensor {name!r} is listed in {fn} by the index but not stored there")

    def keys(self) -> list[str]:
        return list(self._where)

    def entry(self, name: str) -> _Entry:
        return self.files[self._where[name]].entries[name]

    def get(self, name: str) -> np.ndarray:
        return self.files[self._where[name]].get(name)

    def read_slice(self, name: str, sl: tuple[slice, ...]) -> np.ndarray:
        """tensor[sl], reading only what the slice covers (SafetensorsFile.read_slice)."""
        return self.files[self._where[name]].read_slice(name, sl)


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None,
                      holes: dict[str, tuple[Any, tuple[int, ...]]] | None = None) -> None:
    """Write a .safetensors file (any numpy dtype above, bf16 included).

    holes: name -> (numpy dtype, shape) of tensors whose bytes are not written: the file is extended over
    them (a sparse file on filesystems that support it; they read as zeros). For tests and tools that need
    huge tensors (e.g. Engram tables) without the disk space or the time to write them."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    arrays = []
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        if a.dtype not in _NP_TO_ST:
            raise TypeError(f"cannot write {name!r} of dtype {a.dtype}")
        header[name] = {"dtype": _NP_TO_ST[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    for name, (dt, shape) in (holes or {}).items():
        dt = np.dtype(dt)
        if dt not in _NP_TO_ST:
            raise TypeError(f"cannot write {name!r} of dtype {dt}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        header[name] = {"dtype": _NP_TO_ST[dt], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in arrays:
            f.write(a.tobytes())
        f.truncate(8 + len(raw) + offset)
