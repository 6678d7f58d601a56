"""What the Engine keeps on the device per slot for penalised requests, and the sampler program it runs.

Penalties need each request's token counts: `SlotPenalties` holds a PenaltyState over the engine's whole slot pool
(counts int32 [n_slots, V], seen bool [n_slots, V]; n_slots x V x 5 bytes, allocated with the pool). A penalised
request's row is reset when it takes a slot (its prompt's tokens marked seen); every row advances by one count per
token it is given and is copied along when its slot moves. Rows of requests without penalties are read through
neutral values (presence / frequency 0, repetition 1), which leave a logit unchanged exactly, so one program serves
every request.

Programs: the sampler (`sample_window`: the window's penalty rows, the draw, the drawn tokens' logprobs and the counts'
advance in one program, logit_bias, penalties and logprobs switched by each row's values), one per window size; the
pool's reset and move programs (one each: a prompt's seen mask is built on the host; they run only for penalised
requests, so the inventory compiles them when the first one comes); and for prompt logprobs, per
prefill program (rows, S), the step's all-positions variant and one program taking each row's last logits and every
position's logprobs from it (compiled when a request first asks). The engine's inventory lists them all
(inventory.serving_programs) and warm-up compiles them (warmup.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..model.cache import PROGRAMS
from .requests import RequestError
from .sampling import PenaltyState, SamplingBatch, sample, token_logprobs

__all__ = ["SlotPenalties", "sample_window", "logprob_entries", "chunk_prompt_logprobs",
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


def sample_window(pen: PenaltyState, logits, sb: SamplingBatch, step, start, live):
    """Sample the window of rows start .. start + rows: logits f32 [rows, V], sb its sampling rows, step int32 [rows]
    (tokens each row has generated), live bool [rows] (rows given a token: their counts advance). Returns (pen,
    tokens int32 [rows], logprob f32 [rows], top ids int32 [rows, W], top f32 [rows, W]); pen donated."""
    tokens = sample(logits, sb, step, _window(pen, start, rows=logits.shape[0]))
    return (_count(pen, start, tokens, live), tokens, *token_logprobs(logits, tokens))


class SlotPenalties:
    """The pool's PenaltyState on the sampler's device (`put`: Model.to_sampler; the pool allocates it: `fresh`)."""

    def __init__(self, n_slots: int, vocab: int, put):
        self.n_slots, self.vocab, self.put = n_slots, vocab, put
        self.state: PenaltyState | None = None

    def fresh(self) -> PenaltyState:
        """A PenaltyState of no counts and nothing seen."""
        return PenaltyState(self.put(np.zeros((self.n_slots, self.vocab), np.int32)),
                            self.put(np.zeros((self.n_slots, self.vocab), bool)))

    def admit(self, slot: int, prompt: np.ndarray) -> None:
        """A penalised request took `slot`: reset its row. One program whatever the prompt's length: its seen mask is
        built here."""
        seen = np.zeros(self.vocab, bool)
        seen[np.asarray(prompt, np.int64)] = True
        self.state = PROGRAMS.jit(_reset_row, donate_argnums=(0,))(self.state, self.put(np.int32(slot)),
                                                                    self.put(seen))

    def sample(self, logits, sb: SamplingBatch, step: np.ndarray, start: int, live: np.ndarray):
        """sample_window over the pool's rows start .. start + len(live); returns [tokens, logprob, top ids, top] on
        the sampler's device."""
        args = self.put((logits, sb, step, np.int32(start), live))
        self.state, *out = PROGRAMS.jit(sample_window, donate_argnums=(0,))(self.state, *args)
        return out

    def move(self, src: int, dst: int) -> None:
        self.state = PROGRAMS.jit(_move, donate_argnums=(0,))(self.state, self.put(np.int32(src)),
                                                               self.put(np.int32(dst)))


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
