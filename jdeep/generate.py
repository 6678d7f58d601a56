"""Notebook-level API: chunked prefill of a ragged batch, an on-device decode loop, and a no-cache
forward. Shapes are bucketed (batch, chunk length, max length) so repeated calls reuse programs."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .model import Model, model_step

__all__ = ["GenerateOutput", "generate", "forward", "prefill", "validate_prompts", "length_bucket"]

MIN_BUCKET = 16


def length_bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


@dataclass
class GenerateOutput:
    tokens: np.ndarray               # int32 [B, max_new_tokens]
    logits: np.ndarray | None        # float32 [B, max_new_tokens, vocab]; row 0 = last prompt position


def validate_prompts(model: Model, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    out = []
    V = model.config.vocab_size
    for i, p in enumerate(prompts):
        a = np.asarray(p)
        if a.ndim != 1 or a.size == 0:
            raise ValueError(f"prompt {i} must be a non-empty 1-D list of token ids, got shape {a.shape}")
        if not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"prompt {i} must hold integer token ids, got dtype {a.dtype}")
        bad = (a < 0) | (a >= V)
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(f"prompt {i}: token id {int(a[j])} at index {j} is outside the vocabulary [0, {V})")
        out.append(a.astype(np.int32))
    return out


def prefill(model: Model, state: dict, prompts: list[np.ndarray], chunk_size: int = 512,
            history=None) -> tuple[jax.Array, dict]:
    """Run every prompt (row b of the batch; extra rows stay empty) through the model in chunks.
    `history`: the batch's Engram histories (models with Engram; advanced in place).

    Returns (logits fp32 [B, V] at each prompt's last token, state)."""
    B = jax.tree_util.tree_leaves(state)[0].shape[1]
    lens = np.array([len(p) for p in prompts] + [0] * (B - len(prompts)))
    step = model.step_fn(all_logits=False)
    last = None
    for start in range(0, int(lens.max()), chunk_size):
        n = np.clip(lens - start, 0, chunk_size)
        S = length_bucket(int(n.max()))
        toks = np.zeros((B, S), np.int32)
        pos = np.full((B, S), -1, np.int32)
        for b, p in enumerate(prompts):
            if n[b] > 0:
                toks[b, :n[b]] = p[start:start + n[b]]
                pos[b, :n[b]] = np.arange(start, start + n[b])
        eng = model.engram_inputs(history, toks, pos)
        logits, state = step(model.params, state, jnp.asarray(toks), jnp.asarray(pos), eng)
        ends_here = jnp.asarray((lens > start) & (lens <= start + chunk_size))
        last = logits if last is None else jnp.where(ends_here[:, None], logits, last)
    return last, state


def _pick(logits: jax.Array, temperature: float, key: jax.Array) -> jax.Array:
    """Greedy (temperature 0, lowest index on ties) or Gumbel-max sampling; top_k avoids argmax's
    variadic reduce (Neuron)."""
    if temperature > 0:
        logits = logits / temperature + jax.random.gumbel(key, logits.shape, jnp.float32)
    return jax.lax.top_k(logits, 1)[1][:, 0].astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("model_step_fn", "n_steps", "temperature", "keep_logits"),
                   donate_argnums=(1,))
def _decode_loop(params, state, first_logits, lens, key, *, model_step_fn, n_steps, temperature, keep_logits):
    """Sample the first token from the prefill logits, then n_steps decode steps on device."""
    key, sub = jax.random.split(key)
    tok = _pick(first_logits, temperature, sub)

    def body(carry, i):
        state, tok, key = carry
        pos = (lens + i)[:, None]
        pos = jnp.where(lens[:, None] > 0, pos, -1)
        logits, state = model_step_fn(params, state, tok[:, None], pos)
        key, sub = jax.random.split(key)
        nxt = _pick(logits, temperature, sub)
        return (state, nxt, key), (nxt, logits if keep_logits else None)

    (state, _, _), (toks, logits) = jax.lax.scan(body, (state, tok, key), jnp.arange(n_steps, dtype=jnp.int32))
    toks = jnp.concatenate([tok[None], toks], axis=0).T
    if keep_logits:
        logits = jnp.concatenate([first_logits[None], logits], axis=0).transpose(1, 0, 2)
    return toks, logits, state


def generate(model: Model, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16, temperature: float = 0.0,
             return_logits: bool = False, seed: int = 0, prefill_chunk: int = 512) -> GenerateOutput:
    """Generate `max_new_tokens` tokens after each prompt (a ragged batch of token-id lists).

    temperature 0 is greedy. The decode loop runs on the device with a fixed trip count.
    """
    prompts = validate_prompts(model, prompts)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not (isinstance(temperature, (int, float)) and np.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be positive, got {prefill_chunk}")
    longest = max(len(p) for p in prompts) + max_new_tokens
    limit = model.config.max_position_embeddings
    if longest > limit:
        raise ValueError(f"prompt + max_new_tokens = {longest} tokens exceeds max_position_embeddings={limit}")
    B = len(prompts)
    Bb = 1 << (B - 1).bit_length()
    max_len = length_bucket(longest, 256)
    state = model.init_state(Bb, max_len)
    history = model.new_history(Bb)
    first, state = prefill(model, state, prompts, prefill_chunk, history)
    lens = jnp.asarray(np.array([len(p) for p in prompts] + [0] * (Bb - B), np.int32))
    if model.engram is not None:
        toks, logits = _host_decode_loop(model, state, history, first, lens, jax.random.PRNGKey(seed),
                                         n_steps=max_new_tokens - 1, temperature=float(temperature),
                                         keep_logits=return_logits)
        return GenerateOutput(toks[:B], logits[:B] if return_logits else None)
    step = functools.partial(model_step, config=model.config, plan=model.plan, numerics=model.numerics,
                             all_logits=False)
    toks, logits, _ = _decode_loop(model.params, state, first, lens, jax.random.PRNGKey(seed),
                                   model_step_fn=_Hashable(step, (model.config, model.plan, model.numerics)),
                                   n_steps=max_new_tokens - 1, temperature=float(temperature),
                                   keep_logits=return_logits)
    return GenerateOutput(np.asarray(toks)[:B], np.asarray(logits)[:B] if return_logits else None)


_pick_jit = jax.jit(_pick, static_argnames=("temperature",))


def _host_decode_loop(model: Model, state, history, first_logits, lens, key, *, n_steps, temperature, keep_logits):
    """Decode for models with Engram: each step's table rows are hashed and gathered on the host from the
    token just sampled, so the loop runs on the host (one device step per token)."""
    step = model.step_fn(all_logits=False)
    key, sub = jax.random.split(key)
    tok = _pick_jit(first_logits, temperature=temperature, key=sub)
    lens_np = np.asarray(lens)
    toks, rows = [np.asarray(tok)], [first_logits]
    for i in range(n_steps):
        pos = np.where(lens_np > 0, lens_np + i, -1).astype(np.int32)[:, None]
        eng = model.engram_inputs(history, toks[-1][:, None], pos)
        logits, state = step(model.params, state, tok[:, None], jnp.asarray(pos), eng)
        key, sub = jax.random.split(key)
        tok = _pick_jit(logits, temperature=temperature, key=sub)
        toks.append(np.asarray(tok))
        if keep_logits:
            rows.append(logits)
    logits = np.stack([np.asarray(r) for r in rows], axis=1) if keep_logits else None
    return np.stack(toks, axis=1), logits


class _Hashable:
    """A callable with a stable hash (its model's config and plan), usable as a jit-static argument."""

    def __init__(self, fn, key):
        self.fn, self.key = fn, key

    def __call__(self, *a, **k):
        return self.fn(*a, **k)

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, _Hashable) and self.key == other.key


def forward(model: Model, token_ids: Sequence[int], pad_to: int | None = None) -> np.ndarray:
    """Logits at every position of one sequence, without a persistent cache: float32 [T, V].

    The sequence runs as one chunk padded to a length bucket (or to `pad_to`, so that calls with
    different lengths share one compiled program)."""
    (ids,) = validate_prompts(model, [token_ids])
    T = len(ids)
    S = length_bucket(T) if pad_to is None else int(pad_to)
    if S < T:
        raise ValueError(f"pad_to={pad_to} is shorter than the sequence ({T} tokens)")
    state = model.init_state(1, S)
    toks = np.zeros((1, S), np.int32)
    pos = np.full((1, S), -1, np.int32)
    toks[0, :T], pos[0, :T] = ids, np.arange(T)
    eng = model.engram_inputs(model.new_history(1), toks, pos)
    logits, _ = model.step_fn(all_logits=True)(model.params, state, jnp.asarray(toks), jnp.asarray(pos), eng)
    return np.asarray(logits[0, :T])
