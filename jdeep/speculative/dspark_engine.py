"""The Engine with DSpark speculative decoding (DeepSeek-V4.1's drafter, dspark_decode.py): each iteration every
decoding request drafts a block after its last token, the target verifies the first k drafts (one step, or
consecutive steps where a ring is shorter than k + 1: dspark_iteration.verify) and the request takes up to k + 1 tokens;
prefill chunks also write every prompt position into the drafter's windows (dspark_iteration.prefill_chunk).

Besides the Engine's target state the pool holds the drafter's windows (`dstate`, per slot). The host keeps each
request's last token, position and count (the Engine's bookkeeping), checks stop ids, max_new_tokens and stop
strings, and ends a request at the first of them (accepted tokens past it are dropped; its slot is freed).

Without Engram layers an iteration is one program per window of slots (draft then verify), the windows, compaction
and warm-up the Engine's. With Engram layers the whole pool steps (as in the plain engine) and an iteration is two
programs with a host step between, as in dspark_decode: the draft program; the host gathers the Engram rows of
[x, d_1..d_k] from a copy of the pool's n-gram histories; the verify program; then the histories advance by the
kept tokens only, so they always equal plain decoding's. In the regions compile mode the whole pool steps too, through
dspark_regions.RegionsPrograms (the draft, per target step the undo log and the regions step, the finish).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..model.cache import PROGRAMS
from ..model.dspark import empty_dspark_state
from ..model.model import Model
from ..runtime.engine import Engine, RequestOutput
from ..runtime.sampling import INT32_MAX, SamplingBatch, SamplingParams
from ..runtime.scheduler import Iteration
from ..runtime.slot_sampling import SPECULATIVE_UNSUPPORTED
from ..runtime.steps import length_bucket
from ..state import move_slot, put_slot_window, slot_window, zero_slots
from .config import parse_speculative
from .dspark_decode import check_dspark_model, check_k, dead_tokens, draft_program, verify_program
from .dspark_iteration import Carry, iteration, prefill_chunk
from .dspark_regions import RegionsPrograms
from .mtp_decode import SpecStats

__all__ = ["DSparkEngine"]


def _no_stops(rows: int) -> tuple[jax.Array, jax.Array]:
    """stops int32 [rows, 1] and max_new int32 [rows] that never end a row on the device (the host ends requests)."""
    return jnp.full((rows, 1), -1, jnp.int32), jnp.full((rows,), INT32_MAX, jnp.int32)


def _decode_window(params, state, dstate, x, p, count, live, sb, start, *, rows, k, greedy, config, plan, numerics):
    """One iteration (draft, verify) over slots [start, start + rows) as one program (models without Engram): x, p,
    count int32 [rows], live bool [rows], sb the window's sampling rows. Returns (state, dstate, emitted int32
    [rows, k+1] (-1 past what the row emits), accepted int32 [rows] (-1 for rows that did not run))."""
    stops, max_new = _no_stops(rows)
    sw, dw, _, emitted, a, _ = iteration(params, slot_window(state, rows, start), slot_window(dstate, rows, start),
                                         Carry(x, p, count, ~live), sb, stops, max_new, k=k, config=config, plan=plan,
                                         numerics=numerics, greedy=greedy)
    return put_slot_window(state, sw, start), put_slot_window(dstate, dw, start), emitted, a


def _prefill_window(params, state, dstate, tokens, positions, engram, sb, start, *, rows, greedy, config, plan,
                    numerics):
    """A prefill chunk (target with the DSpark taps, then the drafter's windows) over slots [start, start + rows):
    tokens, positions int32 [rows, S]; engram the chunk's Engram rows (None without Engram). Returns (state, dstate,
    first token int32 [rows], meaningful for rows whose prompt ends in this chunk)."""
    first, sw, dw = prefill_chunk(params, slot_window(state, rows, start), slot_window(dstate, rows, start), tokens,
                                  positions, engram, sb, config=config, plan=plan, numerics=numerics, greedy=greedy)
    return put_slot_window(state, sw, start), put_slot_window(dstate, dw, start), first


class DSparkEngine(Engine):
    """Engine(model, ...) with speculative={"method": "dspark", "num_speculative_tokens": k} (a DeepSeek-V4.1 model
    loaded with mtp=True). `spec_stats` counts drafted and accepted tokens (mtp_decode.SpecStats)."""

    unsupported = SPECULATIVE_UNSUPPORTED
    images_unsupported = True   # its draft / verify steps take no image embeddings yet

    def __init__(self, model: Model, speculative: dict, **kw):
        method, self.k = parse_speculative(speculative)
        if method != "dspark":
            raise ValueError(f"DSparkEngine runs speculative method 'dspark', got {method!r} (make_engine picks the "
                             "engine of a method)")
        check_dspark_model(model)
        check_k(model, self.k)
        self._regions = {}
        super().__init__(model, decode_width=self.k + 1, **kw)
        self.spec_stats = SpecStats(self.k)
        self._alloc_drafter()

    def _window_mode(self, model: Model) -> str:
        # the regions mode's DSpark programs step the whole pool, as models with Engram do
        return "pool" if model.compile_mode == "regions" else super()._window_mode(model)

    def _regions_programs(self, greedy: bool) -> RegionsPrograms:
        if greedy not in self._regions:
            self._regions[greedy] = RegionsPrograms(self.model, self.k, greedy)
        return self._regions[greedy]

    def _cache_len(self) -> int:
        # a request near max_len still verifies k + 1 positions
        return length_bucket(self.max_len + self.k + 1, 256)

    def _alloc_drafter(self) -> None:
        m = self.model
        self.dstate = jax.device_put(empty_dspark_state(m.config, m.plan, self.n_slots, self._cache_len(), m.dtype,
                                                        m.numerics), jax.devices()[0])

    def reset(self) -> None:
        super().reset()
        self._alloc_drafter()

    def _reset_slots(self, mask: np.ndarray) -> None:
        super()._reset_slots(mask)
        self.dstate = PROGRAMS.jit(zero_slots, donate_argnums=(0,))(self.dstate, self.model.put(mask))

    def _move_slot(self, src, dst) -> None:
        super()._move_slot(src, dst)
        self.dstate = PROGRAMS.jit(move_slot, donate_argnums=(0,))(self.dstate, src, dst)

    def _program(self, fn, rows: int, **extra):
        m = self.model
        key = (fn.__name__, rows, tuple(sorted(extra.items())), m.config, m.plan, m.numerics)
        return PROGRAMS.get(key, lambda: jax.jit(functools.partial(
            fn, rows=rows, config=m.config, plan=m.plan, numerics=m.numerics, **extra), donate_argnums=(1, 2)))

    def _run_decode(self, rows: int, start: int, x, p, count, live, sb: SamplingBatch, greedy: bool
                    ) -> tuple[np.ndarray, np.ndarray]:
        """One iteration over slots [start, start + rows) from host arrays x, p, count int32 [rows], live bool
        [rows]. Returns (emitted int32 [rows, k+1], accepted int32 [rows]) on the host."""
        m, put = self.model, self.model.put
        rp = self._regions_programs(greedy) if m.compile_mode == "regions" else None
        if self.history is None and rp is None:
            self.state, self.dstate, emitted, a = self._program(_decode_window, rows, k=self.k, greedy=greedy)(
                m.params, self.state, self.dstate, put(x), put(p), put(count), put(live), sb, put(np.int32(start)))
            return m.fetch(emitted), m.fetch(a)
        # the whole pool (start 0, rows n_slots): Engram rows gathered between the draft and the verify, or the
        # regions mode's programs
        carry = Carry(put(x), put(p), put(count), put(~live))
        drafts, q = (draft_program(m, greedy) if rp is None else rp.drafts)(m.params, self.dstate, carry, sb)
        if self.history is not None:
            tokens = np.concatenate([x[:, None], m.fetch(drafts)[:, :self.k]], axis=1).astype(np.int32)
            pos = np.where(live[:, None], p[:, None] + np.arange(self.k + 1, dtype=np.int32)[None, :], -1)
            seen = self.history.copy()
        stops, max_new = _no_stops(rows)
        if rp is None:
            self.state, self.dstate, _, emitted, a, kept = verify_program(m, self.k, greedy)(
                m.params, self.state, self.dstate, carry, drafts, q, sb, stops, max_new,
                m.engram_inputs(seen, tokens, pos))
        else:
            engram = None if self.history is None else [m.engram_inputs(seen, tokens[:, sl], pos[:, sl])
                                                        for sl in rp.slices(self.state)]
            self.state, self.dstate, _, emitted, a, kept = rp.verify(m.params, self.state, self.dstate, carry, drafts,
                                                                     q, sb, stops, max_new, engram)
        if self.history is not None:
            self.history.advance(tokens, m.fetch(kept), dead_tokens(m, tokens))
        return m.fetch(emitted), m.fetch(a)

    def _run_prefill(self, rows: int, start: int, toks: np.ndarray, pos: np.ndarray, sb: SamplingBatch, greedy: bool,
                     history) -> np.ndarray:
        """A prefill chunk over slots [start, start + rows) (toks, pos int32 [rows, S]; `history` gives the Engram
        rows and advances). Returns the first tokens int32 [rows] on the host."""
        m, put = self.model, self.model.put
        engram = m.engram_inputs(history, toks, pos)
        if m.compile_mode == "regions":          # the whole pool
            first, self.state, self.dstate = self._regions_programs(greedy).prefill(
                m.params, self.state, self.dstate, put(toks), put(pos), engram, sb)
        else:
            self.state, self.dstate, first = self._program(_prefill_window, rows, greedy=greedy)(
                m.params, self.state, self.dstate, put(toks), put(pos), engram, sb, put(np.int32(start)))
        return m.fetch(first)

    def _decode(self, it: Iteration) -> list[RequestOutput]:
        if not it.decode:
            return []
        w = it.decode_window
        x, p, count = (np.zeros(w.rows, np.int32) for _ in range(3))
        live = np.zeros(w.rows, bool)
        for i in it.decode:
            s, r = self.slots[i], i - w.start
            x[r], count[r], live[r] = self._last[i], len(s.out.tokens), True
            p[r] = len(s.out.prompt) + len(s.out.tokens) - 1
        self.steps_per_bucket[w.rows] = self.steps_per_bucket.get(w.rows, 0) + 1
        sb = self._window_rows(w)
        emitted, a = self._run_decode(w.rows, w.start, x, p, count, live, sb, bool(np.all(sb.temperature[live] <= 0)))
        self.spec_stats.add(a[live])
        return self._deliver({i: [int(t) for t in emitted[i - w.start] if t >= 0] for i in it.decode})

    def _prefill(self, it: Iteration) -> list[RequestOutput]:
        if not it.prefill:
            return []
        w = it.prefill_window
        toks, pos, ended = self._take_chunk(it)
        self.steps_per_bucket[w.rows] = self.steps_per_bucket.get(w.rows, 0) + 1
        sb = self._window_rows(w)
        greedy = bool(np.all(sb.temperature[[i - w.start for i in it.prefill]] <= 0))
        first = self._run_prefill(w.rows, w.start, toks, pos, sb, greedy, self.history)
        return self._deliver({i: [int(first[i - w.start])] for i in ended})

    def warmup(self) -> int:
        """Compile the decode iteration of every window size and the prefill program of every (window size, chunk),
        each in its greedy and sampled variant, and the slot moves, on rows at position -1 (no state, window or
        history changes). Returns the number of programs run (the draft and the verify count apart with Engram)."""
        counts = dict(self.steps_per_bucket)
        self._reset_slots(np.zeros(self.n_slots, bool))
        n_run, per_decode = 0, 1 if self.history is None and self.model.compile_mode == "scan" else 2
        for n in self.scheduler.decode_programs():
            z = np.zeros(n, np.int32)
            sb = self._host_batch([SamplingParams()] * n)
            for greedy in (True, False):
                self._run_decode(n, 0, z, z, z, np.zeros(n, bool), sb, greedy)
                n_run += per_decode
        for n, S in self.scheduler.prefill_programs():
            sb = self._host_batch([SamplingParams()] * n)
            for greedy in (True, False):
                history = None if self.history is None else self.history.copy()
                self._run_prefill(n, 0, np.zeros((n, S), np.int32), np.full((n, S), -1, np.int32), sb, greedy,
                                  history)
                n_run += 1
        if self.scheduler.window_mode != "pool" and self.n_slots > 1:
            zero = self.model.put(np.int32(0))
            self._move_slot(zero, zero)
            n_run += 2
        jax.block_until_ready((self.state, self.dstate))
        self.steps_per_bucket = counts
        return n_run
