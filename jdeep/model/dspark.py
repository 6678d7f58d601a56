"""DeepSeek-V4.1's DSpark drafter (model-spec.md §5.8), the model half: from the target's hidden states, a block of
`block_size` draft tokens after the target's newest token, with their logits and confidence logits.

    main_x  = main_norm(main_proj(main_hidden))        main_hidden: the target's taps (model_step(taps=True))
    window  : per stage, K=V of main_x (the stage's own wkv/kv_norm, RoPE at the target position, fp8 as §5.3)
    X       = embed([anchor, noise x (block-1)]) on every stream, pre = one-hot (stream 0)
    X, pre  = Stage_k(X, pre) for k = 0..stages-1    V4.1 blocks (delayed pre-mix chained across the stages) whose
                                                      attention sees the stage's window plus the whole block
    h       = Σ pre_i X_i;  logits = head(norm(h))    the last stage's norm, the backbone's vocabulary head
    Markov  : d_0 = anchor; logits_j += markov_head(markov_embed[d_j]); d_{j+1} = choose(logits_j)
    confidence_j = proj([h_j, markov_embed[d_j]])     fp32, un-normalised h

DeepSeek's `forward_spec(anchor, main_hidden, pos)` at decode writes the window entry of position `pos` (from the
target step that ran there) and then drafts the block at positions pos+1 .. pos+block_size: here that is
`dspark_append(positions=[pos])` followed by `dspark_draft(anchor, anchor_pos=pos+1)`; its prefill call
(start_pos 0) only seeds the windows, which is `dspark_append` over the prompt. docs/speculative.md lists what was
read from DeepSeek's code.

Parameters: params["drafter"] = {"stages", "input", "output"} (param_spec.py, loaded by jdeep.load(..., mtp=True));
the embedding and vocabulary head are the backbone's. State: {"window": [stages, B, W+1, D | record]}, the rings
of state.py (slot t mod W, scratch row W).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from .. import kernels
from ..arenas import split_experts
from ..config import AttentionKind, ModelConfig
from ..kernels.linear import linear_f32
from ..layers.attention import output_projection, write_window
from ..layers.block import Streams, ffn_half
from ..layers.chunk import Chunk, make_chunk
from ..layers.head import argmax_ids, head_matmul
from ..layers.linear import dense
from ..layers.mhc import hc_collapse, hc_expand, hc_mixes
from ..layers.norm import rms_norm
from ..layers.rope import inv_freq
from ..layers.shared_attention import query_heads, window_codec, window_entries
from ..numerics import Numerics
from ..plan import LayerPlan, dspark_stage_config
from ..state import empty_slot_state

__all__ = ["empty_dspark_state", "dspark_append", "dspark_draft", "markov_draft", "greedy_choice", "Choice"]

# How the Markov loop picks draft token j from its logits: choose(logits fp32 [B, V], j int32 scalar) -> int32 [B].
Choice = Callable[[jax.Array, jax.Array], jax.Array]


def greedy_choice(logits: jax.Array, j: jax.Array) -> jax.Array:
    """The argmax (ties to the lower id), DeepSeek's temperature-0 choice."""
    return argmax_ids(logits)


def _require(params: dict, plan: LayerPlan) -> None:
    if plan.dspark is None:
        raise ValueError("this model was loaded without its DSpark stages (jdeep.load(..., mtp=True) on a "
                         "DeepSeek-V4.1 checkpoint with DSpark)")
    if "embed" not in params:
        raise ValueError("the DSpark drafter needs the token embedding on the device (load without host_embedding)")


def _freqs(config: ModelConfig):
    # the stages are sliding-window layers: the main RoPE, no YaRN (DeepSeek: compress_ratio 0)
    return inv_freq(config.rope_for(AttentionKind(0)), config.rope_head_dim)


def empty_dspark_state(config: ModelConfig, plan: LayerPlan, batch: int, max_len: int, dtype: Any,
                       numerics: Numerics | None = None) -> dict:
    """The stages' fresh window rings: {"window": [stages, B, W+1, D]} in `dtype` (uint8 records [.., bytes] with
    packed_kv numerics), layer-major like a backbone slot's state."""
    if plan.dspark is None:
        raise ValueError("the plan holds no DSpark stages (build_plan(config, mtp=True) on a V4.1 config with DSpark)")
    return empty_slot_state(config, plan.dspark.pattern[0], plan.dspark.reps, batch, max_len, dtype, numerics)


def dspark_append(params: dict, dstate: dict, main_hidden: jax.Array, positions: jax.Array, *, config: ModelConfig,
                  plan: LayerPlan, numerics: Numerics = Numerics()) -> dict:
    """Write every stage's window entries of the target positions `positions` int32 [B, S] (-1 = padding after the
    real ones: writes nothing) from main_hidden [B, S, n_taps*d] (model_step(taps=True) of the same chunk).

    Prefill seeds every prompt position; a decode step appends the positions it accepted. Only each row's last W
    positions of the chunk reach the ring (slot t mod W). Returns the updated dstate."""
    _require(params, plan)
    mtp = params["drafter"]
    main_x = _main_x(mtp["input"], main_hidden, config=config, numerics=numerics)
    chunk = make_chunk(jnp.zeros(positions.shape, jnp.int32), positions, config.vocab_size)
    freqs = _freqs(config)
    _, store = window_codec(numerics, config, main_x.dtype)

    def write(window, xs):
        p, stage = xs
        kv_raw, kv = window_entries(p, main_x, chunk.positions, freqs, config=config, numerics=numerics)
        entry = kv_raw if numerics.packed_kv else kv      # records quantise the raw values themselves
        return write_window(window, stage, chunk, entry, config.window_size, store), None

    stages = plan.dspark.reps
    window, _ = jax.lax.scan(write, dstate["window"], (mtp["stages"]["attn"], jnp.arange(stages, dtype=jnp.int32)))
    return {**dstate, "window": window}


def _main_x(p: dict, main_hidden: jax.Array, *, config: ModelConfig, numerics: Numerics) -> jax.Array:
    """main_norm(main_proj(main_hidden)): [B, S, n_taps*d] -> [B, S, d] (stage 0's projection, used by every stage)."""
    return rms_norm(dense(main_hidden, p["main_proj"], numerics), p["main_norm"], config.norm_eps)


def dspark_draft(params: dict, dstate: dict, anchor: jax.Array, anchor_pos: jax.Array, *, config: ModelConfig,
                 plan: LayerPlan, numerics: Numerics = Numerics(), choose: Choice = greedy_choice
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Draft the block after the target's newest token `anchor` int32 [B] at position `anchor_pos` int32 [B] (the
    windows hold the positions < anchor_pos, dspark_append). dstate is only read.

    Returns (draft_ids int32 [B, block] (d_1 .. d_block), draft_logits fp32 [B, block, V] (row j: the logits of
    d_{j+1}, Markov bias of d_j included), confidence fp32 [B, block] (raw logits)). `choose` picks each draft
    token from its logits (greedy_choice: DeepSeek's temperature 0)."""
    _require(params, plan)
    ds = config.dspark
    if ds.noise_token_id is None or ds.markov_rank is None:
        raise ValueError("the DSpark drafter needs dspark_noise_token_id and dspark_markov_rank in config.json")
    mtp = params["drafter"]
    B, block = anchor.shape[0], ds.block_size
    tokens = jnp.concatenate([anchor[:, None].astype(jnp.int32),
                              jnp.full((B, block - 1), ds.noise_token_id, jnp.int32)], axis=1)
    chunk = make_chunk(tokens, anchor_pos[:, None] + jnp.arange(block, dtype=jnp.int32)[None, :], config.vocab_size)
    emb = params["embed"][chunk.tokens]                                               # [B, block, d]
    X = jnp.broadcast_to(emb[:, :, None, :], (B, block, config.hc_mult, config.dim))
    pre = jnp.broadcast_to(jnp.eye(config.hc_mult, dtype=jnp.float32)[0], (B, block, config.hc_mult))
    per_stage, experts = split_experts(mtp["stages"])
    stage_config = dspark_stage_config(config)
    freqs = _freqs(config)

    def body(streams, xs):
        p, stage = xs
        streams = _stage(p, experts, stage, dstate["window"], streams, chunk, anchor_pos, config=stage_config,
                         numerics=numerics, freqs=freqs)
        return streams, None

    streams, _ = jax.lax.scan(body, Streams(X, pre), (per_stage, jnp.arange(plan.dspark.reps, dtype=jnp.int32)))
    out = mtp["output"]
    h = hc_collapse(streams.X, streams.pre)                                           # [B, block, d]
    logits = head_matmul(rms_norm(h, out["norm"], config.norm_eps), params["head"])   # fp32 [B, block, V]
    ids, logits, markov_embeds = markov_draft(out, logits, anchor, choose)
    features = jnp.concatenate([h.astype(jnp.float32), markov_embeds.astype(jnp.float32)], axis=-1)
    confidence = linear_f32(features, out["confidence"])[..., 0]
    return ids, logits, confidence


def markov_draft(p: dict, logits: jax.Array, anchor: jax.Array, choose: Choice = greedy_choice
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The Markov-head loop over the block: logits_j += markov_head(markov_embed[d_j]), d_{j+1} = choose(logits_j),
    with d_0 = anchor int32 [B]. p: {"markov_embed" [V, r], "markov_head" [r, V]}; logits fp32 [B, block, V].
    Returns (d_1 .. d_block int32 [B, block], the biased logits fp32 [B, block, V], markov_embed[d_j] [B, block, r]
    in the weights' dtype)."""
    def step(prev, xs):
        row, j = xs
        e = p["markov_embed"][jnp.clip(prev, 0, p["markov_embed"].shape[0] - 1)]     # [B, r] (S12: clamped ids)
        row = row + head_matmul(e, p["markov_head"])
        nxt = choose(row, j)
        return nxt, (nxt, row, e)

    block = logits.shape[1]
    _, (ids, rows, embeds) = jax.lax.scan(step, anchor.astype(jnp.int32),
                                          (jnp.swapaxes(logits, 0, 1), jnp.arange(block, dtype=jnp.int32)))
    return jnp.swapaxes(ids, 0, 1), jnp.swapaxes(rows, 0, 1), jnp.swapaxes(embeds, 0, 1)


def _stage(p: dict, experts: dict, stage: jax.Array, window: jax.Array, streams: Streams, chunk: Chunk,
           anchor_pos: jax.Array, *, config: ModelConfig, numerics: Numerics, freqs) -> Streams:
    """One DSpark stage on the block's streams: the mHC-wrapped block attention, then the backbone's mHC-wrapped MoE
    (config: the stage config, dspark expert counts). Delayed pre-mix: the attention collapses with the pre the
    stream brought, the MoE with the attention's own, and the MoE's pre goes on to the next stage."""
    X = streams.X
    hc = dict(norm_eps=config.norm_eps, hc_eps=config.hc_eps, sinkhorn_iters=config.hc_sinkhorn_iters)
    pre, post, comb = hc_mixes(X, p["hc_attn_fn"], p["hc_attn_base"], p["hc_attn_scale"], **hc)
    x = rms_norm(hc_collapse(X, streams.pre), p["attn_norm"], config.norm_eps)
    y = _block_attention(p["attn"], window, stage, x, chunk, anchor_pos, config=config, numerics=numerics, freqs=freqs)
    streams = Streams(hc_expand(y, post, comb, X), pre)
    return ffn_half(p, experts, stage, streams, chunk, config=config, numerics=numerics, hash_moe=False,
                    delayed_premix=True)


def _block_attention(p: dict, window: jax.Array, stage: jax.Array, x: jax.Array, chunk: Chunk, anchor_pos: jax.Array,
                     *, config: ModelConfig, numerics: Numerics, freqs) -> jax.Array:
    """DSpark attention: x [B, block, d] (after attn_norm) at the block positions -> [B, block, d]. Every block
    position sees the whole window (the W positions before anchor_pos that exist) and every block position, none
    masked; K=V of the block from the stage's own wkv like the window's."""
    B, S, _ = x.shape
    W, D = config.window_size, config.head_dim
    read, _ = window_codec(numerics, config, x.dtype)
    _, q = query_heads(p, x, chunk.positions, freqs, config=config, numerics=numerics)
    _, kv = window_entries(p, x, chunk.positions, freqs, config=config, numerics=numerics)
    ring = read(window[stage][:, :W]).astype(kv.dtype)                               # [B, W, D]
    last = anchor_pos[:, None] - 1
    ring_pos = last - (last - jnp.arange(W, dtype=jnp.int32)[None, :]) % W           # position held by each slot
    visible = jnp.concatenate([jnp.broadcast_to((ring_pos >= 0)[:, None, :], (B, S, W)), jnp.ones((B, S, S), bool)],
                              axis=2)
    o = kernels.get("sparse_attention")(q, jnp.concatenate([ring, kv], axis=1), visible, None, None, p["attn_sink"],
                                        D ** -0.5)
    return output_projection(o, p, chunk, config=config, numerics=numerics, freqs=freqs, dtype=x.dtype)
