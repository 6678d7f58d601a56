"""What the speculative engine needs of a drafting method: the `Drafter` protocol and the records its calls take
(engine.make_drafter picks the implementation of a method name).

A drafter owns the per-slot state of its method (the MTP block's windows and carry, DSpark's windows) as one pytree
the engine holds beside the backbone's (`engine.dstate`); it never holds slot data itself, so the engine's slot pool
(admit, compact, reset) drives both. Per iteration the engine asks it to

    prefill   run a prompt chunk through the target and take the taps the drafter reads (the MTP block's input
              streams, DSpark's tapped hiddens) into its windows; returns each row's first token
    decode    draft k tokens per decoding row, verify them with the target and finish (accept, restore, keep the
              drafter's carry for the next iteration); returns up to k + 1 tokens per row and the accepted counts

`decode` is one call rather than draft / verify / finish because the scan compile mode runs the three as one
program per window (no host round trip); the regions compile mode and Engram models split it into the programs
their implementation names.

Implementations: `MtpDrafter` (DeepSeek-V4's MTP block, mtp_drafter.py) and `DSparkDrafter` (DeepSeek-V4.1,
dspark_drafter.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import numpy as np

from ..runtime.sampling import SamplingBatch
from .acceptance import Emitted

__all__ = ["Drafter", "DecodeRows", "PrefillChunk", "RowCarry", "Emitted", "fetch_emitted"]


class DecodeRows(NamedTuple):
    """The decoding rows of one iteration over slots [start, start + rows): x the last token, p its position, count
    the tokens emitted so far (int32 [rows] each), live bool [rows] (rows that decode; the others write nothing)."""

    rows: int
    start: int
    x: np.ndarray
    p: np.ndarray
    count: np.ndarray
    live: np.ndarray

    @classmethod
    def idle(cls, rows: int) -> "DecodeRows":
        """`rows` rows of which none decodes (warm-up: nothing in the state changes)."""
        z = np.zeros(rows, np.int32)
        return cls(rows, 0, z, z, z, np.zeros(rows, bool))


class PrefillChunk(NamedTuple):
    """A prefill chunk over slots [start, start + rows): tokens, positions int32 [rows, S] (position -1: padding),
    next_tokens int32 [rows, S] (each position's following prompt token, -1 where the prompt has none yet or ends),
    ends bool [rows] (rows whose prompt ends in this chunk: their first token is sampled)."""

    rows: int
    start: int
    tokens: np.ndarray
    positions: np.ndarray
    next_tokens: np.ndarray
    ends: np.ndarray

    @classmethod
    def idle(cls, rows: int, length: int) -> "PrefillChunk":
        """A chunk of `rows` x `length` padding positions (warm-up)."""
        neg = np.full((rows, length), -1, np.int32)
        return cls(rows, 0, np.zeros((rows, length), np.int32), neg, neg, np.zeros(rows, bool))


class RowCarry(NamedTuple):
    """Per-row values a block of iterations carries on the device (jdeep.generate's speculative path): x int32 [B]
    (the last accepted token, at position p, not yet in the target state), p int32 [B], count int32 [B] (tokens
    generated), done bool [B]."""

    x: Any
    p: Any
    count: Any
    done: Any


def fetch_emitted(model, emitted: Emitted, logprobs: bool, logits: bool = False) -> Emitted:
    """An Emitted record on the host: its tokens, its logprob fields only when `logprobs` and its logits only when
    `logits` (else None: a step nobody asked them of reads back its tokens alone)."""
    fetch = lambda a, want: model.fetch(a) if want and a is not None else None
    return Emitted(model.fetch(emitted.tokens), *(fetch(a, logprobs) for a in emitted[1:4]),
                   fetch(emitted.logits, logits))


class Drafter(Protocol):
    """A speculative method's drafter over the engine's slot pool (module docstring). `k` drafts are verified per
    iteration; `programs_per_decode` is how many compiled programs one `decode` call runs (warm-up's count);
    `blocks_on_device`: whether `block` runs several iterations as one program (else one per host step);
    `snapshot_lookahead`: how many prompt tokens after a prefix the drafter's state at that prefix depends on (the
    prefix cache's key then holds them too)."""

    method: str
    k: int
    programs_per_decode: int
    blocks_on_device: bool
    snapshot_lookahead: int

    def window_mode(self, default: str) -> str:
        """The scheduler's window mode (scheduler.py) given the plain engine's choice for the model."""

    def new_state(self, n_slots: int, cache_len: int) -> Any:
        """The drafter's empty per-slot state for a pool of `n_slots` slots of `cache_len` positions."""

    def reset_slots(self, dstate: Any, mask: Any) -> Any:
        """dstate with the slots where mask (bool [n_slots], on the device) is True emptied (dstate donated)."""

    def move_slot(self, state: Any, dstate: Any, src: Any, dst: Any) -> tuple[Any, Any]:
        """(state, dstate) with slot src copied over slot dst in both (int32 scalars on the device; one program, both
        donated)."""

    def snapshot(self, dstate: Any, slot: Any) -> Any:
        """Slot `slot`'s (int32 scalar on the device) drafter state after a prompt prefix, for the prefix cache."""

    def restore(self, dstate: Any, snap: Any, slot: Any) -> Any:
        """dstate with a `snapshot` written over slot `slot` (dstate donated)."""

    def prefill(self, state: Any, dstate: Any, chunk: PrefillChunk, sb: SamplingBatch, greedy: bool,
                history: Any, logprobs: bool = False) -> tuple[Any, Any, Emitted]:
        """Run `chunk` (sb: its window's sampling rows; history: the Engram histories, advanced, or None). Returns
        (state, dstate, first tokens: Emitted [rows] on the host (fetch_emitted: logprobs and the logits they were
        drawn from only when asked), meaningful where chunk.ends)."""

    def decode(self, state: Any, dstate: Any, rows: DecodeRows, sb: SamplingBatch, greedy: bool,
               history: Any, logprobs: bool = False) -> tuple[Any, Any, Emitted, np.ndarray]:
        """One iteration over `rows` (greedy: every live row's temperature is 0). Returns (state, dstate, emitted:
        Emitted [rows, k+1] on the host (tokens -1 past what a row emits; logprobs only when asked), accepted int32
        [rows] on the host (-1 for rows that did not run))."""

    def block(self, state: Any, dstate: Any, carry: RowCarry, sb: SamplingBatch, stops: Any, max_new: Any, n: int,
              greedy: bool, history: Any, logprobs: bool = False, logits: bool = False
              ) -> tuple[Any, Any, RowCarry, Emitted, np.ndarray]:
        """n iterations over the whole batch without a host read between them (n = 1 unless blocks_on_device),
        rows ending on the device at their stop ids (stops int32 [B, W], -1 unused) and max_new int32 [B]. Returns
        (state, dstate, carry, emitted: Emitted [n, B, k+1] on the host (logprobs only when asked; the target's
        logits only with `logits`, from program variants that keep them), accepted int32 [n, B] on the host)."""
