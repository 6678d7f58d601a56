"""Undo logs of the decode state: what a step over draft positions overwrites, saved before it and written back for
the positions verification rejects, so the state after a speculative step is exactly the state plain decoding has.

Every cache entry a step writes is a function of the token's position alone (state.py):
    rings (window, cbuf_*, ibuf_*)   slot t mod E, E = the leaf's entries less its scratch row
    compressed entries (ckv, ikeys)  entry g = (t + 1) / m - 1 when t completes a group of m tokens, else nothing
So the entries positions t_1..t_K can touch are known before the step: `save` gathers them ([R, B, K, ...] per leaf),
`restore` scatters the saved values back for the rejected positions (the scratch row takes the kept ones'). A ring
shorter than K could hold an accepted and a rejected position in one slot; `entry_index` refuses it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ..plan import LayerPlan

__all__ = ["entry_index", "save", "restore", "RINGS", "ENTRIES"]

RINGS = ("window", "cbuf_kv", "cbuf_score", "ibuf_kv", "ibuf_score")
ENTRIES = ("ckv", "ikeys")


def _leaf_index(name: str, leaf: jax.Array, ratio: int, positions: jax.Array) -> jax.Array:
    """Entry (axis 2) of `leaf` that position t [B, K] writes; the scratch row for t < 0 and for no entry."""
    E = leaf.shape[2] - 1
    if name in RINGS:
        if E < positions.shape[1]:
            raise ValueError(f"a {name} ring of {E} entries cannot undo {positions.shape[1]} positions")
        idx = positions % E
    elif name in ENTRIES:
        done = (positions + 1) % ratio == 0
        g = (positions + 1) // ratio - 1
        idx = jnp.where(done & (g < E), g, E)
    else:
        raise ValueError(f"unknown state leaf {name!r}")
    return jnp.clip(jnp.where(positions >= 0, idx, E), 0, E).astype(jnp.int32)    # (clamped: Neuron's S12)


def entry_index(state: dict, plan: LayerPlan | None, positions: jax.Array, mtp: bool = False) -> Any:
    """The entries positions int32 [B, K] (-1: none) write in each leaf of `state`, as a tree of int32 [B, K] mirroring
    it: a backbone state (plan's segments and the V4.1 sources) or, with `mtp`, the MTP blocks' {"window": ...}."""
    if mtp:
        return {k: _leaf_index(k, v, 1, positions) for k, v in state.items()}
    segments = [[{k: _leaf_index(k, v, kind.attn.ratio, positions) for k, v in slot.items()}
                 for slot, kind in zip(seg_state, seg.pattern)]
                for seg_state, seg in zip(state["segments"], plan.segments)]
    sources = {key: {k: _leaf_index(k, v, int(key[1:]), positions) for k, v in d.items()}
               for key, d in state["sources"].items()}
    return {"segments": segments, "sources": sources}


def _batch(idx: jax.Array) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(idx.shape[0], dtype=jnp.int32)[:, None], idx.shape)


def save(state: Any, index: Any) -> Any:
    """The entries `index` (entry_index) names, per leaf [R, B, K, ...]."""
    return jax.tree_util.tree_map(lambda a, i: a[:, _batch(i), i], state, index)


def restore(state: Any, undo: Any, index: Any, rejected: jax.Array) -> Any:
    """`state` with the entries of the rejected positions (bool [B, K]) set back to their saved values. The index is
    clamped again: the regions mode computes it in another program, so here it is an input (Neuron's S12)."""
    def put(a, u, i):
        last = a.shape[2] - 1
        return a.at[:, _batch(i), jnp.where(rejected, jnp.clip(i, 0, last), last)].set(u)

    return jax.tree_util.tree_map(put, state, undo, index)
