"""A deployment's bucket ladders: the window sizes (slot rows) and prefill chunk lengths its step programs are
compiled for, declared up front (as AWS NxDI's context-encoding / token-generation buckets and vLLM's captured batch
sizes are), so the program set is small and known.

- Batch buckets: powers of two up to the pool's slots; the pool's size is always one (every set of slots fits a
  window of the whole pool). A window the scheduler needs is widened to the smallest bucket holding it.
- Chunk buckets: powers of two from MIN_BUCKET (16) up to the longest prefill chunk. A prompt chunk runs at the
  smallest bucket holding it that the iteration's token budget allows (else the largest that fits, and at least the
  smallest bucket: no prompt starves).

- Prefill batch buckets: the window sizes a prefill step may use (a subset of the batch buckets; the aligned window
  mode only: a mesh's and an Engram model's prefill windows are the decode ladder's).

Defaults, per platform (`default_ladders`):
- CPU / GPU: every power of two for the batch and for prefill windows (a one-request window stays one row: on CPU a
  decode step's cost grows with its rows: 5.7x from 1 to 8 rows on v4-bench-small), and for chunks powers of four
  from 16 plus the longest chunk (16, 64, 256 for chunks of 256: three prefill programs per window where powers of
  two take five).
- Neuron: powers of eight for the batch (1, 8, 64, and the pool's size), prefill windows of at most 8 rows. Every
  program there is a neuronx-cc compile (minutes, per region in the regions mode), a decode step streams the same
  weights whatever its rows (padding rows is cheap), and a prefill step of 8 x 16 tokens already fills the tensor
  engine, so wider prefill windows add programs, not speed. (AWS NxDI's defaults go further: context encoding at
  batch 1, token generation at the largest batch.)
"""

from __future__ import annotations

from typing import Sequence

from .steps import MIN_BUCKET

__all__ = ["batch_ladder", "chunk_ladder", "prefill_ladder", "default_chunk_buckets", "default_ladders",
           "parse_buckets", "NEURON_BATCH_STEP", "NEURON_PREFILL_ROWS"]

NEURON_BATCH_STEP = 8      # Neuron's default batch ladder: powers of this
NEURON_PREFILL_ROWS = 8    # Neuron's default widest prefill window


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


def default_ladders(n_slots: int, platform: str) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """(batch buckets, prefill batch buckets) a pool of n_slots slots gets on `platform` when the deployment declares
    none (module docstring; None: every power of two)."""
    if platform != "neuron":
        return None, None
    batch, b = [], 1
    while b < n_slots:
        batch.append(b)
        b *= NEURON_BATCH_STEP
    batch = tuple(batch) + (n_slots,)
    return batch, tuple(b for b in batch if b <= NEURON_PREFILL_ROWS)


def prefill_ladder(batch: Sequence[int], buckets: Sequence[int] | None = None) -> tuple[int, ...]:
    """The prefill window sizes, ascending: `buckets` (validated: each one of the batch buckets `batch`) or `batch`."""
    if buckets is None:
        return tuple(batch)
    if not buckets:
        raise ValueError("prefill batch buckets must name at least one window size")
    for b in buckets:
        if b not in batch:
            raise ValueError(f"prefill batch bucket {b!r} is not one of the batch buckets {list(batch)}")
    return tuple(sorted(set(buckets)))


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
