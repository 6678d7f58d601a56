"""Per-request sampling on the device, vectorised over the batch (each row with its own values).

Order: logit_bias, then the penalties (repetition, then presence / frequency; vLLM applies bias before them too),
then min_tokens (the request's stop ids and EOS at -inf until it has min_tokens tokens), then, as in
transformers' logits warpers, temperature -> top-k -> top-p -> min-p, and a Gumbel-max draw from the surviving
tokens (greedy rows take the argmax of the biased, penalised logits). Penalties (OpenAI's and CTRL's definitions):
a token generated c times so far loses presence * (c > 0) + frequency * c; a token seen in the prompt or the output
has its logit l divided by repetition if l > 0, else multiplied by it. They need the request's token counts: a
dense [B, V] count of generated tokens and a [B, V] mask of the prompt's tokens, passed only when some row uses a
penalty (`PenaltyState`), so plain requests run the programs they always ran. Logprobs are the log-softmax of the
model's raw logits (before bias, penalties, temperature and filtering: vLLM's default `raw_logprobs`), from the
same logits array the token is drawn from: the drawn token's and the TOP_LOGPROBS_WIDTH most likely (lowest id
first among ties). Rows with temperature 0 are greedy (lowest token id on ties). No sort: top-k
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

__all__ = ["SamplingParams", "SamplingBatch", "PenaltyState", "sample", "sample_logprobs", "batch_params", "host_batch", "abstract_batch",
           "TOP_K_MAX", "TOP_P_ITERS", "INT32_MAX", "SEED_MAX", "FLOAT32_MAX", "MAX_STOP_TOKEN_IDS", "MAX_STOP_STRINGS",
           "MAX_STOP_CHARS", "MAX_LOGIT_BIAS", "MAX_TOP_LOGPROBS", "TOP_LOGPROBS_WIDTH", "MAX_PENALTY",
           "MIN_STOP_WIDTH"]

TOP_K_MAX = 1024     # largest top_k honoured exactly (a static top_k width); larger values mean "off"
TOP_P_ITERS = 32     # bisection steps of the top-p threshold (resolution p_max * 2^-32)
# Validation bounds (SamplingParams.validate): what the device arrays and the host loops can hold.
INT32_MAX = 2 ** 31 - 1                      # top_k, max_new_tokens: int32 on the device
SEED_MAX = 2 ** 63 - 1                       # seed: an int64 (jax.random.PRNGKey's range)
FLOAT32_MAX = float(np.finfo(np.float32).max)
MAX_STOP_TOKEN_IDS = 256                     # stop_token_ids per request
MAX_STOP_STRINGS = 32                        # stop strings per request ...
MAX_STOP_CHARS = 1024                        # ... each at most this long
MAX_LOGIT_BIAS = 300                         # logit_bias entries per request (OpenAI's limit); bias in [-100, 100]
MAX_TOP_LOGPROBS = 20                        # top alternatives per token (OpenAI's top_logprobs limit)
TOP_LOGPROBS_WIDTH = MAX_TOP_LOGPROBS        # the static width the sampler returns them in
MAX_PENALTY = 2.0                            # presence / frequency penalties in [-2, 2] (OpenAI's range)
MIN_STOP_WIDTH = MAX_STOP_TOKEN_IDS + 1     # the ids min_tokens holds back: stop_token_ids and EOS


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias) pairs
    min_tokens: int = 0
    logprobs: int | None = None          # None: off; N: the drawn token's logprob and the N most likely tokens'
    prompt_logprobs: int | None = None   # the same for every prompt token after the first
    skip_special_tokens: bool = True     # special tokens left out of the request's text

    @property
    def penalized(self) -> bool:
        """Whether the request needs its token counts (a presence, frequency or repetition penalty)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

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
        for name in ("presence_penalty", "frequency_penalty"):
            if abs(num(name)) > MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {getattr(self, name)}")
        if not 0 < num("repetition_penalty") <= 100:
            raise ValueError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")
        self._validate_bias(vocab_size)
        integer("min_tokens", 0, INT32_MAX)
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_new_tokens ({self.max_new_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                integer(name, 0, MAX_TOP_LOGPROBS)
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be a boolean, got {_show(self.skip_special_tokens)}")
        return self

    def _validate_bias(self, vocab_size: int) -> None:
        bias = self.logit_bias
        if isinstance(bias, (str, bytes)) or not isinstance(bias, (tuple, list)) or len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias must be at most {MAX_LOGIT_BIAS} (token id, bias) pairs, got {_show(bias)}")
        for pair in bias:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"logit_bias entries must be (token id, bias) pairs, got {_show(pair)}")
            t, b = pair
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size:
                raise ValueError(f"logit_bias: {_show(t)} is not a token id in [0, {vocab_size})")
            if isinstance(b, bool) or not isinstance(b, (int, float, np.floating, np.integer)) or not (
                    math.isfinite(float(b)) and -100 <= float(b) <= 100):
                raise ValueError(f"logit_bias: the bias of token {t} must be a number in [-100, 100], got {_show(b)}")


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
    (each request's PRNG key data); presence / frequency / repetition f32 [B]; bias_ids i32 [B, MAX_LOGIT_BIAS]
    (-1 = unused) and bias f32 [B, MAX_LOGIT_BIAS]; min_tokens i32 [B] and min_stops i32 [B, W] (-1 = unused): the
    ids held back until then."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    keys: jax.Array
    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array
    bias_ids: jax.Array
    bias: jax.Array
    min_tokens: jax.Array
    min_stops: jax.Array


class PenaltyState(NamedTuple):
    """A batch's token counts for the penalties: counts i32 [B, V] (each token's count in the output so far) and
    seen bool [B, V] (tokens of the prompt)."""

    counts: jax.Array
    seen: jax.Array


def batch_params(params: Sequence[SamplingParams], batch: int | None = None, default_seed: int = 0,
                 stop_ids: Sequence[Sequence[int]] | None = None) -> SamplingBatch:
    """Stack per-request params (padded with greedy rows up to `batch`). Requests without a seed get
    default_seed + their row index. stop_ids: each request's ids that end it (its Request.stop_ids: stop_token_ids
    and EOS), held back while it has fewer than min_tokens tokens."""
    B = batch or len(params)
    pad = [SamplingParams()] * (B - len(params))
    ps = list(params) + pad
    seeds = [p.seed if p.seed is not None else default_seed + i for i, p in enumerate(ps)]
    keys = np.stack([np.asarray(jax.random.key_data(jax.random.PRNGKey(s))) for s in seeds]).astype(np.uint32)
    top_k = [p.top_k if 0 < p.top_k <= TOP_K_MAX else 0 for p in ps]
    bias_ids = np.full((B, MAX_LOGIT_BIAS), -1, np.int32)
    bias = np.zeros((B, MAX_LOGIT_BIAS), np.float32)
    min_stops = np.full((B, MIN_STOP_WIDTH), -1, np.int32)
    for b, p in enumerate(ps):
        for j, (t, v) in enumerate(p.logit_bias):
            bias_ids[b, j], bias[b, j] = t, v
        if p.min_tokens and stop_ids is not None and b < len(stop_ids):
            ids = list(stop_ids[b])[:MIN_STOP_WIDTH]
            min_stops[b, :len(ids)] = ids

    def f32(name):
        return np.asarray([getattr(p, name) for p in ps], np.float32)

    # built in numpy, then moved as they are (a dtype conversion on the device would be a program of its own)
    rows = (f32("temperature"), np.asarray(top_k, np.int32), f32("top_p"), f32("min_p"), keys,
            f32("presence_penalty"), f32("frequency_penalty"), f32("repetition_penalty"), bias_ids, bias,
            np.asarray([p.min_tokens for p in ps], np.int32), min_stops)
    return SamplingBatch(*(jnp.asarray(a) for a in rows))


def host_batch(params: Sequence[SamplingParams], stop_ids: Sequence[Sequence[int]] | None = None) -> SamplingBatch:
    """batch_params(params, stop_ids=stop_ids) as numpy arrays on the host (an engine's per-slot rows: a window's rows
    are then a slice, not a device program)."""
    return SamplingBatch(*(np.asarray(a) for a in batch_params(params, len(params), stop_ids=stop_ids)))


def abstract_batch(B: int) -> SamplingBatch:
    """The SamplingBatch of B rows as jax.ShapeDtypeStruct leaves (for lowering programs without values)."""
    f, i = jax.ShapeDtypeStruct((B,), jnp.float32), jax.ShapeDtypeStruct((B,), jnp.int32)
    bias_ids, bias = (jax.ShapeDtypeStruct((B, MAX_LOGIT_BIAS), dt) for dt in (jnp.int32, jnp.float32))
    return SamplingBatch(f, i, f, f, jax.ShapeDtypeStruct((B, 2), jnp.uint32), f, f, f, bias_ids, bias, i,
                         jax.ShapeDtypeStruct((B, MIN_STOP_WIDTH), jnp.int32))


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


def _ids_or_spare(ids: jax.Array, V: int) -> jax.Array:
    """Token ids with -1 (unused) sent to a spare column V, clamped (compile-safety rule S12: every data-dependent
    scatter index is clamped and in bounds; the spare column is sliced off)."""
    return jnp.clip(jnp.where(ids >= 0, ids, V), 0, V)


def adjusted_logits(logits: jax.Array, sb: SamplingBatch, step: jax.Array, pen: PenaltyState | None) -> jax.Array:
    """logits [B, V] -> float32 [B, V] with logit_bias, the penalties (given `pen`) and min_tokens applied; step
    int32 [B]: tokens each row has generated so far."""
    x = logits.astype(jnp.float32)
    B, V = x.shape
    rows = jnp.arange(B)[:, None]
    spare = jnp.zeros((B, 1), jnp.float32)
    x = jnp.concatenate([x, spare], axis=1).at[rows, _ids_or_spare(sb.bias_ids, V)].add(sb.bias)[:, :V]
    if pen is not None:
        rep = sb.repetition[:, None]
        used = pen.counts > 0
        x = jnp.where(used | pen.seen, jnp.where(x > 0, x / rep, x * rep), x)
        x = x - sb.frequency[:, None] * pen.counts.astype(jnp.float32) - sb.presence[:, None] * used
    held = jnp.zeros((B, V + 1), jnp.float32).at[rows, _ids_or_spare(sb.min_stops, V)].max(1.0)[:, :V] > 0
    return jnp.where(held & (step < sb.min_tokens)[:, None], -jnp.inf, x)


def sample(logits: jax.Array, sb: SamplingBatch, step: jax.Array, pen: PenaltyState | None = None) -> jax.Array:
    """Next token per row: logits [B, V] fp32, step int32 scalar or [B] (each request's own step count,
    mixed into its key; min_tokens counts it), pen: the rows' token counts when some row uses a penalty
    -> int32 [B]."""
    B = logits.shape[0]
    step = jnp.broadcast_to(jnp.asarray(step, jnp.int32), (B,))
    adjusted = adjusted_logits(logits, sb, step, pen)
    x = filtered_logits(adjusted, sb)

    def noise(key_data, s):
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data, impl="threefry2x32"), s)
        return jax.random.gumbel(key, (logits.shape[-1],), jnp.float32)

    g = jax.vmap(noise)(sb.keys, step)
    sampled = jax.lax.top_k(x + g, 1)[1][:, 0]
    greedy = jax.lax.top_k(adjusted, 1)[1][:, 0]          # top_k: lowest index on ties
    return jnp.where(sb.temperature > 0, sampled, greedy).astype(jnp.int32)


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The raw log-softmax's value at tokens and its TOP_LOGPROBS_WIDTH largest: logits [..., V], tokens int32 [...]
    -> (f32 [...], ids i32 [..., W], values f32 [..., W])."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, jnp.maximum(tokens, 0)[..., None], axis=-1)[..., 0]
    vals, ids = jax.lax.top_k(lp, min(TOP_LOGPROBS_WIDTH, lp.shape[-1]))
    return chosen, ids.astype(jnp.int32), vals


def sample_logprobs(logits: jax.Array, sb: SamplingBatch, step: jax.Array, pen: PenaltyState | None = None):
    """sample, plus the drawn tokens' logprobs: (tokens i32 [B], logprob f32 [B], top ids i32 [B, W],
    top f32 [B, W])."""
    tok = sample(logits, sb, step, pen)
    return (tok, *token_logprobs(logits, tok))
