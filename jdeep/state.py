"""Decode state: per (segment, slot) caches stacked layer-major, for B sequence slots.

    state = {"segments": [[slot dict, ...] per segment], "sources": {f"r{m}": dict}}

Leaves of one slot (kind) have shape [reps, B, ...]; every cache has one spare *scratch* row at the
end that absorbs the writes of padded tokens (so writes never need data-dependent shapes or
out-of-bounds indices, and the spare row is never visible to a query):

    window      [R, B, W+1, D]       act dtype   ring of the last W tokens' K=V, slot t mod W
    ckv         [R, B, Tc+1, D]      act dtype   compressed KV, entry j = tokens j*m .. j*m+m-1
                (with packed_kv numerics both hold uint8 records [.., record_bytes], kv_record.py)
    cbuf_kv     [R, B, Rc+1, c*D]    fp32        compressor ring of the last Rc tokens' projections
    cbuf_score  [R, B, Rc+1, c*D]    fp32        ... and their gate scores (+ position bias)
    ikeys       [R, B, Tc+1, DI]     act dtype   indexer keys (overlap/indexer layers only)
    ibuf_kv / ibuf_score [R, B, 2m+1, 2*DI] fp32 indexer compressor ring

with Tc = max_len // m, c = 2 and Rc = 2m for overlapping compressors, else c = 1 and Rc = m.

DeepSeek-V4.1 layers own only their window; the compressed caches live with the KV sources (model-spec.md
§8.2), stacked per compress ratio m over that ratio's sources (`source_index` gives a layer's row):

    sources["r{m}"]: ckv [n_src, B, Tc+1, D] act dtype (fp4-simulated entries), ikeys [n_src, B, Tc+1, DI],
                     and for m > 1 cbuf_kv / cbuf_score [n_src, B, m+1, D] fp32 (the compressor ring);
                     with packed_kv the window, ckv and ikeys rows are uint8 records (kv_record_v41.py)

No sequence length is stored: the positions passed with each chunk say where every sequence is.

Prefix snapshots (`snapshot_head` / `snapshot_block`, `restore_head` / `restore_block`): after a slot's first p
tokens, its state is a function of those tokens alone. The compressors write an entry only once its m tokens are
complete, so entries j >= p // m of `ckv` / `ikeys` still hold their reset values; the rings (window, cbuf_*,
ibuf_*) hold the last tokens, a not-yet-complete block and, for overlapping compressors, the block before it. A
snapshot keeps the rings whole (its head) and the pools' first p // m entries, as p // block blocks of block // m
entries each (block a multiple of every ratio m): restored into a freshly reset slot, it is that slot's state after
the same p tokens, at any block-aligned p, and the programs copying it do not depend on p.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .kernels.kv_record import record_bytes
from .kernels.kv_record_v41 import ckv_record_bytes, ikey_record_bytes, window_record_bytes
from .numerics import Numerics
from .plan import LayerKind, LayerPlan

__all__ = ["slot_state_shapes", "source_state_shapes", "source_index", "init_state", "empty_state", "empty_slot_state",
           "slot_window", "put_slot_window", "move_slot",
           "state_bytes", "reset_slot", "zero_slots", "SNAPSHOT_POOLS", "snapshot_head",
           "snapshot_block", "restore_head", "restore_block"]

State = dict  # {"segments": list (segments) of list (slots) of dict[str, jax.Array], "sources": dict}
SNAPSHOT_POOLS = ("ckv", "ikeys")      # the leaves with one entry per m tokens (prefix snapshots cut them)


def slot_state_shapes(config: ModelConfig, kind: LayerKind, reps: int, batch: int, max_len: int,
                      dtype: Any, numerics: Numerics | None = None) -> dict[str, tuple[tuple[int, ...], Any]]:
    D, W = config.head_dim, config.window_size
    kv_row, kv_dtype = (D, dtype)
    if numerics is not None and numerics.packed_kv:
        kv_row = (window_record_bytes(D, numerics.kv_block) if kind.shared_kv else
                  record_bytes(D, config.rope_head_dim, numerics.kv_block, np.dtype(dtype).itemsize))
        kv_dtype = jnp.uint8
    shapes = {"window": ((reps, batch, W + 1, kv_row), kv_dtype)}
    m = kind.attn.ratio
    if m > 0 and not kind.shared_kv:      # shared-KV layers read their source's caches in state["sources"]
        c = 2 if kind.attn.overlap else 1
        rc = c * m
        tc = max_len // m
        shapes["ckv"] = ((reps, batch, tc + 1, kv_row), kv_dtype)
        shapes["cbuf_kv"] = ((reps, batch, rc + 1, c * D), jnp.float32)
        shapes["cbuf_score"] = ((reps, batch, rc + 1, c * D), jnp.float32)
        if kind.attn.has_indexer:
            DI = config.index_head_dim
            shapes["ikeys"] = ((reps, batch, tc + 1, DI), dtype)
            shapes["ibuf_kv"] = ((reps, batch, 2 * m + 1, 2 * DI), jnp.float32)
            shapes["ibuf_score"] = ((reps, batch, 2 * m + 1, 2 * DI), jnp.float32)
    return shapes


def source_index(config: ModelConfig, layer: int) -> tuple[str, int]:
    """V4.1: (sources key, row) of the compressed caches `layer` reads (its KV source's)."""
    src = config.kv_source_of(layer)
    m = config.attention_kinds[src].ratio
    same = [s for s in config.sharing.kv_sources if config.attention_kinds[s].ratio == m]
    return f"r{m}", same.index(src)


def source_state_shapes(config: ModelConfig, batch: int, max_len: int, dtype: Any, numerics: Numerics | None = None
                        ) -> dict[str, dict[str, tuple[tuple[int, ...], Any]]]:
    """V4.1 shared compressed caches per compress ratio (empty without cross-layer sharing, V4); uint8 records with
    packed_kv."""
    if config.sharing is None:
        return {}
    D, DI = config.head_dim, config.index_head_dim
    packed = numerics is not None and numerics.packed_kv
    ckv = ((ckv_record_bytes(D, numerics.ckv_fp4_block), jnp.uint8) if packed else (D, dtype))
    ikey = ((ikey_record_bytes(DI, numerics.fp4_block), jnp.uint8) if packed else (DI, dtype))
    out: dict[str, dict] = {}
    for s in config.sharing.kv_sources:
        m = config.attention_kinds[s].ratio
        n = sum(config.attention_kinds[k].ratio == m for k in config.sharing.kv_sources)
        tc = max_len // m
        shapes = {"ckv": ((n, batch, tc + 1, ckv[0]), ckv[1]), "ikeys": ((n, batch, tc + 1, ikey[0]), ikey[1])}
        if m > 1:
            shapes["cbuf_kv"] = ((n, batch, m + 1, D), jnp.float32)
            shapes["cbuf_score"] = ((n, batch, m + 1, D), jnp.float32)
        out[f"r{m}"] = shapes
    return out


def _fill(name: str) -> float:
    # Gate scores start at -inf so that not-yet-seen tokens get zero softmax weight.
    return -np.inf if name.endswith("score") else 0.0


def init_state(config: ModelConfig, plan: LayerPlan, batch: int, max_len: int, dtype: Any,
               numerics: Numerics | None = None) -> State:
    """Fresh state for `batch` sequences of at most `max_len` tokens, placed on the default device
    (committed, like the loaded params and the step outputs, so every call hits one compiled program)."""
    return jax.device_put(empty_state(config, plan, batch, max_len, dtype, numerics), jax.devices()[0])


def empty_slot_state(config: ModelConfig, kind: LayerKind, reps: int, batch: int, max_len: int, dtype: Any,
                     numerics: Numerics | None = None) -> dict[str, jax.Array]:
    """The fresh state of `reps` layers of one kind (slot_state_shapes), without placement."""
    shapes = slot_state_shapes(config, kind, reps, batch, max_len, dtype, numerics)
    return {k: jnp.full(s, _fill(k), dt) for k, (s, dt) in shapes.items()}


def empty_state(config: ModelConfig, plan: LayerPlan, batch: int, max_len: int, dtype: Any,
                numerics: Numerics | None = None) -> State:
    """The fresh state's arrays, without placement (traceable: sharded models build it inside a program)."""
    segments = [[empty_slot_state(config, kind, seg.reps, batch, max_len, dtype, numerics) for kind in seg.pattern]
                for seg in plan.segments]
    sources = {key: {k: jnp.full(s, _fill(k), dt) for k, (s, dt) in shapes.items()}
               for key, shapes in source_state_shapes(config, batch, max_len, dtype, numerics).items()}
    return {"segments": segments, "sources": sources}


def reset_slot(state: State, slot: jax.Array) -> State:
    """The state with sequence slot `slot` (int32 scalar, clamped) reset to empty: every leaf's fill value written over
    the slot's rows [R, 1, ...] in place (dynamic_update_slice). Only that slot's bytes are written (a select over a
    mask of slots reads and writes the whole state), and the donated state is updated in place, as Neuron's
    compile-safety rule S20 asks. One program resets any slot; a batch of admissions calls it once per slot."""
    slot = _slot_index(state, slot)

    def reset(name, leaf):
        row = jnp.full((leaf.shape[0], 1) + leaf.shape[2:], _fill(name), leaf.dtype)
        return jax.lax.dynamic_update_slice(leaf, row, (0, slot) + (0,) * (leaf.ndim - 2))

    return _select_named(state, lambda name: True, reset)


def zero_slots(tree: Any, mask: jax.Array) -> Any:
    """Any layer-major state tree ([R, B, ...] leaves: a drafter's windows, the MTP block's state) with the sequence
    slots where mask [B] is True zeroed."""
    return jax.tree_util.tree_map(
        lambda a: jnp.where(mask.reshape((1, -1) + (1,) * (a.ndim - 2)), jnp.zeros((), a.dtype), a), tree)


def window_start(state: Any, rows: int, start: Any = None) -> jax.Array | int:
    """The first slot of a window of `rows` sequence slots: 0 without `start`, else the traced int32 `start` clamped
    so the window lies inside the state's B slots."""
    if start is None:
        return 0
    B = jax.tree_util.tree_leaves(state)[0].shape[1]
    return jnp.clip(jnp.asarray(start, jnp.int32), 0, B - rows)


def slot_window(state: Any, rows: int, start: Any = None) -> Any:
    """Sequence slots [start, start + rows) of every state leaf ([R, B, ...] -> [R, rows, ...]); `start` a traced
    int32 scalar (one program serves every window of this size) or None for the first `rows` slots."""
    first = window_start(state, rows, start)
    return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_slice_in_dim(a, first, rows, axis=1), state)


def put_slot_window(state: Any, window: Any, start: Any = None) -> Any:
    """`state` with `window` (from slot_window, same `start`) written back over its slots, in place when donated;
    the other slots are neither read nor changed."""
    rows = jax.tree_util.tree_leaves(window)[0].shape[1]
    first = window_start(state, rows, start)
    return jax.tree_util.tree_map(lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b, first, axis=1), state, window)


def move_slot(state: State, src: jax.Array, dst: jax.Array) -> State:
    """The state with slot `src`'s rows copied over slot `dst` (int32 scalars, clamped): how a sequence moves to a
    lower slot when the engine compacts its pool. `src` keeps its rows (the caller treats it as free)."""
    src, dst = _slot_index(state, src), _slot_index(state, dst)
    return jax.tree_util.tree_map(
        lambda a: jax.lax.dynamic_update_slice_in_dim(a, jax.lax.dynamic_slice_in_dim(a, src, 1, axis=1), dst, axis=1),
        state)


def _pool_entries(a: jax.Array, block: int, max_len: int) -> int:
    """Entries of pool leaf `a` ([R, B, Tc + 1, ...], Tc = max_len // m) one block of `block` tokens holds."""
    return max(1, block // (max_len // (a.shape[2] - 1)))


def _slot_index(state: State, slot: jax.Array) -> jax.Array:
    """A slot index (int32 scalar, traced) clamped into the state's B slots (Neuron's rule S12)."""
    B = jax.tree_util.tree_leaves(state)[0].shape[1]
    return jnp.clip(jnp.asarray(slot, jnp.int32), 0, B - 1)


def _block_index(index: jax.Array, block: int, max_len: int) -> jax.Array:
    """A snapshot block index clamped into the state's max_len // block blocks."""
    return jnp.clip(jnp.asarray(index, jnp.int32), 0, max(1, max_len // block) - 1)


def snapshot_head(state: State, slot: jax.Array) -> State:
    """The part of a prefix snapshot (runtime/prefix_snapshot.py) that does not grow with the prefix: slot `slot`'s
    rows of every leaf but the pools ([R, B, ...] -> [R, 1, ...]: the sliding-window rings, the compression
    buffers); the pools (SNAPSHOT_POOLS) are left out of the tree (their entries travel by blocks: snapshot_block).
    slot: int32 scalar (traced, clamped)."""
    slot = _slot_index(state, slot)
    return _select_named(state, lambda name: name not in SNAPSHOT_POOLS,
                         lambda name, a: jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=1))


def snapshot_block(state: State, slot: jax.Array, index: jax.Array, block: int, max_len: int) -> State:
    """Block `index` of slot `slot`'s pools: the entries of tokens [index * block, (index + 1) * block), i.e. pool
    entries [index * block // m, (index + 1) * block // m) of every pool leaf ([R, B, Tc + 1, ...] -> [R, 1,
    block // m, ...]); the other leaves left out of the tree. One program for any prefix length: a p-token snapshot
    is its head and p // block blocks. slot, index: int32 scalars (traced, clamped into the slots and the state's
    max_len // block blocks); block (tokens, a multiple of every compress ratio), max_len (the state's length):
    static."""
    slot, index = _slot_index(state, slot), _block_index(index, block, max_len)

    def cut(name, a):
        n = _pool_entries(a, block, max_len)
        row = jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=1)
        return jax.lax.dynamic_slice_in_dim(row, index * n, n, axis=2)

    return _select_named(state, lambda name: name in SNAPSHOT_POOLS, cut)


def restore_head(state: State, head: State, slot: jax.Array) -> State:
    """`state` with a snapshot's head (snapshot_head) written over slot `slot`'s rows (int32 scalar, clamped); the
    pools are not touched. In place when the state is donated."""
    slot = _slot_index(state, slot)
    return _update_named(state, head, lambda a, b: jax.lax.dynamic_update_slice(
        a, b, (0, slot) + (0,) * (a.ndim - 2)))


def restore_block(state: State, blk: State, slot: jax.Array, index: jax.Array, block: int, max_len: int) -> State:
    """`state` with block `index` of a snapshot (snapshot_block, same block and max_len) written over slot `slot`'s
    pool entries; pool entries of other blocks keep what the slot holds (a freshly reset slot: their reset values).
    In place when the state is donated."""
    slot, index = _slot_index(state, slot), _block_index(index, block, max_len)
    return _update_named(state, blk, lambda a, b: jax.lax.dynamic_update_slice(
        a, b, (0, slot, index * b.shape[2]) + (0,) * (a.ndim - 3)))


def _select_named(state: State, keep, fn) -> State:
    """fn(leaf name, leaf) over the leaves whose name `keep` accepts; the others left out of the dicts."""
    def part(d):
        return {k: fn(k, v) for k, v in d.items() if keep(k)}
    return {"segments": [[part(slot) for slot in seg] for seg in state["segments"]],
            "sources": {key: part(d) for key, d in state["sources"].items()}}


def _update_named(state: State, part: State, fn) -> State:
    """`state` with fn(leaf, part's leaf) in place of every leaf `part` (a _select_named tree of it) holds."""
    def merge(d, p):
        return {k: fn(v, p[k]) if k in p else v for k, v in d.items()}
    return {"segments": [[merge(d, p) for d, p in zip(seg, pseg)] for seg, pseg in zip(state["segments"],
                                                                                  part["segments"])],
            "sources": {key: merge(d, part["sources"][key]) for key, d in state["sources"].items()}}


def state_bytes(config: ModelConfig, plan: LayerPlan, batch: int, max_len: int, dtype: Any,
                numerics: Numerics | None = None) -> int:
    total = 0
    for seg in plan.segments:
        for kind in seg.pattern:
            for shape, dt in slot_state_shapes(config, kind, seg.reps, batch, max_len, dtype, numerics).values():
                total += int(np.prod(shape)) * np.dtype(dt).itemsize
    for shapes in source_state_shapes(config, batch, max_len, dtype, numerics).values():
        for shape, dt in shapes.values():
            total += int(np.prod(shape)) * np.dtype(dt).itemsize
    return total
