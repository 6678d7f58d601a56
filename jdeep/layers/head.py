"""The step's prologue and epilogue, shared by both compile modes: token embedding into the residual streams,
selection of each row's last real token, and the final stream collapse, norm and vocabulary head
(model-spec.md §4.1, §4.6, §5.2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from ..plan import LayerPlan
from .block import Streams
from .mhc import hc_collapse, hc_head_collapse
from .norm import rms_norm
from .shared_attention import empty_published

__all__ = ["embed_streams", "require_engram", "last_token", "head_logits", "head_keys", "head_matmul", "argmax_ids"]


def require_engram(plan: LayerPlan, engram: tuple | None) -> None:
    """ValueError unless a model with Engram layers got its chunk's host-gathered table rows."""
    if plan.has_engram and engram is None:
        raise ValueError("this model has Engram layers: the step needs the host-gathered `engram` rows "
                         "(Model.engram_inputs)")


def embed_streams(table: jax.Array | None, tokens: jax.Array, embeds: jax.Array | None, *, config: ModelConfig,
                  plan: LayerPlan) -> Streams:
    """tokens int32 [B, S] -> the streams entering layer 0: the embedding [B, S, d] (looked up in `table` [V, d],
    or `embeds` gathered on the host) copied onto each of the n streams [B, S, n, d]. With a delayed pre-mix the
    first pre-mix selects stream 0; with shared KV nothing is published yet."""
    if embeds is None:
        if table is None:
            raise ValueError("this model keeps its token embedding on the host: pass embeds")
        embeds = table[jnp.clip(tokens, 0, config.vocab_size - 1)]
    X = jnp.broadcast_to(embeds[:, :, None, :], embeds.shape[:2] + (config.hc_mult, embeds.shape[-1]))
    B, S = tokens.shape
    pre = published = None
    if plan.delayed_premix:
        pre = jnp.broadcast_to(jnp.eye(config.hc_mult, dtype=jnp.float32)[0], (B, S, config.hc_mult))
    if plan.shared_kv:
        published = empty_published(config, B, S)
    return Streams(X, pre, published)


def last_token(x: jax.Array, positions: jax.Array) -> jax.Array:
    """x [B, S, ...] at each row's last real token (positions int32 [B, S], -1 = padding after the real tokens)
    -> [B, ...]; a row without real tokens gives its first entry."""
    n_valid = jnp.sum(positions >= 0, axis=1)
    last = jnp.clip(n_valid - 1, 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, last.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]


def head_keys(plan: LayerPlan) -> tuple[str, ...]:
    """The top-level parameters the head reads (a delayed pre-mix needs no head mixer)."""
    return ("norm", "head") if plan.delayed_premix else ("norm", "head", "hc_head_fn", "hc_head_base", "hc_head_scale")


def head_logits(p: dict, streams: Streams, positions: jax.Array, *, config: ModelConfig, plan: LayerPlan,
                all_logits: bool) -> jax.Array:
    """Logits fp32 [B, S, V] if all_logits, else [B, V] at each row's last real token. p: the head_keys params."""
    X, pre = streams.X, streams.pre
    if not all_logits:
        X = last_token(X, positions)
        pre = None if pre is None else last_token(pre, positions)
    if plan.delayed_premix:
        h = hc_collapse(X, pre)
    else:
        h = hc_head_collapse(X, p["hc_head_fn"], p["hc_head_base"], p["hc_head_scale"], norm_eps=config.norm_eps,
                             hc_eps=config.hc_eps)
    return head_matmul(rms_norm(h, p["norm"], config.norm_eps), p["head"])


def argmax_ids(x: jax.Array) -> jax.Array:
    """The argmax over the last axis as int32, lowest index on ties (lax.top_k, as plain greedy decoding picks;
    Neuron's compiler takes no variadic argmax reduction, S8)."""
    return jax.lax.top_k(x, 1)[1][..., 0].astype(jnp.int32)


def head_matmul(h: jax.Array, head: jax.Array) -> jax.Array:
    """Logits fp32 [..., V] = h [..., d] · head [d, V] (input-major, see param_spec), operands in fp32."""
    return jax.lax.dot_general(h.astype(jnp.float32), head.astype(jnp.float32), (((h.ndim - 1,), (0,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST)
