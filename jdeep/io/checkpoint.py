"""Loading a DeepSeek checkpoint folder (safetensors, single file or sharded) into jdeep's stacked param tree:
every tensor checked against the config first (validate_checkpoint, CheckpointError), then read, converted
and placed on the devices by one loader (load_params_sharded; load_params is its one-device case).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ..config import ModelConfig
from ..kernels import codecs
from ..param_spec import (FP4, FP8, FP8_DEQUANT, INDEX, TensorSpec, empty_tree, engram_table_specs, expected_tensors,
                          leaf_dtype, leaf_plan, put_leaf, tree_path)
from ..plan import LayerPlan
from .safetensors import FLOAT_DTYPES, INT_DTYPES, CheckpointError, CheckpointReader

__all__ = ["CheckpointError", "validate_checkpoint", "load_params", "load_params_sharded"]

FP8Rescale = Callable[[np.ndarray, np.ndarray, tuple[int, int]], tuple[np.ndarray, np.ndarray]]


# ---------------------------------------------------------------------------- expected tensors
# checkpoint dtypes accepted per role
_OK_DTYPES = {
    "float": FLOAT_DTYPES, "index": INT_DTYPES, "fp8": {"F8_E4M3", "U8"}, "fp4": {"I8", "U8"},
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


# ---------------------------------------------------------------------------- validation
def validate_checkpoint(reader: CheckpointReader, config: ModelConfig, plan: LayerPlan, folder: str) -> list:
    """Check names, shapes and dtypes from the headers only; returns the expected (name, spec, dest) list."""
    expected = list(expected_tensors(config, plan))
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
                elif role in ("fp8", "fp4") and e.dtype in FLOAT_DTYPES:
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
    """Tensors of modules the plan does not run: the MTP / DSpark drafter blocks (`mtp.*`, unless the plan holds
    the MTP blocks or the DSpark stages), and V4.1's vision tower, aligner, image-span vectors and image routing bias. They are
    accepted, not loaded."""
    if name.startswith(_LATER_PREFIXES):
        return True
    return config.is_v41 and name.endswith(".ffn.gate.bias_vl")


# ---------------------------------------------------------------------------- loading
def load_params(folder: str, config: ModelConfig, plan: LayerPlan, dtype: Any,
                progress: Callable[[int, int], None] | None = None, fp8_rescale: FP8Rescale | None = None,
                device: Any = None) -> dict:
    """Read and validate every tensor into jdeep's param tree on one device (default: jax.devices()[0]).

    `load_params_sharded` with every leaf whole on `device` (one shard region per leaf): leaves are placed
    on the device one at a time, large stacked leaves assembled there tensor by tensor, so host memory holds
    at most one leaf (or, for those, one checkpoint tensor) beyond the params already placed.
    """
    sharding = jax.sharding.SingleDeviceSharding(device if device is not None else jax.devices()[0])
    return load_params_sharded(folder, config, plan, dtype, lambda path, shape: sharding, progress=progress,
                               fp8_rescale=fp8_rescale)


def load_params_sharded(folder: str, config: ModelConfig, plan: LayerPlan, dtype: Any,
                        sharding_for: Callable[[tuple, tuple[int, ...]], Any], n_experts: int | None = None,
                        progress: Callable[[int, int], None] | None = None,
                        fp8_rescale: FP8Rescale | None = None) -> dict:
    """Read the checkpoint into global arrays sharded over devices, each process reading only the slices its
    own devices hold.

    Validation (names, shapes, dtypes) runs on the headers before any data is read and raises one
    CheckpointError listing every missing, unexpected, mis-shaped or wrongly typed tensor. `mtp.*` tensors
    are loaded when the plan runs the MTP blocks or the DSpark stages (build_plan(mtp=True)), else accepted and skipped, as are
    V4.1's vision tensors.

    sharding_for(tree path, shape) -> jax.sharding.Sharding of that leaf. n_experts: the routed-expert axis
    length of the expert leaves (>= config.n_routed_experts; the extra experts are zeros, never routed to).
    For every distinct shard region of a leaf the covered checkpoint tensors are read (a routed expert is
    one tensor, so an expert shard reads only its experts; a row slice of a tensor is one contiguous read,
    other slices copy from a memory map), converted (`_Converter`) and put on the devices holding that region.
    Host memory holds one region at a time; a stacked region over _ASSEMBLE_ON_DEVICE_BYTES is assembled in
    device buffers updated in place, one checkpoint tensor at a time on the host.
    `fp8_rescale(codes, scale, block) -> (codes, scale)` optionally rewrites fp8 weights (trn2 range).
    progress(done, total) is called after each leaf with the count of checkpoint tensors read.
    """
    reader = CheckpointReader(folder)
    expected = validate_checkpoint(reader, config, plan, folder)
    fills = _fill_plan(expected)
    E = config.n_routed_experts
    n_experts = E if n_experts is None else int(n_experts)
    if n_experts < E:
        raise ValueError(f"n_experts={n_experts} is below the config's {E} routed experts")
    convert = _Converter(reader, config, fp8_rescale)
    total = sum(len(v) for v in fills.values())
    params = empty_tree(plan)
    done = 0
    for key, (shape, cls) in leaf_plan(config, plan).items():
        items = fills[key]
        if key[0] != "top" and items[0][2].expert is not None and n_experts != E:
            if shape[1] != E:
                raise ValueError(f"{tree_path(key)}: padding the DSpark stages' {shape[1]} routed experts for a mesh "
                                 "is not supported")
            shape = shape[:1] + (n_experts,) + shape[2:]
        dt = leaf_dtype(cls, dtype)
        sharding = sharding_for(tree_path(key), shape)
        by_region: dict[tuple, list] = {}
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            region = tuple((sl.indices(n)[0], sl.indices(n)[1]) for sl, n in zip(index, shape))
            by_region.setdefault(region, []).append(device)
        arrays = []
        for region, devices in by_region.items():
            arrays += _place_region(convert.parts(items, region), region, len(items[0][3]), dt, devices)
        put_leaf(params, key, jax.make_array_from_single_device_arrays(shape, sharding, arrays))
        if key[-1] == "scale":
            convert.forget()
        done += len(items)
        if progress is not None:
            progress(done, total)
    return params


_ASSEMBLE_ON_DEVICE_BYTES = 64 << 20


def _fill_plan(expected: list) -> dict[tuple, list]:
    """The checkpoint tensors grouped by the leaf they fill: leaf key -> [(name, role, spec, idx)], idx the
    tensor's position on the leaf's leading axes ((), (rep,) or (rep, expert))."""
    fills: dict[tuple, list] = {}
    for name, spec, dest in expected:
        prefix = name[: len(name) - len(spec.name)]
        key0 = dest[:1] if dest[0] in ("top", "drafter") else ("seg", dest[1], dest[2])
        for tname, role, _shape, suffix in _roles(spec):
            if spec.fmt == FP8_DEQUANT:
                path = key0 + spec.path
            else:
                path = key0 + spec.path + ((suffix,) if suffix else ())
            expert = (spec.expert,) if spec.expert is not None else ()
            idx = () if dest[0] == "top" else (dest[1:] if dest[0] == "drafter" else dest[3:]) + expert
            fills.setdefault(path, []).append((prefix + tname, role, spec, idx))
    return fills


def _place_region(parts: Iterator[tuple[tuple, np.ndarray]], region: tuple, n_lead: int, leaf_dtype: np.dtype,
                  devices: list) -> list:
    """One shard region of a leaf on each of `devices`, from its (position on the leading axes, value) parts.

    Built on the host and put on the devices, or, for a large stacked region (n_lead leading axes), assembled
    part by part in zeroed device buffers updated in place, so the host never holds more than one part."""
    shape = tuple(b - a for a, b in region)
    if n_lead and int(np.prod(shape, dtype=np.int64)) * leaf_dtype.itemsize > _ASSEMBLE_ON_DEVICE_BYTES:
        bufs = [jnp.zeros(shape, leaf_dtype, device=d) for d in devices]
        for dst, part in parts:
            part = np.asarray(part, leaf_dtype)
            bufs = [_set_at(b, part, dst) for b in bufs]
            del part
        return bufs
    host = np.zeros(shape, leaf_dtype)
    for dst, part in parts:
        host[dst] = part
    return [jax.device_put(host, d) for d in devices]


class _Converter:
    """Checkpoint tensors (or slices of them) read and converted into leaf values, as each tensor's role says:
    float weights (transposed when input-major), int32 expert-id tables (range-checked), fp8/fp4 codes as uint8,
    ue8m0 scale bytes, wo_a's fp8 codes + scales dequantised to bf16, and, with `fp8_rescale`, fp8 codes and
    scales rewritten together (the rewritten scales of a leaf's tensors are kept until its scale leaf is read,
    so each codes tensor is read once)."""

    def __init__(self, reader: CheckpointReader, config: ModelConfig, fp8_rescale: FP8Rescale | None):
        self.reader, self.config, self.fp8_rescale = reader, config, fp8_rescale
        self._rescaled_scales: dict[str, np.ndarray] = {}

    def forget(self) -> None:
        """Drop the kept rescaled scales (once their scale leaf is placed)."""
        self._rescaled_scales.clear()

    def parts(self, items: list, region: tuple) -> Iterator[tuple[tuple, np.ndarray]]:
        """(position relative to the region on the leaf's leading axes, the tensor's slice inside the region) for
        every checkpoint tensor of a leaf (items: its `_fill_plan` entries) that falls inside one shard region
        ((start, stop) per leaf dim)."""
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
            yield dst, self._convert(name, role, spec, tuple(slice(a, b) for a, b in rest))

    def _convert(self, name: Any, role: str, spec: TensorSpec, sl: tuple[slice, ...]) -> np.ndarray:
        reader = self.reader
        if role == "dequant":
            codes = reader.get(name["fp8"]).view(np.uint8)
            scale = self._scale(reader.get(name["scale"]), name["scale"])
            return _dequant_host(codes, scale, spec.block).astype(ml_dtypes.bfloat16)[sl]
        if self.fp8_rescale is not None and role in ("fp8", "scale") and spec.fmt == FP8:
            return self._rescaled(name, role, spec)[sl]
        part = reader.read_slice(name, sl[::-1] if spec.input_major else sl)
        if spec.input_major:
            part = part.T
        if role == "index":
            if part.size and (part.min() < 0 or part.max() >= self.config.n_routed_experts):
                raise CheckpointError(f"tensor {name!r} holds expert ids outside [0, {self.config.n_routed_experts})")
        elif role == "scale":
            part = self._scale(part, name)
        elif role in ("fp8", "fp4"):
            part = part.view(np.uint8)
        return part

    def _rescaled(self, name: str, role: str, spec: TensorSpec) -> np.ndarray:
        """The whole fp8 tensor's rewritten codes (role "fp8") or scale bytes (role "scale")."""
        codes_name = name if role == "fp8" else name[: -len(".scale")] + ".weight"
        scale_name = codes_name[: -len(".weight")] + ".scale"
        if role == "scale" and scale_name in self._rescaled_scales:
            return self._rescaled_scales[scale_name]
        codes, scale = self.fp8_rescale(self.reader.get(codes_name).view(np.uint8),
                                        self._scale(self.reader.get(scale_name), scale_name), spec.block)
        self._rescaled_scales[scale_name] = scale
        return codes if role == "fp8" else scale

    def _scale(self, arr: np.ndarray, name: str) -> np.ndarray:
        """ue8m0 exponent bytes from an F8_E8M0/U8 tensor, or from float32 powers of two."""
        if self.reader.entry(name).dtype != "F32":
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


def _set_at(dev: Any, part: np.ndarray, idx: tuple) -> Any:
    """dev[idx] = part on dev's device, in place (the old buffer is donated)."""
    if len(idx) not in _SET_AT:
        def update(a, p, *i):
            start = tuple(i) + (0,) * (a.ndim - len(i))
            return jax.lax.dynamic_update_slice(a, p.reshape((1,) * len(i) + p.shape), start)

        _SET_AT[len(idx)] = jax.jit(update, donate_argnums=0)
    return _SET_AT[len(idx)](dev, part, *(np.int32(i) for i in idx))


_SET_AT: dict = {}
