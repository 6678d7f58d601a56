"""Prefix caching's bookkeeping on the host: which block-aligned prompt prefixes have a decode-state snapshot,
where a prefilling request should take new ones, and least-recently-used eviction under a byte budget.

Keys. A prompt is cut into blocks of `block` tokens (128 by default: a multiple of every compress ratio, so a
snapshot's pools hold whole entries); the key of its first k blocks is a hash chain, h_k = blake2b(h_{k-1} || the
k-th block's int32 bytes), as vLLM's automatic prefix caching keys its KV blocks. One look-up per block boundary
walks the chain from the longest prefix down; a hit also compares the entry's stored tokens with the prompt's, so a
hash collision is a miss, never a wrong state. Only prefixes of at most len(prompt) - 1 tokens are looked up: the
last prompt token is always computed, so the first sampled token comes from a real step.

Where snapshots are taken (`targets`). A snapshot is a copy of a slot's whole rings plus its pools' first entries
(state.snapshot_head / snapshot_block), not blocks shared between entries, so one per block would cost the prefix's pools many times over. A request
prefilling from `start` takes them at the block-times-power-of-two boundaries (128, 256, 512, ...: a later prompt
sharing any prefix recovers at least half of it), at its prompt's last block boundary (the next turn of a
conversation extends the whole prompt), and at the longest block-aligned prefix it shares with a prompt seen before
(a branch point: a system prompt of any length is cached whole once two requests have shared it). The engine cuts
prefill chunks at these points so the snapshots land on them (prefix_snapshot.py).

Eviction: least recently used (a hit or an insert refreshes an entry), while the snapshots' device bytes exceed
`budget_bytes`; a snapshot larger than the whole budget is not kept. Host memory: each entry keeps its prefix's
token ids; the branch-point table keeps `seen_blocks` 16-byte digests (least recently seen dropped first).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["PrefixCache", "PrefixStats", "PrefixPlan", "block_hashes", "DEFAULT_BLOCK"]

DEFAULT_BLOCK = 128


def block_hashes(tokens: np.ndarray, block: int, n_blocks: int) -> list[bytes]:
    """The hash chain of tokens' first n_blocks blocks: entry k-1 keys the prefix of k blocks (16-byte digests)."""
    data = np.ascontiguousarray(np.asarray(tokens)[:n_blocks * block], dtype="<i4")
    out, h = [], b""
    for k in range(n_blocks):
        h = hashlib.blake2b(h + data[k * block:(k + 1) * block].tobytes(), digest_size=16).digest()
        out.append(h)
    return out


@dataclass
class PrefixStats:
    """Counters: look-ups that found a prefix (hits) or none (misses), prompt tokens served from snapshots,
    snapshots stored and evicted, and the device bytes and number of snapshots held now."""

    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    inserts: int = 0
    evictions: int = 0
    bytes: int = 0
    entries: int = 0


@dataclass
class PrefixPlan:
    """A prefilling request's hash chain (block_hashes over its prompt's look-up range) and the prefix lengths it
    still has to snapshot (ascending)."""

    chain: list[bytes]
    targets: list[int] = field(default_factory=list)


@dataclass
class _Entry:
    tokens: np.ndarray       # int32 [p + lookahead]: the prefix itself and the tokens after it (verified on a hit)
    snapshot: Any            # the device snapshot (prefix_snapshot.Snapshot)
    nbytes: int


class PrefixCache:
    """Snapshots of decode state by block-aligned token prefix, LRU under `budget_bytes` device bytes.

    max_len: the decode state's length (the snapshot programs need it); block: the prefix granularity;
    seen_blocks: how many prefix digests the branch-point table remembers; lookahead: how many tokens after a prefix
    its snapshot depends on as well (1 for the MTP drafter, whose window entry at the prefix's last position holds the
    next token), so a hit needs them equal too. `plans` holds the snapshot points of the requests prefilling now, by
    request id (the engine's hooks in prefix_snapshot.py fill and drain it)."""

    def __init__(self, budget_bytes: int, max_len: int, block: int = DEFAULT_BLOCK, seen_blocks: int = 1 << 16,
                 lookahead: int = 0):
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be an integer >= 0, got {budget_bytes!r}")
        if block < 1 or seen_blocks < 0:
            raise ValueError(f"the prefix cache needs a block >= 1 and seen_blocks >= 0, got {block}, {seen_blocks}")
        if lookahead not in (0, 1):
            raise ValueError(f"the prefix cache's lookahead is 0 or 1 token, got {lookahead!r}")
        self.budget, self.max_len, self.block, self.seen_blocks = budget_bytes, max_len, block, seen_blocks
        self.lookahead = lookahead
        self.stats = PrefixStats()
        self.plans: dict[str, PrefixPlan] = {}
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def chain(self, prompt: np.ndarray) -> list[bytes]:
        """The keys of every prefix of `prompt` that may be looked up or cached: k blocks for k * block <=
        len(prompt) - 1."""
        return block_hashes(prompt, self.block, (len(prompt) - 1) // self.block)

    def _get(self, prompt: np.ndarray, chain: list[bytes], p: int) -> _Entry | None:
        entry, n = self._entries.get(chain[p // self.block - 1]), p + self.lookahead
        if entry is None or len(entry.tokens) != n or len(prompt) < n or not np.array_equal(entry.tokens, prompt[:n]):
            return None
        return entry

    def lookup(self, prompt: np.ndarray, chain: list[bytes] | None = None) -> tuple[int, Any]:
        """(p, snapshot) of the longest cached prefix of `prompt` of at most len(prompt) - 1 tokens, refreshed as
        most recently used; (0, None) when there is none. Counts a hit or a miss."""
        chain = self.chain(prompt) if chain is None else chain
        for k in range(len(chain), 0, -1):
            entry = self._get(prompt, chain, k * self.block)
            if entry is not None:
                self._entries.move_to_end(chain[k - 1])
                self.stats.hits += 1
                self.stats.hit_tokens += k * self.block
                return k * self.block, entry.snapshot
        self.stats.misses += 1
        return 0, None

    def targets(self, prompt: np.ndarray, chain: list[bytes], start: int) -> list[int]:
        """The prefix lengths > start a request prefilling `prompt` from `start` should snapshot (module docstring),
        ascending; records the prompt's blocks as seen (for later requests' branch points)."""
        n, B = len(prompt), self.block
        points = {B << j for j in range(max(1, n).bit_length()) if B << j < n}
        points.add((n - 1) // B * B)
        shared = next((k for k in range(len(chain), 0, -1) if chain[k - 1] in self._seen), 0)
        points.add(shared * B)
        for h in chain:
            self._seen[h] = None
            self._seen.move_to_end(h)
        while len(self._seen) > self.seen_blocks:
            self._seen.popitem(last=False)
        return sorted(p for p in points if start < p < n)

    def cached(self, prompt: np.ndarray, chain: list[bytes], p: int) -> bool:
        """Whether prompt[:p] (p a multiple of the block, at most len(prompt) - 1) has a snapshot."""
        return self._get(prompt, chain, p) is not None

    def insert(self, prompt: np.ndarray, chain: list[bytes], p: int, snapshot: Any, nbytes: int) -> bool:
        """Keep `snapshot` (nbytes device bytes) as prompt[:p]'s, evicting the least recently used to fit; returns
        whether it was kept (not when larger than the whole budget)."""
        if nbytes > self.budget:
            return False
        key = chain[p // self.block - 1]
        old = self._entries.pop(key, None)
        if old is not None:
            self.stats.bytes -= old.nbytes
        while self._entries and self.stats.bytes + nbytes > self.budget:
            _, freed = self._entries.popitem(last=False)
            self.stats.bytes -= freed.nbytes
            self.stats.evictions += 1
        self._entries[key] = _Entry(np.array(prompt[:p + self.lookahead], np.int32), snapshot, nbytes)
        self.stats.bytes += nbytes
        self.stats.inserts += 1
        self.stats.entries = len(self._entries)
        return True

    def prefixes(self) -> list[tuple[int, int]]:
        """(length, device bytes) of each cached prefix, least recently used first."""
        return [(len(e.tokens) - self.lookahead, e.nbytes) for e in self._entries.values()]

    def clear(self) -> None:
        """Drop every snapshot (counters other than bytes and entries are kept)."""
        self._entries.clear()
        self.stats.bytes, self.stats.entries = 0, 0
