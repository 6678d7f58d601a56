"""What the Engine keeps on the device per slot for penalised requests, and the sampler programs it runs.

Penalties need each request's token counts: `SlotPenalties` holds a PenaltyState over the engine's whole slot pool
(counts int32 [n_slots, V], seen bool [n_slots, V]), allocated when the first penalised request arrives (servers
that never see one never pay for it). A penalised request's rows are reset when it takes a slot (its prompt's
tokens marked seen), advanced by one count per token it is given, copied along when its slot moves; rows of
other requests are never read through a non-zero penalty (their presence / frequency are 0 and repetition 1, which
leave a logit unchanged exactly).

Programs: the sampler, `sample` or `sample_logprobs` (sampling.py) with or without a PenaltyState window, per window
size; the pool's window and count programs per window size, its reset and move programs (one each: a prompt's seen
mask is built on the host); and for prompt logprobs, per prefill program (rows, S), the step's all-positions variant
and one program taking each row's last logits and every position's logprobs from it. `warm_sampling` compiles them
all for Runner.warmup.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..model.cache import PROGRAMS
from .requests import RequestError
from .sampling import PenaltyState, SamplingParams, host_batch, sample, sample_logprobs, token_logprobs
from .scheduler import Window

__all__ = ["SlotPenalties", "sampler", "warm_sampling", "logprob_entries", "chunk_prompt_logprobs",
           "refuse_unsupported", "SPECULATIVE_UNSUPPORTED"]

# what speculative decoding's verify programs do not apply yet: they take these only "off" (docs/speculative.md's
# feature matrix says why; logit_bias and min_tokens apply at every verified position: acceptance.adjusted, and
# logprobs come from the target's logits at each emitted position: acceptance.Emitted)
SPECULATIVE_UNSUPPORTED = (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1),
                           ("prompt_logprobs", None))


def refuse_unsupported(params, unsupported, engine: str) -> None:
    """RequestError naming the first field of `unsupported` ((name, off value) pairs) that params sets."""
    for name, off in unsupported:
        v = getattr(params, name)
        if not (v == off or (off == () and not v)):
            raise RequestError(f"{name} is not supported by {engine} (speculative decoding)", name)


def _reset_row(pen: PenaltyState, slot, seen) -> PenaltyState:
    """Row `slot` of the pool: no counts, the prompt's tokens seen (seen bool [V], built on the host)."""
    return PenaltyState(pen.counts.at[slot].set(0), pen.seen.at[slot].set(seen))


def _count(pen: PenaltyState, start, tokens, live) -> PenaltyState:
    """Add tokens int32 [rows] (where live [rows]) to the counts of the window's rows start .. start + rows."""
    rows = start + jnp.arange(tokens.shape[0])
    ids = jnp.clip(tokens, 0, pen.counts.shape[1] - 1)
    return pen._replace(counts=pen.counts.at[rows, ids].add(live.astype(jnp.int32)))


def _window(pen: PenaltyState, start, *, rows: int) -> PenaltyState:
    return PenaltyState(*(jax.lax.dynamic_slice_in_dim(a, start, rows, axis=0) for a in pen))


def _move(pen: PenaltyState, src, dst) -> PenaltyState:
    return PenaltyState(*(a.at[dst].set(a[src]) for a in pen))


class SlotPenalties:
    """The pool's PenaltyState on the device (None until a penalised request arrives)."""

    def __init__(self, n_slots: int, vocab: int, put):
        self.n_slots, self.vocab, self.put = n_slots, vocab, put
        self.state: PenaltyState | None = None

    def admit(self, slot: int, prompt: np.ndarray) -> None:
        """A penalised request took `slot`: reset its row (allocating the pool's state on first use). One program
        whatever the prompt's length: its seen mask is built here."""
        if self.state is None:
            self.state = PenaltyState(self.put(np.zeros((self.n_slots, self.vocab), np.int32)),
                                      self.put(np.zeros((self.n_slots, self.vocab), bool)))
        seen = np.zeros(self.vocab, bool)
        seen[np.asarray(prompt, np.int64)] = True
        self.state = PROGRAMS.jit(_reset_row, donate_argnums=(0,))(self.state, self.put(np.int32(slot)),
                                                                    self.put(seen))

    def window(self, start: int, rows: int) -> PenaltyState:
        return PROGRAMS.jit(_window, static_argnames=("rows",))(self.state, self.put(np.int32(start)), rows=rows)

    def count(self, start: int, tokens, live: np.ndarray) -> None:
        self.state = PROGRAMS.jit(_count, donate_argnums=(0,))(self.state, self.put(np.int32(start)), tokens,
                                                                self.put(live))

    def move(self, src: int, dst: int) -> None:
        if self.state is not None:
            self.state = PROGRAMS.jit(_move, donate_argnums=(0,))(self.state, self.put(np.int32(src)),
                                                                   self.put(np.int32(dst)))


def sampler(logprobs: bool):
    """The jitted sampler: (logits [B, V], SamplingBatch, step int32 [B], PenaltyState | None) -> tokens, or
    (tokens, logprob, top ids, top values) with logprobs."""
    return PROGRAMS.jit(sample_logprobs if logprobs else sample)


def logprob_entries(tok: int, lp: float, ids: np.ndarray, vals: np.ndarray, n: int) -> tuple:
    """One token's (token id, logprob, [(id, logprob)] * n) from the sampler's outputs."""
    return int(tok), float(lp), [(int(i), float(v)) for i, v in zip(ids[:n], vals[:n])]


def _prompt_outputs(logits, positions, targets):
    last = jnp.maximum(jnp.sum(positions >= 0, axis=1) - 1, 0)
    return (jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0], *token_logprobs(logits, targets))


def chunk_prompt_logprobs(model, logits: jax.Array, positions: np.ndarray, asked: dict[int, tuple]
                          ) -> tuple[jax.Array, dict]:
    """One prefill chunk's all-position logits [rows, S, V] (positions int32 [rows, S], -1 = padding) -> (each row's
    logits at its last real position [rows, V], on the device; the prompt logprobs of the rows that asked). asked
    maps a row to (its prompt ids, the prompt tokens before this chunk, top N); the entries (logprob_entries) are
    those of the prompt tokens the chunk's positions predict, row -> list. One program per (rows, S)."""
    targets = np.full(positions.shape, -1, np.int32)          # the next prompt token after each position
    for r, (ids, before, _) in asked.items():
        n = int(np.sum(positions[r] >= 0))
        nxt = ids[before + 1:before + n + 1]
        targets[r, :len(nxt)] = nxt
    last, *outs = PROGRAMS.jit(_prompt_outputs)(logits, model.put(positions), model.put(targets))
    if not asked:
        return last, {}
    lp, top_ids, top = (model.fetch(a) for a in outs)
    return last, {r: [logprob_entries(targets[r, j], lp[r, j], top_ids[r, j], top[r, j], n_top)
                      for j in np.flatnonzero(targets[r] >= 0)] for r, (_, _, n_top) in asked.items()}


def warm_sampling(runner, logits: dict[int, jax.Array], prompt_logprobs: bool = True) -> int:
    """Compile what sampling adds to a runner's step programs (Runner.warmup), placed as in serving: per window size
    n (logits[n]: a step's logits [n, V]) the sampler's four variants (logprobs or not, penalties or not) and the
    penalty pool's window and count programs; the pool's reset and (with more than one slot to move between) move
    programs; with prompt_logprobs, per prefill program (rows, S) its all-positions step and the prompt-logprob
    program. Returns the number of programs run. Rows carry position -1 and counts add nothing; the pool's penalty
    state is left as it was (not allocated if no penalised request came yet)."""
    model, pen, sched = runner.model, runner.pool.penalties, runner.scheduler
    kept, pen.state = pen.state, None
    pen.admit(0, np.zeros(1, np.int32))
    n = 1
    for rows in sched.decode_programs():
        args = model.to_sampler((logits[rows], host_batch([SamplingParams()] * rows), np.zeros(rows, np.int32)))
        window = pen.window(0, rows)
        for want, p in ((False, None), (True, None), (False, window), (True, window)):
            out = sampler(want)(*args, p)
        pen.count(0, out[0], np.zeros(rows, bool))
        n += 6
    if sched.window_mode != "pool" and runner.pool.n_slots > 1:
        pen.move(0, 0)
        n += 1
    for rows, S in sched.prefill_programs() if prompt_logprobs else ():
        pos = np.full((rows, S), -1, np.int32)
        chunk_prompt_logprobs(model, runner.run(np.zeros((rows, S), np.int32), pos, Window(0, rows), True), pos, {})
        n += 2
    jax.block_until_ready(pen.state)
    pen.state = kept
    return n
