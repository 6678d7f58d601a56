"""The DeepSeek-V4 forward step and the loaded-model handle.

`model_step(params, state, tokens, positions)` runs one chunk of S tokens for B sequences through the
whole stack and returns logits plus the updated state: prefill is a chunk of S > 1 (any number of
chunks in a row), decode is S = 1. Each plan segment runs as one `lax.scan` over its repetitions, with
the state passed as whole stacked arrays and the repetition index as a traced scalar, so the compiled
program holds one body per segment whatever the depth and caches are updated in place (donated).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..layers.block import block, block_v41
from ..layers.chunk import make_chunk
from ..layers.mhc import hc_collapse, hc_head_collapse
from ..layers.norm import rms_norm
from ..layers.rope import inv_freq
from ..layers.shared_attention import empty_published
from ..numerics import Numerics
from ..arenas import Packed, is_packed, split_experts
from ..plan import LayerPlan, Segment
from ..state import empty_state, init_state, source_index

__all__ = ["Model", "model_step", "DTYPES"]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
def _split_experts(slot_params: dict) -> tuple[Any, dict]:
    """(per-layer params, routed experts) of a slot; per-layer params may be a packing.Packed arena."""
    if "arena" in slot_params:
        return slot_params["arena"], slot_params["experts"]
    return split_experts(slot_params)


def _unpacked(p: Any) -> dict:
    return p.unpack() if isinstance(p, Packed) else p


def _run_segment(seg: Segment, seg_params: list, seg_state: list, X: jax.Array, chunk, config: ModelConfig,
                 numerics: Numerics, layout=None):
    split = [_split_experts(sp) for sp in seg_params]
    per_layer = [s[0] for s in split]
    experts = [s[1] for s in split]
    freqs = [inv_freq(config.rope_for(kind.attn), config.rope_head_dim) for kind in seg.pattern]

    def body(carry, p_slots):
        X, st, r = carry
        st = list(st)
        for j, kind in enumerate(seg.pattern):
            X, st[j] = block(_unpacked(p_slots[j]), experts[j], st[j], r, X, chunk, config=config, numerics=numerics,
                             kind=kind, freqs=freqs[j], layout=layout)
        return (X, st, r + 1), None

    (X, seg_state, _), _ = jax.lax.scan(body, (X, list(seg_state), jnp.int32(0)), per_layer)
    return X, seg_state


def _segment_aux(seg: Segment, config: ModelConfig, engram: tuple | None) -> list[dict]:
    """Per-slot scanned inputs of a V4.1 segment: each repetition's shared-cache row and Engram rows."""
    aux = []
    for j, kind in enumerate(seg.pattern):
        layers = [seg.layer(r, j) for r in range(seg.reps)]
        a = {"row": jnp.asarray([source_index(config, li)[1] if kind.attn.ratio else 0 for li in layers], jnp.int32)}
        if kind.engram:
            order = np.asarray([config.engram.layer_ids.index(li) for li in layers])
            a["engram"] = (engram[0][order], engram[1][order])
        aux.append(a)
    return aux


def _run_segment_v41(seg: Segment, seg_params: list, seg_state: list, sources: dict, X, pre, published, aux,
                     chunk, config: ModelConfig, numerics: Numerics, streams: bool = False, layout=None):
    split = [_split_experts(sp) for sp in seg_params]
    per_layer = [s[0] for s in split]
    experts = [s[1] for s in split]
    freqs = [inv_freq(config.rope_for(kind.attn), config.rope_head_dim) for kind in seg.pattern]

    def body(carry, xs):
        X, pre, published, st, sources, r = carry
        p_slots, a_slots = xs
        st = [dict(d) for d in st]
        outs = []
        for j, kind in enumerate(seg.pattern):
            a = a_slots[j]
            X, pre, st[j]["window"], sources, published = block_v41(
                _unpacked(p_slots[j]), experts[j], st[j]["window"], r, sources, a["row"], X, pre, published, a.get("engram"),
                chunk, config=config, numerics=numerics, kind=kind, freqs=freqs[j], record=outs if streams else None,
                layout=layout)
        return (X, pre, published, st, sources, r + 1), (outs if streams else None)

    init = (X, pre, published, list(seg_state), sources, jnp.int32(0))
    (X, pre, published, seg_state, sources, _), ys = jax.lax.scan(body, init, (per_layer, aux))
    return X, pre, published, seg_state, sources, ys


def _layers_v41(params: dict, state: dict, X: jax.Array, chunk, engram: tuple | None, config: ModelConfig,
                plan: LayerPlan, numerics: Numerics, streams: bool = False, layout=None):
    """The V4.1 stack: carries the delayed pre-mix and the published top-k / candidates across layers."""
    if config.engram is not None and engram is None:
        raise ValueError("this model has Engram layers: model_step needs the host-gathered `engram` rows")
    B, S = chunk.tokens.shape
    n = config.hc_mult
    pre = jnp.broadcast_to(jnp.eye(n, dtype=jnp.float32)[0], (B, S, n))     # layer 0 collapses onto stream 0
    published = empty_published(config, B, S)
    sources = state["sources"]
    new_segments = []
    recorded = {"block_out": [None] * config.n_layers, "engram_out": []}
    for s, seg in enumerate(plan.segments):
        aux = _segment_aux(seg, config, engram)
        X, pre, published, seg_state, sources, ys = _run_segment_v41(
            seg, params["segments"][s], state["segments"][s], sources, X, pre, published, aux, chunk, config, numerics,
            streams, layout)
        new_segments.append(seg_state)
        if streams:
            k = 0
            for j, kind in enumerate(seg.pattern):
                if kind.engram:
                    recorded["engram_out"] += [(seg.layer(r, j), ys[k][r]) for r in range(seg.reps)]
                    k += 1
                for r in range(seg.reps):
                    recorded["block_out"][seg.layer(r, j)] = ys[k][r]
                k += 1
    new_state = {"segments": new_segments, "sources": sources}
    if streams:
        return X, pre, new_state, {"block_out": jnp.stack(recorded["block_out"]),
                                   "engram_out": jnp.stack([x for _, x in sorted(recorded["engram_out"],
                                                                                 key=lambda t: t[0])])}
    return X, pre, new_state


def model_step(params: dict, state: dict, tokens: jax.Array, positions: jax.Array, engram: tuple | None = None,
               embeds: jax.Array | None = None, *, config: ModelConfig, plan: LayerPlan,
               numerics: Numerics = Numerics(), all_logits: bool = False, streams: bool = False, layout=None):
    """One chunk through the model.

    tokens int32 [B, S]; positions int32 [B, S] (absolute, consecutive per row, -1 = padding after the
    real tokens). engram (models with Engram layers): the host-gathered table rows of this chunk, codes
    uint8 [n_engram, B, S, R, hd] and scales uint8 [n_engram, B, S, R, hd/32] (jdeep/engram.py).
    Returns (logits, state): fp32 [B, S, V] if all_logits, else [B, V] at each row's last real token
    (rows without real tokens get meaningless logits). embeds: the chunk's token embeddings [B, S, d]
    gathered on the host (host-resident embedding; params then need no "embed"). With `streams` (V4.1, for layer-by-layer checks)
    a third output holds the residual streams after every block, block_out [n_layers, B, S, n, d], and
    right after every Engram update, engram_out [n_engram, B, S, n, d].
    layout (sharding.Layout): the model runs on a device mesh: the MoE is expert-parallel and the new state
    and the logits are constrained to the layout's shardings (state by sequence slot, logits replicated).
    """
    chunk = make_chunk(tokens, positions, config.vocab_size)
    if embeds is None:
        if "embed" not in params:
            raise ValueError("this model keeps its token embedding on the host: pass embeds")
        embeds = params["embed"][chunk.tokens]                          # [B, S, d]
    x = embeds
    X = jnp.broadcast_to(x[:, :, None, :], x.shape[:2] + (config.hc_mult, x.shape[-1]))
    last = jnp.clip(chunk.n_valid - 1, 0, X.shape[1] - 1)
    recorded = None
    if config.is_v41:
        out = _layers_v41(params, state, X, chunk, engram, config, plan, numerics, streams, layout)
        X, pre, new_state = out[:3]
        recorded = out[3] if streams else None
        if not all_logits:
            X = jnp.take_along_axis(X, last[:, None, None, None], axis=1)[:, 0]
            pre = jnp.take_along_axis(pre, last[:, None, None], axis=1)[:, 0]
        h = hc_collapse(X, pre)
    else:
        segments = []
        for s, seg in enumerate(plan.segments):
            X, seg_state = _run_segment(seg, params["segments"][s], state["segments"][s], X, chunk, config, numerics,
                                        layout)
            segments.append(seg_state)
        new_state = {"segments": segments, "sources": state["sources"]}
        if not all_logits:
            X = jnp.take_along_axis(X, last[:, None, None, None], axis=1)[:, 0]
        h = hc_head_collapse(X, params["hc_head_fn"], params["hc_head_base"], params["hc_head_scale"],
                             norm_eps=config.norm_eps, hc_eps=config.hc_eps)
    h = rms_norm(h, params["norm"], config.norm_eps)
    logits = _head(h, params["head"])
    if layout is not None:
        new_state = layout.constrain_state(new_state)
        logits = layout.constrain_replicated(logits)
    if streams:
        if recorded is None:
            raise ValueError("streams=True is implemented for DeepSeek-V4.1 models")
        return logits, new_state, recorded
    return logits, new_state


def _head(h: jax.Array, head: jax.Array) -> jax.Array:
    """Logits fp32 [..., V] = h [..., d] · head [d, V] (input-major, see param_spec), operands in fp32."""
    return jax.lax.dot_general(h.astype(jnp.float32), head.astype(jnp.float32), (((h.ndim - 1,), (0,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST)


@functools.lru_cache(maxsize=None)
def compiled_step(config: ModelConfig, plan: LayerPlan, numerics: Numerics, all_logits: bool, layout=None) -> Callable:
    """One jitted step per (architecture, numerics, logits mode, layout), shared by every Model that has them."""
    fn = functools.partial(model_step, config=config, plan=plan, numerics=numerics, all_logits=all_logits,
                           layout=layout)
    return jax.jit(fn, donate_argnums=(1,))


@functools.lru_cache(maxsize=None)
def compiled_rows_step(config: ModelConfig, plan: LayerPlan, numerics: Numerics, all_logits: bool, rows: int,
                       layout=None) -> Callable:
    """A step over the first `rows` sequence slots of a larger state (a batch-size bucket): those rows of
    every state leaf ([R, B, ...]) are sliced out, stepped and written back in place (state donated); the
    other slots are neither read nor changed. Tokens, positions and logits have `rows` rows."""
    fn = functools.partial(model_step, config=config, plan=plan, numerics=numerics, all_logits=all_logits,
                           layout=layout)

    def step(params, state, tokens, positions, engram=None, embeds=None):
        sub = jax.tree_util.tree_map(lambda a: a[:, :rows], state)
        logits, sub = fn(params, sub, tokens, positions, engram, embeds)
        state = jax.tree_util.tree_map(lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b, 0, axis=1), state, sub)
        return logits, (state if layout is None else layout.constrain_state(state))

    return jax.jit(step, donate_argnums=(1,))


class HostEmbedStep:
    """A step whose token embedding is gathered on the host: `step(params, state, tokens, positions,
    engram=None)` looks tokens up in `table` (numpy [V, d]) and passes the rows to the device step as
    `embeds`, so the device holds no embedding table. Tokens are fetched to the host (a sync per step)."""

    def __init__(self, step: Callable, table: np.ndarray):
        self.step, self.table = step, table

    def embeds(self, tokens) -> jax.Array:
        ids = np.clip(np.asarray(tokens), 0, self.table.shape[0] - 1)
        return jnp.asarray(self.table[ids])

    def __call__(self, params, state, tokens, positions, engram=None):
        return self.step(params, state, tokens, positions, engram, self.embeds(tokens))


@dataclass
class Model:
    """A loaded model: config, layer plan, device params and the compiled step functions.

    compile_mode: "scan" (one program per step, layers under lax.scan) or "regions" (a host loop over
    layers calling per-kind programs, regions.py). host_embed: the token embedding table kept on the host
    (numpy [V, d]; params then hold no "embed"). sampler_device: a jax.Device the sampler runs on instead of
    the model's (on Neuron the host CPU: the plugin's threefry RNG is incomplete, graphcheck S18); logits go
    there and the sampled tokens come back through the host."""

    config: ModelConfig
    plan: LayerPlan
    params: dict
    dtype: Any
    numerics: Numerics = Numerics()
    engram: Any = None   # jdeep.engram.EngramHost for models with Engram layers
    tokenizer: Any = None  # jdeep.serve.Tokenizer when the checkpoint folder has a tokenizer.json
    compile_mode: str = "scan"
    host_embed: Any = None
    sampler_device: Any = None   # where sampling runs (None: with the model; on Neuron the CPU backend)
    layout: Any = None           # jdeep.sharding.Layout of a model sharded over a device mesh

    def __post_init__(self):
        from ..platforms import COMPILE_MODES

        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {', '.join(COMPILE_MODES)}, got {self.compile_mode!r}")
        if self.compile_mode == "regions" and is_packed(self.params):
            raise ValueError("packed parameters (pack_params) run only in the scan compile mode")
        if self.layout is not None and (self.host_embed is not None or self.sampler_device is not None):
            raise ValueError("a model on a device mesh keeps the embedding and the sampler on the mesh (host "
                             "embedding and a host sampler are single-device)")

    @property
    def host_loop(self) -> bool:
        """Whether decode steps must be driven from the host (regions mode or host-resident embedding)."""
        return self.compile_mode == "regions" or self.host_embed is not None or self.sampler_device is not None

    def to_sampler(self, tree: Any) -> Any:
        """Arrays moved to the sampler's device (unchanged when sampling runs with the model; replicated over
        the mesh for a sharded model)."""
        if self.layout is not None:
            return self.layout.put_tree(tree)
        return tree if self.sampler_device is None else jax.device_put(tree, self.sampler_device)

    def put(self, x: Any) -> jax.Array:
        """A host array as a step input: on the default device, or replicated over the mesh (every process of a
        multi-process run passes the same value)."""
        return jnp.asarray(x) if self.layout is None else self.layout.put(x)

    def fetch(self, x: jax.Array) -> np.ndarray:
        """A device array on the host, also when it spans the devices of several processes."""
        if getattr(x, "is_fully_addressable", True):
            return np.asarray(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    def step_fn(self, all_logits: bool, rows: int | None = None) -> Callable:
        """`step(params, state, tokens, positions, engram=None) -> (logits, state)`, state donated. With `rows`,
        the step runs only the state's first `rows` sequence slots. In the scan mode without host embedding
        this is a jax.jit (it has .lower); otherwise a host-side callable."""
        if self.compile_mode == "regions":
            from .regions import regions_step

            fn = regions_step(self.config, self.plan, self.numerics, all_logits, rows, self.layout)
        elif rows is None:
            fn = compiled_step(self.config, self.plan, self.numerics, all_logits, self.layout)
        else:
            fn = compiled_rows_step(self.config, self.plan, self.numerics, all_logits, rows, self.layout)
        return fn if self.host_embed is None else HostEmbedStep(fn, self.host_embed)

    def new_history(self, batch: int) -> Any:
        """Host-side per-sequence Engram histories (None for models without Engram)."""
        return None if self.engram is None else self.engram.history(batch)

    def engram_inputs(self, history: Any, tokens: np.ndarray, positions: np.ndarray) -> tuple | None:
        """The `engram` argument of a step over tokens / positions int [B, S] (positions -1 = padding after
        the real tokens): the table rows gathered on the host; advances `history`. None without Engram.
        Image tokens (config.image_token_id) are dead for Engram: they block the n-gram look-back."""
        if self.engram is None:
            return None
        tokens = np.asarray(tokens)
        dead = None if self.config.image_token_id is None else tokens == self.config.image_token_id
        codes, scales = self.engram.rows(history, tokens, np.sum(np.asarray(positions) >= 0, axis=1), dead)
        return self.put(codes), self.put(scales)

    def init_state(self, batch: int, max_len: int) -> list:
        """Empty decode state for `batch` sequences of up to `max_len` tokens (see state.py); on a mesh, created
        sharded over `data` by sequence slot."""
        if self.layout is None:
            return init_state(self.config, self.plan, batch, max_len, self.dtype, self.numerics)
        return _sharded_init_state(self.config, self.plan, batch, max_len, self.dtype, self.numerics, self.layout)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size


@functools.lru_cache(maxsize=None)
def _sharded_init_program(config: ModelConfig, plan: LayerPlan, batch: int, max_len: int, dtype: Any,
                          numerics: Numerics, layout) -> Callable:
    def make():
        return empty_state(config, plan, batch, max_len, dtype, numerics)

    return jax.jit(make, out_shardings=layout.state_shardings(jax.eval_shape(make)))


def _sharded_init_state(config, plan, batch, max_len, dtype, numerics, layout) -> dict:
    """The empty state created directly in its shards (no full copy on one device)."""
    return _sharded_init_program(config, plan, batch, max_len, dtype, numerics, layout)()


def as_jax_dtype(dtype: Any) -> Any:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    return jnp.dtype(dtype).type
