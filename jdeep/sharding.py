"""Device meshes and the one table that maps every parameter and state array onto them.

A mesh has three named axes, always in this order (size 1 when unused):

    data     sequence slots (the batch axis of the decode state, tokens and logits)
    tensor   attention heads and output groups (wq_b, attn_sink, wo_a, wo_b, the indexer's heads),
             the vocabulary of the embedding and the head, and the routed experts' intermediate dim
             (when it splits into whole 128-wide quantisation blocks)
    expert   routed experts (whole experts, by index, as DeepSeek's converter distributes them)

`Layout` turns the logical axes of `_PARAM_RULES` / the state's batch axis into `PartitionSpec`s.
A logical axis is sharded only when its mesh axis divides the dimension (else that dimension stays
replicated), so any mesh runs any model correctly: sharding decides where bytes live and which
collectives XLA inserts, never the result. The MoE under expert parallelism is the one place with
explicit collectives (layers/moe.py, inside `shard_map`); everything else is partitioned by XLA from
the input shardings and the constraints `Layout.constrain_*` put on the step's outputs.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["AXES", "parse_mesh", "make_mesh", "Layout", "param_logical_axes", "EXPERT_INTER_BLOCK"]

AXES = ("data", "tensor", "expert")

# logical axis -> mesh axis
_MESH_AXIS = {"batch": "data", "vocab": "tensor", "heads": "tensor", "groups": "tensor", "experts": "expert",
              "expert_inter": "tensor"}

# Per-layer logical axes of parameter leaves, by tree path (quantized leaves' "codes" / "packed" / "scale" /
# "decoded" children take their parent's axes: scales are blocks of the same dims). Leaves not listed are replicated.
_PARAM_RULES: dict[tuple[str, ...], tuple[str | None, ...]] = {
    ("embed",): ("vocab", None),
    ("head",): (None, "vocab"),                          # stored input-major [d, V]
    ("attn", "wq_b"): ("heads", None),
    ("attn", "attn_sink"): ("heads",),
    ("attn", "wo_a"): ("groups", None),
    ("attn", "wo_b"): (None, "groups"),
    ("attn", "indexer", "wq_b"): ("heads", None),
    ("attn", "indexer", "weights_proj"): ("heads", None),
    ("ffn", "w1"): ("experts", "expert_inter", None),
    ("ffn", "w3"): ("experts", "expert_inter", None),
    ("ffn", "w2"): ("experts", None, "expert_inter"),
}
_QUANT_CHILDREN = ("codes", "packed", "scale", "decoded")

# the experts' intermediate dim is split over `tensor` only in whole blocks of this many columns, so fp8
# weight blocks (128), fp4 scale groups (32) and activation-quantisation groups (128) never straddle shards
EXPERT_INTER_BLOCK = 128


def parse_mesh(spec: str | Mapping[str, int] | None) -> dict[str, int]:
    """"data=2,expert=4" or {"data": 2, "expert": 4} -> sizes of all three axes ({"data": 2, "tensor": 1,
    "expert": 4}). ValueError naming the problem for unknown axes, repeated axes or sizes below 1."""
    if spec is None:
        return {a: 1 for a in AXES}
    if isinstance(spec, str):
        items = []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            m = re.fullmatch(r"([A-Za-z_]+)\s*[=:]\s*(-?\d+)", part)
            if m is None:
                raise ValueError(f"mesh {spec!r}: cannot read {part!r}; write axis=size pairs such as "
                                 "'data=2,tensor=2,expert=4'")
            items.append((m.group(1), int(m.group(2))))
    elif isinstance(spec, Mapping):
        items = list(spec.items())
    else:
        raise ValueError(f"mesh must be a string such as 'data=2,expert=4' or a dict of axis sizes, got {spec!r}")
    sizes = {a: 1 for a in AXES}
    seen = set()
    for name, size in items:
        if name not in AXES:
            raise ValueError(f"mesh axis {name!r} is not one of {', '.join(AXES)}")
        if name in seen:
            raise ValueError(f"mesh axis {name!r} is given twice")
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"mesh axis {name} must have a positive integer size, got {size!r}")
        seen.add(name)
        sizes[name] = int(size)
    return sizes


def make_mesh(spec: str | Mapping[str, int] | Mesh | None, devices: list | None = None) -> Mesh:
    """A Mesh with axes (data, tensor, expert) over `devices` (default: every device of every process).
    The product of the sizes must equal the number of devices."""
    if isinstance(spec, Mesh):
        if tuple(spec.axis_names) != AXES:
            raise ValueError(f"a jdeep mesh has axes {AXES}, got {tuple(spec.axis_names)}")
        return spec
    sizes = parse_mesh(spec)
    devices = list(jax.devices() if devices is None else devices)
    n = math.prod(sizes.values())
    if n != len(devices):
        what = ", ".join(f"{a}={s}" for a, s in sizes.items())
        raise ValueError(f"mesh {what} needs {n} devices, but {len(devices)} are available"
                         + (" (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N gives N devices)"
                            if devices and devices[0].platform == "cpu" else ""))
    # expert innermost: expert-parallel collectives stay between neighbouring devices
    return Mesh(np.asarray(devices, dtype=object).reshape(tuple(sizes[a] for a in AXES)), AXES)


def param_logical_axes(path: tuple[str, ...], ndim: int, stacked: int) -> tuple[str | None, ...]:
    """Logical axes of a parameter leaf at tree `path` (within a layer, or top-level) with `stacked` leading
    axes (1 for segment leaves: the layer axis, never sharded)."""
    key = path[:-1] if path and path[-1] in _QUANT_CHILDREN else path
    rule = _PARAM_RULES.get(tuple(key))
    if rule is None:
        return (None,) * ndim
    axes = (None,) * stacked + rule
    if len(axes) != ndim:
        raise ValueError(f"sharding rule for {'.'.join(path)} has {len(rule)} axes, the leaf has {ndim - stacked}")
    return axes


def _tree_path(kp) -> tuple:
    out = []
    for k in kp:
        if isinstance(k, jax.tree_util.DictKey):
            out.append(k.key)
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(k.idx)
        else:
            out.append(getattr(k, "name", str(k)))
    return tuple(out)


@dataclass(frozen=True)
class Layout:
    """A mesh plus the sharding rules for one model (hashable: it keys compiled programs).

    expert_inter: whether the routed experts' intermediate dim is split over `tensor` (set by `for_model`
    from the config: only when it divides into whole EXPERT_INTER_BLOCK blocks per shard)."""

    mesh: Mesh
    expert_inter: bool = False
    _sizes: tuple = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        object.__setattr__(self, "_sizes", tuple(self.mesh.shape[a] for a in AXES))

    @classmethod
    def for_model(cls, mesh: Mesh, moe_inter_dim: int) -> "Layout":
        tp = mesh.shape["tensor"]
        return cls(mesh, expert_inter=tp > 1 and moe_inter_dim % (tp * EXPERT_INTER_BLOCK) == 0)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(zip(AXES, self._sizes))

    @property
    def expert_parallel(self) -> bool:
        """Whether the MoE runs the explicit expert-parallel path (experts or their width split)."""
        return self.sizes["expert"] > 1 or self.expert_inter

    def _spec(self, axes: tuple[str | None, ...], shape: tuple[int, ...]) -> P:
        out = []
        for ax, n in zip(axes, shape):
            mesh_ax = _MESH_AXIS.get(ax) if ax is not None else None
            if ax == "expert_inter" and not self.expert_inter:
                mesh_ax = None
            size = self.sizes[mesh_ax] if mesh_ax else 1
            out.append(mesh_ax if size > 1 and n % size == 0 else None)
        while out and out[-1] is None:
            out.pop()
        return P(*out)

    # ---------------------------------------------------------------- parameters
    def param_spec(self, path: tuple, shape: tuple[int, ...]) -> P:
        """PartitionSpec of a parameter leaf at `path` in the model's param tree (("embed",),
        ("segments", s, slot, "attn", "wq_b", "codes"), ...)."""
        if path and path[0] == "segments":
            return self._spec(param_logical_axes(tuple(path[3:]), len(shape), 1), shape)
        if path and path[0] == "drafter":
            return self._spec(param_logical_axes(tuple(path[1:]), len(shape), 1), shape)
        return self._spec(param_logical_axes(tuple(path), len(shape), 0), shape)

    def param_shardings(self, params: Any) -> Any:
        """NamedSharding per leaf of a param tree (arrays or ShapeDtypeStructs)."""
        return jax.tree_util.tree_map_with_path(
            lambda kp, a: NamedSharding(self.mesh, self.param_spec(_tree_path(kp), a.shape)), params)

    def expert_spec(self, leaf_path: tuple, shape: tuple[int, ...]) -> P:
        """Spec of a routed-expert leaf ([R, E, ...]; leaf_path like ("w1", "codes"))."""
        return self._spec(param_logical_axes(("ffn",) + tuple(leaf_path), len(shape), 1), shape)

    # ---------------------------------------------------------------- decode state, activations
    def state_spec(self, shape: tuple[int, ...]) -> P:
        """Every state leaf is [R, B, ...] (stacked layers or sources, then sequence slots)."""
        return self._spec((None, "batch") + (None,) * (len(shape) - 2), shape)

    def state_shardings(self, state: Any) -> Any:
        return jax.tree_util.tree_map(lambda a: NamedSharding(self.mesh, self.state_spec(a.shape)), state)

    def batch_spec(self, shape: tuple[int, ...]) -> P:
        """Arrays with the sequence slots first ([B, ...]: tokens, positions, Engram rows after their layer axis
        excluded)."""
        return self._spec(("batch",) + (None,) * (len(shape) - 1), shape)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def constrain_state(self, state: Any) -> Any:
        return jax.tree_util.tree_map(
            lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(self.mesh, self.state_spec(a.shape))), state)

    def batch_sharding(self, x: Any) -> NamedSharding:
        return NamedSharding(self.mesh, self.batch_spec(np.shape(x)))

    def constrain_batch(self, tree: Any) -> Any:
        """Batch-first arrays ([B, ...]) constrained to be sharded by sequence slot, as put_batch places them."""
        return jax.tree_util.tree_map(lambda a: jax.lax.with_sharding_constraint(a, self.batch_sharding(a)), tree)

    def constrain_replicated(self, x: jax.Array) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, self.replicated)

    def constrain_logits(self, x: jax.Array) -> jax.Array:
        """Logits [B, ..., V] as the step returns them (replicated), computed where the head's columns live: split
        over the vocabulary (and the batch over `data`) first, so XLA gathers the logits, B x V, instead of the
        whole head, d x V in fp32, on every step."""
        split = self._spec(("batch",) + (None,) * (x.ndim - 2) + ("vocab",), x.shape)
        return self.constrain_replicated(jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, split)))

    # ---------------------------------------------------------------- host <-> global arrays
    def put(self, x: Any, sharding: NamedSharding | None = None) -> jax.Array:
        """A host value (numpy, or a jax array) as a global array (default replicated over the mesh). Works
        across processes: every process must pass the same value."""
        sharding = sharding or self.replicated
        if isinstance(x, jax.Array):
            if x.sharding == sharding:
                return x
            # a global array, or any device array in a single-process run: reshard on the devices
            if not x.is_fully_addressable or jax.process_count() == 1:
                return jax.device_put(x, sharding)
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    def put_tree(self, tree: Any) -> Any:
        return jax.tree_util.tree_map(self.put, tree)

    def put_batch(self, tree: Any) -> Any:
        """Host batch-first arrays ([B, ...]) as global arrays sharded by sequence slot."""
        return jax.tree_util.tree_map(lambda a: self.put(a, self.batch_sharding(a)), tree)

    def describe(self) -> str:
        return ",".join(f"{a}={s}" for a, s in self.sizes.items())
