"""The `regions` compile mode: a host loop over the layers calling a few small compiled programs.

In the `scan` mode (scan.py) one program holds the whole step, the layers under `lax.scan`. neuronx-cc
unrolls while loops, so there a scan over 43-61 layers costs compile time and program size proportional
to depth. In the `regions` mode each step is a sequence of calls:

    embed                      tokens -> residual streams (V4.1: also the first pre-mix and empty top-k)
    attn.<kind>.r<R>           per layer: the mHC-wrapped attention half of one layer kind
    ffn.<hash|topk>.r<R>       per layer: the mHC-wrapped MoE half
    head                       streams -> logits

The prologue and epilogue (layers/head.py) and the halves (layers/block.py) are the scan mode's own.

Every layer of one kind (in segments of one repetition count R) calls the same compiled program with
the kind's stacked parameters, its stacked state and the layer's index as a traced int32 scalar; the
layer's parameter and state views are sliced inside the program, and the state (root arrays, [R, B, ...])
is donated and updated in place. The number of compiled programs therefore depends on the layer kinds
and buckets, never on the depth. Results equal the scan mode's (same functions, same order of ops).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..arenas import split_experts
from ..config import ModelConfig
from ..layers.block import attention_half, ffn_half
from ..layers.chunk import make_chunk
from ..layers.head import embed_streams, head_keys, head_logits, require_engram
from ..layers.rope import inv_freq
from ..numerics import Numerics
from ..plan import LayerKind, LayerPlan, dspark_tap_layers
from ..state import put_slot_window, slot_window, source_index
from .cache import PROGRAMS, ProgramCache

__all__ = ["RegionsStep", "regions_step", "n_compiled", "ATTN_KEYS"]

ATTN_KEYS = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "attn_norm", "attn", "engram")


def _attn_params(slot: dict) -> dict:
    return {k: v for k, v in slot.items() if k in ATTN_KEYS}


def _ffn_params(slot: dict) -> tuple[dict, dict]:
    """(this slot's non-expert FFN parameters, its routed experts)."""
    return split_experts({k: v for k, v in slot.items() if k not in ATTN_KEYS})


def _clamp(i: jax.Array, n: int) -> jax.Array:
    """A layer/row index from the host, clamped into [0, n) in the graph (graphcheck S12)."""
    return jnp.clip(i, 0, n - 1)


def _reps(tree) -> int:
    return jax.tree_util.tree_leaves(tree)[0].shape[0]


def _layer_view(stacked: dict, layer: jax.Array) -> dict:
    """One layer's parameters out of a kind's stacked ones ([R, ...] -> [...])."""
    return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False), stacked)


def _rows(rows: int | None, fn: Callable) -> Callable:
    """fn(state, *rest) -> (out, state) run on a window of `rows` sequence slots of the state ([R, B, ...] leaves),
    written back in place; the other slots are neither read nor changed. The wrapped program takes the window's
    first slot as its last argument (a traced int32 scalar, or None for the first `rows` slots)."""
    if rows is None:
        return fn

    def wrapped(state, *rest):
        *rest, start = rest
        out, sub = fn(slot_window(state, rows, start), *rest)
        return out, put_slot_window(state, sub, start)

    return wrapped


def _constrain_state(state, layout):
    """On a mesh the updated state keeps its input layout (so the donated buffers are reused in place)."""
    return state if layout is None else layout.constrain_state(state)


def _attention(state, p, layer, row, streams, engram, engram_index, tokens, positions, *, config, numerics, kind,
               freqs, layout=None, tap=False):
    """The attention half of one layer of `kind`: state = (this kind's stacked slot state, the shared caches).
    tap: the output is (streams, the DSpark tap [B, S, d]: the mean over the streams entering the layer after its
    Engram update, as model_step(taps=True) takes it)."""
    st, sources = state
    layer = _clamp(layer, _reps(st))
    if row is not None:
        row = _clamp(row, sources[f"r{kind.attn.ratio}"]["ckv"].shape[0])
    rows = None
    if kind.engram:
        engram_index = _clamp(engram_index, engram[0].shape[0])
        rows = tuple(jax.lax.dynamic_index_in_dim(a, engram_index, keepdims=False) for a in engram)
    chunk = make_chunk(tokens, positions, config.vocab_size)
    seen = [] if tap and kind.engram else None
    entering = streams.X
    streams, st, sources = attention_half(_layer_view(p, layer), st, sources, layer, row, streams, rows, chunk,
                                          config=config, numerics=numerics, kind=kind, freqs=freqs, record=seen)
    if tap:
        X = seen[0] if kind.engram else entering
        streams = (streams, jnp.mean(X, axis=2).astype(X.dtype))
    return streams, _constrain_state((st, sources), layout)


def _ffn(p, experts, layer, streams, tokens, positions, *, config, numerics, hash_moe, delayed_premix, layout=None):
    layer = _clamp(layer, _reps(experts))
    chunk = make_chunk(tokens, positions, config.vocab_size)
    return ffn_half(_layer_view(p, layer), experts, layer, streams, chunk, config=config, numerics=numerics,
                    hash_moe=hash_moe, delayed_premix=delayed_premix, layout=layout)


def _make_program(name, config, plan, numerics, rows, kind, hash_moe, all_logits, layout, hidden=False,
                  tap=False) -> Callable:
    if name == "embed":
        return jax.jit(lambda table, tokens, embeds: embed_streams(table, tokens, embeds, config=config, plan=plan))
    if name == "head":
        logits = functools.partial(head_logits, config=config, plan=plan, all_logits=all_logits)
        if layout is not None:      # logits replicated, as in the scan mode
            logits = lambda *a, _f=logits: layout.constrain_logits(_f(*a))
        if hidden:                  # also the final streams X [B, S, n, d] (what the MTP drafter reads)
            return jax.jit(lambda p, s, positions: (logits(p, s, positions), s.X))
        if tap:                     # also the DSpark taps, concatenated in layer order: [B, S, n_taps * d]
            return jax.jit(lambda p, s, positions, taps: (logits(p, s, positions), jnp.concatenate(taps, axis=-1)))
        return jax.jit(logits)
    if name == "attn":      # state first (donated), returned as (out, state)
        freqs = inv_freq(config.rope_for(kind.attn), config.rope_head_dim)
        fn = _rows(rows, functools.partial(_attention, config=config, numerics=numerics, kind=kind, freqs=freqs,
                                           layout=layout, tap=tap))
        if layout is not None and rows is not None:      # the whole state written back keeps its layout too
            inner = fn

            def fn(state, *rest):
                out, state = inner(state, *rest)
                return out, _constrain_state(state, layout)
        return jax.jit(fn, donate_argnums=(0,))
    if name == "ffn":
        return jax.jit(functools.partial(_ffn, config=config, numerics=numerics, hash_moe=hash_moe,
                                         delayed_premix=plan.delayed_premix, layout=layout))
    raise ValueError(f"unknown region program {name!r}")


def n_compiled(config: ModelConfig, numerics: Numerics, cache: ProgramCache = PROGRAMS) -> int:
    """Compiled programs (all kinds and buckets) of the regions mode for this architecture and numerics."""
    return sum(fn._cache_size() for key, fn in cache.items()
               if key[0] == "region" and key[2] == config and key[4] == numerics)


class RegionsStep:
    """`step(params, state, tokens, positions, engram=None, embeds=None) -> (logits, state)` in the regions
    mode, for one (architecture, numerics, logits mode, rows bucket). state is donated (consumed). With `hidden`
    the first output is (logits, the final streams X [B, S, n, d]), as model_step(hidden=True) returns them; with
    `taps` (V4.1 with DSpark) (logits, main_hidden [B, S, n_taps*d]), as model_step(taps=True): the target layers'
    attention programs have a variant that also returns the layer's tap.

    embeds: host-gathered token embeddings [B, S, d] (host-resident embedding; params then need no
    "embed"). `programs(...)` lists the distinct compiled programs one step calls (for export and checks).
    """

    def __init__(self, config: ModelConfig, plan: LayerPlan, numerics: Numerics, all_logits: bool,
                 rows: int | None = None, layout=None, cache: ProgramCache = PROGRAMS, hidden: bool = False,
                 taps: bool = False):
        if hidden and taps:
            raise ValueError("a regions step returns the final streams (hidden) or the DSpark taps, not both")
        self.config, self.plan, self.numerics, self.all_logits, self.rows = config, plan, numerics, all_logits, rows
        self.layout, self.cache, self.hidden = layout, cache, hidden
        self.tap_layers = dspark_tap_layers(config) if taps else ()
        self._index = {}

    def _scalar(self, i: int) -> jax.Array:
        if i not in self._index:
            self._index[i] = jax.device_put(np.int32(i)) if self.layout is None else self.layout.put(np.int32(i))
        return self._index[i]

    def _fn(self, name: str, kind: LayerKind | None = None, hash_moe: bool = False, tap: bool = False) -> Callable:
        """One jitted region program, shared by every model and step with the same architecture, bucket and layout.
        tap: the attention program's variant that also returns the layer's DSpark tap (the head's that takes them)."""
        rows = self.rows if name == "attn" else None
        all_logits = self.all_logits if name == "head" else False
        hidden = self.hidden and name == "head"
        key = ("region", name, self.config, self.plan, self.numerics, rows, kind, hash_moe, all_logits, self.layout) \
            + (("hidden",) if hidden else ()) + (("tap",) if tap else ())
        return self.cache.get(key, lambda: _make_program(name, self.config, self.plan, self.numerics, rows, kind,
                                                         hash_moe, all_logits, self.layout, hidden, tap))

    def __call__(self, params, state, tokens, positions, engram=None, embeds=None, start=None):
        """start: the first slot of the step's window of `rows` slots (an int32 scalar; None: slot 0)."""
        return self._run(params, state, tokens, positions, engram, embeds, lambda name, fn, *a: fn(*a), start)

    def programs(self, params, state, tokens, positions, engram=None, embeds=None, start=None
                 ) -> list[tuple[str, Callable, tuple]]:
        """[(name, jitted program, args)] of the distinct programs one step calls, args as abstract values
        (inputs may be arrays or jax.ShapeDtypeStruct; `start` as in __call__)."""
        found: dict[str, tuple[str, Callable, tuple]] = {}

        def record(name, fn, *args):
            found.setdefault(name, (name, fn, args))
            return jax.eval_shape(fn, *args)

        spec = functools.partial(jax.tree_util.tree_map, lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype))
        self._run(spec(params), spec(state), spec(tokens), spec(positions), spec(engram), spec(embeds), record,
                  spec(start))
        return list(found.values())

    def n_programs(self) -> int:
        """Compiled programs held by this step's region functions (all buckets)."""
        return n_compiled(self.config, self.numerics, self.cache)

    def _run(self, params, state, tokens, positions, engram, embeds, call, start=None):
        config, plan = self.config, self.plan
        window = () if self.rows is None else (start,)
        require_engram(plan, engram)
        s = call("embed", self._fn("embed"), params.get("embed"), tokens, embeds)
        taps = {}
        sources = state["sources"]
        segments = [list(seg) for seg in state["segments"]]
        for i, seg in enumerate(plan.segments):
            split = [(_attn_params(sp),) + _ffn_params(sp) for sp in params["segments"][i]]
            for r in range(seg.reps):
                layer = self._scalar(r)
                for j, kind in enumerate(seg.pattern):
                    pa, pf, experts = split[j]
                    tag = f"{kind.name}.r{seg.reps}"
                    li = seg.layer(r, j)
                    row = self._scalar(source_index(config, li)[1]) if kind.shared is not None else None
                    k = self._scalar(config.engram.layer_ids.index(li)) if kind.engram else None
                    tap = li in self.tap_layers
                    s, (segments[i][j], sources) = call(
                        f"attn.{tag}" + (".tap" if tap else ""), self._fn("attn", kind=kind, tap=tap),
                        (segments[i][j], sources), pa, layer, row, s, engram if kind.engram else None, k, tokens,
                        positions, *window)
                    if tap:
                        s, taps[li] = s
                    moe = "hash" if kind.hash_moe else "topk"
                    published = s.published        # the MoE half neither reads nor changes it
                    s = call(f"ffn.{moe}.r{seg.reps}", self._fn("ffn", hash_moe=kind.hash_moe), pf, experts, layer,
                             s._replace(published=None), tokens, positions)._replace(published=published)
        head = {k: params[k] for k in head_keys(plan)}
        if self.tap_layers:
            logits = call("head.taps", self._fn("head", tap=True), head, s._replace(published=None), positions,
                          tuple(taps[li] for li in self.tap_layers))
        else:
            logits = call("head", self._fn("head"), head, s._replace(published=None), positions)
        return logits, {"segments": segments, "sources": sources}


def regions_step(config: ModelConfig, plan: LayerPlan, numerics: Numerics, all_logits: bool,
                 rows: int | None = None, layout=None, cache: ProgramCache = PROGRAMS,
                 hidden: bool = False, taps: bool = False) -> RegionsStep:
    return cache.get(("regions_step", config, plan, numerics, all_logits, rows, layout, hidden, taps),
                     lambda: RegionsStep(config, plan, numerics, all_logits, rows, layout, cache, hidden, taps))
