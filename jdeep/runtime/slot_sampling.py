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
and one program taking each row's last logits and every position's logprobs from it. The engine's inventory lists
them all (inventory.serving_programs) and warm-up compiles them (warmup.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..model.cache import PROGRAMS
from .requests import RequestError
from .sampling import PenaltyState, sample, sample_logprobs, token_logprobs

__all__ = ["SlotPenalties", "sampler", "logprob_entries", "chunk_prompt_logprobs",
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


def _slot(pen: PenaltyState, slot):
    """A slot index clamped to the pool (Neuron's rule S12: scatter indices derive from a clamp)."""
    return jnp.clip(slot, 0, pen.counts.shape[0] - 1)


def _reset_row(pen: PenaltyState, slot, seen) -> PenaltyState:
    """Row `slot` of the pool: no counts, the prompt's tokens seen (seen bool [V], built on the host)."""
    slot = _slot(pen, slot)
    return PenaltyState(pen.counts.at[slot].set(0), pen.seen.at[slot].set(seen))


def _count(pen: PenaltyState, start, tokens, live) -> PenaltyState:
    """Add tokens int32 [rows] (where live [rows]) to the counts of the window's rows start .. start + rows: a
    one-hot add over the window's slice, written back in place (no integer scatter-add, which Neuron computes in
    fp32: rule S11)."""
    n, V = tokens.shape[0], pen.counts.shape[1]
    window = jax.lax.dynamic_slice_in_dim(pen.counts, start, n, axis=0)
    hit = (jnp.arange(V, dtype=jnp.int32)[None, :] == tokens[:, None]) & live[:, None]
    return pen._replace(counts=jax.lax.dynamic_update_slice_in_dim(pen.counts, window + hit.astype(jnp.int32), start,
                                                                   axis=0))


def _window(pen: PenaltyState, start, *, rows: int) -> PenaltyState:
    return PenaltyState(*(jax.lax.dynamic_slice_in_dim(a, start, rows, axis=0) for a in pen))


def _move(pen: PenaltyState, src, dst) -> PenaltyState:
    src, dst = _slot(pen, src), _slot(pen, dst)
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
