"""DeepSeek-V4's MTP block as the engine's drafter (drafter.Drafter): each iteration every decoding row drafts k
tokens, the backbone verifies them in one step and the row takes up to k + 1 tokens (mtp_iteration.draft / finish,
per window of slots); prefill chunks also run the MTP block, so a request's first iteration drafts from its prompt.

The drafter's per-slot state (`MtpSlots`) is the MTP blocks' window state and, per slot, the drafter's logits for the
next token and its output streams (mtp_iteration.Carry's mlogits and hm), set when the slot's prompt ends.

Programs per compile mode: in the scan mode an iteration is one program per window size (draft, the backbone's
verify step over the k + 1 positions, finish) and a prefill chunk one program per (window, chunk); in the regions
mode (Neuron's) an iteration is the draft program, the regions step over the window and the finish program, and a
prefill chunk the regions step then the MTP half.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..model.cache import PROGRAMS
from ..model.model import Model
from ..model.mtp import empty_mtp_state
from ..model.regions import regions_step
from ..model.scan import model_step
from ..model.spec import ModelSpec
from ..runtime.inventory import ProgramSpec
from ..runtime.sampling import INT32_MAX, SamplingBatch, abstract_batch
from ..state import move_slot, put_slot_window, slot_window, zero_slots
from .drafter import DecodeRows, PrefillChunk, RowCarry, fetch_emitted
from .mtp_decode import check_mtp_spec, new_mtp_state, programs
from .mtp_iteration import Carry, draft, finish, mtp_params, prefill_tail

__all__ = ["MtpDrafter", "MtpSlots"]


class MtpSlots(NamedTuple):
    """The MTP drafter's per-slot state: mstate (the MTP blocks' layer-major windows, [R, n_slots, ...] leaves),
    mlogits fp32 [n_slots, V] (the drafter's logits for the token after each slot's last), hm [n_slots, n, d] (the
    MTP block's output streams at that token's position - 1)."""

    mstate: dict
    mlogits: jax.Array
    hm: jax.Array


def _abstract(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def _rows_of(a: jax.Array, rows: int, start) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(a, start, rows, axis=0)


def _put_rows(a: jax.Array, b: jax.Array, start) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(a, b, start, axis=0)


def _first_slot(ds: MtpSlots, rows: int, start):
    return jnp.clip(start, 0, ds.mlogits.shape[0] - rows)


def _decode_window(params, state, ds, x, p, count, live, sb, start, *, rows, k, greedy, config, plan, numerics,
                   layout=None):
    """One iteration over slots [start, start + rows) as one program (the scan compile mode): x, p, count int32
    [rows], live bool [rows], sb the window's sampling rows. The regions mode's three calls (_draft_window, the regions
    step, _finish_window) in one program. Returns (state, ds, emitted: acceptance.Emitted [rows, k+1], accepted
    int32 [rows])."""
    kw = dict(rows=rows, k=k, greedy=greedy, config=config, plan=plan, numerics=numerics)
    ds, carry, dr = _draft_window(params, state, ds, x, p, count, live, sb, start, **kw)
    first = _first_slot(ds, rows, start)
    out = model_step(params, slot_window(state, rows, first), dr.tokens, dr.pos, config=config, plan=plan,
                     numerics=numerics, all_logits=True, hidden=True, layout=layout)
    logits, sw, XB = out.logits, out.state, out.hidden
    state = put_slot_window(state, sw, first)
    return _finish_window(params, state, ds, carry, dr, logits, XB, sb, start, **kw)


def _draft_window(params, state, ds, x, p, count, live, sb, start, *, rows, k, greedy, config, plan, numerics):
    """The window's carry and the draft (mtp_iteration.draft). Returns (ds, carry, Drafted)."""
    start = _first_slot(ds, rows, start)
    carry = Carry(x, p, _rows_of(ds.mlogits, rows, start), _rows_of(ds.hm, rows, start), count, ~live)
    mw, dr = draft(params, slot_window(state, rows, start), slot_window(ds.mstate, rows, start), carry, sb, k=k,
                   config=config, plan=plan, numerics=numerics, greedy=greedy)
    return ds._replace(mstate=put_slot_window(ds.mstate, mw, start)), carry, dr


def _finish_window(params, state, ds, carry, dr, logits, XB, sb, start, *, rows, k, greedy, config, plan, numerics):
    """After the backbone verified the window's k + 1 positions (logits, final streams XB): mtp_iteration.finish.
    Returns (state, ds, emitted, accepted) as _decode_window."""
    start = _first_slot(ds, rows, start)
    stops = jnp.full((rows, 1), -1, jnp.int32)          # the host ends requests
    max_new = jnp.full((rows,), INT32_MAX, jnp.int32)
    sw, mw, carry, emitted, a = finish(params, slot_window(state, rows, start), slot_window(ds.mstate, rows, start),
                                       carry, dr, logits, XB, sb, stops, max_new, k=k, config=config, plan=plan,
                                       numerics=numerics, greedy=greedy)
    ds = MtpSlots(put_slot_window(ds.mstate, mw, start), _put_rows(ds.mlogits, carry.mlogits, start),
                  _put_rows(ds.hm, carry.hm, start))
    return put_slot_window(state, sw, start), ds, emitted, a


def _prefill_window(params, state, ds, tokens, positions, next_tokens, ends, sb, start, *, rows, greedy, config, plan,
                    numerics, layout=None):
    """A prefill chunk (the backbone, then _tail_window) over slots [start, start + rows) as one program (the scan
    mode). Returns (state, ds, first tokens: acceptance.Emitted [rows])."""
    first_slot = _first_slot(ds, rows, start)
    out = model_step(params, slot_window(state, rows, first_slot), tokens, positions, config=config, plan=plan,
                     numerics=numerics, hidden=True, layout=layout)
    logits, sw, X = out.logits, out.state, out.hidden
    state = put_slot_window(state, sw, first_slot)
    ds, first = _tail_window(params, ds, logits, X, positions, next_tokens, ends, sb, start, rows=rows, greedy=greedy,
                             config=config, plan=plan, numerics=numerics)
    return state, ds, first


def _tail_window(params, ds, logits, X, positions, next_tokens, ends, sb, start, *, rows, greedy, config, plan,
                 numerics):
    """The MTP half of a prefill chunk, after the backbone ran it (its logits and final streams X); ends bool [rows]:
    the rows whose carry is set. Returns (ds, first tokens: acceptance.Emitted [rows])."""
    start = _first_slot(ds, rows, start)
    first, ml, h, mw = prefill_tail(params, slot_window(ds.mstate, rows, start), logits, X, positions, next_tokens,
                                    sb, config=config, plan=plan, numerics=numerics, greedy=greedy)
    ml = jnp.where(ends[:, None], ml, _rows_of(ds.mlogits, rows, start))
    h = jnp.where(ends[:, None, None], h, _rows_of(ds.hm, rows, start))
    return MtpSlots(put_slot_window(ds.mstate, mw, start), _put_rows(ds.mlogits, ml, start),
                    _put_rows(ds.hm, h, start)), first


def _move_rows(tree, src, dst):
    return jax.tree_util.tree_map(
        lambda a: jax.lax.dynamic_update_slice_in_dim(a, jax.lax.dynamic_slice_in_dim(a, src, 1, axis=0), dst, axis=0),
        tree)


def _move_all(state, ds, src, dst):
    return move_slot(state, src, dst), MtpSlots(move_slot(ds.mstate, src, dst), *_move_rows((ds.mlogits, ds.hm),
                                                                                            src, dst))


def _slot_windows(ds: MtpSlots, slot):
    return slot_window(ds.mstate, 1, slot)


def _restore_windows(ds, snap, slot):
    return ds._replace(mstate=put_slot_window(ds.mstate, snap, slot))


def _reset(ds, mask):
    return ds._replace(mstate=zero_slots(ds.mstate, mask))     # mlogits and hm are set when a prompt ends


class MtpDrafter:
    """drafter.Drafter for method "mtp" (a DeepSeek-V4 model loaded with its MTP block: jdeep.load(path, drafter=True));
    MtpDrafter.for_spec(spec, k): without weights, for its programs (inventory lowering) only."""

    method = "mtp"
    programs_per_decode = 1
    blocks_on_device = True
    snapshot_lookahead = 1      # the window entry at a prefix's last position holds the token after it

    def __init__(self, model: Model | None, k: int, spec: ModelSpec | None = None):
        self.model, self.spec = model, model.spec if model is not None else spec
        check_mtp_spec(self.spec)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {k!r}")
        self.k = k

    @classmethod
    def for_spec(cls, spec: ModelSpec, k: int) -> "MtpDrafter":
        return cls(None, k, spec)

    def window_mode(self, default: str) -> str:
        return default

    def empty_state(self, n_slots: int, cache_len: int) -> MtpSlots:
        """A fresh per-slot state (on the default device; jax.eval_shape of this gives its shapes)."""
        t = self.spec
        n, d = t.config.hc_mult, t.config.dim
        return MtpSlots(empty_mtp_state(t.config, t.plan, n_slots, cache_len, t.dtype, t.numerics),
                        jnp.zeros((n_slots, t.config.vocab_size), jnp.float32), jnp.zeros((n_slots, n, d), t.dtype))

    def new_state(self, n_slots: int, cache_len: int) -> MtpSlots:
        m = self.model
        if m.layout is None:
            return jax.device_put(self.empty_state(n_slots, cache_len), jax.devices()[0])
        n, d = m.config.hc_mult, m.config.dim
        carry = m.layout.put_tree((np.zeros((n_slots, m.config.vocab_size), np.float32),
                                   np.zeros((n_slots, n, d), m.dtype)))
        return MtpSlots(new_mtp_state(m, n_slots, cache_len), *carry)

    def slot_program(self, name: str):
        """The jitted slot program `name` (drafter.SLOT_PROGRAMS): reset (dstate, mask), move (state, dstate, src,
        dst), snapshot (dstate, slot), restore (dstate, snap, slot)."""
        return {"reset": lambda: PROGRAMS.jit(_reset, donate_argnums=(0,)),
                "move": lambda: PROGRAMS.jit(_move_all, donate_argnums=(0, 1)),
                "snapshot": lambda: PROGRAMS.jit(_slot_windows),   # mlogits and hm are set after any snapshot point
                "restore": lambda: PROGRAMS.jit(_restore_windows, donate_argnums=(0,))}[name]()

    def reset_slots(self, dstate: MtpSlots, mask) -> MtpSlots:
        return self.slot_program("reset")(dstate, mask)

    def move_slot(self, state, dstate: MtpSlots, src, dst):
        return self.slot_program("move")(state, dstate, src, dst)

    def snapshot(self, dstate: MtpSlots, slot):
        return self.slot_program("snapshot")(dstate, slot)

    def restore(self, dstate: MtpSlots, snap, slot) -> MtpSlots:
        return self.slot_program("restore")(dstate, snap, slot)

    def _program(self, fn, rows: int, donate: tuple[int, ...] = (1, 2), **extra):
        t = self.spec
        return PROGRAMS.keyed(f"{self.method}.{fn.__name__}", t, lambda: jax.jit(functools.partial(
            fn, rows=rows, config=t.config, plan=t.plan, numerics=t.numerics, **extra), donate_argnums=donate),
            rows=rows, **extra)

    def _regions_decode(self, rows: int, greedy: bool):
        """The regions mode's iteration parts: (draft program, regions verify step, finish program)."""
        t = self.spec
        return (self._program(_draft_window, rows, donate=(2,), k=self.k, greedy=greedy),   # state: read
                regions_step(t.config, t.plan, t.numerics, True, rows, t.layout, hidden=True),
                self._program(_finish_window, rows, k=self.k, greedy=greedy))

    def _regions_prefill(self, rows: int, greedy: bool):
        """The regions mode's prefill parts: (regions backbone step, MTP tail program)."""
        t = self.spec
        return (regions_step(t.config, t.plan, t.numerics, False, rows, t.layout, hidden=True),
                self._program(_tail_window, rows, donate=(1,), greedy=greedy))

    def _decode_program(self, rows: int, greedy: bool):
        """(params, state, ds, x, p, count, live, sb, start) -> (state, ds, emitted, accepted) (module docstring)."""
        if self.spec.compile_mode != "regions":
            return self._program(_decode_window, rows, k=self.k, greedy=greedy, layout=self.spec.layout)
        draft_p, verify, finish_p = self._regions_decode(rows, greedy)

        def run(params, state, ds, x, p, count, live, sb, start):
            mp = mtp_params(params)
            ds, carry, dr = draft_p(mp, state, ds, x, p, count, live, sb, start)
            (logits, XB), state = verify(params, state, dr.tokens, dr.pos, start=start)
            return finish_p(mp, state, ds, carry, dr, logits, XB, sb, start)
        return run

    def _prefill_program(self, rows: int, greedy: bool):
        """(params, state, ds, tokens, positions, next_tokens, ends, sb, start) -> (state, ds, first)."""
        if self.spec.compile_mode != "regions":
            return self._program(_prefill_window, rows, greedy=greedy, layout=self.spec.layout)
        backbone, tail = self._regions_prefill(rows, greedy)

        def run(params, state, ds, tokens, positions, next_tokens, ends, sb, start):
            (logits, X), state = backbone(params, state, tokens, positions, start=start)
            ds, first = tail(mtp_params(params), ds, logits, X, positions, next_tokens, ends, sb, start)
            return state, ds, first
        return run

    def step_programs(self, entry: ProgramSpec, params, state, dstate) -> list[tuple[str, object, tuple]]:
        """[(name, jitted program, abstract args)] of a "spec.decode" or "spec.prefill" inventory entry over abstract
        params, state and dstate (jax.ShapeDtypeStruct trees): the programs `decode` / `prefill` run for it."""
        n, greedy, name = entry.rows, entry.variant == "greedy", entry.name
        sb, start, ivec, bvec = abstract_batch(n), _abstract((), jnp.int32), _abstract((n,), jnp.int32), \
            _abstract((n,), jnp.bool_)
        regions = self.spec.compile_mode == "regions"
        if entry.kind == "spec.decode":
            args = (params, state, dstate, ivec, ivec, ivec, bvec, sb, start)
            if not regions:
                return [(name, self._decode_program(n, greedy), args)]
            draft_p, verify, finish_p = self._regions_decode(n, greedy)
            dargs = (mtp_params(params),) + args[1:]
            ds, carry, dr = jax.eval_shape(draft_p, *dargs)
            (logits, XB), _ = jax.eval_shape(lambda p, s, t, q, i: verify(p, s, t, q, start=i),
                                             params, state, dr.tokens, dr.pos, start)
            return ([(f"{name}.draft", draft_p, dargs)] +
                    [(f"{name}.verify.{r}", fn, a) for r, fn, a in verify.programs(params, state, dr.tokens, dr.pos,
                                                                                  start=start)] +
                    [(f"{name}.finish", finish_p, (dargs[0], state, ds, carry, dr, logits, XB, sb, start))])
        ids = _abstract((n, entry.seq), jnp.int32)
        args = (params, state, dstate, ids, ids, ids, bvec, sb, start)
        if not regions:
            return [(name, self._prefill_program(n, greedy), args)]
        backbone, tail = self._regions_prefill(n, greedy)
        (logits, X), _ = jax.eval_shape(lambda p, s, t, q, i: backbone(p, s, t, q, start=i), params, state, ids, ids,
                                        start)
        return ([(f"{name}.{r}", fn, a) for r, fn, a in backbone.programs(params, state, ids, ids, start=start)] +
                [(f"{name}.tail", tail, (mtp_params(params), dstate, logits, X, ids, ids, bvec, sb, start))])

    def prefill(self, state, dstate: MtpSlots, chunk: PrefillChunk, sb: SamplingBatch, greedy: bool, history,
                logprobs: bool = False, logits: bool = False):
        m, put = self.model, self.model.put
        state, dstate, first = self._prefill_program(chunk.rows, greedy)(
            m.params, state, dstate, put(chunk.tokens), put(chunk.positions), put(chunk.next_tokens), put(chunk.ends),
            put(sb), put(np.int32(chunk.start)))
        return state, dstate, fetch_emitted(m, first, logprobs, logits)

    def decode(self, state, dstate: MtpSlots, rows: DecodeRows, sb: SamplingBatch, greedy: bool, history,
               logprobs: bool = False):
        m, put = self.model, self.model.put
        state, dstate, emitted, a = self._decode_program(rows.rows, greedy)(
            m.params, state, dstate, put(rows.x), put(rows.p), put(rows.count), put(rows.live), put(sb),
            put(np.int32(rows.start)))
        return state, dstate, fetch_emitted(m, emitted, logprobs), m.fetch(a)

    def block(self, state, dstate: MtpSlots, carry: RowCarry, sb, stops, max_new, n: int, greedy: bool, history,
              logprobs: bool = False, logits: bool = False):
        m = self.model
        full = Carry(carry.x, carry.p, dstate.mlogits, dstate.hm, carry.count, carry.done)
        state, mstate, full, emitted, a = programs(m, self.k, greedy, logits).iterations(n)(
            m.params, state, dstate.mstate, full, sb, stops, max_new)
        return (state, MtpSlots(mstate, full.mlogits, full.hm), RowCarry(full.x, full.p, full.count, full.done),
                fetch_emitted(m, emitted, logprobs, logits), m.fetch(a))
