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
from ..model.spec import ModelSpec
from ..runtime.inventory import ProgramSpec
from ..runtime.sampling import INT32_MAX, SamplingBatch, abstract_batch
from ..state import move_slot, put_slot_window, slot_window, zero_slots
from .acceptance import Emitted
from .drafter import DecodeRows, PrefillChunk, RowCarry, fetch_emitted
from .dspark_decode import (check_dspark_spec, check_k, dead_tokens, draft_program, iterations_program,
                           verify_program)
from .dspark_iteration import iteration, prefill_chunk
from .dspark_regions import RegionsPrograms

__all__ = ["DSparkDrafter"]


def _no_stops(rows: int) -> tuple[jax.Array, jax.Array]:
    """stops int32 [rows, 1] and max_new int32 [rows] that never end a row on the device (the host ends requests)."""
    return np.full((rows, 1), -1, np.int32), np.full((rows,), INT32_MAX, np.int32)


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
    drafter=True)); k in [1, the checkpoint's dspark_block_size]. DSparkDrafter.for_spec(spec, k): without weights,
    for its programs (inventory lowering) only."""

    method = "dspark"
    snapshot_lookahead = 0      # the windows hold the target's taps of each position, nothing after it

    def __init__(self, model: Model | None, k: int, spec: ModelSpec | None = None):
        self.model, self.spec = model, model.spec if model is not None else spec
        check_dspark_spec(self.spec)
        check_k(self.spec, k)
        self.k = k
        self._regions: dict[tuple[bool, bool], RegionsPrograms] = {}
        # with Engram the draft and the verify are two programs with the host's gather between them; the regions
        # mode's programs are called from the host too
        self.blocks_on_device = self.spec.config.engram is None and self.spec.compile_mode == "scan"
        self.programs_per_decode = 1 if self.blocks_on_device else 2

    @classmethod
    def for_spec(cls, spec: ModelSpec, k: int) -> "DSparkDrafter":
        return cls(None, k, spec)

    def window_mode(self, default: str) -> str:
        # the regions mode's DSpark programs step the whole pool, as models with Engram do
        return "pool" if self.spec.compile_mode == "regions" else default

    def empty_state(self, n_slots: int, cache_len: int):
        """A fresh per-slot state (jax.eval_shape of this gives its shapes)."""
        t = self.spec
        return empty_dspark_state(t.config, t.plan, n_slots, cache_len, t.dtype, t.numerics)

    def new_state(self, n_slots: int, cache_len: int):
        return jax.device_put(self.empty_state(n_slots, cache_len), jax.devices()[0])

    def slot_program(self, name: str):
        """The jitted slot program `name` (drafter.SLOT_PROGRAMS): reset (dstate, mask), move (state, dstate, src,
        dst), snapshot (dstate, slot), restore (dstate, snap, slot)."""
        return {"reset": lambda: PROGRAMS.jit(zero_slots, donate_argnums=(0,)),
                "move": lambda: PROGRAMS.jit(_move_both, donate_argnums=(0, 1)),
                "snapshot": lambda: PROGRAMS.jit(_slot_rows),
                "restore": lambda: PROGRAMS.jit(put_slot_window, donate_argnums=(0,))}[name]()

    def reset_slots(self, dstate, mask):
        return self.slot_program("reset")(dstate, mask)

    def move_slot(self, state, dstate, src, dst):
        return self.slot_program("move")(state, dstate, src, dst)

    def snapshot(self, dstate, slot):
        return self.slot_program("snapshot")(dstate, slot)

    def restore(self, dstate, snap, slot):
        return self.slot_program("restore")(dstate, snap, slot)

    def step_programs(self, entry: ProgramSpec, params, state, dstate) -> list[tuple[str, object, tuple]]:
        """[(name, jitted program, abstract args)] of a "spec.decode" or "spec.prefill" inventory entry over abstract
        params, state and dstate (jax.ShapeDtypeStruct trees): the programs `decode` / `prefill` run for it (the
        regions mode's: dspark_regions.RegionsPrograms.programs, over the whole pool)."""
        t, n, greedy, name = self.spec, entry.rows, entry.variant == "greedy", entry.name
        sb = abstract_batch(n)
        if t.compile_mode == "regions":
            return self._regions_programs(greedy).programs(name, params, state, dstate, sb,
                                                           entry.seq if entry.kind == "spec.prefill" else None)
        start = jax.ShapeDtypeStruct((), jnp.int32)
        ivec, bvec = jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.bool_)
        if entry.kind == "spec.prefill":
            ids = jax.ShapeDtypeStruct((n, entry.seq), jnp.int32)
            return [(name, self._program(_prefill_window, n, greedy=greedy),
                     (params, state, dstate, ids, ids, t.abstract_engram(n, entry.seq), sb, start))]
        if self.blocks_on_device:
            return [(name, self._program(_decode_window, n, k=self.k, greedy=greedy),
                     (params, state, dstate, ivec, ivec, ivec, bvec, sb, start))]
        carry = RowCarry(ivec, ivec, ivec, bvec)
        draft_p = draft_program(t, greedy)
        drafts, q = jax.eval_shape(draft_p, params, dstate, carry, sb)
        stops, max_new = (jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _no_stops(n))
        return [(f"{name}.draft", draft_p, (params, dstate, carry, sb)),
                (f"{name}.verify", verify_program(t, self.k, greedy),
                 (params, state, dstate, carry, drafts, q, sb, stops, max_new, t.abstract_engram(n, self.k + 1)))]

    def _regions_programs(self, greedy: bool, keep_logits: bool = False) -> RegionsPrograms:
        if (greedy, keep_logits) not in self._regions:
            self._regions[greedy, keep_logits] = RegionsPrograms(self.spec, self.k, greedy, keep_logits,
                                                                 None if self.model is None else self.model.put)
        return self._regions[greedy, keep_logits]

    def _program(self, fn, rows: int, **extra):
        t = self.spec
        return PROGRAMS.keyed(f"{self.method}.{fn.__name__}", t, lambda: jax.jit(functools.partial(
            fn, rows=rows, config=t.config, plan=t.plan, numerics=t.numerics, **extra), donate_argnums=(1, 2)),
            rows=rows, **extra)

    def prefill(self, state, dstate, chunk: PrefillChunk, sb: SamplingBatch, greedy: bool, history,
                logprobs: bool = False, logits: bool = False):
        m, put = self.model, self.model.put
        engram = m.engram_inputs(history, chunk.tokens, chunk.positions)
        if m.compile_mode == "regions":          # the whole pool
            first, state, dstate = self._regions_programs(greedy).prefill(
                m.params, state, dstate, put(chunk.tokens), put(chunk.positions), engram, put(sb))
        else:
            state, dstate, first = self._program(_prefill_window, chunk.rows, greedy=greedy)(
                m.params, state, dstate, put(chunk.tokens), put(chunk.positions), engram, put(sb),
                put(np.int32(chunk.start)))
        return state, dstate, fetch_emitted(m, first, logprobs, logits)

    def decode(self, state, dstate, rows: DecodeRows, sb: SamplingBatch, greedy: bool, history,
               logprobs: bool = False):
        m, put = self.model, self.model.put
        if self.blocks_on_device:
            state, dstate, emitted, a = self._program(_decode_window, rows.rows, k=self.k, greedy=greedy)(
                m.params, state, dstate, put(rows.x), put(rows.p), put(rows.count), put(rows.live), put(sb),
                put(np.int32(rows.start)))
            return state, dstate, fetch_emitted(m, emitted, logprobs), m.fetch(a)
        # the whole pool (start 0, rows n_slots): Engram rows gathered between the draft and the verify, or the
        # regions mode's programs
        carry = RowCarry(put(rows.x), put(rows.p), put(rows.count), put(~rows.live))
        stops, max_new = put(_no_stops(rows.rows))
        state, dstate, _, emitted, a = self._host_iteration(state, dstate, carry, put(sb), stops, max_new, greedy,
                                                            history)
        return state, dstate, fetch_emitted(m, emitted, logprobs), m.fetch(a)

    def block(self, state, dstate, carry: RowCarry, sb, stops, max_new, n: int, greedy: bool, history,
              logprobs: bool = False, logits: bool = False):
        m = self.model
        if self.blocks_on_device:
            state, dstate, carry, emitted, a = iterations_program(m.spec, self.k, n, greedy, logits)(
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
        drafts, q = (draft_program(m.spec, greedy) if rp is None else rp.drafts)(m.params, dstate, carry, sb)
        if history is not None:
            x, p, done = m.fetch(carry.x), m.fetch(carry.p), m.fetch(carry.done)
            tokens = np.concatenate([x[:, None], m.fetch(drafts)[:, :k]], axis=1).astype(np.int32)
            pos = np.where(done[:, None], -1, p[:, None] + np.arange(k + 1, dtype=np.int32)[None, :]).astype(np.int32)
            seen = history.copy()
        if rp is None:
            state, dstate, carry, emitted, a, kept = verify_program(m.spec, k, greedy, keep_logits)(
                m.params, state, dstate, carry, drafts, q, sb, stops, max_new, m.engram_inputs(seen, tokens, pos))
        else:
            engram = None if history is None else [m.engram_inputs(seen, tokens[:, sl], pos[:, sl])
                                                   for sl in rp.slices(state)]
            state, dstate, carry, emitted, a, kept = rp.verify(m.params, state, dstate, carry, drafts, q, sb, stops,
                                                               max_new, engram)
        if history is not None:
            history.advance(tokens, m.fetch(kept), dead_tokens(m, tokens))
        return state, dstate, carry, emitted, a
