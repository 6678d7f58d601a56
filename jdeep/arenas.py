"""Parameter arenas: a layer kind's many small per-layer parameters packed into one buffer per dtype.

A scan-mode step takes every parameter leaf as a program argument: 147 to 322 on the tiny goldens, more
on the released models. The Neuron runtime reportedly slows down sharply between 128 and 512 argument
buffers (neuron-notes.md §5.7, graphcheck S19), so for Neuron the scan mode packs each (segment, slot)'s
non-expert parameters, stacked [R, ...], into arenas [R, N_dtype] (one per dtype); the routed experts stay
separate stacks (the MoE slices one expert out of them). Inside the program a layer's row of each arena is
cut back into its tensors by static slices. `Packed` is a pytree node whose static layout travels in the
tree structure, so jit keys its programs on it and lax.scan slices the arenas like any stacked leaf.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Packed", "pack_slot", "pack_params", "is_packed", "split_experts", "unpacked", "EXPERT_KEYS"]

EXPERT_KEYS = ("w1", "w2", "w3")


def split_experts(slot: dict) -> tuple[dict, dict]:
    """(a slot's parameters without its routed experts, the experts {w1, w2, w3} stacked [R, E, ...])."""
    ffn = slot["ffn"]
    rest = {**slot, "ffn": {k: v for k, v in ffn.items() if k not in EXPERT_KEYS}}
    return rest, {k: ffn[k] for k in EXPERT_KEYS}


@jax.tree_util.register_pytree_node_class
class Packed:
    """arenas {dtype name: [..., N]} + layout ((dtype name, offset, shape) per leaf, in treedef order) and the
    tree's treedef (both static).

    The leading axes of every arena are the stacking axes (layers); `unpack()` needs them gone (one layer)
    or equal to the stored tensors' leading axes."""

    def __init__(self, arenas: dict, layout: tuple, treedef: Any):
        self.arenas, self.layout, self.treedef = arenas, layout, treedef

    def tree_flatten(self):
        names = tuple(sorted(self.arenas))
        return [self.arenas[n] for n in names], (names, self.layout, self.treedef)

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        names, layout, treedef = aux
        return cls(dict(zip(names, leaves)), layout, treedef)

    def unpack(self) -> Any:
        """The original tree of one layer's tensors (arenas [N])."""
        leaves = []
        for dtype, offset, shape in self.layout:
            size = int(np.prod(shape))
            leaves.append(jax.lax.slice_in_dim(self.arenas[dtype], offset, offset + size, axis=-1).reshape(shape))
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def unpacked(p: Any) -> Any:
    """One layer's tensors: a Packed arena unpacked, anything else as it is."""
    return p.unpack() if isinstance(p, Packed) else p


def pack_slot(tree: Any) -> Packed:
    """Pack a tree of stacked leaves [R, ...] (arrays or jax.ShapeDtypeStruct) into arenas [R, N]."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    R = leaves[0].shape[0]
    layout, offsets, parts = [], {}, {}
    for leaf in leaves:
        name = np.dtype(leaf.dtype).name
        off = offsets.get(name, 0)
        size = int(np.prod(leaf.shape[1:]))
        layout.append((name, off, tuple(leaf.shape[1:])))
        offsets[name] = off + size
        parts.setdefault(name, []).append(leaf)
    if isinstance(leaves[0], jax.ShapeDtypeStruct):
        arenas = {n: jax.ShapeDtypeStruct((R, offsets[n]), np.dtype(n)) for n in parts}
    else:
        arenas = {n: jnp.concatenate([p.reshape(R, -1) for p in ps], axis=1) for n, ps in parts.items()}
    return Packed(arenas, tuple(layout), treedef)


def is_packed(params: dict) -> bool:
    return bool(params["segments"]) and "arena" in params["segments"][0][0]


def pack_params(params: dict) -> dict:
    """The param tree with each (segment, slot) — and DeepSeek-V4's MTP blocks, when loaded — as {"arena":
    Packed(non-expert params), "experts": {w1, w2, w3}}."""
    def packed(slot: dict) -> dict:
        rest, experts = split_experts(slot)
        return {"arena": pack_slot(rest), "experts": experts}

    out = {**params, "segments": [[packed(slot) for slot in seg] for seg in params["segments"]]}
    if "ffn" in params.get("drafter", {}):
        out["drafter"] = packed(params["drafter"])
    return out
