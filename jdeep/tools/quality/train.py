"""Training a DeepSeek-V4 with jdeep's own forward (model_step in float numerics, one chunk from an empty state,
logits at every position): the next-token loss, DeepSeek's joint objectives — the MTP blocks' next-next-token loss
(model/mtp.py) and the lightning indexer's KL to the main attention (layers/index_loss.py) — their gradient, and an
optax update of the float parameters.

The integer leaves (hash-routing tables) and the top-k gate biases are not trained by the gradient: the tables
are fixed, and the routing bias only moves the selection, so no gradient reaches it (DeepSeek adjusts it with
an auxiliary-loss-free balancing rule instead).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from ...config import ModelConfig
from ...model.mtp import empty_mtp_state, mtp_inputs, mtp_step
from ...model.scan import StepOutput, model_step
from ...numerics import Numerics
from ...plan import LayerPlan
from ...state import empty_state

__all__ = ["split_trainable", "merge", "lm_loss", "train_losses", "make_train_step", "MTP_WEIGHT"]

MTP_WEIGHT = 0.3   # DeepSeek-V3's MTP loss weight for the first 10T tokens (λ, technical report §2.2)


def _trainable(path, leaf) -> bool:
    keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
    return jnp.issubdtype(leaf.dtype, jnp.floating) and not (keys[-2:] == ["gate", "bias"])


def split_trainable(params: dict) -> tuple[dict, dict]:
    """(the leaves the gradient trains, the rest), each the params' tree with None where the other has a leaf."""
    mask = jax.tree_util.tree_map_with_path(_trainable, params)
    train = jax.tree_util.tree_map(lambda m, x: x if m else None, mask, params)
    fixed = jax.tree_util.tree_map(lambda m, x: None if m else x, mask, params)
    return train, fixed


def merge(train: dict, fixed: dict) -> dict:
    """The inverse of split_trainable."""
    return jax.tree_util.tree_map(lambda a, b: b if a is None else a, train, fixed, is_leaf=lambda x: x is None)


def _nll(logits: jax.Array, targets: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Mean cross-entropy (nats) of logits [B, S, V] for targets int32 [B, S] where mask bool [B, S] (None: all)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    if mask is None:
        return jnp.mean(nll)
    return jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def _positions(tokens: jax.Array) -> jax.Array:
    """Positions int32 [B, T] of rows that are whole sequences from position 0."""
    B, T = tokens.shape
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


def _backbone(params: dict, tokens: jax.Array, config: ModelConfig, plan: LayerPlan, training: bool) -> StepOutput:
    """model_step over tokens [B, T] from an empty state in float numerics, logits at every position."""
    B, T = tokens.shape
    state = empty_state(config, plan, B, T, jnp.float32, Numerics())
    return model_step(params, state, tokens, _positions(tokens), config=config, plan=plan, numerics=Numerics(),
                      all_logits=True, training=training)


def train_losses(params: dict, tokens: jax.Array, mask: jax.Array | None = None, *, config: ModelConfig,
                 plan: LayerPlan) -> dict[str, jax.Array]:
    """The training objectives of tokens int32 [B, T] (every row a sequence from position 0; mask bool [B, T-1]:
    the next-token targets tokens[:, 1:] that count), through model_step in float numerics:

    "lm": the mean next-token cross-entropy (nats); "index_kl": the mean KL from the main attention to the indexer
    per query and indexer layer (0 without indexer layers); with the plan's MTP blocks, "mtp": the mean over depths
    k of the cross-entropy of token t+k+2 from MTP block k (its input: the backbone's streams at t, the embedding
    of token t+k+1)."""
    B, T = tokens.shape
    numerics = Numerics()
    positions = _positions(tokens)
    step = _backbone(params, tokens, config, plan, training=True)
    logits, aux = step.logits, step.training
    out = {"lm": _nll(logits[:, :-1], tokens[:, 1:], mask),
           "index_kl": aux["index_kl"][0] / jnp.maximum(aux["index_kl"][1], 1.0)}
    if plan.mtp is not None:
        hidden, mtp_state, losses = aux["hidden"], empty_mtp_state(config, plan, B, T, jnp.float32, numerics), []
        for k in range(plan.mtp.reps):
            shift = k + 1   # block k reads token t+k+1 and predicts token t+k+2
            next_tokens, pos = mtp_inputs(tokens, positions, k)
            mtp_logits, hidden, mtp_state = mtp_step(params, mtp_state, hidden, next_tokens, pos, config=config,
                                                     plan=plan, numerics=numerics, depth=k)
            losses.append(_nll(mtp_logits[:, :T - shift - 1], tokens[:, shift + 1:],
                               None if mask is None else mask[:, shift:]))
        out["mtp"] = sum(losses) / len(losses)
    return out


def lm_loss(params: dict, tokens: jax.Array, mask: jax.Array | None = None, *, config: ModelConfig,
            plan: LayerPlan) -> jax.Array:
    """Mean next-token cross-entropy (nats) of tokens int32 [B, T] (mask bool [B, T-1]: the targets that count),
    every row a sequence from position 0, through model_step in float numerics."""
    logits = _backbone(params, tokens, config, plan, training=False).logits
    return _nll(logits[:, :-1], tokens[:, 1:], mask)


def make_train_step(config: ModelConfig, plan: LayerPlan, optimizer: Any, mtp_weight: float = MTP_WEIGHT,
                    index_weight: float = 1.0) -> Callable:
    """step(train, fixed, opt_state, tokens [B, T], mask [B, T-1]) -> (train, opt_state, losses), jitted, on
    lm + mtp_weight · mtp + index_weight · index_kl (train_losses; losses: that dict plus "total"). The indexer's
    parameters learn only from index_kl and the rest only from lm and mtp (the indexer's inputs and its target are
    detached), so index_weight only scales the indexer's step. `optimizer` an optax GradientTransformation over
    the `train` half of split_trainable. The step donates `train` and `opt_state` (copy leaves still in use
    elsewhere, such as a loaded model's params)."""
    def loss_fn(train, fixed, tokens, mask):
        losses = train_losses(merge(train, fixed), tokens, mask, config=config, plan=plan)
        total = losses["lm"] + index_weight * losses["index_kl"]
        if "mtp" in losses:
            total = total + mtp_weight * losses["mtp"]
        return total, {**losses, "total": total}

    @functools.partial(jax.jit, donate_argnums=(0, 2))
    def step(train, fixed, opt_state, tokens, mask):
        (_, losses), grads = jax.value_and_grad(loss_fn, has_aux=True)(train, fixed, tokens, mask)
        updates, opt_state = optimizer.update(grads, opt_state, train)
        train = jax.tree_util.tree_map(lambda p, u: p + u.astype(p.dtype), train, updates)
        return train, opt_state, losses

    return step
