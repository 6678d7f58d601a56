"""The `scan` compile mode's forward step: the whole stack in one program, each plan segment one `lax.scan`.

`model_step(params, state, tokens, positions)` runs one chunk of S tokens for B sequences through the
whole stack and returns logits plus the updated state: prefill is a chunk of S > 1 (any number of
chunks in a row), decode is S = 1. Each plan segment runs as one `lax.scan` over its repetitions, with
the state passed as whole stacked arrays and the repetition index as a traced scalar, so the compiled
program holds one body per segment whatever the depth and caches are updated in place (donated).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..arenas import split_experts, unpacked
from ..config import ModelConfig
from ..kernels.linear import InPlace, from_bits
from ..layers.block import Streams, block
from ..layers.chunk import make_chunk
from ..layers.head import embed_streams, head_keys, head_logits, require_engram
from ..layers.rope import inv_freq
from ..numerics import Numerics
from ..plan import LayerPlan, Segment, dspark_tap_layers
from ..state import source_index

__all__ = ["model_step", "StepOutput", "slot_params"]


class StepOutput(NamedTuple):
    """What model_step returns: the logits (fp32 [B, V] at each row's last real token, or [B, S, V] with all_logits)
    and the new decode state, then what its flags ask for, None where not asked: `streams` (block_out, engram_out),
    `training` ({"hidden", "index_kl"}), `hidden` (the final streams X [B, S, n, d]) and `taps` (main_hidden
    [B, S, n_taps*d])."""

    logits: Any
    state: Any
    streams: Any = None
    training: Any = None
    hidden: Any = None
    taps: Any = None


def slot_params(slot: dict) -> tuple[Any, dict]:
    """(per-layer params, routed experts) of a (segment, slot); per-layer params may be an arenas.Packed arena."""
    if "arena" in slot:
        return slot["arena"], slot["experts"]
    return split_experts(slot)


def segment_inputs(seg: Segment, config: ModelConfig, engram: tuple | None, tap_layers: tuple[int, ...] = ()
                   ) -> list[dict]:
    """Per-slot scanned inputs of a segment, one entry per repetition: "row" (int32 [R], each layer's row in its
    ratio's shared caches; shared-KV compressed layers), "engram" (each layer's table rows; Engram layers) and,
    when tap_layers are given, "tap" (int32 [R]: each layer's index in tap_layers, -1 if it is not one)."""
    aux = []
    for j, kind in enumerate(seg.pattern):
        layers = [seg.layer(r, j) for r in range(seg.reps)]
        a = {}
        if kind.shared is not None:
            a["row"] = jnp.asarray([source_index(config, li)[1] for li in layers], jnp.int32)
        if kind.engram:
            order = np.asarray([config.engram.layer_ids.index(li) for li in layers])
            a["engram"] = (engram[0][order], engram[1][order])
        if tap_layers:
            a["tap"] = jnp.asarray([tap_layers.index(li) if li in tap_layers else -1 for li in layers], jnp.int32)
        aux.append(a)
    return aux


# Per-layer weight matrices that only products read (layers.linear.dense, kernels.linear.linear / linear_f32, the
# shared expert, the grouped wo_a): in a step the native CPU kernel runs, they are read in place from their stacks.
_PRODUCT_WEIGHTS = frozenset({"wq_a", "wq_b", "wkv", "wo_a", "wo_b", "wgate", "wk", "w1", "w2", "w3"})


def _product_weight(path, leaf) -> bool:
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    if keys and keys[-1] == "decoded":
        keys = keys[:-1]
    return bool(keys) and keys[-1] in _PRODUCT_WEIGHTS and leaf.ndim >= 3 and \
        leaf.dtype in (jnp.float32, jnp.bfloat16, jnp.uint16)


def _split_in_place(slot, numerics: Numerics, rows: int) -> tuple[list, list, Any]:
    """One slot's per-layer params [R, ...] as (scanned leaves, resident leaves, treedef): where this step's products
    of `rows` rows run the native CPU kernel (Numerics.native_gemm_rows), the product weight matrices stay out of the
    scan's sliced inputs (None there) and are read in place at the layer's index (`_layer_params`); XLA:CPU would
    otherwise copy each one out of its stack for every layer (docs/performance.md). Otherwise all are scanned."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(slot)
    native = (isinstance(slot, dict) and numerics.native_gemm_rows and 2 <= rows <= numerics.native_gemm_rows)
    resident = [leaf if native and _product_weight(path, leaf) else None for path, leaf in flat]
    scanned = [None if res is not None else leaf for res, (_, leaf) in zip(resident, flat)]
    return scanned, resident, treedef


def _layer_params(scanned: list, resident: list, treedef, r: jax.Array):
    """One layer's params from _split_in_place's parts: the scanned slices (bf16 bits bitcast back), the resident
    matrices as InPlace(stack, (r,))."""
    if all(res is None for res in resident):       # a Packed arena is unpacked before its bits are bitcast
        return jax.tree_util.tree_map(from_bits, unpacked(jax.tree_util.tree_unflatten(treedef, scanned)))
    leaves = [InPlace(res, (r,)) if res is not None else from_bits(sl) for sl, res in zip(scanned, resident)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _take_tap(taps: jax.Array, tap: jax.Array, X: jax.Array) -> jax.Array:
    """taps [B, S, n_taps, d] with entry `tap` (traced int32; -1 = this layer is no target) set to mean_i X_i
    (X [B, S, n, d], the streams entering the layer)."""
    hit = jnp.arange(taps.shape[2], dtype=jnp.int32) == tap
    return jnp.where(hit[:, None], jnp.mean(X, axis=2)[:, :, None, :].astype(taps.dtype), taps)


def _run_segment(seg: Segment, seg_params: list, seg_state: list, sources: dict, streams: Streams, aux: list,
                 chunk, config: ModelConfig, numerics: Numerics, record: bool, layout=None, index_loss: bool = False,
                 taps: jax.Array | None = None):
    """The segment's lax.scan. Returns (streams, state, sources, recorded streams per repetition, indexer
    objective fp32 [2] summed over the segment's indexer layers (None without index_loss), taps (the
    accumulator [B, S, n_taps, d] with this segment's target layers filled in; None without taps))."""
    split = [slot_params(sp) for sp in seg_params]
    parts = [_split_in_place(s[0], numerics, chunk.tokens.size) for s in split]
    per_layer = [p[0] for p in parts]
    experts = [s[1] for s in split]
    freqs = [inv_freq(config.rope_for(kind.attn), config.rope_head_dim) for kind in seg.pattern]

    def body(carry, xs):
        streams, st, sources, r, taps = carry
        p_slots, a_slots = xs
        st = list(st)
        outs = [] if record else None
        losses = [] if index_loss else None
        for j, kind in enumerate(seg.pattern):
            a = a_slots[j]
            # a tap reads the streams entering the layer after its Engram update, which block records first
            seen = outs if outs is not None else ([] if taps is not None and kind.engram else None)
            first_seen, entering = len(seen or ()), streams.X
            layer_params = _layer_params(p_slots[j], parts[j][1], parts[j][2], r)
            streams, st[j], sources = block(layer_params, experts[j], st[j], sources, r, a.get("row"),
                                            streams, a.get("engram"), chunk, config=config, numerics=numerics,
                                            kind=kind, freqs=freqs[j], record=seen, layout=layout, losses=losses)
            if taps is not None:
                taps = _take_tap(taps, a["tap"], seen[first_seen] if kind.engram else entering)
        loss = sum(losses, jnp.zeros(2, jnp.float32)) if index_loss else None
        return (streams, st, sources, r + 1, taps), (outs, loss)

    init = (streams, list(seg_state), sources, jnp.int32(0), taps)
    (streams, seg_state, sources, _, taps), (ys, loss) = jax.lax.scan(body, init, (per_layer, aux))
    return streams, seg_state, sources, ys, (jnp.sum(loss, axis=0) if index_loss else None), taps


def model_step(params: dict, state: dict, tokens: jax.Array, positions: jax.Array, engram: tuple | None = None,
               embeds: jax.Array | None = None, *, config: ModelConfig, plan: LayerPlan,
               numerics: Numerics = Numerics(), all_logits: bool = False, streams: bool = False, layout=None,
               training: bool = False, hidden: bool = False, taps: bool = False):
    """One chunk through the model.

    tokens int32 [B, S]; positions int32 [B, S] (absolute, consecutive per row, -1 = padding after the
    real tokens). engram (models with Engram layers): the host-gathered table rows of this chunk, codes
    uint8 [n_engram, B, S, R, hd] and scales uint8 [n_engram, B, S, R, hd/32] (io/engram_tables.py).
    Returns a StepOutput: logits fp32 [B, S, V] if all_logits, else [B, V] at each row's last real token
    (rows without real tokens get meaningless logits), the new state, and the outputs the flags below ask for. embeds: the chunk's token embeddings [B, S, d]
    gathered on the host (host-resident embedding; params then need no "embed"). With `streams` (layer-by-layer
    checks) `streams` holds the residual streams after every block, block_out [n_layers, B, S, n, d], and
    right after every Engram update, engram_out [n_engram, B, S, n, d] (absent without Engram layers).
    layout (sharding.Layout): the model runs on a device mesh: the MoE is expert-parallel and the new state
    and the logits are constrained to the layout's shardings (state by sequence slot, logits replicated).
    training: `training` holds what training needs besides the logits (tools/quality/train.py): "hidden", the final
    streams X [B, S, n, d] (the MTP blocks' input), and "index_kl" fp32 [2], the indexer objective summed over
    the V4 indexer layers and its number of terms (layers/index_loss.py).
    hidden: `hidden` is the final streams X [B, S, n, d] (what the MTP drafter reads while decoding).
    taps (V4.1 with DSpark): `taps` is main_hidden [B, S, n_taps*d] in the activation dtype, what the DSpark
    drafter reads (model/dspark.py): per target layer (config.dspark.target_layer_ids, in layer order as DeepSeek
    collects them) the mean over the n streams entering it (after its Engram update), concatenated; gathered
    inside the scans.
    """
    require_engram(plan, engram)
    chunk = make_chunk(tokens, positions, config.vocab_size)
    s = embed_streams(params.get("embed"), chunk.tokens, embeds, config=config, plan=plan)
    tap_layers = dspark_tap_layers(config) if taps else ()
    tapped = jnp.zeros(tokens.shape + (len(tap_layers), config.dim), s.X.dtype) if taps else None
    sources = state["sources"]
    segments = []
    block_out: list = [None] * config.n_layers
    engram_out: list = []
    for i, seg in enumerate(plan.segments):
        aux = segment_inputs(seg, config, engram, tap_layers)
        s, seg_state, sources, ys, seg_loss, tapped = _run_segment(
            seg, params["segments"][i], state["segments"][i], sources, s, aux, chunk, config, numerics, streams,
            layout, training, tapped)
        if training:
            index_kl = seg_loss if i == 0 else index_kl + seg_loss
        segments.append(seg_state)
        if streams:
            k = 0
            for j, kind in enumerate(seg.pattern):
                if kind.engram:
                    engram_out += [(seg.layer(r, j), ys[k][r]) for r in range(seg.reps)]
                    k += 1
                for r in range(seg.reps):
                    block_out[seg.layer(r, j)] = ys[k][r]
                k += 1
    new_state = {"segments": segments, "sources": sources}
    logits = head_logits({k: params[k] for k in head_keys(plan)}, s, positions, config=config, plan=plan,
                         all_logits=all_logits)
    if layout is not None:
        new_state = layout.constrain_state(new_state)
        logits = layout.constrain_logits(logits)
    recorded = None
    if streams:
        recorded = {"block_out": jnp.stack(block_out)}
        if engram_out:
            recorded["engram_out"] = jnp.stack([x for _, x in sorted(engram_out, key=lambda t: t[0])])
    return StepOutput(logits, new_state, recorded, {"hidden": s.X, "index_kl": index_kl} if training else None,
                      s.X if hidden else None, tapped.reshape(tapped.shape[:2] + (-1,)) if taps else None)
