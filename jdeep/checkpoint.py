"""Checkpoint reading: DeepSeek's safetensors (single or sharded) into jdeep's stacked param tree,
with every tensor checked against the config; Orbax save/restore of the converted tree.

Safetensors files are parsed here (header + memory map) rather than through a framework binding,
so each tensor is read lazily as raw bytes, whatever its dtype (bf16 and the fp8 codes included).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import ml_dtypes
import numpy as np

from .config import ConfigError, ModelConfig
from .param_spec import F32, INDEX, TensorSpec, layer_specs, leaf_shape, top_specs
from .plan import LayerPlan

__all__ = ["CheckpointError", "SafetensorsFile", "CheckpointReader", "load_params", "abstract_params",
           "save_converted", "restore_converted", "is_converted", "write_safetensors"]

# safetensors dtype name -> numpy dtype (fp8 codes are read as raw uint8 bytes, never as float8)
_ST_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(np.uint8), "F8_E5M2": np.dtype(np.uint8), "F8_E8M0": np.dtype(np.uint8),
}
_FLOAT_ST = {"F64", "F32", "F16", "BF16"}
_INT_ST = {"I64", "I32", "I16"}


class CheckpointError(ValueError):
    """A checkpoint folder does not match its config; the message names every offending tensor."""


@dataclass(frozen=True)
class _Entry:
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


class SafetensorsFile:
    """One .safetensors file, memory-mapped; `get(name)` returns a read-only numpy view."""

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

    def get(self, name: str) -> np.ndarray:
        e = self.entries[name]
        if e.dtype not in _ST_DTYPES:
            raise CheckpointError(f"tensor {name!r} in {self.path} has unsupported dtype {e.dtype}")
        dt = _ST_DTYPES[e.dtype]
        count = int(np.prod(e.shape, dtype=np.int64))
        if count * dt.itemsize != e.end - e.start:
            raise CheckpointError(f"tensor {name!r} in {self.path}: {e.end - e.start} bytes for shape {e.shape} {e.dtype}")
        arr = np.frombuffer(self._buffer(), dtype=dt, count=count, offset=self._data_start + e.start)
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


# ---------------------------------------------------------------------------- expected tensors
def _expected(config: ModelConfig, plan: LayerPlan) -> Iterator[tuple[str, TensorSpec, tuple]]:
    """(checkpoint name, spec, destination) for every tensor the model needs.

    destination: ("top",) or ("seg", segment, slot, rep)."""
    for spec in top_specs(config):
        yield spec.name, spec, ("top",)
    for s, seg in enumerate(plan.segments):
        for rep in range(seg.reps):
            for slot, kind in enumerate(seg.pattern):
                layer = seg.layer(rep, slot)
                for spec in layer_specs(config, kind):
                    yield f"layers.{layer}.{spec.name}", spec, ("seg", s, slot, rep)


def _np_dtype(kind: str, dtype: Any) -> np.dtype:
    if kind == F32:
        return np.dtype(np.float32)
    if kind == INDEX:
        return np.dtype(np.int32)
    return np.dtype(dtype)


def _set_path(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def _get_path(tree: dict, path: tuple[str, ...]) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _build_tree(config: ModelConfig, plan: LayerPlan, dtype: Any, make: Callable[[tuple, np.dtype], Any]) -> dict:
    params: dict[str, Any] = {}
    for spec in top_specs(config):
        _set_path(params, spec.path, make(spec.shape, _np_dtype(spec.kind, dtype)))
    segments = []
    for seg in plan.segments:
        slots = []
        for kind in seg.pattern:
            tree: dict[str, Any] = {}
            for spec in layer_specs(config, kind):
                if spec.expert not in (None, 0):
                    continue
                _set_path(tree, spec.path, make((seg.reps,) + leaf_shape(spec, config), _np_dtype(spec.kind, dtype)))
            slots.append(tree)
        segments.append(slots)
    params["segments"] = segments
    return params


def abstract_params(config: ModelConfig, plan: LayerPlan, dtype: Any) -> dict:
    """The param tree as jax.ShapeDtypeStruct leaves (for restore targets and lowering)."""
    import jax

    return _build_tree(config, plan, dtype, lambda shape, dt: jax.ShapeDtypeStruct(shape, dt))


def load_params(folder: str, config: ModelConfig, plan: LayerPlan, dtype: Any,
                progress: Callable[[int, int], None] | None = None) -> dict:
    """Read and validate every tensor; returns a numpy param tree (host memory).

    Raises CheckpointError listing every missing, unexpected, mis-shaped or wrongly typed tensor.
    `mtp.*` tensors (the multi-token-prediction block, not run by jdeep) are accepted and skipped.
    """
    reader = CheckpointReader(folder)
    expected = list(_expected(config, plan))
    present = set(reader.keys())
    wanted = {name for name, _, _ in expected}
    problems: list[str] = []
    for name, spec, _ in expected:
        if name not in present:
            problems.append(f"missing tensor {name!r} (expected shape {list(spec.shape)})")
            continue
        e = reader.entry(name)
        if e.shape != spec.shape:
            problems.append(f"tensor {name!r} has shape {list(e.shape)}, expected {list(spec.shape)}")
        ok = e.dtype in (_INT_ST if spec.kind == INDEX else _FLOAT_ST)
        if not ok:
            what = "an integer" if spec.kind == INDEX else "a float (F32/BF16/F16)"
            hint = " (quantized fp8/fp4 checkpoints are not supported by this version)" if e.dtype.startswith("F8") or e.dtype == "I8" else ""
            problems.append(f"tensor {name!r} has dtype {e.dtype}, expected {what}{hint}")
    for name in sorted(present - wanted):
        if name.startswith("mtp."):
            continue
        problems.append(f"unexpected tensor {name!r} (not part of this config's model)")
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise CheckpointError(f"checkpoint {folder} does not match its config.json: " + "; ".join(shown))

    params = _build_tree(config, plan, dtype, lambda shape, dt: np.empty(shape, dt))
    for i, (name, spec, dest) in enumerate(expected):
        arr = reader.get(name)
        if spec.kind == INDEX:
            if arr.size and (arr.min() < 0 or arr.max() >= config.n_routed_experts):
                raise CheckpointError(f"tensor {name!r} holds expert ids outside [0, {config.n_routed_experts})")
        if dest[0] == "top":
            leaf = _get_path(params, spec.path)
            leaf[...] = arr
        else:
            _, s, slot, rep = dest
            leaf = _get_path(params["segments"][s][slot], spec.path)
            if spec.expert is not None:
                leaf[rep, spec.expert] = arr
            else:
                leaf[rep] = arr
        if progress is not None:
            progress(i + 1, len(expected))
    return params


# ---------------------------------------------------------------------------- writing
_NP_TO_ST = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
             np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int8): "I8",
             np.dtype(np.uint8): "U8", np.dtype(np.float64): "F64"}


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write a .safetensors file (any numpy dtype above, bf16 included)."""
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
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in arrays:
            f.write(a.tobytes())


# ---------------------------------------------------------------------------- orbax
_CONVERTED_MARKER = "jdeep_converted.json"


def is_converted(folder: str) -> bool:
    return os.path.exists(os.path.join(folder, _CONVERTED_MARKER))


def save_converted(folder: str, config: ModelConfig, params: dict, dtype: str) -> None:
    """Save the converted param tree with Orbax, plus config.json, so `jdeep.load` skips conversion."""
    import orbax.checkpoint as ocp

    folder = os.path.abspath(folder)
    os.makedirs(folder, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(folder, "params"), params, force=True)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config.to_dict(), f, indent=2)
    with open(os.path.join(folder, _CONVERTED_MARKER), "w", encoding="utf-8") as f:
        json.dump({"format": "jdeep-orbax-v1", "dtype": dtype}, f)


def restore_converted(folder: str, config: ModelConfig, plan: LayerPlan, dtype: Any) -> dict:
    import orbax.checkpoint as ocp

    folder = os.path.abspath(folder)
    with open(os.path.join(folder, _CONVERTED_MARKER), encoding="utf-8") as f:
        saved_dtype = json.load(f).get("dtype")
    if np.dtype(saved_dtype) != np.dtype(dtype):
        raise ConfigError(f"{folder} was converted with dtype {saved_dtype}; load it with dtype={saved_dtype!r}")
    target = abstract_params(config, plan, dtype)
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(os.path.join(folder, "params"), target)
