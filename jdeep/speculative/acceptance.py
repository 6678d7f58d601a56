"""Drafting and verifying tokens so that the output has exactly the target model's distribution.

Each row samples with its own SamplingParams (runtime/sampling.py). Its target distribution p at a position is what
plain decoding draws from there: the row's logit_bias and min_tokens applied (`adjusted`: the position's token is
the row's count + j-th, so min_tokens holds its stop ids back exactly as plain decoding would), then softmax of the
filtered logits (temperature, top-k, top-p, min-p), or, for a greedy row (temperature 0), the one-hot of the argmax
(lowest index on ties, as plain greedy decoding picks). The drafter's distribution q goes through the same transform
and the draft token is drawn from it.

The standard rule (Leviathan et al. 2023; DeepSeek's DeepSpec evaluator, `verify_draft_tokens`):
    draft d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)) (q clamped at 1e-8), in order, until the first
    rejection; at the first rejected position i the token is drawn from the normalised residual max(0, p_i - q_i)
    (p_i itself where the residual has no mass); when all k drafts are accepted a bonus token is drawn from p_{k+1}.
For greedy rows this is exactly "the longest prefix of drafts equal to the target's argmax, then the target's argmax".

Randomness: every draw uses the row's own key folded with the number of tokens the row has generated and a
purpose tag, so a request's draws do not depend on the batch it shares.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..layers.head import argmax_ids
from ..runtime.sampling import SamplingBatch, adjusted_logits, filtered_logits, token_logprobs

__all__ = ["Emitted", "with_logprobs", "adjusted", "greedy_ids", "distribution", "draw", "accept", "accept_greedy",
           "uniform", "argmax_ids", "emit"]

_Q_FLOOR = 1e-8


class Emitted(NamedTuple):
    """Tokens a step emits with what `logprobs` / `top_logprobs` report for them: tokens int32 [...] (-1 where nothing
    is emitted), logprob f32 [...] (the token's raw log-softmax: vLLM's raw logprobs, as plain decoding reports them),
    top_ids int32 [..., W] and top_vals f32 [..., W] (the W = TOP_LOGPROBS_WIDTH most likely); logits f32 [..., V]
    (the target's, NaN where nothing is emitted) in programs built with keep_logits, else None. An iteration's are
    [B, k+1] (the target's logits at each verified position), a prefill's first tokens [B]."""

    tokens: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_vals: jax.Array
    logits: jax.Array | None = None


def with_logprobs(tokens: jax.Array, logits: jax.Array, keep_logits: bool = False) -> Emitted:
    """tokens int32 [...] with their logprobs from the target's logits [..., V] (sampling.token_logprobs), and the
    logits themselves with keep_logits (jdeep.generate's return_logits)."""
    kept = jnp.where((tokens < 0)[..., None], jnp.nan, logits.astype(jnp.float32)) if keep_logits else None
    return Emitted(tokens, *token_logprobs(logits, jnp.maximum(tokens, 0)), kept)


def _rows(sb: SamplingBatch, k: int) -> SamplingBatch:
    """sb with every row repeated k times (row b*k + j = row b)."""
    return SamplingBatch(*(jnp.repeat(a, k, axis=0) for a in sb))


def adjusted(logits: jax.Array, sb: SamplingBatch, count: jax.Array) -> jax.Array:
    """logits [B, K, V] with each row's logit_bias and min_tokens applied at position j as plain decoding applies them
    to the token after count + j generated ones (sampling.adjusted_logits, no penalties; count int32 [B]): fp32
    [B, K, V]. The identity for rows that set neither."""
    B, K, V = logits.shape
    steps = (count[:, None] + jnp.arange(K, dtype=jnp.int32)[None, :]).reshape(B * K)
    return adjusted_logits(logits.reshape(B * K, V), _rows(sb, K), steps, None).reshape(B, K, V)


def greedy_ids(logits: jax.Array, sb: SamplingBatch, count: jax.Array) -> jax.Array:
    """The token plain greedy decoding takes at each position: the argmax of `adjusted` (lowest id on ties); logits
    [B, K, V] -> int32 [B, K]."""
    return argmax_ids(adjusted(logits, sb, count))


def distribution(logits: jax.Array, sb: SamplingBatch, count: jax.Array) -> jax.Array:
    """The distribution each row samples from at each position (`adjusted` at count + j, then the filters):
    logits [B, K, V] -> probabilities fp32 [B, K, V] (one-hot of the argmax for greedy rows)."""
    B, K, V = logits.shape
    flat = adjusted(logits, sb, count).reshape(B * K, V)
    probs = jax.nn.softmax(filtered_logits(flat, _rows(sb, K)), axis=-1)
    greedy = jax.nn.one_hot(argmax_ids(flat), V, dtype=jnp.float32)
    greedy_row = jnp.repeat(sb.temperature <= 0, K)[:, None]
    return jnp.where(greedy_row, greedy, probs).reshape(B, K, V)


def _key(sb: SamplingBatch, count: jax.Array, tag: int) -> jax.Array:
    """Per-row keys [B] for draw number `count` int32 [B] with purpose `tag`."""
    def one(key_data, c):
        key = jax.random.wrap_key_data(key_data, impl="threefry2x32")
        return jax.random.fold_in(jax.random.fold_in(key, c), tag)

    return jax.vmap(one)(sb.keys, count)


def uniform(sb: SamplingBatch, count: jax.Array, tag: int, n: int) -> jax.Array:
    """n uniform draws in [0, 1) per row: fp32 [B, n]."""
    return jax.vmap(lambda key: jax.random.uniform(key, (n,), jnp.float32))(_key(sb, count, tag))


def draw(probs: jax.Array, sb: SamplingBatch, count: jax.Array, tag: int) -> jax.Array:
    """One token per row from probs fp32 [B, V] (Gumbel-max over log p; a one-hot row gives its token): int32 [B]."""
    g = jax.vmap(lambda key: jax.random.gumbel(key, probs.shape[-1:], jnp.float32))(_key(sb, count, tag))
    logp = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf)
    return argmax_ids(logp + g)


def accept(drafts: jax.Array, q: jax.Array, p: jax.Array, sb: SamplingBatch, count: jax.Array,
           tag: int) -> tuple[jax.Array, jax.Array]:
    """Verify drafts int32 [B, k] drawn from q fp32 [B, k, V] against the target distributions p fp32 [B, k+1, V]
    (position i of p: the token after draft i; p[:, 0] follows the last accepted token).

    Returns (tokens int32 [B, k+1], accepted int32 [B]): row b emits tokens[b, :accepted[b] + 1] — the accepted
    drafts, then the residual draw at the first rejection or the bonus draw from p[:, k]."""
    B, k = drafts.shape
    p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]              # [B, k]
    q_d = jnp.maximum(jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0], _Q_FLOOR)
    ok = uniform(sb, count, tag, k) < jnp.minimum(1.0, p_d / q_d)
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    # the distribution of the token after the accepted prefix: residual at a rejection, p itself for the bonus
    at = jnp.clip(accepted, 0, k)[:, None, None]
    p_a = jnp.take_along_axis(p, at, axis=1)[:, 0]
    q_a = jnp.take_along_axis(jnp.pad(q, ((0, 0), (0, 1), (0, 0))), at, axis=1)[:, 0]   # 0 past the drafts
    residual = jnp.maximum(p_a - q_a, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > _Q_FLOOR, residual / jnp.maximum(mass, _Q_FLOOR), p_a)
    last = draw(residual, sb, count, tag + 1)
    offs = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    tokens = jnp.where(offs < accepted[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), last[:, None])
    return tokens.astype(jnp.int32), accepted


def accept_greedy(drafts: jax.Array, target_logits: jax.Array, sb: SamplingBatch, count: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """`accept` for a batch of greedy rows, from the target's logits fp32 [B, k+1, V] (no distributions): the longest
    prefix of drafts equal to the target's greedy token (greedy_ids at count + j), then that token. Same outputs as
    `accept`."""
    g = greedy_ids(target_logits, sb, count)                                            # [B, k+1]
    accepted = jnp.sum(jnp.cumprod((drafts == g[:, :-1]).astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    return g, accepted


def emit(g: jax.Array, a: jax.Array, stops: jax.Array, max_new: jax.Array, count: jax.Array, live: jax.Array
         ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """What each row emits after acceptance: g int32 [B, k+1] (the accepted drafts, then the residual or bonus
    token), a int32 [B] accepted drafts; up to a + 1 tokens, cut after the row's first stop id (stops int32 [B, W],
    -1 = unused) and at max_new int32 [B] less count int32 [B]; rows not live emit nothing. Returns (n int32 [B]
    tokens emitted, rejected bool [B, k+1] (positions p+n .. p+k, whose state entries are undone), emitted int32
    [B, k+1] (-1 past n), count + n, ended bool [B] (a stop id emitted or max_new reached))."""
    offs = jnp.arange(g.shape[1], dtype=jnp.int32)
    is_stop = jnp.any(g[:, :, None] == stops[:, None, :], axis=-1) & (offs[None, :] <= a[:, None])
    first_stop = jnp.min(jnp.where(is_stop, offs[None, :], g.shape[1]), axis=1)
    n = jnp.where(live, jnp.minimum(jnp.minimum(a + 1, first_stop + 1), max_new - count), 0)
    count = count + n
    return (n, offs[None, :] >= n[:, None], jnp.where(offs[None, :] < n[:, None], g, -1), count,
            (first_stop < n) | (count >= max_new))
