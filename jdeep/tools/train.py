"""Training a DeepSeek-V4 with jdeep's own forward: the next-token loss of `model_step` (float numerics, one chunk
from an empty state, logits at every position), its gradient, and an optax update of the float parameters.

The integer leaves (hash-routing tables) and the top-k gate biases are not trained by the gradient: the tables
are fixed, and the routing bias only moves the selection, so no gradient reaches it (DeepSeek adjusts it with
an auxiliary-loss-free balancing rule instead).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from ..model.scan import model_step
from ..numerics import Numerics
from ..plan import LayerPlan
from ..state import empty_state

__all__ = ["split_trainable", "merge", "lm_loss", "make_train_step"]


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


def lm_loss(params: dict, tokens: jax.Array, mask: jax.Array | None = None, *, config: ModelConfig,
            plan: LayerPlan) -> jax.Array:
    """Mean next-token cross-entropy (nats) of tokens int32 [B, T] (mask bool [B, T-1]: the targets that count),
    every row a sequence from position 0, through model_step in float numerics."""
    B, T = tokens.shape
    state = empty_state(config, plan, B, T, jnp.float32, Numerics())
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    logits, _ = model_step(params, state, tokens, positions, config=config, plan=plan, numerics=Numerics(),
                           all_logits=True)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    if mask is None:
        return jnp.mean(nll)
    return jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def make_train_step(config: ModelConfig, plan: LayerPlan, optimizer: Any) -> Callable:
    """step(train, fixed, opt_state, tokens [B, T], mask [B, T-1]) -> (train, opt_state, loss), jitted; `optimizer`
    an optax GradientTransformation over the `train` half of split_trainable."""
    def loss_fn(train, fixed, tokens, mask):
        return lm_loss(merge(train, fixed), tokens, mask, config=config, plan=plan)

    @functools.partial(jax.jit, donate_argnums=(0, 2))
    def step(train, fixed, opt_state, tokens, mask):
        loss, grads = jax.value_and_grad(loss_fn)(train, fixed, tokens, mask)
        updates, opt_state = optimizer.update(grads, opt_state, train)
        train = jax.tree_util.tree_map(lambda p, u: p + u.astype(p.dtype), train, updates)
        return train, opt_state, loss

    return step
