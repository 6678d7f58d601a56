"""DeepSeek-V4's multi-token-prediction blocks (model-spec.md §4.7): from the backbone's final streams at position t
and the embedding of token t+1, the distribution of token t+2 (depth k: of token t+k+2, chaining on the streams
of depth k-1).

    e   = enorm(embed(token t+1))                      (the backbone's embedding)
    X'  = e_proj(e) on every stream + h_proj(hnorm(X)) (X [B, S, n, d]: the backbone's streams after its last block)
    X'  = Block(X')                                    (a sliding-window layer with a top-k MoE, own KV window)
    logits = head(norm(hc_head collapse of X'))        (own head mixer and norm, the backbone's vocabulary head)

The blocks live in the plan's `mtp` segment (build_plan(mtp=True)) and the param tree's "drafter" subtree, their
window state in `empty_mtp_state` (one [depths, B, W+1, D] ring, like a backbone layer's).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ..arenas import unpacked
from ..config import ModelConfig
from ..layers.block import Streams, block
from ..layers.chunk import make_chunk
from ..layers.head import head_logits
from ..layers.linear import dense
from ..layers.norm import rms_norm
from ..layers.rope import inv_freq
from ..numerics import Numerics
from ..plan import LayerPlan
from ..state import empty_slot_state
from .scan import slot_params

__all__ = ["mtp_step", "mtp_inputs", "empty_mtp_state", "init_mtp_state"]


def empty_mtp_state(config: ModelConfig, plan: LayerPlan, batch: int, max_len: int, dtype: Any,
                    numerics: Numerics | None = None) -> dict:
    """The MTP blocks' fresh window state: {"window": [depths, B, W+1, D | record]}."""
    return empty_slot_state(config, plan.mtp.pattern[0], plan.mtp.reps, batch, max_len, dtype, numerics)


def init_mtp_state(config: ModelConfig, plan: LayerPlan, batch: int, max_len: int, dtype: Any,
                   numerics: Numerics | None = None) -> dict:
    """empty_mtp_state placed on the default device (committed, like init_state, so the first call of a program and
    the later ones, on its outputs, hit one compiled program)."""
    return jax.device_put(empty_mtp_state(config, plan, batch, max_len, dtype, numerics), jax.devices()[0])


def mtp_inputs(tokens: jax.Array, positions: jax.Array, depth: int = 0) -> tuple[jax.Array, jax.Array]:
    """The token ids and positions MTP block `depth` takes for a chunk the backbone ran from tokens, positions
    int32 [B, S] (-1 = padding after the real tokens): at position t the token t + depth + 1 (zeros past the
    chunk), and the positions with -1 wherever that token is not a real one."""
    shift = depth + 1
    next_tokens = jnp.pad(tokens[:, shift:], ((0, 0), (0, shift)))
    has_next = jnp.pad(positions[:, shift:] >= 0, ((0, 0), (0, shift)))
    return next_tokens, jnp.where(has_next, positions, -1)


def mtp_step(params: dict, state: dict, hidden: jax.Array, next_tokens: jax.Array, positions: jax.Array, *,
             config: ModelConfig, plan: LayerPlan, numerics: Numerics = Numerics(), depth: int = 0,
             all_logits: bool = True) -> tuple[jax.Array, jax.Array, dict]:
    """One chunk through MTP block `depth`.

    hidden [B, S, n, d]: the streams at positions t (the backbone's final streams for depth 0, the previous depth's
    output after); next_tokens int32 [B, S]: the token at t + depth + 1; positions int32 [B, S] the positions t
    (-1 = padding after the real tokens). Returns (logits fp32 [B, S, V] (or [B, V] at each row's last real token
    when not all_logits): the distribution of the token at t + depth + 2, the block's output streams
    [B, S, n, d], the updated state).
    """
    if plan.mtp is None:
        raise ValueError("this model was loaded without its MTP blocks (jdeep.load(..., mtp=True))")
    if "embed" not in params:
        raise ValueError("the MTP blocks need the token embedding on the device (load without host_embedding)")
    eps = config.norm_eps
    chunk = make_chunk(next_tokens, positions, config.vocab_size)
    per_layer, experts = slot_params(params["drafter"])
    p = unpacked(jax.tree_util.tree_map(lambda a: a[depth], per_layer))
    e = rms_norm(params["embed"][chunk.tokens], p["enorm"], eps)
    x = dense(e, p["e_proj"], numerics)[:, :, None, :] + dense(rms_norm(hidden, p["hnorm"], eps), p["h_proj"], numerics)
    kind = plan.mtp.pattern[0]
    streams, state, _ = block(p, experts, state, {}, jnp.int32(depth), None, Streams(x.astype(hidden.dtype)), None,
                              chunk, config=config, numerics=numerics, kind=kind,
                              freqs=inv_freq(config.rope_for(kind.attn), config.rope_head_dim))
    head = {"head": params["head"], "norm": p["norm"], "hc_head_fn": p["hc_head_fn"], "hc_head_base": p["hc_head_base"],
            "hc_head_scale": p["hc_head_scale"]}
    logits = head_logits(head, streams, positions, config=config, plan=plan, all_logits=all_logits)
    return logits, streams.X, state
