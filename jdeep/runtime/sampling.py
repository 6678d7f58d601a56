"""Per-request sampling on the device, vectorised over the batch (each row with its own values).

Order, as in transformers' logits warpers: temperature -> top-k -> top-p -> min-p, then a Gumbel-max draw
from the surviving tokens. Rows with temperature 0 are greedy (lowest token id on ties). No sort: top-k
takes its threshold from `lax.top_k`, top-p finds its probability threshold by bisection (a fixed number
of masked sums over the vocabulary), min-p is a threshold on p / p_max. Noise comes from each request's
own key folded with its step index, so a request samples the same tokens whatever batch it shares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["SamplingParams", "SamplingBatch", "sample", "batch_params", "TOP_K_MAX", "TOP_P_ITERS", "INT32_MAX",
           "SEED_MAX", "FLOAT32_MAX", "MAX_STOP_TOKEN_IDS", "MAX_STOP_STRINGS", "MAX_STOP_CHARS"]

TOP_K_MAX = 1024     # largest top_k honoured exactly (a static top_k width); larger values mean "off"
TOP_P_ITERS = 32     # bisection steps of the top-p threshold (resolution p_max * 2^-32)
# Validation bounds (SamplingParams.validate): what the device arrays and the host loops can hold.
INT32_MAX = 2 ** 31 - 1                      # top_k, max_new_tokens: int32 on the device
SEED_MAX = 2 ** 63 - 1                       # seed: an int64 (jax.random.PRNGKey's range)
FLOAT32_MAX = float(np.finfo(np.float32).max)
MAX_STOP_TOKEN_IDS = 256                     # stop_token_ids per request
MAX_STOP_STRINGS = 32                        # stop strings per request ...
MAX_STOP_CHARS = 1024                        # ... each at most this long


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. temperature 0 = greedy; top_k 0 = off; top_p 1 = off; min_p 0 = off.
    seed: None draws one from the engine's generator; stop_token_ids end the request (the stop token is
    kept in the output); stop strings end it at the text level (the host cuts the text before them)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()

    def validate(self, vocab_size: int) -> "SamplingParams":
        """Raise ValueError naming the first bad field; returns self. Bounds (the constants above): floats finite
        (also in float32), integers within int32 (top_k, max_new_tokens) or int64 (seed), at most MAX_STOP_TOKEN_IDS
        stop ids and MAX_STOP_STRINGS stop strings of at most MAX_STOP_CHARS characters."""
        def num(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
                raise ValueError(f"{name} must be a finite number, got {_show(v)}")
            try:
                x = float(v)
            except OverflowError:
                x = math.inf
            if not math.isfinite(x) or abs(x) > FLOAT32_MAX:
                raise ValueError(f"{name} must be a finite number (float32), got {_show(v)}")
            return x

        def integer(name: str, lo: int, hi: int) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
                raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {_show(v)}")

        if num("temperature") < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < num("top_p") <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= num("min_p") <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        integer("top_k", 0, INT32_MAX)
        integer("max_new_tokens", 1, INT32_MAX)
        if self.seed is not None:
            integer("seed", 0, SEED_MAX)
        ids = self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (tuple, list)) or len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids, "
                             f"got {_show(ids)}")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids: {_show(t)} is not a token id in [0, {vocab_size})")
        stop = self.stop
        if (isinstance(stop, (str, bytes)) or not isinstance(stop, (tuple, list)) or len(stop) > MAX_STOP_STRINGS
                or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)):
            raise ValueError(f"stop must be a list of at most {MAX_STOP_STRINGS} non-empty strings of at most "
                             f"{MAX_STOP_CHARS} characters, got {_show(stop)}")
        return self


def _show(v) -> str:
    """A value for an error message: its repr, cut to 200 characters (also for ints too long to print)."""
    try:
        r = repr(v)
    except (ValueError, RecursionError):     # an int beyond Python's digit limit for str(), a deeply nested value
        r = f"<{type(v).__name__} of {v.bit_length()} bits>" if isinstance(v, int) else f"<{type(v).__name__}>"
    return r if len(r) <= 200 else r[:197] + "..."


class SamplingBatch(NamedTuple):
    """Device arrays of one batch's sampling values (row b = request b).

    temperature f32 [B]; top_k i32 [B] (0 = off); top_p f32 [B]; min_p f32 [B]; keys uint32 [B, 2]
    (each request's PRNG key data)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    keys: jax.Array


def batch_params(params: Sequence[SamplingParams], batch: int | None = None, default_seed: int = 0) -> SamplingBatch:
    """Stack per-request params (padded with greedy rows up to `batch`). Requests without a seed get
    default_seed + their row index."""
    B = batch or len(params)
    pad = [SamplingParams()] * (B - len(params))
    ps = list(params) + pad
    seeds = [p.seed if p.seed is not None else default_seed + i for i, p in enumerate(ps)]
    keys = np.stack([np.asarray(jax.random.key_data(jax.random.PRNGKey(s))) for s in seeds]).astype(np.uint32)
    top_k = [p.top_k if 0 < p.top_k <= TOP_K_MAX else 0 for p in ps]
    return SamplingBatch(jnp.asarray([p.temperature for p in ps], jnp.float32), jnp.asarray(top_k, jnp.int32),
                         jnp.asarray([p.top_p for p in ps], jnp.float32), jnp.asarray([p.min_p for p in ps], jnp.float32),
                         jnp.asarray(keys))


def _top_p_threshold(probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """Largest tau with sum(probs[probs >= tau]) >= top_p, per row (bisection): probs [B, V] -> [B]."""
    lo = jnp.zeros(probs.shape[:1], jnp.float32)
    hi = jnp.max(probs, axis=-1) * (1 + 2 ** -20) + 1e-30       # mass(hi) = 0 < top_p

    def step(_, bounds):
        lo, hi = bounds
        mid = 0.5 * (lo + hi)
        mass = jnp.sum(jnp.where(probs >= mid[:, None], probs, 0.0), axis=-1)
        ok = mass >= top_p
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, TOP_P_ITERS, step, (lo, hi))
    return lo


def filtered_logits(logits: jax.Array, sb: SamplingBatch) -> jax.Array:
    """Temperature-scaled logits [B, V] with the tokens top-k / top-p / min-p remove set to -inf."""
    t = jnp.where(sb.temperature > 0, sb.temperature, 1.0)
    x = logits.astype(jnp.float32) / t[:, None]
    V = x.shape[-1]
    kmax = min(TOP_K_MAX, V)
    vals, _ = jax.lax.top_k(x, kmax)                                       # [B, kmax] descending
    kth = jnp.take_along_axis(vals, jnp.clip(sb.top_k - 1, 0, kmax - 1)[:, None], axis=-1)
    x = jnp.where((sb.top_k[:, None] > 0) & (x < kth), -jnp.inf, x)
    probs = jax.nn.softmax(x, axis=-1)
    tau = _top_p_threshold(probs, sb.top_p)
    x = jnp.where((sb.top_p[:, None] < 1) & (probs < tau[:, None]), -jnp.inf, x)
    probs = jax.nn.softmax(x, axis=-1)
    pmax = jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(probs < sb.min_p[:, None] * pmax, -jnp.inf, x)


def sample(logits: jax.Array, sb: SamplingBatch, step: jax.Array) -> jax.Array:
    """Next token per row: logits [B, V] fp32, step int32 scalar or [B] (each request's own step count,
    mixed into its key) -> int32 [B]."""
    B = logits.shape[0]
    step = jnp.broadcast_to(jnp.asarray(step, jnp.int32), (B,))
    x = filtered_logits(logits, sb)

    def noise(key_data, s):
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data, impl="threefry2x32"), s)
        return jax.random.gumbel(key, (logits.shape[-1],), jnp.float32)

    g = jax.vmap(noise)(sb.keys, step)
    sampled = jax.lax.top_k(x + g, 1)[1][:, 0]
    greedy = jax.lax.top_k(logits.astype(jnp.float32), 1)[1][:, 0]          # top_k: lowest index on ties
    return jnp.where(sb.temperature > 0, sampled, greedy).astype(jnp.int32)
