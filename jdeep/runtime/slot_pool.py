"""The Engine's slot pool: a fixed number of sequence slots and everything that lives per slot.

Slot i holds one running request (`slots[i]`, a slots.Slot, or None when free) and its rows of: the device decode
state (`state`: n_slots rows of `cache_len` tokens) and Engram n-gram history, the host sampling values
(`rows`, a SamplingBatch of numpy arrays: a window's rows are a slice, not a device program), the last token given
(`last`), the device token counts of penalised requests (`penalties`, slot_sampling.SlotPenalties), and the prefix
cache's snapshots of it (`prefix_cache`, prefix_snapshot.py). Admission resets a slot's rows (one program for all
slots admitted together), compaction moves the highest slots down so the smallest window holds the running requests
(one program per moved slot), and a window's prefill chunk is packed from its slots' prompts here.

Device programs: the slot reset (per slot), move_state, the snapshot copies, one each per shape. A speculative engine's pool
(speculative/engine.DraftingSlotPool) overrides those four to carry its drafter's per-slot state along.
"""

from __future__ import annotations

import jax
import numpy as np

from ..model.cache import PROGRAMS
from ..model.model import Model
from ..state import move_slot, reset_slot
from .prefix_cache import PrefixCache
from .prefix_snapshot import admit_cached, cut_at_targets, prefix_cache_for, restore_snapshot, take_snapshot
from .sampling import SamplingBatch, SamplingParams, host_batch
from .scheduler import Iteration, Window
from .slot_sampling import SlotPenalties
from .slots import Slot
from .steps import batch_bucket, pack_chunk

__all__ = ["SlotPool", "window_mode_for", "window_mode_of"]


def window_mode_for(engram: bool, mesh: bool) -> str:
    """How the scheduler picks the slots a program steps (scheduler.py): the whole pool for models with Engram
    (their host-side histories are per pool row), windows starting at slot 0 on a mesh, else aligned windows."""
    return "pool" if engram else "prefix" if mesh else "aligned"


def window_mode_of(model: Model) -> str:
    """window_mode_for a loaded model."""
    return window_mode_for(model.engram is not None, model.layout is not None)


class SlotPool:
    """SlotPool(model, n_slots, cache_len): see the module docstring. window_mode: the scheduler's (window_mode_of
    unless a drafter narrows it); prefix_cache_bytes, snapshot_lookahead: the prefix cache's budget (0: off; "auto":
    prefix_snapshot.auto_budget) and PrefixCache.lookahead."""

    def __init__(self, model: Model, n_slots: int, cache_len: int, prefix_cache_bytes: int | str = 0,
                 snapshot_lookahead: int = 0):
        self.model, self.n_slots, self.cache_len = model, n_slots, cache_len
        self.slots: list[Slot | None] = [None] * n_slots
        self.rows = SamplingBatch(*(np.array(a) for a in host_batch([SamplingParams()] * n_slots)))
        self.last = np.zeros(n_slots, np.int32)
        self.penalties = SlotPenalties(n_slots, model.config.vocab_size, model.to_sampler)
        self.prefix_cache: PrefixCache | None = prefix_cache_for(model, prefix_cache_bytes, cache_len,
                                                                 snapshot_lookahead, n_slots)
        self.state = self.history = None
        self.new_state()

    @property
    def snapshot_block(self) -> int | None:
        """The prefix cache's block (None without a cache)."""
        return None if self.prefix_cache is None else self.prefix_cache.block

    @property
    def window_mode(self) -> str:
        return window_mode_of(self.model)

    # ------------------------------------------------------------------ device state
    def new_state(self) -> None:
        """Allocate a fresh decode state and Engram history (after a failed step: donated state may be gone)."""
        self.state = self.model.init_state(self.n_slots, self.cache_len)
        self.history = self.model.new_history(self.n_slots)
        self.penalties.state = self.penalties.fresh()

    def block_until_ready(self) -> None:
        """Wait for every program writing the pool's device state."""
        jax.block_until_ready((self.state, self.penalties.state))

    def reset_slots(self, mask: np.ndarray) -> None:
        """Empty the device state of the slots where mask [n_slots] is True (state.reset_slot: one program, called
        once per slot, writing only that slot's rows; the state donated)."""
        reset = PROGRAMS.jit(reset_slot, donate_argnums=(0,))
        for i in np.flatnonzero(mask):
            self.state = reset(self.state, self.model.put(np.int32(i)))

    def move_state(self, src: jax.Array, dst: jax.Array) -> None:
        """Copy slot src's device state over slot dst (int32 scalars placed on the device; the state donated)."""
        self.state = PROGRAMS.jit(move_slot, donate_argnums=(0,))(self.state, src, dst)

    def snapshot(self, i: int, p: int) -> tuple[object, int]:
        """(snapshot, device bytes) of slot i's device state after p prompt tokens (prefix_snapshot.py)."""
        return take_snapshot(self.prefix_cache, self.state, self.model.put(np.int32(i)), p, self.model.put)

    def restore(self, i: int, snap) -> None:
        """Write a `snapshot` over slot i's device state."""
        self.state = restore_snapshot(self.prefix_cache, self.state, snap, self.model.put(np.int32(i)), self.model.put)

    # ------------------------------------------------------------------ slots
    @property
    def n_running(self) -> int:
        """Requests holding a slot (prefilling or decoding)."""
        return sum(s is not None for s in self.slots)

    def free_slots(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s is None]

    def find(self, out) -> int | None:
        """The slot holding the request whose RequestOutput is `out` (None if none)."""
        return next((i for i, s in enumerate(self.slots) if s is not None and s.out is out), None)

    def place(self, i: int, slot: Slot) -> None:
        """Put a request into free slot i: its host sampling row and PRNG key, and for a penalised request its
        device counts (host work for one request: an exception leaves slot i free)."""
        row = host_batch([slot.params], [slot.request.stop_ids])
        if slot.params.penalized:
            self.penalties.admit(i, slot.request.ids)
        self.slots[i] = slot
        for dst, src in zip(self.rows, row):
            dst[i] = src[0]

    def start(self, taken: list[int]) -> None:
        """Reset the device rows and history of the slots just placed, then let the prefix cache restore their
        longest cached prefixes (prefix_snapshot.admit_cached)."""
        if not taken:
            return
        mask = np.zeros(self.n_slots, bool)
        mask[taken] = True
        self.reset_slots(mask)
        if self.history is not None:
            self.history.reset(taken)
        admit_cached(self, taken)

    def compact(self, window_mode: str) -> int:
        """Move requests from the highest slots into free lower ones until they fit the smallest window that can
        hold them all (not for whole-pool models); returns the number of slots moved."""
        if window_mode == "pool":
            return 0
        used = [i for i, s in enumerate(self.slots) if s is not None]
        target = batch_bucket(len(used)) if used else 1
        free = [i for i in range(target) if self.slots[i] is None]
        moves = 0
        for src in sorted((i for i in used if i >= target), reverse=True):
            dst = free.pop(0)
            self.move_state(self.model.put(np.int32(src)), self.model.put(np.int32(dst)))
            self.slots[dst], self.slots[src] = self.slots[src], None
            for a in self.rows:
                a[dst] = a[src]
            if self.slots[dst].params.penalized:
                self.penalties.move(src, dst)
            self.last[dst] = self.last[src]
            moves += 1
        return moves

    def window_rows(self, w: Window) -> SamplingBatch:
        """The window's sampling rows (host arrays)."""
        return SamplingBatch(*(a[w.start:w.start + w.rows] for a in self.rows))

    def remaining_prompts(self) -> list[int | None]:
        """Each slot's prompt tokens left to prefill (None: free), cut at the prefix cache's next snapshot point."""
        return cut_at_targets(self, [None if s is None else len(s.out.prompt) - s.prefilled for s in self.slots])

    def take_chunk(self, it: Iteration) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """The iteration's prefill chunk over its window (tokens, positions int32 [rows, S]), counted as prefilled;
        and the slots whose prompt ends in it (sorted)."""
        w = it.prefill_window
        prompts = [self.slots[i].request.ids[:self.slots[i].prefilled + it.prefill[i]] if i in it.prefill else None
                   for i in range(w.start, w.start + w.rows)]
        done = [self.slots[i].prefilled if i in it.prefill else 0 for i in range(w.start, w.start + w.rows)]
        toks, pos, taken = pack_chunk(prompts, done, w.rows, it.chunk, width=it.chunk)
        assert toks.shape[1] == it.chunk and all(taken[i - w.start] == n for i, n in it.prefill.items())
        for i, n in it.prefill.items():
            self.slots[i].prefilled += n
        return toks, pos, sorted(i for i in it.prefill if self.slots[i].prefilled == len(self.slots[i].out.prompt))
