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

from ..config import ConfigError, ModelConfig
from ..kernels import codecs
from ..param_spec import (FP4, FP8, FP8_DEQUANT, INDEX, TensorSpec, engram_table_specs, layer_specs, top_specs,
                         tree_leaves)
from ..plan import LayerPlan

__all__ = ["CheckpointError", "SafetensorsFile", "CheckpointReader", "load_params", "load_params_sharded",
           "padded_experts", "tree_path", "abstract_params", "validate_checkpoint",
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


_LEAF_DTYPES = {"f32": np.dtype(np.float32), "i32": np.dtype(np.int32), "u8": np.dtype(np.uint8)}


def _leaf_dtype(cls: str, dtype: Any) -> np.dtype:
    return _LEAF_DTYPES.get(cls, np.dtype(dtype))


def _set_path(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def _get_path(tree: dict, path: tuple[str, ...]) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _leaf_plan(config: ModelConfig, plan: LayerPlan) -> dict[tuple, tuple[tuple[int, ...], str]]:
    """Every tree leaf: key (("top",) | ("seg", s, slot)) + path -> (full shape, dtype class)."""
    leaves: dict[tuple, tuple[tuple[int, ...], str]] = {}
    for spec in top_specs(config):
        for path, shape, cls in tree_leaves(spec):
            leaves[("top",) + path] = (shape, cls)
    for s, seg in enumerate(plan.segments):
        for slot, kind in enumerate(seg.pattern):
            for spec in layer_specs(config, kind):
                if spec.expert not in (None, 0):
                    continue
                extra = (config.n_routed_experts,) if spec.expert is not None else ()
                for path, shape, cls in tree_leaves(spec):
                    leaves[("seg", s, slot) + path] = ((seg.reps,) + extra + shape, cls)
    return leaves


def _build_tree(config: ModelConfig, plan: LayerPlan, dtype: Any, make: Callable[[tuple, np.dtype], Any]) -> dict:
    params: dict[str, Any] = {"segments": [[{} for _ in seg.pattern] for seg in plan.segments]}
    for key, (shape, cls) in _leaf_plan(config, plan).items():
        leaf = make(shape, _leaf_dtype(cls, dtype))
        if key[0] == "top":
            _set_path(params, key[1:], leaf)
        else:
            _set_path(params["segments"][key[1]][key[2]], key[3:], leaf)
    return params


def abstract_params(config: ModelConfig, plan: LayerPlan, dtype: Any) -> dict:
    """The param tree as jax.ShapeDtypeStruct leaves (for restore targets and lowering)."""
    import jax

    return _build_tree(config, plan, dtype, lambda shape, dt: jax.ShapeDtypeStruct(shape, dt))


# checkpoint dtypes accepted per role
_OK_DTYPES = {
    "float": _FLOAT_ST, "index": _INT_ST, "fp8": {"F8_E4M3", "U8"}, "fp4": {"I8", "U8"},
    "scale": {"F8_E8M0", "U8", "F32"},
}


def _roles(spec: TensorSpec) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(checkpoint name, role, stored shape, leaf sub-path suffix) of the tensors behind one spec."""
    if spec.kind == INDEX:
        return [(spec.name, "index", spec.shape, "")]
    if spec.fmt in (FP8, FP8_DEQUANT):
        return [(spec.name, "fp8", spec.shape, "codes"), (spec.scale_name, "scale", spec.scale_shape, "scale")]
    if spec.fmt == FP4:
        return [(spec.name, "fp4", spec.stored_shape, "packed"), (spec.scale_name, "scale", spec.scale_shape, "scale")]
    return [(spec.name, "float", spec.shape, "")]


def _scale_bytes(arr: np.ndarray, st_dtype: str, name: str) -> np.ndarray:
    """ue8m0 exponent bytes from an F8_E8M0/U8 tensor, or from float32 powers of two."""
    if st_dtype != "F32":
        return arr.view(np.uint8)
    a = np.asarray(arr, np.float32)
    mant, _ = np.frexp(a)
    if not (np.all(a > 0) and np.all(mant == 0.5)):
        raise CheckpointError(f"tensor {name!r}: float32 scales must be positive powers of two (ue8m0)")
    return (codecs.floor_log2(np, a) + 127).astype(np.uint8)


def _dequant_host(codes: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """fp8 codes + ue8m0 block exponents -> float32 (exact), on the host."""
    w = _E4M3FN_LUT[codes]
    s = codecs.ue8m0_decode(np, scale)
    s = np.repeat(np.repeat(s, block[0], axis=0), block[1], axis=1)[: w.shape[0], : w.shape[1]]
    return w * s


_E4M3FN_LUT = codecs.e4m3_decode(np, np.arange(256)).astype(np.float32)


def validate_checkpoint(reader: "CheckpointReader", config: ModelConfig, plan: LayerPlan, folder: str) -> list:
    """Check names, shapes and dtypes from the headers only; returns the expected (name, spec, dest) list."""
    expected = list(_expected(config, plan))
    present = set(reader.keys())
    wanted: set[str] = set()
    problems: list[str] = []
    for name, spec, _ in expected:
        for tname, role, shape, _suffix in _roles(spec):
            full = name[: len(name) - len(spec.name)] + tname
            wanted.add(full)
            if full not in present:
                problems.append(f"missing tensor {full!r} (expected shape {list(shape)})")
                continue
            e = reader.entry(full)
            if e.shape != shape:
                problems.append(f"tensor {full!r} has shape {list(e.shape)}, expected {list(shape)}")
            if e.dtype not in _OK_DTYPES[role]:
                what = {"float": "a float (F32/BF16/F16)", "index": "an integer", "fp8": "fp8 e4m3 codes (F8_E4M3)",
                        "fp4": "packed fp4 codes (I8)", "scale": "ue8m0 scales (F8_E8M0)"}[role]
                hint = ""
                if role == "float" and (e.dtype.startswith("F8") or e.dtype == "I8"):
                    hint = " (the tensor is quantized but config.json has no quantization_config)"
                elif role in ("fp8", "fp4") and e.dtype in _FLOAT_ST:
                    hint = " (config.json declares a quantized checkpoint, this tensor is not quantized)"
                problems.append(f"tensor {full!r} has dtype {e.dtype}, expected {what}{hint}")
    for table, code_shape, scale_shape in engram_table_specs(config):
        for tname, shape, ok in ((table + ".weight", code_shape, {"F8_E4M3", "U8"}),
                                 (table + ".scale", scale_shape, {"F8_E8M0", "U8"})):
            wanted.add(tname)
            if tname not in present:
                problems.append(f"missing Engram table {tname!r} (expected shape {list(shape)})")
                continue
            e = reader.entry(tname)
            if e.shape != shape or e.dtype not in ok:
                problems.append(f"Engram table {tname!r} is {e.dtype} {list(e.shape)}, expected "
                                f"{sorted(ok)[0]} {list(shape)}")
    for name in sorted(present - wanted):
        if _kept_for_later(name, config):
            continue
        problems.append(f"unexpected tensor {name!r} (not part of this config's model)")
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise CheckpointError(f"checkpoint {folder} does not match its config.json: " + "; ".join(shown))
    return expected


_LATER_PREFIXES = ("mtp.", "vision.", "aligner.", "image_start", "image_end", "image_newline")


def _kept_for_later(name: str, config: ModelConfig) -> bool:
    """Tensors of modules jdeep does not run yet: the MTP / DSpark drafter blocks (`mtp.*`), and V4.1's
    vision tower, aligner, image-span vectors and image routing bias. They are accepted, not loaded."""
    if name.startswith(_LATER_PREFIXES):
        return True
    return config.is_v41 and name.endswith(".ffn.gate.bias_vl")


def load_params(folder: str, config: ModelConfig, plan: LayerPlan, dtype: Any,
                progress: Callable[[int, int], None] | None = None,
                place: Callable[[np.ndarray], Any] | None = None,
                place_into: Callable[[tuple, np.dtype], Any] | None = None,
                fp8_rescale: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None) -> dict:
    """Read and validate every tensor into jdeep's param tree.

    Validation (names, shapes, dtypes) runs on the headers before any data is read and raises one
    CheckpointError listing every missing, unexpected, mis-shaped or wrongly typed tensor. `mtp.*`
    tensors (the multi-token-prediction block, not run by jdeep) are accepted and skipped.
    Leaves are built one at a time and handed to `place` (e.g. a device put) before the next one is
    read, so host memory holds at most one stacked leaf beyond what `place` keeps; with
    `place_into(shape, dtype)` (an empty device buffer) large stacked leaves are assembled one layer
    at a time directly in device memory instead.
    `fp8_rescale(codes, scale) -> (codes, scale)` optionally rewrites fp8 weights (trn2 range).
    """
    reader = CheckpointReader(folder)
    expected = validate_checkpoint(reader, config, plan, folder)
    place = place or (lambda a: a)
    fills = _fill_plan(expected)
    leaves = _leaf_plan(config, plan)
    params: dict[str, Any] = {"segments": [[{} for _ in seg.pattern] for seg in plan.segments]}
    done = 0
    for key, (shape, cls) in leaves.items():
        items = fills[key]
        leaf_dtype = _leaf_dtype(cls, dtype)
        big = int(np.prod(shape)) * leaf_dtype.itemsize > _ASSEMBLE_ON_DEVICE_BYTES
        if place_into is not None and big and key[0] == "seg" and fp8_rescale is None \
                and items[0][2].fmt != FP8_DEQUANT:
            # Large stacked leaves are assembled tensor by tensor in a device buffer updated in place, so
            # the host never holds more than one checkpoint tensor of them.
            dev = place_into(shape, leaf_dtype)
            for name, role, spec, idx in items:
                part = np.empty(shape[len(idx):], leaf_dtype)
                _fill(part, (), reader, name, role, config, spec)
                dev = _set_at(dev, part, idx)
                del part
            _put(params, key, dev)
            done += len(items)
            if progress is not None:
                progress(done, sum(len(v) for v in fills.values()))
            continue
        buf = np.empty(shape, leaf_dtype)
        if items[0][2].fmt == FP8_DEQUANT:       # wo_a: codes + scale -> bf16 values
            by_idx: dict[tuple, dict] = {}
            for name, role, spec, idx in items:
                by_idx.setdefault(idx, {"spec": spec})[role] = name
            for idx, d in by_idx.items():
                codes = reader.get(d["fp8"]).view(np.uint8)
                scale = _scale_bytes(reader.get(d["scale"]), reader.entry(d["scale"]).dtype, d["scale"])
                w = _dequant_host(codes, scale, d["spec"].block)
                buf[idx] = w.astype(ml_dtypes.bfloat16).astype(buf.dtype)
        else:
            for name, role, spec, idx in items:
                _fill(buf, idx, reader, name, role, config, spec)
        if fp8_rescale is not None and key[-1] == "codes":
            scale_key = key[:-1] + ("scale",)
            sbuf = np.empty(leaves[scale_key][0], np.uint8)
            for name, role, spec, idx in fills[scale_key]:
                sbuf[idx] = _scale_bytes(reader.get(name), reader.entry(name).dtype, name)
            buf, sbuf = fp8_rescale(buf, sbuf, items[0][2].block)
            _put(params, scale_key, place(sbuf))
        elif fp8_rescale is not None and key[-1] == "scale" and key[:-1] + ("codes",) in leaves:
            continue                              # placed together with its codes
        _put(params, key, place(buf))
        del buf
        done += len(items)
        if progress is not None:
            progress(done, sum(len(v) for v in fills.values()))
    return params


_ASSEMBLE_ON_DEVICE_BYTES = 64 << 20


def _fill_plan(expected: list) -> dict[tuple, list]:
    """The checkpoint tensors grouped by the leaf they fill: leaf key -> [(name, role, spec, idx)], idx the
    tensor's position on the leaf's leading axes ((), (rep,) or (rep, expert))."""
    fills: dict[tuple, list] = {}
    for name, spec, dest in expected:
        prefix = name[: len(name) - len(spec.name)]
        key0 = ("top",) if dest[0] == "top" else ("seg", dest[1], dest[2])
        for tname, role, _shape, suffix in _roles(spec):
            if spec.fmt == FP8_DEQUANT:
                path = key0 + spec.path
            else:
                path = key0 + spec.path + ((suffix,) if suffix else ())
            idx = () if dest[0] == "top" else (dest[3],) + ((spec.expert,) if spec.expert is not None else ())
            fills.setdefault(path, []).append((prefix + tname, role, spec, idx))
    return fills


def tree_path(key: tuple) -> tuple:
    """A leaf key of `_leaf_plan` as its path in the param tree (("embed",), ("segments", s, slot, ...))."""
    return key[1:] if key[0] == "top" else ("segments",) + key[1:]


def padded_experts(n_experts: int, expert_axis: int) -> int:
    """The routed-expert count rounded up to a multiple of the mesh's expert axis (zero experts pad it)."""
    return -(-n_experts // expert_axis) * expert_axis


def load_params_sharded(folder: str, config: ModelConfig, plan: LayerPlan, dtype: Any,
                        sharding_for: Callable[[tuple, tuple[int, ...]], Any], n_experts: int | None = None,
                        progress: Callable[[int, int], None] | None = None,
                        fp8_rescale: Callable | None = None) -> dict:
    """Read the checkpoint into global arrays sharded over a mesh, each process reading only the slices its
    own devices hold.

    sharding_for(tree path, shape) -> jax.sharding.Sharding of that leaf. n_experts: the routed-expert axis
    length of the expert leaves (>= config.n_routed_experts; the extra experts are zeros, never routed to).
    For every distinct shard region of a leaf the covered checkpoint tensors are read (a routed expert is
    one tensor, so an expert shard reads only its experts; a row slice of a tensor is one contiguous read,
    other slices copy from a memory map), converted as `load_params` does, and put on the devices holding
    that region; host memory holds one region at a time. Validation is `load_params`'.
    """
    import jax

    reader = CheckpointReader(folder)
    expected = validate_checkpoint(reader, config, plan, folder)
    fills = _fill_plan(expected)
    leaves = _leaf_plan(config, plan)
    E = config.n_routed_experts
    n_experts = E if n_experts is None else int(n_experts)
    if n_experts < E:
        raise ValueError(f"n_experts={n_experts} is below the config's {E} routed experts")
    total = sum(len(v) for v in fills.values())
    params: dict[str, Any] = {"segments": [[{} for _ in seg.pattern] for seg in plan.segments]}
    done = 0
    for key, (shape, cls) in leaves.items():
        items = fills[key]
        if key[0] == "seg" and items[0][2].expert is not None:
            shape = shape[:1] + (n_experts,) + shape[2:]
        leaf_dtype = _leaf_dtype(cls, dtype)
        sharding = sharding_for(tree_path(key), shape)
        by_region: dict[tuple, list] = {}
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            region = tuple((sl.indices(n)[0], sl.indices(n)[1]) for sl, n in zip(index, shape))
            by_region.setdefault(region, []).append(device)
        arrays = []
        for region, devices in by_region.items():
            host = _read_region(reader, key, items, region, leaf_dtype, config, fp8_rescale, fills)
            arrays += [jax.device_put(host, d) for d in devices]
            del host
        _put(params, key, jax.make_array_from_single_device_arrays(shape, sharding, arrays))
        done += len(items)
        if progress is not None:
            progress(done, total)
    return params


def _read_region(reader: "CheckpointReader", key: tuple, items: list, region: tuple, leaf_dtype: np.dtype,
                 config: ModelConfig, fp8_rescale: Callable | None, fills: dict) -> np.ndarray:
    """One shard region ((start, stop) per leaf dim) of a leaf, read from the tensors that fall inside it."""
    out = np.zeros(tuple(b - a for a, b in region), leaf_dtype)
    if items[0][2].fmt == FP8_DEQUANT:                     # wo_a: codes + scale -> bf16 values, per layer
        by_idx: dict[tuple, dict] = {}
        for name, role, spec, idx in items:
            by_idx.setdefault(idx, {"spec": spec})[role] = name
        items = [(d, "dequant", d["spec"], idx) for idx, d in by_idx.items()]
    for name, role, spec, idx in items:
        lead, rest = region[:len(idx)], region[len(idx):]
        if not all(a <= i < b for i, (a, b) in zip(idx, lead)):
            continue
        dst = tuple(i - a for i, (a, _) in zip(idx, lead))
        sl = tuple(slice(a, b) for a, b in rest)
        if role == "dequant":
            codes = reader.get(name["fp8"]).view(np.uint8)
            scale = _scale_bytes(reader.get(name["scale"]), reader.entry(name["scale"]).dtype, name["scale"])
            part = _dequant_host(codes, scale, spec.block).astype(ml_dtypes.bfloat16)[sl]
        elif fp8_rescale is not None and role in ("fp8", "scale") and spec.fmt == FP8:
            codes_name = name if role == "fp8" else name[: -len(".scale")] + ".weight"
            scale_name = codes_name[: -len(".weight")] + ".scale"
            codes, scale = fp8_rescale(reader.get(codes_name).view(np.uint8),
                                       _scale_bytes(reader.get(scale_name), reader.entry(scale_name).dtype, scale_name),
                                       spec.block)
            part = (codes if role == "fp8" else scale)[sl]
        else:
            part = _tensor_slice(reader, name, sl[::-1] if spec.input_major else sl)
            if spec.input_major:
                part = part.T
            if role == "index":
                if part.size and (part.min() < 0 or part.max() >= config.n_routed_experts):
                    raise CheckpointError(f"tensor {name!r} holds expert ids outside [0, {config.n_routed_experts})")
            elif role == "scale":
                part = _scale_bytes(part, reader.entry(name).dtype, name)
            elif role in ("fp8", "fp4"):
                part = part.view(np.uint8)
        out[dst] = part
    return out


def _tensor_slice(reader: "CheckpointReader", name: str, sl: tuple) -> np.ndarray:
    """tensor[sl] without reading the rest: a row range is one positioned read; other slices are copied out of a
    memory map (only the touched pages are read)."""
    f = reader.files[reader._where[name]]
    e, dt, _ = f._checked(name)
    full = all(s.start == 0 and s.stop == n for s, n in zip(sl[1:], e.shape[1:]))
    if not sl or (full and sl[0].start == 0 and sl[0].stop == e.shape[0]):
        return f.get(name)
    if full:
        row = int(np.prod(e.shape[1:], dtype=np.int64)) * dt.itemsize
        return f.read_range(name, sl[0].start * row, sl[0].stop * row).reshape((sl[0].stop - sl[0].start,) + e.shape[1:])
    return np.array(f.view(name)[sl])


def _fill(buf: np.ndarray, idx: tuple, reader: "CheckpointReader", name: str, role: str, config: ModelConfig,
          spec: TensorSpec) -> None:
    """Copy one checkpoint tensor into its place in a leaf buffer, converting as its role says."""
    arr = reader.get(name)
    if spec.input_major:
        arr = arr.T
    if role == "index":
        if arr.size and (arr.min() < 0 or arr.max() >= config.n_routed_experts):
            raise CheckpointError(f"tensor {name!r} holds expert ids outside [0, {config.n_routed_experts})")
        buf[idx] = arr
    elif role == "scale":
        buf[idx] = _scale_bytes(arr, reader.entry(name).dtype, name)
    elif role in ("fp8", "fp4"):
        buf[idx] = arr.view(np.uint8)
    else:
        buf[idx] = arr


def _set_at(dev: Any, part: np.ndarray, idx: tuple) -> Any:
    """dev[idx] = part on the device, in place (the old buffer is donated)."""
    import jax

    if len(idx) not in _SET_AT:
        def update(a, p, *i):
            start = tuple(i) + (0,) * (a.ndim - len(i))
            return jax.lax.dynamic_update_slice(a, p.reshape((1,) * len(i) + p.shape), start)

        _SET_AT[len(idx)] = jax.jit(update, donate_argnums=0)
    return _SET_AT[len(idx)](dev, part, *(np.int32(i) for i in idx))


_SET_AT: dict = {}


def _put(params: dict, key: tuple, value: Any) -> None:
    if key[0] == "top":
        _set_path(params, key[1:], value)
    else:
        _set_path(params["segments"][key[1]][key[2]], key[3:], value)


# ---------------------------------------------------------------------------- writing
_NP_TO_ST = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
             np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int8): "I8",
             np.dtype(np.uint8): "U8", np.dtype(np.float64): "F64",
             np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(ml_dtypes.float8_e8m0fnu): "F8_E8M0"}


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


# ---------------------------------------------------------------------------- orbax
_CONVERTED_MARKER = "jdeep_converted.json"


def is_converted(folder: str) -> bool:
    return os.path.exists(os.path.join(folder, _CONVERTED_MARKER))


# v2: the output head is stored input-major ([d, V], param_spec.py)
_CONVERTED_FORMAT = "jdeep-orbax-v2"


def save_converted(folder: str, config: ModelConfig, params: dict, dtype: str) -> None:
    """Save the converted param tree with Orbax, plus config.json, so `jdeep.load` skips conversion."""
    if config.engram is not None:
        raise ValueError("models with Engram layers (DeepSeek-V4.1) cannot be converted yet: their tables stay "
                         "memory-mapped in the original safetensors; load the original checkpoint folder")
    import orbax.checkpoint as ocp

    folder = os.path.abspath(folder)
    os.makedirs(folder, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(folder, "params"), params, force=True)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config.to_dict(), f, indent=2)
    with open(os.path.join(folder, _CONVERTED_MARKER), "w", encoding="utf-8") as f:
        json.dump({"format": _CONVERTED_FORMAT, "dtype": dtype}, f)


def restore_converted(folder: str, config: ModelConfig, plan: LayerPlan, dtype: Any, target: Any = None) -> dict:
    """The converted param tree; `target` (abstract arrays, possibly with shardings) defaults to
    abstract_params on the default device."""
    import orbax.checkpoint as ocp

    folder = os.path.abspath(folder)
    with open(os.path.join(folder, _CONVERTED_MARKER), encoding="utf-8") as f:
        marker = json.load(f)
    if marker.get("format") != _CONVERTED_FORMAT:
        raise ConfigError(f"{folder} was converted by an older jdeep (format {marker.get('format')!r}, this jdeep reads "
                          f"{_CONVERTED_FORMAT!r}): convert the original checkpoint again with `jdeep convert`")
    saved_dtype = marker.get("dtype")
    if np.dtype(saved_dtype) != np.dtype(dtype):
        raise ConfigError(f"{folder} was converted with dtype {saved_dtype}; load it with dtype={saved_dtype!r}")
    if target is None:
        target = abstract_params(config, plan, dtype)
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(os.path.join(folder, "params"), target)
