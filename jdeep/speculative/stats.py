"""Acceptance counters of speculative decoding (the engine's `spec_stats`, jdeep.generate's and `jdeep bench`'s)."""

from __future__ import annotations

import numpy as np

__all__ = ["SpecStats"]


class SpecStats:
    """Acceptance counters: iterations (row-iterations that ran), drafted and accepted draft tokens, and per draft
    position how often it was accepted."""

    def __init__(self, k: int):
        self.k, self.iterations, self.drafted, self.accepted = k, 0, 0, 0
        self.per_position = np.zeros(k, np.int64)

    def add(self, accepted: np.ndarray) -> None:
        """accepted int [...]: per row-iteration accepted drafts (-1 = the row did not run)."""
        a = accepted[accepted >= 0]
        self.iterations += a.size
        self.drafted += a.size * self.k
        self.accepted += int(a.sum())
        self.per_position += np.sum(a[:, None] > np.arange(self.k)[None, :], axis=0)

    def as_dict(self) -> dict:
        it = max(self.iterations, 1)
        return {"k": self.k, "iterations": self.iterations, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": self.accepted / max(self.drafted, 1),
                "acceptance_per_position": (self.per_position / it).tolist(),
                "mean_accepted_length": 1 + self.accepted / it}
