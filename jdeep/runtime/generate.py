"""Notebook-level API: chunked prefill of a ragged batch, an on-device decode loop, and a no-cache
forward. Shapes are bucketed (batch, chunk length, max length) so repeated calls reuse programs."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..model.model import Model, model_step
from .sampling import SamplingParams, batch_params, sample
from .stops import StopMatcher

__all__ = ["GenerateOutput", "generate", "forward", "prefill", "validate_prompts", "length_bucket"]

MIN_BUCKET = 16


def length_bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


@dataclass
class GenerateOutput:
    tokens: np.ndarray               # int32 [B, max_new_tokens]; -1 after a request ended (stop token / EOS kept)
    logits: np.ndarray | None        # float32 [B, max_new_tokens, vocab]; row 0 = last prompt position; NaN after the end
    lengths: np.ndarray | None = None  # int [B]: tokens generated per request
    texts: list[str] | None = None   # the generated text per request (cut before a stop string), given a tokenizer


def validate_prompts(model: Model, prompts: Sequence[Sequence[int] | str], tokenizer=None) -> list[np.ndarray]:
    """Prompts (token-id lists, or strings encoded with `tokenizer`) -> int32 id arrays; ValueError naming
    the first bad prompt."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists (or of strings, with a tokenizer)")
    out = []
    V = model.config.vocab_size
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(f"prompt {i} is text but the model has no tokenizer (no tokenizer.json in its "
                                 "folder): pass token ids or tokenizer=")
            p = tokenizer.encode(p)
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
        logits, state = step(model.params, state, model.put(toks), model.put(pos), eng)
        ends_here = model.put((lens > start) & (lens <= start + chunk_size))
        last = logits if last is None else jnp.where(ends_here[:, None], logits, last)
    return last, state


def _advance(logits, carry, lens, sb, stops, max_new, keep_logits):
    """After one decode step: sample the next tokens and update carry = (tok [B], count [B], done [B])."""
    tok, count, done = carry
    nxt = jnp.where(done, -1, sample(logits, sb, count))
    count = count + (~done).astype(jnp.int32)
    done = done | jnp.any(nxt[:, None] == stops, axis=-1) | (count >= max_new)
    out_logits = jnp.where((nxt < 0)[:, None], jnp.nan, logits) if keep_logits else None
    return (nxt, count, done), out_logits


def _feed(carry, lens):
    """The (tokens [B, 1], positions [B, 1]) a decode step feeds; a done row feeds position -1 (no writes)."""
    tok, count, done = carry
    return jnp.maximum(tok, 0)[:, None], jnp.where(done, -1, lens + count - 1)[:, None]


def _decode_block(params, state, engram, carry, lens, sb, stops, max_new, *, model_step_fn, n_steps, keep_logits):
    """n_steps decode steps on the device. carry = (tok [B] last token, count [B] tokens generated so far,
    done [B]); a done row feeds position -1 (no state writes) and emits -1. Returns (state, carry,
    tokens [n_steps, B], logits [n_steps, B, V] | None)."""
    def body(c, _):
        state, carry = c
        logits, state = model_step_fn(params, state, *_feed(carry, lens), engram)
        carry, out_logits = _advance(logits, carry, lens, sb, stops, max_new, keep_logits)
        return (state, carry), (carry[0], out_logits)

    (state, carry), (toks, logits) = jax.lax.scan(body, (state, carry), None, length=n_steps)
    return state, carry, toks, logits


def _host_decode_block(model: Model, state, engram, carry, lens, sb, stops, max_new, *, n_steps, keep_logits):
    """The same as _decode_block with the loop on the host, for models whose step is not one jitted program
    (regions compile mode, host-resident embedding)."""
    step = model.step_fn(all_logits=False)
    toks, logits = [], []
    for _ in range(n_steps):
        tok, pos = _feed_jit(carry, lens)
        if model.sampler_device is not None:             # back through the host to the model's device
            tok, pos = np.asarray(tok), np.asarray(pos)
        out, state = step(model.params, state, tok, pos, engram)
        carry, lg = _advance_jit(model.to_sampler(out), carry, lens, sb, stops, max_new, keep_logits)
        toks.append(carry[0])
        logits.append(lg)
    return state, carry, jnp.stack(toks), jnp.stack(logits) if keep_logits else None


_decode_block_jit = jax.jit(_decode_block, static_argnames=("model_step_fn", "n_steps", "keep_logits"),
                            donate_argnums=(1,))
_advance_jit = jax.jit(_advance, static_argnums=(6,))
_feed_jit = jax.jit(_feed)
_sample_jit = jax.jit(sample)


@jax.jit
def _first_done_jit(tok, stops, max_new, lens):
    return jnp.any(tok[:, None] == stops, axis=-1) | (max_new <= 1) | (lens == 0)


def _sampling_for(n: int, sampling, max_new_tokens: int, temperature: float, seed: int
                  ) -> list[SamplingParams]:
    if sampling is None:
        sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
        return [dataclasses.replace(sampling, seed=seed + i) for i in range(n)]
    if isinstance(sampling, SamplingParams):
        return [sampling if sampling.seed is None or n == 1 else dataclasses.replace(sampling, seed=sampling.seed + i)
                for i in range(n)]
    sampling = list(sampling)
    if len(sampling) != n or not all(isinstance(p, SamplingParams) for p in sampling):
        raise ValueError(f"sampling must be one SamplingParams or one per prompt ({n}), got {len(sampling)} items")
    return sampling


def generate(model: Model, prompts: Sequence[Sequence[int] | str], max_new_tokens: int = 16, temperature: float = 0.0,
             return_logits: bool = False, seed: int = 0, prefill_chunk: int = 512,
             sampling: SamplingParams | Sequence[SamplingParams] | None = None, ignore_eos: bool = False,
             stream: Callable[[list[list[int]]], None] | None = None, stream_every: int = 16,
             tokenizer=None) -> GenerateOutput:
    """Generate after each prompt of a ragged batch of token-id lists or strings.

    sampling: one SamplingParams for every prompt or one per prompt (temperature, top-k, top-p, min-p,
    seed, max_new_tokens, stop_token_ids, stop strings); without it, `max_new_tokens`, `temperature` and
    `seed` apply (prompt i seeded seed + i). A request ends at its max_new_tokens, at one of its stop tokens
    or at the model's EOS (kept in the output; `ignore_eos` disables the EOS stop), or once its text
    contains one of its stop strings (checked on the host between blocks; the tokens after the one that
    completed it are dropped, and `texts` ends before it).
    tokenizer: for text prompts, stop strings and `texts` (default: model.tokenizer, from the folder's
    tokenizer.json).
    The decode loop runs on the device in blocks of `stream_every` steps with a fixed trip count and
    per-sequence done masks (in the regions compile mode, or with host-resident embedding, the same loop
    runs on the host, one step call per token); between blocks `stream(new_tokens)` (if given) receives each request's tokens
    since the last call, and generation ends early once every request is done. Models with Engram layers
    decode one step per block (their table rows are gathered on the host from the token just sampled).
    """
    tokenizer = tokenizer if tokenizer is not None else model.tokenizer
    prompts = validate_prompts(model, prompts, tokenizer)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not (isinstance(temperature, (int, float)) and np.isfinite(temperature)
                                             and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be positive, got {prefill_chunk}")
    if stream_every < 1:
        raise ValueError(f"stream_every must be positive, got {stream_every}")
    V = model.config.vocab_size
    params = [p.validate(V) for p in _sampling_for(len(prompts), sampling, max_new_tokens, temperature, seed)]
    if any(p.stop for p in params) and tokenizer is None:
        raise ValueError("stop strings need a tokenizer (the model has no tokenizer.json): use stop_token_ids")
    n_new = max(p.max_new_tokens for p in params)
    longest = max(len(pr) + p.max_new_tokens for pr, p in zip(prompts, params))
    limit = model.config.max_position_embeddings
    if longest > limit:
        raise ValueError(f"prompt + max_new_tokens = {longest} tokens exceeds max_position_embeddings={limit}")
    B = len(prompts)
    Bb = 1 << (B - 1).bit_length()
    max_len = length_bucket(longest, 256)
    state = model.init_state(Bb, max_len)
    history = model.new_history(Bb)
    first, state = prefill(model, state, prompts, prefill_chunk, history)

    eos = () if ignore_eos or model.config.eos_token_id is None else (model.config.eos_token_id,)
    stop_lists = [tuple(dict.fromkeys(tuple(p.stop_token_ids) + eos)) for p in params]
    width = max(1, max(len(s) for s in stop_lists))
    stops = np.full((Bb, width), -1, np.int32)
    for b, st in enumerate(stop_lists):
        stops[b, :len(st)] = st
    sb = batch_params(params, Bb, default_seed=seed)
    max_new = np.asarray([p.max_new_tokens for p in params] + [1] * (Bb - B), np.int32)
    lens = np.array([len(p) for p in prompts] + [0] * (Bb - B), np.int32)

    first, sb, stops, max_new, lens, zeros, ones = model.to_sampler(
        (first, sb, stops, max_new, lens, np.zeros((Bb,), np.int32), np.ones((Bb,), np.int32)))
    tok = _sample_jit(first, sb, zeros)
    done = _first_done_jit(tok, stops, max_new, lens)
    carry = (tok, ones, done)
    fetch = model.fetch
    tokens, logits = [fetch(tok)[:, None]], [fetch(first)[:, None]] if return_logits else None
    matchers = {b: StopMatcher(tokenizer, p.stop) for b, p in enumerate(params) if p.stop}
    kept = np.full(B, n_new)          # tokens kept per request (a stop string ends one early)
    sent = np.zeros(B, int)           # tokens already streamed per request

    def after_block(new: np.ndarray) -> None:
        """Stop strings and streaming for a block of new tokens [Bb, n] (-1 = ended)."""
        nonlocal carry
        stopped = []
        for b, m in matchers.items():
            if not m.stopped:
                m.push(t for t in new[b] if t >= 0)
                if m.stopped:
                    kept[b] = m.n_tokens
                    stopped.append(b)
        if stopped:                                  # end those rows on the device too
            done = np.array(fetch(carry[2]))
            done[stopped] = True
            carry = (carry[0], carry[1], model.to_sampler(done) if model.layout is not None else jnp.asarray(done))
        if stream is not None:
            chunks = []
            for b in range(B):
                row = [int(t) for t in new[b] if t >= 0][:max(0, kept[b] - sent[b])]
                sent[b] += len(row)
                chunks.append(row)
            stream(chunks)

    after_block(tokens[0])
    step_fn = _Hashable(functools.partial(model_step, config=model.config, plan=model.plan, numerics=model.numerics,
                                          all_logits=False, layout=model.layout),
                        (model.config, model.plan, model.numerics, model.layout))
    # power-of-two blocks: a handful of compiled programs whatever max_new_tokens is
    block = 1 if model.engram is not None else min(length_bucket(stream_every, 1), length_bucket(n_new - 1, 1))
    produced = 1
    while produced < n_new and not bool(np.all(fetch(carry[2]))):
        engram = None
        if model.engram is not None:
            t_last, count, dn = (fetch(c) for c in carry)
            pos = np.where(dn, -1, fetch(lens) + count - 1).astype(np.int32)[:, None]
            engram = model.engram_inputs(history, np.maximum(t_last, 0)[:, None], pos)
        if model.host_loop:
            state, carry, toks, lg = _host_decode_block(model, state, engram, carry, lens, sb, stops, max_new,
                                                        n_steps=block, keep_logits=return_logits)
        else:
            state, carry, toks, lg = _decode_block_jit(model.params, state, engram, carry, lens, sb, stops, max_new,
                                                       model_step_fn=step_fn, n_steps=block,
                                                       keep_logits=return_logits)
        toks = fetch(toks).T                                             # [B, block]
        tokens.append(toks)
        if return_logits:
            logits.append(fetch(lg).transpose(1, 0, 2))
        produced += block
        after_block(toks)
    out = np.concatenate(tokens, axis=1)[:B, :n_new]
    out_logits = None
    if return_logits:
        out_logits = np.concatenate(logits, axis=1)[:B, :n_new]
        if out_logits.shape[1] < n_new:   # every request ended early
            pad = np.full((B, n_new - out_logits.shape[1], V), np.nan, np.float32)
            out_logits = np.concatenate([out_logits, pad], axis=1)
    if out.shape[1] < n_new:
        out = np.concatenate([out, np.full((B, n_new - out.shape[1]), -1, np.int32)], axis=1)
    for b in range(B):                     # tokens after a stop string's last token are dropped
        out[b, kept[b]:] = -1
        if out_logits is not None:
            out_logits[b, kept[b]:] = np.nan
    lengths = np.sum(out >= 0, axis=1)
    texts = None
    if tokenizer is not None:
        texts = [matchers[b].text if b in matchers and matchers[b].stopped else tokenizer.decode(out[b, :lengths[b]])
                 for b in range(B)]
    return GenerateOutput(out, out_logits, lengths, texts)


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
    logits, _ = model.step_fn(all_logits=True)(model.params, state, model.put(toks), model.put(pos), eng)
    return model.fetch(logits)[0, :T]
