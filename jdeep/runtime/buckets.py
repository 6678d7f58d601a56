"""A deployment's bucket ladders: the window sizes (slot rows) and prefill chunk lengths its step programs are
compiled for, declared up front (as AWS NxDI's context-encoding / token-generation buckets and vLLM's captured batch
sizes are), so the program set is small and known.

- Batch buckets: powers of two up to the pool's slots; the pool's size is always one (every set of slots fits a
  window of the whole pool). A window the scheduler needs is widened to the smallest bucket holding it.
- Chunk buckets: powers of two from MIN_BUCKET (16) up to the longest prefill chunk. A prompt chunk runs at the
  smallest bucket holding it that the iteration's token budget allows (else the largest that fits, and at least the
  smallest bucket: no prompt starves).

Defaults: every power of two for the batch (a one-request window stays one row: on CPU a decode step's cost grows
with its rows), and for chunks powers of four from 16 plus the longest chunk (16, 64, 256 for chunks of 256: three
prefill programs per window where powers of two take five).
"""

from __future__ import annotations

from typing import Sequence

from .steps import MIN_BUCKET

__all__ = ["batch_ladder", "chunk_ladder", "default_chunk_buckets", "parse_buckets"]


def _is_pow2(n: int) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and not n & (n - 1)


def parse_buckets(text: str, what: str) -> tuple[int, ...]:
    """"1,2,8" -> (1, 2, 8) (ValueError naming `what` for anything else)."""
    try:
        values = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, e.g. 1,2,8, got {text!r}") from None
    if not values:
        raise ValueError(f"{what} must name at least one bucket, got {text!r}")
    return values


def batch_ladder(n_slots: int, buckets: Sequence[int] | None = None) -> tuple[int, ...]:
    """The window sizes of a pool of n_slots (a power of two) slots, ascending, ending with n_slots: `buckets`
    (validated) or every power of two."""
    if buckets is None:
        return tuple(1 << k for k in range(n_slots.bit_length()))
    for b in buckets:
        if not _is_pow2(b):
            raise ValueError(f"batch bucket {b!r} is not a power of two (windows are aligned blocks of slots)")
        if b > n_slots:
            raise ValueError(f"batch bucket {b} exceeds the engine's {n_slots} slots (max_num_seqs rounded up to a "
                             "power of two)")
    return tuple(sorted(set(buckets) | {n_slots}))


def default_chunk_buckets(max_chunk: int, smallest: int = MIN_BUCKET) -> tuple[int, ...]:
    """Powers of four from `smallest` below max_chunk, and max_chunk (powers of two, smallest <= max_chunk)."""
    out, S = [], smallest
    while S < max_chunk:
        out.append(S)
        S *= 4
    return tuple(out) + (max_chunk,)


def chunk_ladder(max_chunk: int, buckets: Sequence[int] | None = None) -> tuple[int, ...]:
    """The prefill chunk lengths, ascending: `buckets` (validated: powers of two from MIN_BUCKET to max_chunk) or
    every power of two from MIN_BUCKET to max_chunk (the scheduler's own default; the Engine passes
    default_chunk_buckets unless told otherwise)."""
    if buckets is None:
        out, S = [], MIN_BUCKET
        while S <= max_chunk:
            out.append(S)
            S *= 2
        return tuple(out)
    for S in buckets:
        if not _is_pow2(S) or S < MIN_BUCKET:
            raise ValueError(f"chunk bucket {S!r} must be a power of two of at least {MIN_BUCKET} tokens")
        if S > max_chunk:
            raise ValueError(f"chunk bucket {S} exceeds the longest prefill chunk {max_chunk} (prefill_chunk)")
    return tuple(sorted(set(buckets)))
