"""What one engine iteration runs: every decoding sequence gets its next token, and the rest of a token budget
goes to prefill chunks, oldest request first (chunked prefill mixed with decode, as vLLM's and SGLang's schedulers
do), so a long prompt never freezes the running streams.

An iteration is at most two programs over windows of the pool's sequence slots: the decode step ([rows, 1]) over the
window holding every decoding slot, and one prefill step ([rows, S]) over the window holding the slots prefilled
this iteration. A window is `rows` slots from `start`, rows a batch bucket and start a multiple of it (an aligned
block), and S a chunk bucket (buckets.py: the deployment's declared ladders), so the compiled set is one decode
program per batch bucket and one prefill program per (batch bucket, chunk bucket) with rows x chunk within the
budget: finite and known at warm-up. The budget counts what the programs compute: the decode window's rows plus the
prefill window's rows x chunk length (padding included). Whatever the budget, the oldest prompt takes at least the
smallest chunk bucket each iteration: no request starves.

`Scheduler.schedule` is pure bookkeeping over the slots (no model, no device), tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import jax

from .buckets import batch_ladder, chunk_ladder, default_chunk_buckets, default_ladders, prefill_ladder
from .steps import MIN_BUCKET

__all__ = ["Window", "Iteration", "Scheduler", "serving_scheduler", "covering_window", "floor_pow2"]


@dataclass(frozen=True)
class Window:
    """Sequence slots [start, start + rows) of the pool."""

    start: int
    rows: int

    def __contains__(self, slot: int) -> bool:
        return self.start <= slot < self.start + self.rows


@dataclass
class Iteration:
    """One iteration's plan. decode: the slots decoding (ascending), each over `decode_width` positions (1, or k + 1
    with k speculative tokens); prefill: slot -> prompt tokens it takes (oldest request first); chunk: the prefill
    program's length bucket S."""

    decode: list[int] = field(default_factory=list)
    decode_window: Window | None = None
    prefill: dict[int, int] = field(default_factory=dict)
    prefill_window: Window | None = None
    chunk: int = 0
    decode_width: int = 1

    @property
    def decode_tokens(self) -> int:
        return len(self.decode)

    @property
    def prefill_tokens(self) -> int:
        return sum(self.prefill.values())

    @property
    def cost(self) -> int:
        """Token positions the iteration's programs compute (padding included)."""
        return ((self.decode_window.rows * self.decode_width if self.decode_window else 0)
                + (self.prefill_window.rows * self.chunk if self.prefill_window else 0))


def floor_pow2(n: int) -> int:
    """Largest power of two <= n (n >= 1)."""
    return 1 << (int(n).bit_length() - 1)


def covering_window(slots: Sequence[int], n_slots: int, mode: str = "aligned") -> Window:
    """The smallest window holding `slots` (non-empty). mode "aligned": an aligned power-of-two block; "prefix": the
    first power-of-two slots (a mesh, whose slots are sharded, slices only from slot 0); "pool": every slot (models
    with Engram keep per-pool-row n-gram histories on the host)."""
    lo, hi = min(slots), max(slots)
    if mode == "pool":
        return Window(0, n_slots)
    if mode == "prefix":
        return Window(0, min(n_slots, 1 << hi.bit_length()))
    rows = 1
    while lo // rows != hi // rows:
        rows *= 2
    return Window(lo // rows * rows, rows)


class Scheduler:
    """Plans iterations for a pool of `n_slots` slots (a power of two) under a budget of `max_batched_tokens` token
    positions per iteration, with prefill chunks of at most `max_chunk` tokens (rounded down to a power of two).
    decode_width: positions one decoding request computes per iteration (k + 1 with k speculative tokens).
    batch_buckets / chunk_buckets: the window sizes and chunk lengths programs exist for (buckets.py; None: every
    power of two); prefill_batch_buckets: the window sizes of prefill steps, in the aligned window mode (None: the
    batch buckets)."""

    def __init__(self, n_slots: int, max_batched_tokens: int, max_chunk: int, window_mode: str = "aligned",
                 decode_width: int = 1, batch_buckets: Sequence[int] | None = None,
                 chunk_buckets: Sequence[int] | None = None, prefill_batch_buckets: Sequence[int] | None = None):
        if n_slots < 1 or n_slots & (n_slots - 1):
            raise ValueError(f"n_slots must be a power of two, got {n_slots}")
        if max_chunk < 1:
            raise ValueError(f"the prefill chunk must be positive, got {max_chunk}")
        if max_batched_tokens < MIN_BUCKET:
            raise ValueError(f"max_num_batched_tokens must be at least {MIN_BUCKET} (one minimum prefill chunk), "
                             f"got {max_batched_tokens}")
        if window_mode not in ("aligned", "prefix", "pool"):
            raise ValueError(f"unknown window mode {window_mode!r}")
        self.n_slots, self.budget, self.window_mode = n_slots, max_batched_tokens, window_mode
        self.decode_width = decode_width
        self.batch_buckets = batch_ladder(n_slots, batch_buckets)
        self.prefill_buckets = (prefill_ladder(self.batch_buckets, prefill_batch_buckets) if window_mode == "aligned"
                                else self.batch_buckets)
        self.chunk_buckets = chunk_ladder(max(MIN_BUCKET, floor_pow2(max_chunk)), chunk_buckets)
        self.max_chunk = self.chunk_buckets[-1]

    def window(self, slots: Sequence[int], prefill: bool = False) -> Window | None:
        """The smallest window of a batch bucket's rows (prefill: a prefill bucket's) holding `slots`; None when no
        prefill bucket is that wide."""
        w = covering_window(slots, self.n_slots, self.window_mode)
        rows = next((b for b in (self.prefill_buckets if prefill else self.batch_buckets) if b >= w.rows), None)
        return None if rows is None else Window(w.start // rows * rows, rows)

    def chunk(self, need: int, cap: int) -> int:
        """The chunk bucket for `need` tokens under a cap of `cap`: the smallest holding them within the cap, else the
        largest within it, else the smallest."""
        fits = [S for S in self.chunk_buckets if S <= cap]
        return next((S for S in fits if S >= need), fits[-1] if fits else self.chunk_buckets[0])

    def schedule(self, remaining: Sequence[int | None], order: Sequence[int] | None = None) -> Iteration:
        """remaining[i]: prompt tokens slot i still has to prefill (0: it decodes; None: the slot is free).
        order[i]: its request's arrival rank (lower = older; default the slot index)."""
        it = Iteration(decode_width=self.decode_width)
        it.decode = [i for i, r in enumerate(remaining) if r == 0]
        if it.decode:
            it.decode_window = self.window(it.decode)
        waiting = sorted((i for i, r in enumerate(remaining) if r), key=lambda i: (order or range(len(remaining)))[i])
        if not waiting:
            return it
        left = self.budget - (it.decode_window.rows * self.decode_width if it.decode_window else 0)
        first = waiting[0]
        window = self.window([first], prefill=True)
        cap = min(self.max_chunk, max(MIN_BUCKET, floor_pow2(max(1, left // window.rows))))
        it.chunk = self.chunk(min(remaining[first], cap), cap)
        it.prefill = {first: min(remaining[first], it.chunk)}
        for i in waiting[1:]:           # younger prompts share the oldest one's chunk length where the budget allows
            wider = self.window(list(it.prefill) + [i], prefill=True)
            if wider is not None and wider.rows * it.chunk <= left:
                window = wider
                it.prefill[i] = min(remaining[i], it.chunk)
        it.prefill_window = window
        return it

    def prefill_programs(self) -> list[tuple[int, int]]:
        """Every (rows, chunk) prefill program `schedule` can choose, for warm-up."""
        smallest = self.chunk_buckets[0]
        windows = [self.n_slots] if self.window_mode == "pool" else list(self.prefill_buckets)
        return [(n, S) for n in windows for S in self.chunk_buckets if n * S <= max(self.budget, n * smallest)]

    def decode_programs(self) -> list[int]:
        """Every window size `schedule` can choose (decode and prefill), for warm-up."""
        return [self.n_slots] if self.window_mode == "pool" else list(self.batch_buckets)


def serving_scheduler(n_slots: int, max_batched_tokens: int, prefill_chunk: int, window_mode: str = "aligned",
                      decode_width: int = 1, batch_buckets: Sequence[int] | None = None,
                      chunk_buckets: Sequence[int] | None = None, prefill_batch_buckets: Sequence[int] | None = None,
                      platform: str | None = None) -> Scheduler:
    """A deployment's Scheduler: its declared ladders, else the serving defaults of `platform` (default: JAX's
    backend; buckets.default_ladders for the batch and prefill windows, buckets.default_chunk_buckets for the
    chunks). Declared batch buckets without prefill ones prefill at every batch bucket."""
    if chunk_buckets is None:
        chunk_buckets = default_chunk_buckets(max(MIN_BUCKET, floor_pow2(max(1, prefill_chunk))))
    if batch_buckets is None:
        batch_buckets, default_prefill = default_ladders(n_slots, platform or jax.default_backend())
        prefill_batch_buckets = default_prefill if prefill_batch_buckets is None else prefill_batch_buckets
    return Scheduler(n_slots, max_batched_tokens, prefill_chunk, window_mode, decode_width, batch_buckets,
                     chunk_buckets, prefill_batch_buckets)
