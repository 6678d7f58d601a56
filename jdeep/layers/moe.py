"""Mixture of experts (model-spec.md §4.5): sqrtsoftplus scores, bias-steered or hash-routed top-k,
normalised weights × route scale, clamped SwiGLU experts and one shared expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import kernels
from ..config import ModelConfig
from ..numerics import Numerics
from .linear import linear_f32

__all__ = ["route", "moe"]


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
        numerics: Numerics, hash_moe: bool) -> jax.Array:
    """x [B, S, d] (after ffn_norm), tokens [B, S] -> [B, S, d].

    p: this layer's gate ("gate" weight [E, d], "bias" [E] or "tid2eid" [V, k]) and shared expert;
    experts: w1, w2, w3 of all layers of this kind ([R, E, ...]), indexed by `layer`.
    """
    B, S, d = x.shape
    xt = x.reshape(B * S, d)
    idx, w = route(xt, tokens.reshape(-1), p["gate"], config=config, hash_moe=hash_moe)
    T, k = idx.shape
    op = "moe_experts_gather" if T * k <= config.n_routed_experts else "moe_experts_grouped"
    routed = kernels.get(op)(xt, idx, w, experts["w1"], experts["w2"], experts["w3"], layer, config.swiglu_limit,
                             numerics)
    sh = p["shared_experts"]
    shared = kernels.get("shared_expert")(xt, sh["w1"], sh["w2"], sh["w3"], config.swiglu_limit, numerics)
    return (routed + shared).astype(x.dtype).reshape(B, S, d)
