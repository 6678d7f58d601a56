"""The Engine with speculative decoding, for every drafting method, and make_engine (the plain Engine or this one).

Each iteration every decoding request drafts k tokens, the target verifies them and the request takes up to k + 1
tokens; prefill chunks also feed the drafter, so a request's first iteration drafts from its prompt. What is
method-specific (the drafter's per-slot state and its programs) is a drafter.Drafter: MTP (DeepSeek-V4,
mtp_drafter.py) or DSpark (DeepSeek-V4.1, dspark_drafter.py). Everything else is the plain Engine's: requests, slots
and their compaction, the scheduler (a decoding request counts k + 1 positions against the token budget), sampling
rows, delivery and stop strings. The engine holds the drafter's state beside the target's (`dstate`) and moves,
resets and reallocates both together; a prefix-cache snapshot holds both (Drafter.snapshot). The host keeps each
request's last token, position and count, checks stop ids, max_new_tokens and stop strings, and ends a request at the
first of them (accepted tokens past it are dropped; its slot is freed). logit_bias and min_tokens apply at every
verified position, logprobs come from the target's logits at each emitted one (acceptance.py); penalties and prompt
logprobs are refused by name (docs/speculative.md's feature matrix).
"""

from __future__ import annotations

import jax
import numpy as np

from ..model.model import Model
from ..runtime.engine import Engine, RequestOutput
from ..runtime.prefix_snapshot import prefix_cache_for, snapshot_prefills, warm_snapshots
from ..runtime.sampling import SamplingParams
from ..runtime.scheduler import Iteration
from ..runtime.slot_sampling import SPECULATIVE_UNSUPPORTED, logprob_entries
from ..runtime.slots import guarded
from ..runtime.steps import length_bucket
from .config import parse_speculative
from .drafter import DecodeRows, Drafter, Emitted, PrefillChunk
from .dspark_drafter import DSparkDrafter
from .mtp_drafter import MtpDrafter
from .stats import SpecStats

__all__ = ["SpeculativeEngine", "make_engine", "make_drafter"]

DRAFTERS = {"mtp": MtpDrafter, "dspark": DSparkDrafter}


def make_drafter(model: Model, method: str, k: int) -> Drafter:
    """The drafter of `method` (as config.parse_speculative names it) for `model`; ValueError when the model cannot
    run it."""
    return DRAFTERS[method](model, k)


class SpeculativeEngine(Engine):
    """Engine(model, ...) with speculative={"method": "mtp" | "dspark", "num_speculative_tokens": k} (vLLM's spelling;
    the model loaded with mtp=True). `drafter` is the method's Drafter, `dstate` its per-slot state, `spec_stats`
    counts drafted and accepted tokens (SpecStats)."""

    unsupported = SPECULATIVE_UNSUPPORTED
    images_unsupported = True   # the draft / verify steps take no image embeddings yet

    def __init__(self, model: Model, speculative: dict, prefix_cache_bytes: int = 0, **kw):
        method, self.k = parse_speculative(speculative)
        self.drafter = make_drafter(model, method, self.k)
        super().__init__(model, decode_width=self.k + 1, **kw)
        self.spec_stats = SpecStats(self.k)
        self.dstate = self.drafter.new_state(self.n_slots, self._cache_len())
        self.prefix_cache = prefix_cache_for(model, prefix_cache_bytes, self._cache_len(),
                                             self.drafter.snapshot_lookahead)

    def _window_mode(self, model: Model) -> str:
        return self.drafter.window_mode(super()._window_mode(model))

    def _cache_len(self) -> int:
        # a request near max_len still verifies k + 1 positions
        return length_bucket(self.max_len + self.k + 1, 256)

    def reset(self) -> None:
        super().reset()
        self.dstate = self.drafter.new_state(self.n_slots, self._cache_len())

    def _reset_slots(self, mask: np.ndarray) -> None:
        super()._reset_slots(mask)
        self.dstate = self.drafter.reset_slots(self.dstate, self.model.put(mask))

    def _move_slot(self, src, dst) -> None:
        self.state, self.dstate = self.drafter.move_slot(self.state, self.dstate, src, dst)

    def snapshot_slot(self, i: int, p: int) -> tuple[object, int]:
        """The target's snapshot (Engine.snapshot_slot) with the drafter's (Drafter.snapshot) of slot i."""
        snap, nbytes = super().snapshot_slot(i, p)
        dsnap = self.drafter.snapshot(self.dstate, self.model.put(np.int32(i)))
        return (snap, dsnap), nbytes + sum(int(a.nbytes) for a in jax.tree_util.tree_leaves(dsnap))

    def restore_slot(self, i: int, snap) -> None:
        super().restore_slot(i, snap[0])
        self.dstate = self.drafter.restore(self.dstate, snap[1], self.model.put(np.int32(i)))

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
        sb, want = self._window_rows(w), self._wanting_logprobs(it.decode)
        self.state, self.dstate, emitted, a = self.drafter.decode(
            self.state, self.dstate, DecodeRows(w.rows, w.start, x, p, count, live), sb,
            bool(np.all(sb.temperature[live] <= 0)), self.history, logprobs=bool(want))
        self.spec_stats.add(a[live])
        new = {i: [int(t) for t in emitted.tokens[i - w.start] if t >= 0] for i in it.decode}
        return self._deliver(new, self._logprobs(emitted, want, w.start, new))

    def _wanting_logprobs(self, slots) -> list[int]:
        return [i for i in slots if self.slots[i].params.logprobs is not None]

    def _logprobs(self, emitted: Emitted, want: list[int], start: int, new: dict[int, list[int]]) -> dict:
        """For each slot in `want`, one logprob entry per token it is given (emitted: [rows, k+1] or, for first tokens,
        [rows]; a failure stays with its request, runtime.slots.guarded)."""
        def entry(i, j):
            r = (i - start,) if emitted.tokens.ndim == 1 else (i - start, j)
            return guarded(logprob_entries, new[i][j], emitted.logprob[r], emitted.top_ids[r], emitted.top_vals[r],
                           self.slots[i].params.logprobs)
        return {i: [entry(i, j) for j in range(len(new[i]))] for i in want}

    def _prefill(self, it: Iteration) -> list[RequestOutput]:
        if not it.prefill:
            return []
        w = it.prefill_window
        done = {i: self.slots[i].prefilled for i in it.prefill}
        toks, pos, ended = self._take_chunk(it)
        nxt = np.full_like(toks, -1)
        ends = np.zeros(w.rows, bool)
        for i, n in it.prefill.items():
            following = self.slots[i].request.ids[done[i] + 1:done[i] + n + 1]    # (one short where the prompt ends)
            nxt[i - w.start, :len(following)] = following
        ends[[i - w.start for i in ended]] = True
        self.steps_per_bucket[w.rows] = self.steps_per_bucket.get(w.rows, 0) + 1
        sb, want = self._window_rows(w), self._wanting_logprobs(ended)
        greedy = bool(np.all(sb.temperature[[i - w.start for i in it.prefill]] <= 0))
        self.state, self.dstate, first = self.drafter.prefill(
            self.state, self.dstate, PrefillChunk(w.rows, w.start, toks, pos, nxt, ends), sb, greedy, self.history,
            logprobs=bool(want))
        snapshot_prefills(self, it.prefill)
        new = {i: [int(first.tokens[i - w.start])] for i in ended}
        return self._deliver(new, self._logprobs(first, want, w.start, new))

    def warmup(self) -> int:
        """Compile the decode iteration of every window size and the prefill program of every (window size, chunk),
        each in its greedy and sampled variant, and the slot move, on rows at position -1 (no state, drafter state
        or Engram history changes). Returns the number of programs run (Drafter.programs_per_decode per iteration)."""
        counts = dict(self.steps_per_bucket)
        self._reset_slots(np.zeros(self.n_slots, bool))
        n_run = 0
        for n in self.scheduler.decode_programs():
            sb = self._host_batch([SamplingParams()] * n)
            for greedy in (True, False):
                self.state, self.dstate, _, _ = self.drafter.decode(self.state, self.dstate, DecodeRows.idle(n), sb,
                                                                    greedy, self.history)
                n_run += self.drafter.programs_per_decode
        for n, S in self.scheduler.prefill_programs():
            sb = self._host_batch([SamplingParams()] * n)
            for greedy in (True, False):
                history = None if self.history is None else self.history.copy()
                self.state, self.dstate, _ = self.drafter.prefill(self.state, self.dstate, PrefillChunk.idle(n, S),
                                                                  sb, greedy, history)
                n_run += 1
        if self.scheduler.window_mode != "pool" and self.n_slots > 1:
            zero = self.model.put(np.int32(0))
            self._move_slot(zero, zero)
            n_run += 1
        n_run += warm_snapshots(self)        # (with a prefix cache: its copy-out and copy-in programs)
        jax.block_until_ready((self.state, self.dstate))
        self.steps_per_bucket = counts
        return n_run


def make_engine(model: Model, speculative: dict | None = None, **kw) -> Engine:
    """An Engine, or with `speculative` (vLLM's spelling) the SpeculativeEngine of its method."""
    if speculative is None:
        return Engine(model, **kw)
    return SpeculativeEngine(model, speculative, **kw)
