"""Prefix caching in the Engine: the snapshot copy-out / copy-in programs and the hooks the engine calls.

- admission (`admit_cached`): a request that takes a freshly reset slot looks up the longest cached prefix of its
  prompt (prefix_cache.py). On a hit the snapshot is copied into its slot, its Engram n-gram history (models with
  Engram layers) is replayed from the prefix's last tokens, and those tokens count as prefilled. The request then
  gets its snapshot points (PrefixCache.targets).
- scheduling (`cut_at_targets`): a prefilling request's remaining prompt is reported only up to its next snapshot
  point, so the scheduler ends its prefill chunk there.
- after a chunk (`snapshot_prefills`): a request whose prefill now ends on its next snapshot point is copied out of
  its slot, unless that prefix is cached already.

Programs: a snapshot of p tokens (p a multiple of the cache's block) is a `Snapshot`: the slot's head (every leaf but
the compressed pools: the sliding-window rings and compression buffers; state.snapshot_head) and p // block blocks of
its pools' entries (state.snapshot_block: the entries of one block of tokens, at a block index passed as a runtime
value). So four programs serve every prefix length (`SNAPSHOT_PROGRAMS`: the head's and a block's copy-out and
copy-in), listed in the engine's inventory (inventory.py) and compiled by its warm-up; a snapshot of p tokens costs
1 + p // block program calls each way. Snapshots stay on the device, as program outputs placed like the state; their
bytes (exactly the prefix's pool entries, no rounding up) count against the budget.

Exactness: the restored slot holds exactly the state the earlier request had after the prefix (state.py), so the
continuation computes what a from-scratch run does over the same chunks after the prefix: bit for bit equal logits
when those chunks have the same length buckets. Where chunks end does not change a bit; the program's chunk bucket
S does (XLA:CPU picks other kernels): the state after a prefix is the same for any chunking whose buckets are all
>= 128 on the v41-tiny-q golden (>= 64 on v4-tiny-q), while smaller buckets round differently: float32 rounding,
~1e-6 in the logits, which DeepSeek's fp8 / fp4 quantisation and top-k selections can amplify (up to 0.4 in
v41-tiny-q's logits with 64-token chunks). The cache cuts chunks only at block multiples, so the chunks it adds
are whole blocks (bucket >= 128 with prefill_chunk >= 128); a hit's prompt tail after the prefix may be chunked
in smaller buckets than a from-scratch run would chunk it, and then differs from it as any rechunking does.

The hooks take the engine's slot pool (slot_pool.SlotPool), which takes and restores a slot's snapshot
(SlotPool.snapshot / restore): the speculative engine's pool pairs the target's with its drafter's
(Drafter.snapshot). Not served: requests asking for prompt logprobs look
nothing up (they need every prompt position's logits); a device mesh (model.layout) refuses the cache.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import numpy as np

from ..model.cache import PROGRAMS
from ..state import restore_block, restore_head, snapshot_block, snapshot_head, state_bytes
from ..platforms import device_memory
from .prefix_cache import DEFAULT_BLOCK, PrefixCache, PrefixPlan

__all__ = ["AUTO", "auto_budget", "prefix_cache_for", "admit_cached", "cut_at_targets", "snapshot_prefills", "take_snapshot",
           "restore_snapshot", "replay_history", "snapshot_block_for", "prefix_block", "Snapshot", "SNAPSHOT_PROGRAMS",
           "snapshot_programs", "warm_snapshot"]


AUTO = "auto"


def auto_budget(model, n_slots: int, max_len: int) -> int:
    """The default budget (prefix_cache_bytes="auto", `jdeep serve`'s default): the device bytes of a quarter of
    the decode state (n_slots // 4 snapshots of full-length prompts, at least one; snapshots of shorter prefixes
    take proportionally less), capped at an eighth of the device's memory; 0 (off) on a device mesh, which the
    cache does not support."""
    if model.layout is not None:
        return 0
    one_slot = state_bytes(model.config, model.plan, 1, max_len, model.dtype, model.numerics)
    return min(max(1, n_slots // 4) * one_slot, device_memory() // 8)


def prefix_cache_for(model, budget_bytes: int | str, max_len: int, lookahead: int = 0,
                     n_slots: int = 1) -> PrefixCache | None:
    """The Engine's cache for a decode state of `max_len` tokens and `n_slots` slots (None when budget_bytes is 0;
    "auto": auto_budget); ValueError for an explicit budget on a device mesh. The block is DEFAULT_BLOCK, or a
    multiple of a larger compress ratio; lookahead: PrefixCache's."""
    if budget_bytes == AUTO:
        budget_bytes = auto_budget(model, n_slots, max_len)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"prefix_cache_bytes must be an integer >= 0 or 'auto', got {budget_bytes!r}")
    if not budget_bytes:
        return None
    if model.layout is not None:
        raise ValueError("prefix caching does not support a model on a device mesh yet (its snapshots would have to "
                         "follow the state's sharding): use prefix_cache_bytes=0")
    return PrefixCache(budget_bytes, max_len, block=prefix_block(model.config), lookahead=lookahead)


def prefix_block(config) -> int:
    """The cache's block (tokens): DEFAULT_BLOCK, or a multiple of a larger compress ratio."""
    return math.lcm(DEFAULT_BLOCK, *[k.ratio for k in config.attention_kinds if k.ratio > 0])


class Snapshot(NamedTuple):
    """A prefix snapshot on the device (module docstring): head (state.snapshot_head's tree) and blocks (one
    state.snapshot_block tree per block of the prefix, in order)."""

    head: dict
    blocks: tuple


SNAPSHOT_PROGRAMS = ("snapshot.head.out", "snapshot.head.in", "snapshot.block.out", "snapshot.block.in")
_STATIC = ("block", "max_len")


def snapshot_programs() -> dict[str, Callable]:
    """The jitted programs of SNAPSHOT_PROGRAMS by name: head out (state, slot), head in (state, head, slot), block
    out (state, slot, index, *, block, max_len), block in (state, blk, slot, index, *, block, max_len); the copy-ins
    donate the state."""
    return {"snapshot.head.out": PROGRAMS.jit(snapshot_head),
            "snapshot.head.in": PROGRAMS.jit(restore_head, donate_argnums=(0,)),
            "snapshot.block.out": PROGRAMS.jit(snapshot_block, static_argnames=_STATIC),
            "snapshot.block.in": PROGRAMS.jit(restore_block, donate_argnums=(0,), static_argnames=_STATIC)}


def take_snapshot(cache: PrefixCache, state: dict, slot: jax.Array, p: int, put: Callable) -> tuple[Snapshot, int]:
    """(snapshot, device bytes) of slot `slot` (int32 scalar on the device) after p prompt tokens (a multiple of the
    cache's block); put: places a host int32 on the state's device (Model.put)."""
    if p <= 0 or p % cache.block:
        raise ValueError(f"a prefix snapshot covers whole {cache.block}-token blocks, got {p} tokens")
    progs = snapshot_programs()
    static = {"block": cache.block, "max_len": cache.max_len}
    head = progs["snapshot.head.out"](state, slot)
    blocks = tuple(progs["snapshot.block.out"](state, slot, put(np.int32(k)), **static)
                   for k in range(p // cache.block))
    snap = Snapshot(head, blocks)
    return snap, sum(int(a.nbytes) for a in jax.tree_util.tree_leaves(snap))


def restore_snapshot(cache: PrefixCache, state: dict, snap: Snapshot, slot: jax.Array, put: Callable) -> dict:
    """The state with `snap` written over slot `slot` (state donated); put as in take_snapshot."""
    progs = snapshot_programs()
    static = {"block": cache.block, "max_len": cache.max_len}
    state = progs["snapshot.head.in"](state, snap.head, slot)
    for k, blk in enumerate(snap.blocks):
        state = progs["snapshot.block.in"](state, blk, slot, put(np.int32(k)), **static)
    return state


def warm_snapshot(pool, spec, held: dict) -> None:
    """Run one SNAPSHOT_PROGRAMS entry of the inventory (spec.name; spec.seq: the block) on slot 0 of the pool's
    state: the copy-outs keep their result in `held`, the copy-ins write it back where it came from (nothing
    changes)."""
    progs, put = snapshot_programs(), pool.model.put
    zero = put(np.int32(0))
    static = {"block": spec.seq, "max_len": pool.cache_len}
    if spec.name == "snapshot.head.out":
        held["head"] = progs[spec.name](pool.state, zero)
    elif spec.name == "snapshot.head.in":
        pool.state = progs[spec.name](pool.state, held.pop("head"), zero)
    elif spec.name == "snapshot.block.out":
        held["block"] = progs[spec.name](pool.state, zero, zero, **static)
    elif spec.name == "snapshot.block.in":
        pool.state = progs[spec.name](pool.state, held.pop("block"), zero, zero, **static)
    else:
        raise ValueError(f"{spec.name!r} is not a snapshot program ({SNAPSHOT_PROGRAMS})")


def replay_history(history, slot: int, prefix: np.ndarray, image_token_id: int | None) -> None:
    """Set slot `slot`'s (freshly reset) Engram n-gram history to what prefilling `prefix` leaves: its last H tokens
    pushed through NgramHistory.advance (image tokens dead, as Model.engram_inputs marks them)."""
    tail = np.asarray(prefix[max(0, len(prefix) - history.layout.history):], np.int64)
    if not len(tail):
        return
    toks = np.zeros((history.batch, len(tail)), np.int64)
    toks[slot] = tail
    n_valid = np.zeros(history.batch, np.int64)
    n_valid[slot] = len(tail)
    history.advance(toks, n_valid, None if image_token_id is None else toks == image_token_id)


def admit_cached(pool, slots: list[int]) -> None:
    """Requests that just took `slots` (freshly reset, histories reset) start from the longest cached prefix of their
    prompt and get their snapshot points (module docstring). Nothing without a cache (as every hook here)."""
    cache = pool.prefix_cache
    if cache is None:
        return
    for i in slots:
        s = pool.slots[i]
        ids = s.request.ids
        if s.request.images:      # an image span's positions all hold image_token_id: cache the text before it only
            ids = ids[:s.request.images[0][0]]
        chain = cache.chain(ids)
        if s.params.prompt_logprobs is None:
            n, snap = cache.lookup(ids, chain)
            if snap is not None:
                pool.restore(i, snap)
                if pool.history is not None:
                    replay_history(pool.history, i, ids[:n], pool.model.config.image_token_id)
                s.prefilled = n
        targets = cache.targets(ids, chain, s.prefilled)
        if targets:
            cache.plans[s.out.request_id] = PrefixPlan(chain, targets)
        else:               # (a plan left by an aborted request of the same id is not this request's)
            cache.plans.pop(s.out.request_id, None)


def cut_at_targets(pool, remaining: list[int | None]) -> list[int | None]:
    """Each slot's prompt tokens left to prefill, counted only up to its next snapshot point (so the scheduler ends
    its chunk there); forgets the plans of requests that left (finished or aborted)."""
    cache = pool.prefix_cache
    if cache is None:
        return remaining
    live = {s.out.request_id for s in pool.slots if s is not None}
    for rid in [r for r in cache.plans if r not in live]:
        del cache.plans[rid]
    out = list(remaining)
    for i, s in enumerate(pool.slots):
        plan = cache.plans.get(s.out.request_id) if s is not None else None
        if plan is not None and out[i]:
            out[i] = min(out[i], plan.targets[0] - s.prefilled)
    return out


def snapshot_prefills(pool, slots) -> None:
    """After a prefill chunk: copy out every slot in `slots` whose prefill now ends on its next snapshot point, unless
    that prefix is cached already."""
    cache = pool.prefix_cache
    if cache is None:
        return
    for i in slots:
        s = pool.slots[i]
        plan = cache.plans.get(s.out.request_id)
        if plan is None or s.prefilled != plan.targets[0]:
            continue
        p = plan.targets.pop(0)
        if not plan.targets:
            del cache.plans[s.out.request_id]
        if not cache.cached(s.request.ids, plan.chain, p):
            snap, nbytes = pool.snapshot(i, p)
            cache.insert(s.request.ids, plan.chain, p, snap, nbytes)


def snapshot_block_for(block: int | None, max_len: int) -> int | None:
    """The block of a cache of `block`-token blocks (None: no cache) if it can snapshot a prompt of up to
    max_len - 1 tokens, else None (the engine's inventory holds SNAPSHOT_PROGRAMS for a block)."""
    return block if block is not None and max_len - 1 >= block else None
