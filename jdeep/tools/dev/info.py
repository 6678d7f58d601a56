"""Size accounting: parameter bytes by dtype and decode-state bytes per token for a config, and (for deployment
planning) the bytes every device of a mesh holds: `device_footprint` / `mesh_summary`."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jax.sharding import AbstractMesh, Mesh

from ...config import ModelConfig
from ...numerics import Numerics
from ...model.weights import resident_bytes
from ...param_spec import abstract_params, leaf_dtype, leaf_plan, layer_specs, padded_experts, tree_leaves, tree_path
from ...plan import build_plan, layer_kinds
from ...sharding import AXES, Layout, parse_mesh
from ...state import slot_state_shapes, source_state_shapes, state_bytes

__all__ = [
    "H200_BYTES",
    "TRN2_CORE_BYTES",
    "DeviceFootprint",
    "LeafShare",
    "abstract_layout",
    "device_footprint",
    "kv_bytes_per_token",
    "mesh_summary",
    "param_bytes_by_dtype",
    "param_shares",
    "state_shares",
    "summary",
]

TRN2_CORE_BYTES = 24 * 2**30   # trn2: 96 GiB HBM per chip = 4 logical NeuronCores (LNC=2), one jdeep device each
H200_BYTES = 141 * 10**9       # H200: 141 GB HBM per GPU


def param_bytes_by_dtype(config: ModelConfig, dtype: Any = np.float32) -> dict[str, int]:
    """Bytes of the device parameter tree per dtype name, as jdeep holds it: float weights in `dtype`,
    quantized weights as uint8 codes + uint8 exponents."""
    counts: Counter = Counter()
    for shape, cls in leaf_plan(config, build_plan(config)).values():
        dt = leaf_dtype(cls, dtype)
        counts[dt.name] += int(np.prod(shape)) * dt.itemsize
    return dict(counts)


def kv_bytes_per_token(config: ModelConfig, dtype: Any = np.float32, numerics: Numerics | None = None) -> float:
    """Growth of the decode state per token of context (compressed KV + indexer keys), in bytes."""
    plan = build_plan(config)
    a = state_bytes(config, plan, 1, 4096, dtype, numerics)
    b = state_bytes(config, plan, 1, 8192, dtype, numerics)
    return (b - a) / 4096


def summary(config: ModelConfig, dtype: Any = np.float32) -> str:
    plan = build_plan(config)
    kinds = Counter(k.name for k in layer_kinds(config))
    lines = [
        f"model_type      {config.model_type}",
        f"layers          {config.n_layers} ({', '.join(f'{n}x {k}' for k, n in kinds.items())})",
        f"hidden / heads  {config.dim} / {config.n_heads} x {config.head_dim} (rope {config.rope_head_dim})",
        f"experts         {config.n_routed_experts} routed, {config.n_activated_experts} active, 1 shared, width {config.moe_inter_dim}",
        f"vocab           {config.vocab_size}",
        "quantization    " + (", ".join(f"{k}={v}" for k, v in config.quantization.to_hf().items()) if config.quantization else "none"),
        "scan segments   " + ", ".join(f"[{'+'.join(k.name for k in s.pattern)}]x{s.reps}" for s in plan.segments),
    ]
    pb = param_bytes_by_dtype(config, dtype)
    lines.append("param bytes     " + ", ".join(f"{k} {v / 2**30:.3f} GiB" for k, v in pb.items())
                 + f" (total {sum(pb.values()) / 2**30:.3f} GiB)")
    if config.quantization:
        tree = abstract_params(config, plan, dtype)
        lines.append(f"resident        {resident_bytes(tree, 'codes', dtype) / 2**30:.3f} GiB with weights=codes "
                     f"(Neuron's default), {resident_bytes(tree, 'decoded', dtype) / 2**30:.3f} GiB with "
                     f"weights=decoded ({np.dtype(dtype).name}; the CPU and GPU default where it fits in half the memory)")
    if config.engram is not None:
        e = config.engram
        host = sum(r * (e.head_dim + e.head_dim // 32) for r in e.num_embeddings)
        lines.append(f"engram tables   {host / 2**30:.3f} GiB on the host (memory-mapped, fp8 rows + e8m0 scales); "
                     f"{e.rows_per_token} rows x {e.head_dim + e.head_dim // 32} B gathered per token and Engram layer")
    name = np.dtype(dtype).name
    lines.append(f"state bytes     {kv_bytes_per_token(config, dtype):.0f} B/token + "
                 f"{state_bytes(config, plan, 1, 0, dtype) / 2**20:.2f} MiB fixed per sequence ({name} caches)")
    try:
        packed = Numerics.for_config(config, True, packed_kv=True)
    except ValueError:
        packed = None
    if packed is not None:
        lines.append(f"                {kv_bytes_per_token(config, dtype, packed):.0f} B/token + "
                     f"{state_bytes(config, plan, 1, 0, dtype, packed) / 2**20:.2f} MiB fixed per sequence "
                     f"(packed fp8 KV records, --packed-kv)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- per-device bytes
def abstract_layout(config: ModelConfig, mesh: Any):
    """The `sharding.Layout` jdeep would use for `config` on a mesh of these sizes (a "data=1,tensor=4" string, a
    dict of axis sizes, a Mesh or a Layout), over an AbstractMesh: no devices needed."""
    if isinstance(mesh, Layout):
        return mesh
    if isinstance(mesh, Mesh):
        mesh = dict(mesh.shape)
    sizes = parse_mesh(mesh)
    return Layout.for_model(AbstractMesh(tuple(sizes[a] for a in AXES), AXES), config.moe_inter_dim)


def _split(spec: Any, sizes: Mapping[str, int]) -> int:
    """Devices a leaf with PartitionSpec `spec` is divided over: the product of the mesh axes it names (entries are
    None, an axis name or a tuple of axis names)."""
    n = 1
    for entry in spec:
        for ax in (entry if isinstance(entry, tuple) else (entry,)):
            if ax is not None:
                n *= sizes[ax]
    return n


@dataclass(frozen=True)
class LeafShare:
    """One parameter or state leaf as the mesh holds it."""

    key: tuple                  # leaf_plan key (params) or ("state", ...) path
    shape: tuple[int, ...]      # global shape on the mesh (routed experts padded to the expert axis)
    dtype: np.dtype
    spec: Any                   # jax.sharding.PartitionSpec
    split: int                  # devices the leaf is divided over (1: every device holds all of it)
    pad_bytes: int = 0          # bytes of zero experts added to divide the expert axis
    expert: bool = False        # a routed-expert leaf (axis 1 stacks the experts)

    @property
    def nbytes(self) -> int:
        """Bytes of the global (padded) leaf."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def device_bytes(self) -> int:
        """Bytes every device holds of this leaf (the layout shards a dimension only when the axis divides it)."""
        return self.nbytes // self.split

    @property
    def replicated(self) -> bool:
        return self.split == 1


def _expert_keys(config: ModelConfig, plan) -> set[tuple]:
    """The leaf_plan keys of routed-expert leaves (their axis 1 stacks the experts)."""
    keys = set()
    for s, seg in enumerate(plan.segments):
        for slot, kind in enumerate(seg.pattern):
            for spec in layer_specs(config, kind):
                if spec.expert == 0:
                    keys.update(("seg", s, slot) + path for path, _, _ in tree_leaves(spec))
    return keys


def param_shares(config: ModelConfig, mesh: Any, dtype: Any = np.float32) -> list[LeafShare]:
    """Every parameter leaf with its PartitionSpec on `mesh` (see `abstract_layout`), routed experts padded as
    `jdeep.load(..., mesh=)` pads them."""
    layout = abstract_layout(config, mesh)
    sizes = layout.sizes
    plan = build_plan(config)
    experts = _expert_keys(config, plan)
    n_exp = padded_experts(config.n_routed_experts, sizes["expert"])
    out = []
    for key, (shape, cls) in leaf_plan(config, plan).items():
        dt = leaf_dtype(cls, dtype)
        pad = 0
        if key in experts and n_exp != shape[1]:
            pad = math.prod(shape[:1] + (n_exp - shape[1],) + shape[2:]) * dt.itemsize
            shape = shape[:1] + (n_exp,) + shape[2:]
        spec = layout.param_spec(tree_path(key), shape)
        out.append(LeafShare(key, tuple(shape), dt, spec, _split(spec, sizes), pad, key in experts))
    return out


def state_shares(config: ModelConfig, mesh: Any, batch: int, max_len: int, dtype: Any = np.float32,
                 numerics: Numerics | None = None) -> list[LeafShare]:
    """Every decode-state leaf for `batch` sequences of up to `max_len` tokens with its spec on `mesh` (the batch
    axis is split over `data` when data divides it)."""
    layout = abstract_layout(config, mesh)
    plan = build_plan(config)
    leaves = []
    for s, seg in enumerate(plan.segments):
        for slot, kind in enumerate(seg.pattern):
            for name, (shape, dt) in slot_state_shapes(config, kind, seg.reps, batch, max_len, dtype, numerics).items():
                leaves.append((("state", "segments", s, slot, name), shape, dt))
    for key, shapes in source_state_shapes(config, batch, max_len, dtype, numerics).items():
        for name, (shape, dt) in shapes.items():
            leaves.append((("state", "sources", key, name), shape, dt))
    out = []
    for key, shape, dt in leaves:
        spec = layout.state_spec(shape)
        out.append(LeafShare(key, tuple(shape), np.dtype(dt), spec, _split(spec, layout.sizes)))
    return out


def _group(key: tuple) -> str:
    """A leaf's name without segment indices and quantized children ("attn.wq_a", "ffn.shared_experts.w1")."""
    path = [p for p in key[1:] if isinstance(p, str)]
    if path and path[-1] in ("codes", "packed", "scale"):
        path = path[:-1]
    return ".".join(path)


@dataclass
class DeviceFootprint:
    """What one device of a mesh holds for a model (every device holds the same amount: the layout shards a
    dimension only where the mesh axis divides it)."""

    mesh: dict[str, int]
    devices: int
    batch: int
    max_len: int
    dtype_name: str
    packed_kv: bool
    expert_inter: bool                 # routed experts' width split over tensor
    n_experts: int                     # routed experts in the config
    n_experts_padded: int              # ... rounded up to the expert axis
    params: list[LeafShare] = field(repr=False)
    state: list[LeafShare] = field(repr=False)

    @property
    def param_bytes_by_dtype(self) -> dict[str, int]:
        """Per device."""
        counts: Counter = Counter()
        for leaf in self.params:
            counts[leaf.dtype.name] += leaf.device_bytes
        return dict(counts)

    @property
    def param_bytes(self) -> int:
        return sum(leaf.device_bytes for leaf in self.params)

    @property
    def model_param_bytes(self) -> int:
        """Unpadded bytes of the whole model (what one device would hold alone)."""
        return sum(leaf.nbytes - leaf.pad_bytes for leaf in self.params)

    @property
    def mesh_param_bytes(self) -> int:
        """Bytes summed over all devices (replicated leaves once per device)."""
        return self.param_bytes * self.devices

    @property
    def replicated_bytes(self) -> int:
        """Per device: parameter bytes every device holds in full (norms, mHC, shared experts, unsplit weights)."""
        return sum(leaf.device_bytes for leaf in self.params if leaf.replicated)

    def replicated_groups(self) -> list[tuple[str, int]]:
        """Replicated bytes per leaf name, largest first."""
        counts: Counter = Counter()
        for leaf in self.params:
            if leaf.replicated:
                counts[_group(leaf.key)] += leaf.device_bytes
        return counts.most_common()

    @property
    def routed_expert_bytes(self) -> int:
        """Per device: the routed experts' share (padding included)."""
        return sum(leaf.device_bytes for leaf in self.params if leaf.expert)

    @property
    def pad_bytes(self) -> int:
        """Zero experts over the whole mesh (global bytes)."""
        return sum(leaf.pad_bytes for leaf in self.params)

    @property
    def state_bytes(self) -> int:
        """Per device."""
        return sum(leaf.device_bytes for leaf in self.state)

    @property
    def state_split(self) -> int:
        """Devices the state's sequence slots are divided over (data when it divides batch, else 1)."""
        return max((leaf.split for leaf in self.state), default=1)

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.state_bytes


def device_footprint(config: ModelConfig, mesh: Any, dtype: Any = np.float32, batch: int = 1, max_len: int = 8192,
                packed_kv: bool = False) -> DeviceFootprint:
    """Parameter and decode-state bytes per device of `mesh` for `batch` sequences of up to `max_len` tokens
    (packed_kv: the KV caches as uint8 fp8 records, which needs DeepSeek's numerics). Weights and state only:
    activations, compiled-program workspace and the runtime's own memory come on top; Engram tables stay on the
    host."""
    for name, v in (("batch", batch), ("max_len", max_len)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    numerics = Numerics.for_config(config, True, packed_kv=True) if packed_kv else None
    layout = abstract_layout(config, mesh)
    sizes = layout.sizes
    return DeviceFootprint(
        mesh=sizes, devices=math.prod(sizes.values()), batch=int(batch), max_len=int(max_len),
        dtype_name=np.dtype(dtype).name, packed_kv=bool(packed_kv), expert_inter=layout.expert_inter,
        n_experts=config.n_routed_experts, n_experts_padded=padded_experts(config.n_routed_experts, sizes["expert"]),
        params=param_shares(config, layout, dtype), state=state_shares(config, layout, batch, max_len, dtype, numerics))


def _gib(n: float) -> str:
    """Bytes in GiB (3 decimals), or in MiB / KiB below a tenth of the larger unit (tiny test models)."""
    if abs(n) >= 2**30 / 10 or n == 0:
        return f"{n / 2**30:.3f} GiB"
    if abs(n) >= 2**20 / 10:
        return f"{n / 2**20:.3f} MiB"
    return f"{n / 2**10:.3f} KiB"


def _fits(total: int, capacity: int, what: str) -> str:
    if total <= capacity:
        return f"{what}: yes ({_gib(capacity - total)} left)"
    return f"{what}: no (over by {_gib(total - capacity)})"


def mesh_summary(plan: DeviceFootprint) -> str:
    """The per-device lines `jdeep info --mesh` prints."""
    m = plan.mesh
    mesh = ",".join(f"{a}={s}" for a, s in m.items())
    moe = []
    if m["expert"] > 1:
        moe.append(f"{plan.n_experts_padded // m['expert']} routed experts per device")
    if plan.expert_inter:
        moe.append(f"experts' width split over tensor={m['tensor']}")
    elif m["tensor"] > 1:
        moe.append("experts' width not split (not whole 128-column blocks per tensor shard)")
    lines = [f"mesh            {mesh} ({plan.devices} device{'s' if plan.devices != 1 else ''}" + "".join(f"; {x}" for x in moe) + ")"]
    pb = plan.param_bytes_by_dtype
    lines.append("params/device   " + ", ".join(f"{k} {_gib(v)}" for k, v in pb.items())
                 + f" (total {_gib(plan.param_bytes)}; whole model {_gib(plan.model_param_bytes)}, "
                 f"{plan.mesh_param_bytes / plan.model_param_bytes:.2f}x of it summed over the mesh)")
    lines.append(f"  routed experts {_gib(plan.routed_expert_bytes)} per device")
    if plan.devices > 1:
        groups = plan.replicated_groups()
        top = ", ".join(f"{name} {_gib(b)}" for name, b in groups[:4])
        lines.append(f"  replicated     {_gib(plan.replicated_bytes)} per device held in full by every device"
                     + (f" (largest: {top})" if top else ""))
    if plan.n_experts_padded != plan.n_experts:
        lines.append(f"expert padding  {plan.n_experts} routed experts padded to {plan.n_experts_padded} over "
                     f"expert={m['expert']} ({plan.n_experts_padded - plan.n_experts} zero "
                     f"expert{'s' if plan.n_experts_padded - plan.n_experts > 1 else ''}, "
                     f"{_gib(plan.pad_bytes)} over the mesh)")
    else:
        lines.append(f"expert padding  none ({plan.n_experts} routed experts divide over expert={m['expert']})")
    kv = "packed fp8 KV records" if plan.packed_kv else f"{plan.dtype_name} caches"
    per = plan.batch // plan.state_split
    split = (f"batch split over data={m['data']}" if plan.state_split > 1 else
             "replicated on every device" + (f": data={m['data']} does not divide batch {plan.batch}"
                                             if m["data"] > 1 else ""))
    lines.append(f"state/device    {_gib(plan.state_bytes)} for batch {plan.batch} x max-len {plan.max_len} ({kv}; "
                 f"{per} sequence{'s' if per != 1 else ''} per device, {split})")
    lines.append(f"total/device    {_gib(plan.total_bytes)}, the same on every device (weights + decode state; "
                 "activations, program workspace and runtime memory come on top)")
    lines.append("fits            " + _fits(plan.total_bytes, TRN2_CORE_BYTES, "trn2 logical core (24 GiB, LNC=2)")
                 + f"; the mesh needs {math.ceil(plan.devices / 4)} trn2 chip{'s' if plan.devices > 4 else ''} "
                 "(4 logical cores each)")
    lines.append("                " + _fits(plan.total_bytes, H200_BYTES, "H200 (141 GB)")
                 + f"; the mesh needs {plan.devices} GPU{'s' if plan.devices != 1 else ''}")
    return "\n".join(lines)
