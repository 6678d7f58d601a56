"""Mixture of experts (model-spec.md §4.5): sqrtsoftplus scores, bias-steered or hash-routed top-k,
normalised weights × route scale, clamped SwiGLU experts and one shared expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .. import kernels
from ..config import ModelConfig
from ..kernels.linear import linear_f32
from ..kernels.reference import stacked_experts
from ..numerics import Numerics
from .stages import scope, stage

__all__ = ["route", "moe", "moe_expert_parallel", "DECODE_MAX_S"]

# Steps shorter than this are decode-class (one token per sequence, or a speculative verify of k + 1 <= 9 tokens):
# their MoE must not sort (neuron-notes S6). Prefill chunks are at least 16 tokens (runtime.steps.MIN_BUCKET).
DECODE_MAX_S = 16


@stage("moe.router")
def route(x: jax.Array, tokens: jax.Array, p: dict, *, config: ModelConfig, hash_moe: bool) -> tuple[jax.Array, jax.Array]:
    """x [T, d], tokens int32 [T] -> (expert ids int32 [T, k], weights fp32 [T, k]).

    p: weight [E, d], and bias [E] (top-k steering; V4.1 also bias_vl [E] for image tokens) or tid2eid
    int32 [V, k] (hash routing).
    """
    logits = linear_f32(x, p["weight"])
    if config.is_v41:
        logits = logits / config.gate_temp
    scores = jnp.sqrt(jax.nn.softplus(logits))                              # [T, E]
    k = config.n_activated_experts
    if hash_moe:
        idx = jnp.clip(p["tid2eid"][tokens], 0, config.n_routed_experts - 1)   # ids from data: clamp (S12)
    else:
        bias = p["bias"]
        if "bias_vl" in p and config.image_token_id is not None:   # V4.1: image tokens route with bias_vl
            bias = jnp.where((tokens == config.image_token_id)[:, None], p["bias_vl"], bias)
        _, idx = jax.lax.top_k(scores + bias, k)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    denom = jnp.sum(w, axis=-1, keepdims=True)
    if config.is_v41:
        denom = denom + 1e-20   # V4.1's guard (V4 records none)
    w = config.route_scale * w / denom
    return idx.astype(jnp.int32), w


def moe(p: dict, experts: dict, layer: jax.Array, x: jax.Array, tokens: jax.Array, *, config: ModelConfig,
        numerics: Numerics, hash_moe: bool, layout=None) -> jax.Array:
    """x [B, S, d] (after ffn_norm), tokens [B, S] -> [B, S, d].

    p: this layer's gate ("gate" weight [E, d], "bias" [E] or "tid2eid" [V, k]) and shared expert;
    experts: w1, w2, w3 of all layers of this kind ([R, E, ...]), indexed by `layer`.
    layout (sharding.Layout): under expert parallelism the MoE runs in `shard_map` (`moe_expert_parallel`).
    A decode step (S < DECODE_MAX_S: one token per sequence, or a speculative verify of k + 1) runs a sort-free
    routed-expert op (`_routed_op`).
    """
    if layout is not None and layout.expert_parallel:
        return moe_expert_parallel(p, experts, layer, x, tokens, config=config, numerics=numerics,
                                   hash_moe=hash_moe, layout=layout)
    B, S, d = x.shape
    xt = x.reshape(B * S, d)
    idx, w = route(xt, tokens.reshape(-1), p["gate"], config=config, hash_moe=hash_moe)
    op = kernels.get(_routed_op(config, B * S, S < DECODE_MAX_S, numerics.pair_kernel_limit))
    with scope("moe.experts"):
        routed = op(xt, idx, w, experts["w1"], experts["w2"], experts["w3"], layer, config.swiglu_limit, numerics)
    sh = p["shared_experts"]
    with scope("moe.shared"):
        shared = kernels.get("shared_expert")(xt, sh["w1"], sh["w2"], sh["w3"], config.swiglu_limit, numerics)
    return (routed + shared).astype(x.dtype).reshape(B, S, d)


def _routed_op(config: ModelConfig, n_tokens: int, decode: bool = False, pair_limit: int = 1) -> str:
    """The routed-expert op for n_tokens tokens: per-pair slices while the (token, expert) pairs are fewer than
    the experts (T*k < E), in a decode step while they are fewer than `pair_limit` times the experts (the target
    platform's, Numerics.pair_kernel_limit: on CPU 8, its small-row GEMMs are slow, see docs/performance.md;
    Neuron 1, whose S4 budget a loop of T*k trips would exceed at serving batches), else the tiled grouped
    matmul; in a decode program its sort-free twin (neuron-notes S6: no sort in decode), whose result is the
    same. `decode`: a decode-class step (the caller's S < DECODE_MAX_S: one token per sequence, as the decode
    programs of `tools.programs`, or a speculative verify step of k + 1 tokens); prefill chunks (S >= 16) may sort."""
    pairs, E = n_tokens * config.n_activated_experts, config.n_routed_experts
    if pairs < E or (decode and pairs < pair_limit * E):
        return "moe_experts_gather"
    return "moe_experts_grouped_nosort" if decode else "moe_experts_grouped"


def _local_routed_op(config: ModelConfig, n_tokens: int, n_local: int, decode: bool = False, pair_limit: int = 1
                     ) -> str:
    """The routed-expert kernel for one expert shard holding n_local experts. Every shard does the worst case
    (all T*k pairs could be its own), so when its experts are few it applies each of them to every token
    (reading each expert once) instead of slicing one expert per pair: with the per-pair kernel when
    n_local <= T*k, with the grouped ones (either) when n_local <= k (fewer rows than their T*k). `decode` as in
    `_routed_op` (no sort in a decode program), `pair_limit` too."""
    k = config.n_activated_experts
    pairs = _routed_op(config, n_tokens, decode, pair_limit)
    if n_local <= (n_tokens * k if pairs == "moe_experts_gather" else k):
        return "moe_experts_dense"
    return pairs


def moe_expert_parallel(p: dict, experts: dict, layer: jax.Array, x: jax.Array, tokens: jax.Array, *,
                        config: ModelConfig, numerics: Numerics, hash_moe: bool, layout) -> jax.Array:
    """The MoE with routed experts split over the mesh's `expert` axis (and their intermediate dim over
    `tensor` when layout.expert_inter), inside `shard_map`, with fixed shapes.

    Every expert shard sees all tokens of its data shard (x is replicated over `expert`), routes them
    (the gate is replicated), and runs a routed-expert kernel on its local experts: the (token, expert)
    pairs whose expert lives elsewhere keep their slot with routing weight 0, so no shape depends on the
    routing. The kernel is the one a single device would run (`_routed_op`: sort-free in decode), or, when the
    shard's experts are few, the dense one (each local expert applied to every token, `_local_routed_op`). The partial
    sums (fp32) are then reduced over the shards:
      - when the token count divides by the expert axis: reduce-scatter over `expert` (each shard gets the
        sums of T/ep tokens), the shared expert runs on that slice only, and an all-gather returns the
        summed rows to every shard;
      - otherwise (decode with fewer tokens than shards): an all-reduce, the shared expert on all tokens.
    With the intermediate dim split the partials are also summed over `tensor`. Equal to `moe` up to fp32
    summation order. Experts padded at load (E not divisible by the axis) are never routed to.
    """
    mesh = layout.mesh
    sizes = layout.sizes
    B, S, d = x.shape
    ep = sizes["expert"]
    data = "data" if sizes["data"] > 1 and B % sizes["data"] == 0 else None
    T = (B // (sizes["data"] if data else 1)) * S                  # tokens per data shard
    scatter = ep > 1 and T % ep == 0
    inter_axes = ("tensor",) if layout.expert_inter else ()
    exp_specs = jax.tree_util.tree_map_with_path(
        lambda kp, a: layout.expert_spec(tuple(k.key for k in kp), a.shape), experts)
    n_local = stacked_experts(experts["w1"]) // ep
    op = kernels.get(_local_routed_op(config, T, n_local, S < DECODE_MAX_S, numerics.pair_kernel_limit))
    shared_op = kernels.get("shared_expert")

    def local(x, tokens, gate, shared, experts, layer):
        xt = x.reshape(-1, d)
        idx, w = route(xt, tokens.reshape(-1), gate, config=config, hash_moe=hash_moe)
        local_idx = idx - jax.lax.axis_index("expert") * n_local
        mine = (local_idx >= 0) & (local_idx < n_local)
        routed = op(xt, jnp.clip(local_idx, 0, n_local - 1), jnp.where(mine, w, 0.0), experts["w1"], experts["w2"],
                    experts["w3"], layer, config.swiglu_limit, numerics)        # fp32 [T, d], this shard's part
        if inter_axes:
            routed = jax.lax.psum(routed, inter_axes)
        sh = (shared["w1"], shared["w2"], shared["w3"], config.swiglu_limit, numerics)
        if scatter:
            part = jax.lax.psum_scatter(routed, "expert", scatter_dimension=0, tiled=True)   # [T/ep, d]
            mine_rows = jax.lax.dynamic_slice_in_dim(xt, jax.lax.axis_index("expert") * (T // ep), T // ep)
            y = (part + shared_op(mine_rows, *sh)).astype(x.dtype)
            y = jax.lax.all_gather(y, "expert", axis=0, tiled=True)                          # [T, d]
        else:
            if ep > 1:
                routed = jax.lax.psum(routed, "expert")
            y = (routed + shared_op(xt, *sh)).astype(x.dtype)
        return y.reshape(x.shape)

    rep = P()
    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(data), P(data), rep, rep, exp_specs, rep), out_specs=P(data),
                       check_vma=False)
    return fn(x, tokens, p["gate"], p["shared_experts"], experts, layer)
