"""The `regions` compile mode: a host loop over the layers calling a few small compiled programs.

In the `scan` mode (model.py) one program holds the whole step, the layers under `lax.scan`. neuronx-cc
unrolls while loops, so there a scan over 43-61 layers costs compile time and program size proportional
to depth. In the `regions` mode each step is a sequence of calls:

    embed                      tokens -> residual streams (V4.1: also the first pre-mix and empty top-k)
    attn.<kind>.r<R>           per layer: the mHC-wrapped attention half of one layer kind
    ffn.<hash|topk>.r<R>       per layer: the mHC-wrapped MoE half
    head                       streams -> logits

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

from ..config import ModelConfig
from ..layers.block import attention_half, ffn_half, v41_attention_half, v41_ffn_half
from ..layers.chunk import make_chunk
from ..layers.mhc import hc_collapse, hc_head_collapse
from ..layers.norm import rms_norm
from ..layers.rope import inv_freq
from ..layers.shared_attention import empty_published
from ..numerics import Numerics
from ..arenas import split_experts
from ..plan import LayerKind, LayerPlan
from ..state import source_index

__all__ = ["RegionsStep", "regions_step", "ATTN_KEYS"]

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
    """fn(state, *rest) -> (out, state) run on the state's first `rows` sequence slots ([R, B, ...] leaves),
    written back in place; the other slots are neither read nor changed."""
    if rows is None:
        return fn

    def wrapped(state, *rest):
        sub = jax.tree_util.tree_map(lambda a: a[:, :rows], state)
        out, sub = fn(sub, *rest)
        return out, jax.tree_util.tree_map(lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b, 0, axis=1),
                                           state, sub)

    return wrapped


def _embed(embed, tokens, embeds, *, config: ModelConfig):
    """Residual streams [B, S, n, d] from the table (or from host-gathered `embeds` [B, S, d])."""
    if embeds is None:
        embeds = embed[jnp.clip(tokens, 0, config.vocab_size - 1)]
    X = jnp.broadcast_to(embeds[:, :, None, :], embeds.shape[:2] + (config.hc_mult, embeds.shape[-1]))
    if not config.is_v41:
        return X
    B, S = tokens.shape
    pre = jnp.broadcast_to(jnp.eye(config.hc_mult, dtype=jnp.float32)[0], (B, S, config.hc_mult))
    return X, pre, empty_published(config, B, S)


def _last(X: jax.Array, positions: jax.Array) -> jax.Array:
    """X [B, S, ...] at each row's last real token -> [B, ...]."""
    n_valid = jnp.sum(positions >= 0, axis=1)
    last = jnp.clip(n_valid - 1, 0, X.shape[1] - 1)
    return jnp.take_along_axis(X, last.reshape((-1,) + (1,) * (X.ndim - 1)), axis=1)[:, 0]


def _head(p, X, positions, pre=None, *, config: ModelConfig, all_logits: bool):
    from .model import _head as head_matmul

    if not all_logits:
        X = _last(X, positions)
        pre = None if pre is None else _last(pre, positions)
    if config.is_v41:
        h = hc_collapse(X, pre)
    else:
        h = hc_head_collapse(X, p["hc_head_fn"], p["hc_head_base"], p["hc_head_scale"], norm_eps=config.norm_eps,
                             hc_eps=config.hc_eps)
    return head_matmul(rms_norm(h, p["norm"], config.norm_eps), p["head"])


def _v4_attn(st, p, layer, X, tokens, positions, *, config, numerics, kind, freqs, layout=None):
    layer = _clamp(layer, _reps(st))
    chunk = make_chunk(tokens, positions, config.vocab_size)
    X, st = attention_half(_layer_view(p, layer), st, layer, X, chunk, config=config, numerics=numerics, kind=kind,
                           freqs=freqs)
    return X, _constrain_state(st, layout)


def _constrain_state(state, layout):
    """On a mesh the updated state keeps its input layout (so the donated buffers are reused in place)."""
    return state if layout is None else layout.constrain_state(state)


def _v4_ffn(p, experts, layer, X, tokens, positions, *, config, numerics, hash_moe, layout=None):
    layer = _clamp(layer, _reps(experts))
    chunk = make_chunk(tokens, positions, config.vocab_size)
    return ffn_half(_layer_view(p, layer), experts, layer, X, chunk, config=config, numerics=numerics,
                    hash_moe=hash_moe, layout=layout)


def _v41_attn(state, p, layer, row, X, pre, published, engram, engram_index, tokens, positions, *, config, numerics,
              kind, freqs, layout=None):
    window, sources = state
    layer = _clamp(layer, window.shape[0])
    if kind.attn.ratio:
        row = _clamp(row, sources[f"r{kind.attn.ratio}"]["ckv"].shape[0])
    chunk = make_chunk(tokens, positions, config.vocab_size)
    rows = None
    if kind.engram:
        engram_index = _clamp(engram_index, engram[0].shape[0])
        rows = tuple(jax.lax.dynamic_index_in_dim(a, engram_index, keepdims=False) for a in engram)
    X, pre_a, window, sources, published = v41_attention_half(
        _layer_view(p, layer), window, layer, sources, row, X, pre, published, rows, chunk, config=config,
        numerics=numerics, kind=kind, freqs=freqs)
    return (X, pre_a, published), _constrain_state((window, sources), layout)


def _v41_ffn(p, experts, layer, X, pre_a, tokens, positions, *, config, numerics, layout=None):
    layer = _clamp(layer, _reps(experts))
    chunk = make_chunk(tokens, positions, config.vocab_size)
    return v41_ffn_half(_layer_view(p, layer), experts, layer, X, pre_a, chunk, config=config, numerics=numerics,
                        layout=layout)


_PROGRAMS: dict[tuple, Callable] = {}


def _program(name: str, config: ModelConfig, numerics: Numerics, rows: int | None, kind: LayerKind | None = None,
             hash_moe: bool = False, all_logits: bool = False, layout=None) -> Callable:
    """One jitted region program, shared by every model and step with the same architecture, bucket and layout."""
    key = (name, config, numerics, rows, kind, hash_moe, all_logits, layout)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = _make_program(name, config, numerics, rows, kind, hash_moe, all_logits, layout)
    return _PROGRAMS[key]


def _make_program(name, config, numerics, rows, kind, hash_moe, all_logits, layout) -> Callable:
    if name == "embed":
        return jax.jit(functools.partial(_embed, config=config))
    if name == "head":
        head = functools.partial(_head, config=config, all_logits=all_logits)
        if layout is not None:      # logits replicated, as in the scan mode
            return jax.jit(lambda *a: layout.constrain_replicated(head(*a)))
        return jax.jit(head)
    if name == "attn":      # state first (donated), returned as (out, state)
        freqs = inv_freq(config.rope_for(kind.attn), config.rope_head_dim)
        body = _v41_attn if config.is_v41 else _v4_attn
        fn = _rows(rows, functools.partial(body, config=config, numerics=numerics, kind=kind, freqs=freqs,
                                           layout=layout))
        if layout is not None and rows is not None:      # the whole state written back keeps its layout too
            inner = fn

            def fn(state, *rest):
                out, state = inner(state, *rest)
                return out, _constrain_state(state, layout)
        return jax.jit(fn, donate_argnums=(0,))
    if name == "ffn":
        if config.is_v41:
            return jax.jit(functools.partial(_v41_ffn, config=config, numerics=numerics, layout=layout))
        return jax.jit(functools.partial(_v4_ffn, config=config, numerics=numerics, hash_moe=hash_moe, layout=layout))
    raise ValueError(f"unknown region program {name!r}")


def n_compiled(config: ModelConfig, numerics: Numerics) -> int:
    """Compiled programs (all kinds and buckets) of the regions mode for this architecture and numerics."""
    return sum(fn._cache_size() for key, fn in _PROGRAMS.items() if key[1] == config and key[2] == numerics)


class RegionsStep:
    """`step(params, state, tokens, positions, engram=None, embeds=None) -> (logits, state)` in the regions
    mode, for one (architecture, numerics, logits mode, rows bucket). state is donated (consumed).

    embeds: host-gathered token embeddings [B, S, d] (host-resident embedding; params then need no
    "embed"). `programs(...)` lists the distinct compiled programs one step calls (for export and checks).
    """

    def __init__(self, config: ModelConfig, plan: LayerPlan, numerics: Numerics, all_logits: bool,
                 rows: int | None = None, layout=None):
        self.config, self.plan, self.numerics, self.all_logits, self.rows = config, plan, numerics, all_logits, rows
        self.layout = layout
        self._index = {}

    def _scalar(self, i: int) -> jax.Array:
        if i not in self._index:
            self._index[i] = jax.device_put(np.int32(i)) if self.layout is None else self.layout.put(np.int32(i))
        return self._index[i]

    def _fn(self, name: str, **kw) -> Callable:
        return _program(name, self.config, self.numerics, self.rows if name == "attn" else None, layout=self.layout,
                        **kw)

    def __call__(self, params, state, tokens, positions, engram=None, embeds=None):
        return self._run(params, state, tokens, positions, engram, embeds, lambda name, fn, *a: fn(*a))

    def programs(self, params, state, tokens, positions, engram=None, embeds=None) -> list[tuple[str, Callable, tuple]]:
        """[(name, jitted program, args)] of the distinct programs one step calls, args as abstract values
        (inputs may be arrays or jax.ShapeDtypeStruct)."""
        found: dict[str, tuple[str, Callable, tuple]] = {}

        def record(name, fn, *args):
            found.setdefault(name, (name, fn, args))
            return jax.eval_shape(fn, *args)

        spec = functools.partial(jax.tree_util.tree_map, lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype))
        self._run(spec(params), spec(state), spec(tokens), spec(positions), spec(engram), spec(embeds), record)
        return list(found.values())

    def n_programs(self) -> int:
        """Compiled programs held by this step's region functions (all buckets)."""
        return n_compiled(self.config, self.numerics)

    def _run(self, params, state, tokens, positions, engram, embeds, call):
        config = self.config
        if embeds is None and "embed" not in params:
            raise ValueError("this model keeps its token embedding on the host: pass embeds")
        out = call("embed", self._fn("embed"), params.get("embed"), tokens, embeds)
        if config.is_v41:
            if config.engram is not None and engram is None:
                raise ValueError("this model has Engram layers: the step needs the host-gathered `engram` rows")
            X, pre, published = out
            sources = state["sources"]
        else:
            X = out
        segments = [list(seg) for seg in state["segments"]]
        for s, seg in enumerate(self.plan.segments):
            slots = params["segments"][s]
            split = [(_attn_params(sp),) + _ffn_params(sp) for sp in slots]
            for r in range(seg.reps):
                layer = self._scalar(r)
                for j, kind in enumerate(seg.pattern):
                    pa, pf, experts = split[j]
                    tag = f"{kind.name}.r{seg.reps}"
                    if config.is_v41:
                        li = seg.layer(r, j)
                        row = self._scalar(source_index(config, li)[1] if kind.attn.ratio else 0)
                        k = self._scalar(config.engram.layer_ids.index(li) if kind.engram else 0)
                        (X, pre_a, published), (window, sources) = call(
                            f"attn.{tag}", self._fn("attn", kind=kind), (segments[s][j]["window"], sources), pa,
                            layer, row, X, pre, published, engram if kind.engram else None, k, tokens, positions)
                        segments[s][j] = {**segments[s][j], "window": window}
                        X, pre = call(f"ffn.r{seg.reps}", self._fn("ffn"), pf, experts, layer, X, pre_a, tokens,
                                      positions)
                    else:
                        X, segments[s][j] = call(f"attn.{tag}", self._fn("attn", kind=kind), segments[s][j], pa,
                                                 layer, X, tokens, positions)
                        moe = "hash" if kind.hash_moe else "topk"
                        X = call(f"ffn.{moe}.r{seg.reps}", self._fn("ffn", hash_moe=kind.hash_moe), pf, experts,
                                 layer, X, tokens, positions)
        head_keys = ("norm", "head") if config.is_v41 else ("norm", "head", "hc_head_fn", "hc_head_base",
                                                            "hc_head_scale")
        head_p = {k: params[k] for k in head_keys}
        logits = call("head", self._fn("head", all_logits=self.all_logits), head_p, X, positions,
                      pre if config.is_v41 else None)
        new_state = {"segments": segments, "sources": sources if config.is_v41 else state["sources"]}
        return logits, new_state


@functools.lru_cache(maxsize=None)
def regions_step(config: ModelConfig, plan: LayerPlan, numerics: Numerics, all_logits: bool,
                 rows: int | None = None, layout=None) -> RegionsStep:
    return RegionsStep(config, plan, numerics, all_logits, rows, layout)


