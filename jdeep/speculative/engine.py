"""The Engine with MTP speculative decoding, and make_engine (the plain Engine, this one or dspark_engine's): each
iteration every decoding request drafts k tokens, the backbone verifies them in one step and the request takes up to
k + 1 tokens (mtp_decode.iteration, per window of slots); prefill chunks also run the MTP block, so a request's
first iteration drafts from its prompt.

Besides the Engine's backbone state the pool holds the MTP blocks' window state and, per slot, the drafter's logits
for the next token and its output streams (mtp_decode.Carry's mlogits and hm). The host keeps each request's last
token, position and count (the Engine's own bookkeeping), checks stop ids, max_new_tokens and stop strings, and
ends a request at the first of them (accepted tokens past it are dropped; its slot is freed). Scheduling, windows,
compaction and warm-up are the Engine's: a decoding request counts k + 1 positions against the token budget.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..model.cache import PROGRAMS
from ..model.model import Model
from ..model.regions import regions_step
from ..model.scan import model_step
from ..runtime.engine import Engine, RequestOutput
from ..runtime.sampling import INT32_MAX, SamplingParams
from ..runtime.scheduler import Iteration
from ..runtime.slot_sampling import SPECULATIVE_UNSUPPORTED
from ..runtime.steps import length_bucket, pack_chunk
from ..state import move_slot, put_slot_window, slot_window, zero_slots
from .config import parse_speculative
from .dspark_engine import DSparkEngine
from .mtp_decode import SpecStats, check_mtp_model, new_mtp_state
from .mtp_iteration import Carry, draft, finish, mtp_params, prefill_tail

__all__ = ["SpeculativeEngine", "make_engine"]


def _rows_of(a: jax.Array, rows: int, start) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(a, start, rows, axis=0)


def _put_rows(a: jax.Array, b: jax.Array, start) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(a, b, start, axis=0)


def _decode_window(params, state, mstate, mlogits, hm, x, p, count, live, sb, start, *, rows, k, greedy, config,
                   plan, numerics, layout=None):
    """One speculative iteration over slots [start, start + rows) as one program (the scan compile mode): x, p, count
    int32 [rows], live bool [rows], sb the window's sampling rows (greedy: all of them greedy). The draft, the
    backbone's verify step, the finish: the regions mode's three calls (_draft_window, the regions step,
    _finish_window) in one program. Returns (state, mstate, mlogits, hm, emitted int32 [rows, k+1], accepted int32
    [rows])."""
    kw = dict(rows=rows, k=k, greedy=greedy, config=config, plan=plan, numerics=numerics)
    mstate, carry, dr = _draft_window(params, state, mstate, mlogits, hm, x, p, count, live, sb, start, **kw)
    first = jnp.clip(start, 0, mlogits.shape[0] - rows)
    logits, sw, XB = model_step(params, slot_window(state, rows, first), dr.tokens, dr.pos, config=config, plan=plan,
                                numerics=numerics, all_logits=True, hidden=True, layout=layout)
    state = put_slot_window(state, sw, first)
    return _finish_window(params, state, mstate, mlogits, hm, carry, dr, logits, XB, sb, start, **kw)


def _prefill_window(params, state, mstate, mlogits, hm, tokens, positions, next_tokens, ends, sb, start, *, rows,
                    greedy, config, plan, numerics, layout=None):
    """A prefill chunk (backbone and MTP block) over slots [start, start + rows) as one program (the scan mode: the
    backbone step, then _tail_window); ends bool [rows]: the rows whose prompt ends in this chunk (their drafter
    carry is set). Returns (state, mstate, mlogits, hm, first token int32 [rows])."""
    first_slot = jnp.clip(start, 0, mlogits.shape[0] - rows)
    logits, sw, X = model_step(params, slot_window(state, rows, first_slot), tokens, positions, config=config,
                               plan=plan, numerics=numerics, hidden=True, layout=layout)
    state = put_slot_window(state, sw, first_slot)
    mstate, mlogits, hm, first = _tail_window(params, mstate, mlogits, hm, logits, X, positions, next_tokens, ends,
                                              sb, start, rows=rows, greedy=greedy, config=config, plan=plan,
                                              numerics=numerics)
    return state, mstate, mlogits, hm, first


def _draft_window(params, state, mstate, mlogits, hm, x, p, count, live, sb, start, *, rows, k, greedy, config, plan,
                  numerics):
    """The regions mode's first third of _decode_window: the window's carry and the draft (mtp_iteration.draft).
    Returns (mstate, carry, Drafted)."""
    start = jnp.clip(start, 0, mlogits.shape[0] - rows)
    carry = Carry(x, p, _rows_of(mlogits, rows, start), _rows_of(hm, rows, start), count, ~live)
    mw, dr = draft(params, slot_window(state, rows, start), slot_window(mstate, rows, start), carry, sb, k=k,
                   config=config, plan=plan, numerics=numerics, greedy=greedy)
    return put_slot_window(mstate, mw, start), carry, dr


def _finish_window(params, state, mstate, mlogits, hm, carry, dr, logits, XB, sb, start, *, rows, k, greedy, config,
                   plan, numerics):
    """The regions mode's last third of _decode_window, after the regions step verified the window's k + 1
    positions (mtp_iteration.finish). Returns what _decode_window returns."""
    start = jnp.clip(start, 0, mlogits.shape[0] - rows)
    stops = jnp.full((rows, 1), -1, jnp.int32)
    max_new = jnp.full((rows,), INT32_MAX, jnp.int32)
    sw, mw, carry, emitted, a = finish(params, slot_window(state, rows, start), slot_window(mstate, rows, start),
                                       carry, dr, logits, XB, sb, stops, max_new, k=k, config=config, plan=plan,
                                       numerics=numerics, greedy=greedy)
    return (put_slot_window(state, sw, start), put_slot_window(mstate, mw, start),
            _put_rows(mlogits, carry.mlogits, start), _put_rows(hm, carry.hm, start), emitted, a)


def _tail_window(params, mstate, mlogits, hm, logits, X, positions, next_tokens, ends, sb, start, *, rows, greedy,
                 config, plan, numerics):
    """The regions mode's MTP half of _prefill_window, after the regions step ran the chunk (its logits and final
    streams X). Returns (mstate, mlogits, hm, first token int32 [rows])."""
    start = jnp.clip(start, 0, mlogits.shape[0] - rows)
    first, ml, h, mw = prefill_tail(params, slot_window(mstate, rows, start), logits, X, positions, next_tokens, sb,
                                    config=config, plan=plan, numerics=numerics, greedy=greedy)
    ml = jnp.where(ends[:, None], ml, _rows_of(mlogits, rows, start))
    h = jnp.where(ends[:, None, None], h, _rows_of(hm, rows, start))
    return put_slot_window(mstate, mw, start), _put_rows(mlogits, ml, start), _put_rows(hm, h, start), first


def _move_rows(tree, src, dst):
    return jax.tree_util.tree_map(
        lambda a: jax.lax.dynamic_update_slice_in_dim(a, jax.lax.dynamic_slice_in_dim(a, src, 1, axis=0), dst, axis=0),
        tree)


def _move_all(state, mstate, carry, src, dst):
    return move_slot(state, src, dst), move_slot(mstate, src, dst), _move_rows(carry, src, dst)


class SpeculativeEngine(Engine):
    """Engine(model, ...) with speculative={"method": "mtp", "num_speculative_tokens": k} (model loaded with
    mtp=True). `spec_stats` counts drafted and accepted tokens (SpecStats)."""

    unsupported = SPECULATIVE_UNSUPPORTED
    images_unsupported = True   # its draft / verify steps take no image embeddings yet

    def __init__(self, model: Model, speculative: dict, **kw):
        method, self.k = parse_speculative(speculative)
        if method != "mtp":
            raise ValueError(f"SpeculativeEngine runs speculative method 'mtp', got {method!r} (make_engine picks the "
                             "engine of a method)")
        check_mtp_model(model)
        super().__init__(model, decode_width=self.k + 1, **kw)
        self.spec_stats = SpecStats(self.k)
        self._alloc_mtp()

    def _cache_len(self) -> int:
        # a request near max_len still verifies k + 1 positions
        return length_bucket(self.max_len + self.k + 1, 256)

    def _alloc_mtp(self) -> None:
        m = self.model
        self.mstate = new_mtp_state(m, self.n_slots, self._cache_len())
        n, d = m.config.hc_mult, m.config.dim
        carry = (np.zeros((self.n_slots, m.config.vocab_size), np.float32), np.zeros((self.n_slots, n, d), m.dtype))
        self.mlogits, self.hm = (jax.device_put(carry, jax.devices()[0]) if m.layout is None else
                                 m.layout.put_tree(carry))

    def reset(self) -> None:
        super().reset()
        self._alloc_mtp()

    def _reset_slots(self, mask: np.ndarray) -> None:
        super()._reset_slots(mask)
        self.mstate = PROGRAMS.jit(zero_slots, donate_argnums=(0,))(self.mstate, self.model.put(mask))

    def _move_slot(self, src, dst) -> None:
        self.state, self.mstate, (self.mlogits, self.hm) = PROGRAMS.jit(_move_all, donate_argnums=(0, 1, 2))(
            self.state, self.mstate, (self.mlogits, self.hm), src, dst)

    def _program(self, fn, rows: int, donate: tuple[int, ...] = (1, 2, 3, 4), **extra):
        m = self.model
        kw = dict(rows=rows, config=m.config, plan=m.plan, numerics=m.numerics, **extra)
        key = (fn.__name__, rows, tuple(sorted(extra.items())), m.config, m.plan, m.numerics)
        return PROGRAMS.get(key, lambda: jax.jit(functools.partial(fn, **kw), donate_argnums=donate))

    def _decode_program(self, rows: int, greedy: bool):
        """(params, state, mstate, mlogits, hm, x, p, count, live, sb, start) -> (state, mstate, mlogits, hm, emitted,
        accepted): one program in the scan compile mode; in the regions mode the draft program, the regions step over
        the window's k + 1 positions and the finish program."""
        if self.model.compile_mode != "regions":
            return self._program(_decode_window, rows, k=self.k, greedy=greedy, layout=self.model.layout)
        m = self.model
        draft_p = self._program(_draft_window, rows, donate=(2,), k=self.k, greedy=greedy)   # state: read
        finish_p = self._program(_finish_window, rows, k=self.k, greedy=greedy)
        verify = regions_step(m.config, m.plan, m.numerics, True, rows, m.layout, hidden=True)

        def run(params, state, mstate, mlogits, hm, x, p, count, live, sb, start):
            mp = mtp_params(params)
            mstate, carry, dr = draft_p(mp, state, mstate, mlogits, hm, x, p, count, live, sb, start)
            (logits, XB), state = verify(params, state, dr.tokens, dr.pos, start=start)
            return finish_p(mp, state, mstate, mlogits, hm, carry, dr, logits, XB, sb, start)
        return run

    def _prefill_program(self, rows: int, greedy: bool):
        """(params, state, mstate, mlogits, hm, tokens, positions, next_tokens, ends, sb, start) -> (state, mstate,
        mlogits, hm, first): one program in the scan mode; the regions step and the MTP half in the regions mode."""
        if self.model.compile_mode != "regions":
            return self._program(_prefill_window, rows, greedy=greedy, layout=self.model.layout)
        m = self.model
        tail = PROGRAMS.get(("_tail_window", rows, greedy, m.config, m.plan, m.numerics), lambda: jax.jit(
            functools.partial(_tail_window, rows=rows, greedy=greedy, config=m.config, plan=m.plan,
                              numerics=m.numerics), donate_argnums=(1, 2, 3)))
        backbone = regions_step(m.config, m.plan, m.numerics, False, rows, m.layout, hidden=True)

        def run(params, state, mstate, mlogits, hm, tokens, positions, next_tokens, ends, sb, start):
            (logits, X), state = backbone(params, state, tokens, positions, start=start)
            mstate, mlogits, hm, first = tail(mtp_params(params), mstate, mlogits, hm, logits, X, positions,
                                              next_tokens, ends, sb, start)
            return state, mstate, mlogits, hm, first
        return run

    def _decode(self, it: Iteration) -> list[RequestOutput]:
        if not it.decode:
            return []
        w = it.decode_window
        x = np.zeros(w.rows, np.int32)
        p = np.zeros(w.rows, np.int32)
        count = np.zeros(w.rows, np.int32)
        live = np.zeros(w.rows, bool)
        for i in it.decode:
            s, r = self.slots[i], i - w.start
            x[r], count[r], live[r] = self._last[i], len(s.out.tokens), True
            p[r] = len(s.out.prompt) + len(s.out.tokens) - 1
        self.steps_per_bucket[w.rows] = self.steps_per_bucket.get(w.rows, 0) + 1
        put, sb = self.model.put, self._window_rows(w)
        greedy = bool(np.all(sb.temperature[live] <= 0))
        program = self._decode_program(w.rows, greedy)
        self.state, self.mstate, self.mlogits, self.hm, emitted, a = program(
            self.model.params, self.state, self.mstate, self.mlogits, self.hm, put(x), put(p), put(count), put(live),
            sb, put(np.int32(w.start)))
        emitted, a = self.model.fetch(emitted), self.model.fetch(a)
        self.spec_stats.add(a[live])
        return self._deliver({i: [int(t) for t in emitted[i - w.start] if t >= 0] for i in it.decode})

    def _prefill(self, it: Iteration) -> list[RequestOutput]:
        if not it.prefill:
            return []
        w = it.prefill_window
        slots = [self.slots[i] if i in it.prefill else None for i in range(w.start, w.start + w.rows)]
        prompts = [s.request.ids if s is not None else None for s in slots]
        done = [s.prefilled if s is not None else 0 for s in slots]
        toks, pos, taken = pack_chunk(prompts, done, w.rows, it.chunk)
        nxt = np.full_like(toks, -1)
        ends = np.zeros(w.rows, bool)
        for r, s in enumerate(slots):
            if s is None:
                continue
            ids, n = s.request.ids, int(taken[r])
            nxt[r, :n] = np.concatenate([ids[done[r] + 1:done[r] + n + 1], [-1]])[:n]
            s.prefilled += n
            ends[r] = s.prefilled == len(ids)
        self.steps_per_bucket[w.rows] = self.steps_per_bucket.get(w.rows, 0) + 1
        put, sb = self.model.put, self._window_rows(w)
        greedy = bool(np.all(sb.temperature[[i - w.start for i in it.prefill]] <= 0))
        self.state, self.mstate, self.mlogits, self.hm, first = self._prefill_program(w.rows, greedy)(
            self.model.params, self.state, self.mstate, self.mlogits, self.hm, put(toks), put(pos), put(nxt),
            put(ends), sb, put(np.int32(w.start)))
        first = self.model.fetch(first)
        return self._deliver({w.start + r: [int(first[r])] for r in np.flatnonzero(ends)})

    def warmup(self) -> int:
        """Compile the speculative decode program of every window size and the prefill program of every (window size,
        chunk), each in its greedy and sampled variant, and the slot move, on rows at position -1 (nothing in the state changes). Returns
        the number of programs run."""
        counts = dict(self.steps_per_bucket)
        self._reset_slots(np.zeros(self.n_slots, bool))
        put, n_run = self.model.put, 0
        for n in self.scheduler.decode_programs():
            z = np.zeros(n, np.int32)
            sb = self._host_batch([SamplingParams()] * n)
            for greedy in (True, False):
                program = self._decode_program(n, greedy)
                self.state, self.mstate, self.mlogits, self.hm, _, _ = program(
                    self.model.params, self.state, self.mstate, self.mlogits, self.hm, put(z), put(z), put(z),
                    put(np.zeros(n, bool)), sb, put(np.int32(0)))
                n_run += 1
        for n, S in self.scheduler.prefill_programs():
            sb = self._host_batch([SamplingParams()] * n)
            neg = np.full((n, S), -1, np.int32)
            for greedy in (True, False):
                self.state, self.mstate, self.mlogits, self.hm, _ = self._prefill_program(n, greedy)(
                    self.model.params, self.state, self.mstate, self.mlogits, self.hm,
                    put(np.zeros((n, S), np.int32)), put(neg), put(neg), put(np.zeros(n, bool)), sb, put(np.int32(0)))
                n_run += 1
        if self.scheduler.window_mode != "pool" and self.n_slots > 1:
            zero = put(np.int32(0))
            self._move_slot(zero, zero)
            n_run += 1
        jax.block_until_ready(self.state)
        self.steps_per_bucket = counts
        return n_run


def make_engine(model: Model, speculative: dict | None = None, **kw) -> Engine:
    """An Engine, or with `speculative` (vLLM's spelling) the speculative engine of its method: SpeculativeEngine
    (MTP) or DSparkEngine."""
    if speculative is None:
        return Engine(model, **kw)
    if kw.pop("prefix_cache_bytes", 0):
        raise ValueError("prefix caching does not support speculative decoding yet (its drafter state is not "
                         "snapshotted): drop --prefix-cache-bytes or --speculative-config")
    method, _ = parse_speculative(speculative)
    return (DSparkEngine if method == "dspark" else SpeculativeEngine)(model, speculative, **kw)
