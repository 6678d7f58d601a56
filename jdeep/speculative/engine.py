"""The Engine with speculative decoding, for every drafting method, and make_engine (the plain Engine or this one).

Each iteration every decoding request drafts k tokens, the target verifies them and the request takes up to k + 1
tokens; prefill chunks also feed the drafter, so a request's first iteration drafts from its prompt. What is
method-specific (the drafter's per-slot state and its programs) is a drafter.Drafter: MTP (DeepSeek-V4,
mtp_drafter.py) or DSpark (DeepSeek-V4.1, dspark_drafter.py). Everything else is the plain Engine's: its request
table, scheduler (a decoding request counts k + 1 positions against the token budget) and output processor
(delivery, stop strings: a request ends at the first stop id, max_new_tokens or stop string, accepted tokens past it
dropped). Two of the engine's parts are replaced: the slot pool (`DraftingSlotPool`) holds the drafter's state beside
the target's (`dstate`) and moves, resets, reallocates and snapshots both together (Drafter.snapshot), and the runner
(`SpeculativeRunner`) runs the drafter's prefill and draft-verify-finish programs and lists them in the engine's
inventory. logit_bias and min_tokens apply at every verified position, logprobs come from the target's logits at each
emitted one (acceptance.py); penalties and prompt logprobs are refused by name (docs/speculative.md's feature
matrix).
"""

from __future__ import annotations

import jax
import numpy as np

from ..model.model import Model
from ..runtime.engine import Engine
from ..runtime.inventory import ProgramSpec
from ..runtime.prefix_snapshot import snapshot_block_for, snapshot_prefills
from ..runtime.runner import Runner, Tokens
from ..runtime.sampling import SamplingParams, host_batch
from ..runtime.scheduler import Iteration
from ..runtime.slot_pool import SlotPool, window_mode_of
from ..runtime.slot_sampling import SPECULATIVE_UNSUPPORTED, logprob_entries
from ..runtime.slots import guarded
from ..runtime.warmup import WarmContext
from .config import parse_speculative
from .drafter import DecodeRows, Drafter, Emitted, PrefillChunk
from .inventory import drafter_programs as drafter_entry_programs
from .inventory import DRAFTERS, drafting_programs
from .stats import SpecStats

__all__ = ["SpeculativeEngine", "DraftingSlotPool", "SpeculativeRunner", "make_engine", "make_drafter"]


def make_drafter(model: Model, method: str, k: int) -> Drafter:
    """The drafter of `method` (as config.parse_speculative names it) for `model`; ValueError when the model cannot
    run it."""
    return DRAFTERS[method](model, k)


class DraftingSlotPool(SlotPool):
    """The slot pool with the drafter's per-slot state (`dstate`) beside the target's: reset, moved, reallocated and
    snapshotted together."""

    def __init__(self, model: Model, drafter: Drafter, n_slots: int, cache_len: int,
                 prefix_cache_bytes: int | str = 0):
        self.drafter, self.dstate = drafter, None
        super().__init__(model, n_slots, cache_len, prefix_cache_bytes, drafter.snapshot_lookahead)

    @property
    def window_mode(self) -> str:
        return self.drafter.window_mode(window_mode_of(self.model))

    def new_state(self) -> None:
        super().new_state()
        self.dstate = self.drafter.new_state(self.n_slots, self.cache_len)

    def block_until_ready(self) -> None:
        super().block_until_ready()
        jax.block_until_ready(self.dstate)

    def reset_slots(self, mask: np.ndarray) -> None:
        super().reset_slots(mask)
        self.dstate = self.drafter.reset_slots(self.dstate, self.model.put(mask))

    def move_state(self, src, dst) -> None:
        self.state, self.dstate = self.drafter.move_slot(self.state, self.dstate, src, dst)

    def snapshot(self, i: int, p: int) -> tuple[object, int]:
        """The target's snapshot (SlotPool.snapshot) with the drafter's (Drafter.snapshot) of slot i."""
        snap, nbytes = super().snapshot(i, p)
        dsnap = self.drafter.snapshot(self.dstate, self.model.put(np.int32(i)))
        return (snap, dsnap), nbytes + sum(int(a.nbytes) for a in jax.tree_util.tree_leaves(dsnap))

    def restore(self, i: int, snap) -> None:
        super().restore(i, snap[0])
        self.dstate = self.drafter.restore(self.dstate, snap[1], self.model.put(np.int32(i)))


class SpeculativeRunner(Runner):
    """The runner whose decode drafts k tokens per decoding row, verifies and finishes them (Drafter.decode) and
    whose prefill feeds the drafter too (Drafter.prefill). spec_stats counts drafted and accepted tokens."""

    def __init__(self, model: Model, pool: DraftingSlotPool, scheduler):
        super().__init__(model, pool, scheduler)
        self.drafter = pool.drafter
        self.spec_stats = SpecStats(self.drafter.k)

    def decode(self, it: Iteration) -> Tokens:
        if not it.decode:
            return {}, {}
        pool, w = self.pool, it.decode_window
        x, p, count = (np.zeros(w.rows, np.int32) for _ in range(3))
        live = np.zeros(w.rows, bool)
        for i in it.decode:
            s, r = pool.slots[i], i - w.start
            x[r], count[r], live[r] = pool.last[i], len(s.out.tokens), True
            p[r] = len(s.out.prompt) + len(s.out.tokens) - 1
        self.count_step(w.rows)
        sb, want = pool.window_rows(w), self._wanting_logprobs(it.decode)
        pool.state, pool.dstate, emitted, a = self.drafter.decode(
            pool.state, pool.dstate, DecodeRows(w.rows, w.start, x, p, count, live), sb,
            bool(np.all(sb.temperature[live] <= 0)), pool.history, logprobs=bool(want))
        self.spec_stats.add(a[live])
        new = {i: [int(t) for t in emitted.tokens[i - w.start] if t >= 0] for i in it.decode}
        return new, self._logprobs(emitted, want, w.start, new)

    def _wanting_logprobs(self, slots) -> list[int]:
        return [i for i in slots if self.pool.slots[i].params.logprobs is not None]

    def _logprobs(self, emitted: Emitted, want: list[int], start: int, new: dict[int, list[int]]) -> dict:
        """For each slot in `want`, one logprob entry per token it is given (emitted: [rows, k+1] or, for first tokens,
        [rows]; a failure stays with its request, runtime.slots.guarded)."""
        def entry(i, j):
            r = (i - start,) if emitted.tokens.ndim == 1 else (i - start, j)
            return guarded(logprob_entries, new[i][j], emitted.logprob[r], emitted.top_ids[r], emitted.top_vals[r],
                           self.pool.slots[i].params.logprobs)
        return {i: [entry(i, j) for j in range(len(new[i]))] for i in want}

    def prefill(self, it: Iteration) -> Tokens:
        if not it.prefill:
            return {}, {}
        pool, w = self.pool, it.prefill_window
        done = {i: pool.slots[i].prefilled for i in it.prefill}
        toks, pos, ended = pool.take_chunk(it)
        nxt = np.full_like(toks, -1)
        ends = np.zeros(w.rows, bool)
        for i, n in it.prefill.items():
            following = pool.slots[i].request.ids[done[i] + 1:done[i] + n + 1]    # (one short where the prompt ends)
            nxt[i - w.start, :len(following)] = following
        ends[[i - w.start for i in ended]] = True
        self.count_step(w.rows)
        sb, want = pool.window_rows(w), self._wanting_logprobs(ended)
        greedy = bool(np.all(sb.temperature[[i - w.start for i in it.prefill]] <= 0))
        pool.state, pool.dstate, first = self.drafter.prefill(
            pool.state, pool.dstate, PrefillChunk(w.rows, w.start, toks, pos, nxt, ends), sb, greedy, pool.history,
            logprobs=bool(want))
        snapshot_prefills(pool, it.prefill)
        new = {i: [int(first.tokens[i - w.start])] for i in ended}
        return new, self._logprobs(first, want, w.start, new)

    def programs(self, max_len: int, prompt_logprobs: bool = True) -> list[ProgramSpec]:
        """The speculative inventory (inventory.drafting_programs): the slot pool's and drafter's slot programs, per
        window size the decode iteration and per (window size, chunk bucket) the prefill program, each greedy and
        sampled. prompt_logprobs: unused (speculation refuses them)."""
        return drafting_programs(self.scheduler, self.pool.n_slots,
                                 snapshot_block_for(self.pool.snapshot_block, max_len), self.drafter)

    def lowered(self, specs: list[ProgramSpec], drafter_programs=None):
        """Runner.lowered, the drafter's entries through speculative.inventory.drafter_programs."""
        def drafts(spec, params, state):
            return drafter_entry_programs(self.drafter, spec, params, state, self.pool.n_slots, self.pool.cache_len)
        return super().lowered(specs, drafts)

    def warm(self, spec: ProgramSpec, ctx: WarmContext) -> None:
        """Run one entry of `programs` on rows at position -1 (no state, drafter state or Engram history changes)."""
        pool, n = self.pool, spec.rows
        greedy = spec.variant == "greedy"
        zero = self.model.put(np.int32(0))
        if spec.name == "drafter.reset":
            pool.dstate = self.drafter.reset_slots(pool.dstate, self.model.put(np.zeros(pool.n_slots, bool)))
        elif spec.name == "drafter.move":
            pool.move_state(zero, zero)
        elif spec.name == "drafter.snapshot.out":
            ctx.snapshots["drafter"] = self.drafter.snapshot(pool.dstate, zero)
        elif spec.name == "drafter.snapshot.in":
            pool.dstate = self.drafter.restore(pool.dstate, ctx.snapshots.pop("drafter"), zero)
        elif spec.kind == "spec.decode":
            pool.state, pool.dstate, _, _ = self.drafter.decode(pool.state, pool.dstate, DecodeRows.idle(n),
                                                                host_batch([SamplingParams()] * n), greedy,
                                                                pool.history)
        elif spec.kind == "spec.prefill":
            history = None if pool.history is None else pool.history.copy()
            pool.state, pool.dstate, _ = self.drafter.prefill(pool.state, pool.dstate, PrefillChunk.idle(n, spec.seq),
                                                              host_batch([SamplingParams()] * n), greedy, history)
        else:
            super().warm(spec, ctx)


class SpeculativeEngine(Engine):
    """Engine(model, ...) with speculative={"method": "mtp" | "dspark", "num_speculative_tokens": k} (vLLM's spelling;
    the model loaded with drafter=True). `drafter` is the method's Drafter, `dstate` its per-slot state, `spec_stats`
    counts drafted and accepted tokens (SpecStats)."""

    unsupported = SPECULATIVE_UNSUPPORTED
    images_unsupported = True   # the draft / verify steps take no image embeddings yet

    def __init__(self, model: Model, speculative: dict, **kw):
        method, self.k = parse_speculative(speculative)
        self.drafter = make_drafter(model, method, self.k)
        super().__init__(model, decode_width=self.k + 1, **kw)

    def make_pool(self, cache_len: int, prefix_cache_bytes: int | str) -> DraftingSlotPool:
        return DraftingSlotPool(self.model, self.drafter, self.n_slots, cache_len, prefix_cache_bytes)

    def make_runner(self) -> SpeculativeRunner:
        return SpeculativeRunner(self.model, self.pool, self.scheduler)

    @property
    def dstate(self):
        """The drafter's per-slot state (the pool's)."""
        return self.pool.dstate

    @property
    def spec_stats(self) -> SpecStats:
        return self.runner.spec_stats


def make_engine(model: Model, speculative: dict | None = None, **kw) -> Engine:
    """An Engine, or with `speculative` (vLLM's spelling) the SpeculativeEngine of its method."""
    if speculative is None:
        return Engine(model, **kw)
    return SpeculativeEngine(model, speculative, **kw)
