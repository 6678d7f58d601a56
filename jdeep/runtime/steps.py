"""The step helpers both `jdeep.generate` and the Engine run on: shape buckets, the prefill chunk packer, one
model step from host inputs, and the decode loop (on the device, or on the host for models whose step is not
one program).

A decode step's carry is (tok [B] last token, count [B] tokens generated so far, done [B], pen): a done row feeds
position -1 (no state writes) and emits -1; a row ends at one of its stop ids or at its max_new_tokens. pen is the
batch's PenaltyState (sampling.py: token counts, advanced in the loop) when some row uses a penalty, else None.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..model.cache import PROGRAMS
from ..model.model import Model
from ..model.vision import chunk_embeds
from .sampling import PenaltyState, sample, sample_logprobs

__all__ = ["MIN_BUCKET", "length_bucket", "state_length", "batch_bucket", "pack_chunk", "run_step", "decode_block", "first_done",
           "sample_program", "count_tokens"]

MIN_BUCKET = 16


def length_bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def state_length(max_len: int, decode_width: int = 1) -> int:
    """An engine's decode-state length for requests of up to max_len tokens: a 256-token bucket, with room for the
    decode_width positions a speculative iteration verifies past max_len."""
    return length_bucket(max_len + (decode_width if decode_width > 1 else 0), 256)


def batch_bucket(n: int) -> int:
    """Smallest power of two >= n: the batch-size bucket of n sequences."""
    return 1 << (int(n) - 1).bit_length()


def pack_chunk(prompts: Sequence[np.ndarray | None], done: Sequence[int], rows: int, chunk: int,
               width: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The next prefill chunk of a batch: row b takes up to `chunk` tokens of prompts[b] from offset done[b]; rows
    past len(prompts), None prompts and finished prompts stay empty (position -1, so they write no state).

    Returns (tokens int32 [rows, S], positions int32 [rows, S], taken int [rows]), S `width` (a chunk bucket the
    caller chose) or the length bucket of the longest take."""
    taken = np.zeros(rows, int)
    for b, p in enumerate(prompts):
        if p is not None:
            taken[b] = np.clip(len(p) - done[b], 0, chunk)
    S = width if width is not None else length_bucket(int(taken.max(initial=0)))
    toks = np.zeros((rows, S), np.int32)
    pos = np.full((rows, S), -1, np.int32)
    for b in np.flatnonzero(taken):
        start, n = done[b], taken[b]
        toks[b, :n] = prompts[b][start:start + n]
        pos[b, :n] = np.arange(start, start + n)
    return toks, pos, taken


def run_step(model: Model, state: dict, tokens, positions, history=None, *, engram: tuple | None = None,
             rows: int | None = None, start: int | None = None, all_logits: bool = False,
             images=None) -> tuple[jax.Array, dict]:
    """One model step from host (or device) tokens / positions int32 [B, S] (positions -1 = padding): the Engram
    rows gathered for them (advancing `history`) unless `engram` is given, the inputs placed, the step run (state
    donated). With `rows`, only a window of the state's slots: the first `rows`, or [start, start + rows) (one
    program for every start). images: per row its image spans (start, rows) (runtime.images); a chunk holding span
    positions gets their rows as input embeddings (model.vision.chunk_embeds). Returns (logits fp32, state)."""
    if engram is None:
        engram = model.engram_inputs(history, tokens, positions)
    embeds = chunk_embeds(model, np.asarray(tokens), np.asarray(positions), images) if images and any(images) else None
    step = model.step_fn(all_logits=all_logits, rows=rows)
    # positional, in one fixed form, as runtime/lowering.step_programs lowers them: a program compiled ahead of time
    # is found only by a call with the same argument structure
    args = (model.params, state, model.put(tokens), model.put(positions), engram)
    if rows is not None and start is not None:
        return step(*args, embeds, model.put(np.int32(start)))
    return step(*args) if embeds is None else step(*args, embeds)


def count_tokens(pen: PenaltyState | None, tokens: jax.Array) -> PenaltyState | None:
    """The counts after each row drew tokens int32 [B] (-1: none)."""
    if pen is None:
        return None
    rows = jnp.arange(tokens.shape[0])
    ids = jnp.clip(tokens, 0, pen.counts.shape[1] - 1)
    return pen._replace(counts=pen.counts.at[rows, ids].add((tokens >= 0).astype(jnp.int32)))


def _advance(logits, carry, sb, stops, max_new, keep_logits, want_logprobs=False):
    """After one decode step: sample the next tokens and update the carry. Returns (carry, logits or None,
    (logprob [B], top ids [B, W], top [B, W]) or None)."""
    tok, count, done, pen = carry
    out = sample_logprobs(logits, sb, count, pen) if want_logprobs else (sample(logits, sb, count, pen),)
    nxt = jnp.where(done, -1, out[0])
    count = count + (~done).astype(jnp.int32)
    done = done | jnp.any(nxt[:, None] == stops, axis=-1) | (count >= max_new)
    out_logits = jnp.where((nxt < 0)[:, None], jnp.nan, logits) if keep_logits else None
    return (nxt, count, done, count_tokens(pen, nxt)), out_logits, (out[1:] if want_logprobs else None)


def _feed(carry, lens):
    """The (tokens [B, 1], positions [B, 1]) a decode step feeds."""
    tok, count, done = carry[:3]
    return jnp.maximum(tok, 0)[:, None], jnp.where(done, -1, lens + count - 1)[:, None]


def _device_block(params, state, engram, carry, lens, sb, stops, max_new, *, step, n_steps, keep_logits,
                  want_logprobs):
    def body(c, _):
        state, carry = c
        logits, state = step(params, state, *_feed(carry, lens), engram)
        carry, out_logits, lps = _advance(logits, carry, sb, stops, max_new, keep_logits, want_logprobs)
        return (state, carry), (carry[0], out_logits, lps)

    (state, carry), (toks, logits, lps) = jax.lax.scan(body, (state, carry), None, length=n_steps)
    return state, carry, toks, logits, lps


def _device_block_program(model: Model, n_steps: int, keep_logits: bool, want_logprobs: bool):
    """The model's own step (one program, Model.step_fn) scanned n_steps times with sampling, as one program."""
    def make():
        return jax.jit(functools.partial(_device_block, step=model.step_fn(all_logits=False), n_steps=n_steps,
                                         keep_logits=keep_logits, want_logprobs=want_logprobs), donate_argnums=(1,))

    return PROGRAMS.keyed("decode_block", model.spec, make, n_steps=n_steps, keep_logits=keep_logits,
                          want_logprobs=want_logprobs)


def decode_block(model: Model, state: dict, engram: tuple | None, carry: tuple, lens, sb, stops, max_new, *,
                 n_steps: int, keep_logits: bool, want_logprobs: bool = False):
    """n_steps decode steps of every row: lens int32 [B] prompt lengths, sb the SamplingBatch, stops int32 [B, W]
    (-1 = unused), max_new int32 [B]. One program with a fixed trip count on the device; for models whose step is
    driven from the host (regions mode, host embedding, a host sampler) the same loop runs on the host.
    Returns (state, carry, tokens [n_steps, B], logits [n_steps, B, V] | None, logprobs: (logprob [n_steps, B],
    top ids [n_steps, B, W], top [n_steps, B, W]) | None); state donated."""
    if not model.host_loop:
        program = _device_block_program(model, n_steps, keep_logits, want_logprobs)
        return program(model.params, state, engram, carry, lens, sb, stops, max_new)
    feed, advance = PROGRAMS.jit(_feed), PROGRAMS.jit(_advance, static_argnums=(5, 6))
    toks, logits, lps = [], [], []
    for _ in range(n_steps):
        tok, pos = feed(carry, lens)
        if model.sampler_device is not None:             # back through the host to the model's device
            tok, pos = np.asarray(tok), np.asarray(pos)
        out, state = run_step(model, state, tok, pos, engram=engram)
        carry, lg, lp = advance(model.to_sampler(out), carry, sb, stops, max_new, keep_logits, want_logprobs)
        toks.append(carry[0])
        logits.append(lg)
        lps.append(lp)
    stacked = tuple(jnp.stack(a) for a in zip(*lps)) if want_logprobs else None
    return state, carry, jnp.stack(toks), jnp.stack(logits) if keep_logits else None, stacked


def _first_done(tok, stops, max_new, lens):
    return jnp.any(tok[:, None] == stops, axis=-1) | (max_new <= 1) | (lens == 0)


def first_done(tok, stops, max_new, lens) -> jax.Array:
    """Whether each row ends with its first token tok [B]: a stop id, max_new <= 1, or no prompt (lens 0)."""
    return PROGRAMS.jit(_first_done)(tok, stops, max_new, lens)


def sample_program(want_logprobs: bool = False):
    """The jitted sampler: (logits [B, V], SamplingBatch, step int32 [B], PenaltyState | None) -> tokens int32 [B]
    (with want_logprobs: tokens, logprob, top ids, top values)."""
    return PROGRAMS.jit(sample_logprobs if want_logprobs else sample)
