"""DeepSeek-V4.1's DSpark drafter as the engine's drafter (drafter.Drafter; dspark_decode.py describes the method):
each iteration every decoding row drafts a block after its last token, the target verifies the first k drafts (one
step, or consecutive steps where a ring is shorter than k + 1: dspark_iteration.verify) and the row takes up to
k + 1 tokens; prefill chunks also write every prompt position into the drafter's windows
(dspark_iteration.prefill_chunk). Its per-slot state is the drafter's windows (model.dspark's state, layer-major).

Without Engram layers an iteration is one program per window of slots (draft then verify). With Engram layers the
whole pool steps (the engine's window mode for them) and an iteration is two programs with a host step between, as in
dspark_decode: the draft program; the host gathers the Engram rows of [x, d_1..d_k] from a copy of the pool's n-gram
histories; the verify program; then the histories advance by the kept tokens only, so they always equal plain
decoding's. In the regions compile mode the whole pool steps too, through dspark_regions.RegionsPrograms (the draft,
per target step the undo log and the regions step, the finish).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..model.cache import PROGRAMS
from ..model.dspark import empty_dspark_state
from ..model.model import Model
from ..runtime.sampling import INT32_MAX, SamplingBatch
from ..state import move_slot, put_slot_window, slot_window, zero_slots
from .acceptance import Emitted
from .drafter import DecodeRows, PrefillChunk, RowCarry, fetch_emitted
from .dspark_decode import (check_dspark_model, check_k, dead_tokens, draft_program, iterations_program,
                           verify_program)
from .dspark_iteration import iteration, prefill_chunk
from .dspark_regions import RegionsPrograms

__all__ = ["DSparkDrafter"]


def _no_stops(rows: int) -> tuple[jax.Array, jax.Array]:
    """stops int32 [rows, 1] and max_new int32 [rows] that never end a row on the device (the host ends requests)."""
    return jnp.full((rows, 1), -1, jnp.int32), jnp.full((rows,), INT32_MAX, jnp.int32)


def _decode_window(params, state, dstate, x, p, count, live, sb, start, *, rows, k, greedy, config, plan, numerics):
    """One iteration (draft, verify) over slots [start, start + rows) as one program (models without Engram): x, p,
    count int32 [rows], live bool [rows], sb the window's sampling rows. Returns (state, dstate, emitted
    (acceptance.Emitted [rows, k+1]: tokens -1 past what the row emits), accepted int32 [rows] (-1 for rows that did
    not run))."""
    stops, max_new = _no_stops(rows)
    sw, dw, _, emitted, a, _ = iteration(params, slot_window(state, rows, start), slot_window(dstate, rows, start),
                                         RowCarry(x, p, count, ~live), sb, stops, max_new, k=k, config=config,
                                         plan=plan, numerics=numerics, greedy=greedy)
    return put_slot_window(state, sw, start), put_slot_window(dstate, dw, start), emitted, a


def _prefill_window(params, state, dstate, tokens, positions, engram, sb, start, *, rows, greedy, config, plan,
                    numerics):
    """A prefill chunk (target with the DSpark taps, then the drafter's windows) over slots [start, start + rows):
    tokens, positions int32 [rows, S]; engram the chunk's Engram rows (None without Engram). Returns (state, dstate,
    first tokens (acceptance.Emitted [rows]), meaningful for rows whose prompt ends in this chunk)."""
    first, sw, dw = prefill_chunk(params, slot_window(state, rows, start), slot_window(dstate, rows, start), tokens,
                                  positions, engram, sb, config=config, plan=plan, numerics=numerics, greedy=greedy)
    return put_slot_window(state, sw, start), put_slot_window(dstate, dw, start), first


def _slot_rows(tree, slot):
    return slot_window(tree, 1, slot)


def _move_both(state, dstate, src, dst):
    return move_slot(state, src, dst), move_slot(dstate, src, dst)


class DSparkDrafter:
    """drafter.Drafter for method "dspark" (a DeepSeek-V4.1 model loaded with its DSpark stages: jdeep.load(path,
    mtp=True)); k in [1, the checkpoint's dspark_block_size]."""

    method = "dspark"
    snapshot_lookahead = 0      # the windows hold the target's taps of each position, nothing after it

    def __init__(self, model: Model, k: int):
        check_dspark_model(model)
        check_k(model, k)
        self.model, self.k = model, k
        self._regions: dict[tuple[bool, bool], RegionsPrograms] = {}
        # with Engram the draft and the verify are two programs with the host's gather between them; the regions
        # mode's programs are called from the host too
        self.blocks_on_device = model.engram is None and model.compile_mode == "scan"
        self.programs_per_decode = 1 if self.blocks_on_device else 2

    def window_mode(self, default: str) -> str:
        # the regions mode's DSpark programs step the whole pool, as models with Engram do
        return "pool" if self.model.compile_mode == "regions" else default

    def new_state(self, n_slots: int, cache_len: int):
        m = self.model
        return jax.device_put(empty_dspark_state(m.config, m.plan, n_slots, cache_len, m.dtype, m.numerics),
                              jax.devices()[0])

    def reset_slots(self, dstate, mask):
        return PROGRAMS.jit(zero_slots, donate_argnums=(0,))(dstate, mask)

    def move_slot(self, state, dstate, src, dst):
        return PROGRAMS.jit(_move_both, donate_argnums=(0, 1))(state, dstate, src, dst)

    def snapshot(self, dstate, slot):
        return PROGRAMS.jit(_slot_rows)(dstate, slot)

    def restore(self, dstate, snap, slot):
        return PROGRAMS.jit(put_slot_window, donate_argnums=(0,))(dstate, snap, slot)

    def _regions_programs(self, greedy: bool, keep_logits: bool = False) -> RegionsPrograms:
        if (greedy, keep_logits) not in self._regions:
            self._regions[greedy, keep_logits] = RegionsPrograms(self.model, self.k, greedy, keep_logits)
        return self._regions[greedy, keep_logits]

    def _program(self, fn, rows: int, **extra):
        m = self.model
        return PROGRAMS.keyed(f"{self.method}.{fn.__name__}", m.spec, lambda: jax.jit(functools.partial(
            fn, rows=rows, config=m.config, plan=m.plan, numerics=m.numerics, **extra), donate_argnums=(1, 2)),
            rows=rows, **extra)

    def prefill(self, state, dstate, chunk: PrefillChunk, sb: SamplingBatch, greedy: bool, history,
                logprobs: bool = False, logits: bool = False):
        m, put = self.model, self.model.put
        engram = m.engram_inputs(history, chunk.tokens, chunk.positions)
        if m.compile_mode == "regions":          # the whole pool
            first, state, dstate = self._regions_programs(greedy).prefill(
                m.params, state, dstate, put(chunk.tokens), put(chunk.positions), engram, sb)
        else:
            state, dstate, first = self._program(_prefill_window, chunk.rows, greedy=greedy)(
                m.params, state, dstate, put(chunk.tokens), put(chunk.positions), engram, sb,
                put(np.int32(chunk.start)))
        return state, dstate, fetch_emitted(m, first, logprobs, logits)

    def decode(self, state, dstate, rows: DecodeRows, sb: SamplingBatch, greedy: bool, history,
               logprobs: bool = False):
        m, put = self.model, self.model.put
        if self.blocks_on_device:
            state, dstate, emitted, a = self._program(_decode_window, rows.rows, k=self.k, greedy=greedy)(
                m.params, state, dstate, put(rows.x), put(rows.p), put(rows.count), put(rows.live), sb,
                put(np.int32(rows.start)))
            return state, dstate, fetch_emitted(m, emitted, logprobs), m.fetch(a)
        # the whole pool (start 0, rows n_slots): Engram rows gathered between the draft and the verify, or the
        # regions mode's programs
        carry = RowCarry(put(rows.x), put(rows.p), put(rows.count), put(~rows.live))
        state, dstate, _, emitted, a = self._host_iteration(state, dstate, carry, sb, *_no_stops(rows.rows), greedy,
                                                            history)
        return state, dstate, fetch_emitted(m, emitted, logprobs), m.fetch(a)

    def block(self, state, dstate, carry: RowCarry, sb, stops, max_new, n: int, greedy: bool, history,
              logprobs: bool = False, logits: bool = False):
        m = self.model
        if self.blocks_on_device:
            state, dstate, carry, emitted, a = iterations_program(m, self.k, n, greedy, logits)(
                m.params, state, dstate, carry, sb, stops, max_new)
            return state, dstate, carry, fetch_emitted(m, emitted, logprobs, logits), m.fetch(a)
        state, dstate, carry, emitted, a = self._host_iteration(state, dstate, carry, sb, stops, max_new, greedy,
                                                                history, logits)
        emitted = fetch_emitted(m, emitted, logprobs, logits)
        return state, dstate, carry, Emitted(*(None if e is None else e[None] for e in emitted)), m.fetch(a)[None]

    def _host_iteration(self, state, dstate, carry: RowCarry, sb, stops, max_new, greedy: bool, history,
                        keep_logits: bool = False):
        """One iteration with a host step between the draft and the verify (module docstring): the Engram rows of
        [x, d_1..d_k] gathered from a copy of `history`, which then advances by the kept tokens; or the regions
        mode's programs. Returns (state, dstate, carry, emitted, accepted) on the device."""
        m, k = self.model, self.k
        rp = self._regions_programs(greedy, keep_logits) if m.compile_mode == "regions" else None
        drafts, q = (draft_program(m, greedy) if rp is None else rp.drafts)(m.params, dstate, carry, sb)
        if history is not None:
            x, p, done = m.fetch(carry.x), m.fetch(carry.p), m.fetch(carry.done)
            tokens = np.concatenate([x[:, None], m.fetch(drafts)[:, :k]], axis=1).astype(np.int32)
            pos = np.where(done[:, None], -1, p[:, None] + np.arange(k + 1, dtype=np.int32)[None, :]).astype(np.int32)
            seen = history.copy()
        if rp is None:
            state, dstate, carry, emitted, a, kept = verify_program(m, k, greedy, keep_logits)(
                m.params, state, dstate, carry, drafts, q, sb, stops, max_new, m.engram_inputs(seen, tokens, pos))
        else:
            engram = None if history is None else [m.engram_inputs(seen, tokens[:, sl], pos[:, sl])
                                                   for sl in rp.slices(state)]
            state, dstate, carry, emitted, a, kept = rp.verify(m.params, state, dstate, carry, drafts, q, sb, stops,
                                                               max_new, engram)
        if history is not None:
            history.advance(tokens, m.fetch(kept), dead_tokens(m, tokens))
        return state, dstate, carry, emitted, a
