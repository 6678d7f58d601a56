"""Prefix caching (runtime/prefix_cache.py, prefix_snapshot.py).

Exactness on the goldens, against the same requests computed from scratch: v4-tiny-q (DeepSeek-V4, compress ratios
4 and 128, a 16-token window far shorter than the 512-token prefix) and v41-tiny-q (DeepSeek-V4.1: shared
compressed sources of ratios 2 and 1, Engram layers whose host n-gram history the cache replays). A state restored
from a snapshot gives the from-scratch logits bit for bit, although the cache chunks the prefix differently (128,
128, 256 instead of 256, 256: where chunks end changes no bit, only chunk buckets below 128 round differently on
XLA:CPU, prefix_snapshot.py); served through the engine, the greedy tokens and the top-20 logprobs are equal bit for
bit. Then: the host bookkeeping (hash-chain keys verified token by token, LRU under the byte budget, where
snapshots are taken), a tiny budget in the engine, two requests sharing a prefix at once, and the refusals."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from conftest import golden_path

import jdeep
from jdeep import SamplingParams
from jdeep.runtime.engine import Engine
from jdeep.runtime.prefix_cache import PrefixCache
from jdeep.runtime.prefix_snapshot import prefix_cache_for, replay_history, restore_snapshot, take_snapshot
from jdeep.runtime.steps import pack_chunk, run_step

RNG = np.random.default_rng(7)
PREFIX = [0] + RNG.integers(2, 500, 511).tolist()          # 512 tokens: four 128-blocks
SUFFIXES = [RNG.integers(2, 500, n).tolist() for n in (9, 5, 12)]
DIVERGED = PREFIX[:300] + RNG.integers(2, 500, 40).tolist()    # shares 300 tokens: the 256-token snapshot
P = SamplingParams(max_new_tokens=4, logprobs=20, temperature=0.0)
MAX_LEN, CHUNK = 1024, 256


@pytest.fixture(scope="module")
def v4():
    return jdeep.load(golden_path("v4-tiny-q"))


@pytest.fixture(scope="module")
def v41():
    return jdeep.load(golden_path("v41-tiny-q"))


def _engine(model, cache_bytes: int, slots: int = 1, chunk: int = CHUNK) -> Engine:
    return Engine(model, max_num_seqs=slots, max_len=MAX_LEN, prefill_chunk=chunk, prefix_cache_bytes=cache_bytes,
                  max_num_batched_tokens=slots * chunk + slots)


def _serve(eng: Engine, prompts) -> list:
    """(tokens, [(logprob, top 20)] per token) of each prompt, all queued at once."""
    ids = [eng.add_request(p, P) for p in prompts]
    outs = eng.run()
    assert all(outs[i].error is None for i in ids)
    return [(outs[i].tokens, [(e[1], e[2]) for e in outs[i].logprobs]) for i in ids]


# ---------------------------------------------------------------------------------------------- host bookkeeping
def _snap(nbytes: int) -> SimpleNamespace:
    return SimpleNamespace(nbytes=nbytes)


def test_hash_chain_keys_verify_the_tokens():
    c = PrefixCache(100, 64, block=4)
    a = np.arange(20, dtype=np.int32)
    assert len(c.chain(a)) == 4 and len(c.chain(a[:17])) == 4 and len(c.chain(a[:16])) == 3   # prefixes <= n - 1
    c.insert(a, c.chain(a), 8, _snap(1), 1)
    c.insert(a, c.chain(a), 12, _snap(2), 2)
    assert c.lookup(a)[0] == 12 and c.lookup(a[:13])[0] == 12
    assert c.lookup(a[:12])[0] == 8                        # at most len(prompt) - 1 tokens
    b = a.copy()
    b[9] = 99                                              # diverges inside the third block
    assert c.lookup(b)[0] == 8
    # an entry whose key is a's chain but whose tokens are b's (a hash collision) is never served for a
    c2 = PrefixCache(100, 64, block=4)
    c2.insert(b, c2.chain(a), 12, _snap(1), 1)
    assert c2.lookup(a) == (0, None)
    assert (c.stats.hits, c.stats.misses, c.stats.hit_tokens) == (4, 0, 12 + 12 + 8 + 8)
    assert (c2.stats.hits, c2.stats.misses) == (0, 1)


def test_lookahead_keys_the_token_after_the_prefix():
    """lookahead=1 (the MTP drafter's snapshots depend on the token after the prefix): a hit needs that token equal
    too; prefixes() still reports the prefix's own length."""
    c = PrefixCache(100, 64, block=4, lookahead=1)
    a = np.arange(20, dtype=np.int32)
    c.insert(a, c.chain(a), 8, _snap(1), 1)
    b = a.copy()
    b[8] = 99                                              # the same 8-token prefix, another token after it
    assert c.lookup(a[:9])[0] == 8 and c.lookup(b) == (0, None)
    assert c.cached(a, c.chain(a), 8) and not c.cached(b, c.chain(b), 8) and c.prefixes() == [(8, 1)]
    with pytest.raises(ValueError, match="lookahead"):
        PrefixCache(100, 64, block=4, lookahead=2)


def test_lru_eviction_under_the_byte_budget():
    c = PrefixCache(10, 64, block=4)
    prompts = [np.full(9, i, np.int32) for i in range(4)]
    for i, size in enumerate((4, 3, 3)):
        assert c.insert(prompts[i], c.chain(prompts[i]), 8, _snap(size), size)
    assert c.lookup(prompts[0])[0] == 8                    # refreshes prompt 0: prompt 1 is now the oldest
    assert c.insert(prompts[3], c.chain(prompts[3]), 8, _snap(3), 3)
    assert [c.lookup(p)[0] for p in prompts] == [8, 0, 8, 8]
    st = c.stats
    assert (st.evictions, st.bytes, st.entries, st.inserts) == (1, 10, 3, 4)
    assert not c.insert(prompts[1], c.chain(prompts[1]), 8, _snap(11), 11)     # larger than the budget
    assert st.bytes == 10 and st.entries == 3


def test_snapshot_points():
    c = PrefixCache(1, 2048, block=128)
    a = np.arange(1000, dtype=np.int32)
    # powers of two times the block, and the last block boundary short of the last token
    assert c.targets(a, c.chain(a), 0) == [128, 256, 512, 896]
    assert c.targets(a[:513], c.chain(a[:513]), 256) == [512]
    # a prompt sharing 700 tokens with one seen before adds the branch point 640
    b = np.concatenate([a[:700], np.full(300, 7, np.int32)])
    assert c.targets(b, c.chain(b), 0) == [128, 256, 512, 640, 896]


def test_refusals(v4):
    with pytest.raises(ValueError, match="mesh"):
        prefix_cache_for(SimpleNamespace(layout=object(), config=v4.config), 1 << 20, MAX_LEN)
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        Engine(v4, max_num_seqs=1, max_len=MAX_LEN, prefix_cache_bytes=-1)
    assert Engine(v4, max_num_seqs=1, max_len=MAX_LEN).prefix_cache_stats is None


def test_engram_history_replay(v41):
    """Replaying a prefix's last tokens leaves the n-gram history that advancing over the whole prefix leaves."""
    prefix = np.asarray(PREFIX, np.int64)
    want = v41.new_history(2)
    want.advance(np.stack([np.zeros_like(prefix), prefix]), [0, len(prefix)])
    got = v41.new_history(2)
    replay_history(got, 1, prefix, v41.config.image_token_id)
    np.testing.assert_array_equal(got.classes, want.classes)
    np.testing.assert_array_equal(got.dead, want.dead)


# ---------------------------------------------------------------------------------------------- exactness
def _prefill(model, state, prompt, chunks, start=0):
    """Run `prompt` from `start` in chunks of the given lengths (one slot); returns (last logits, state)."""
    done = start
    for n in chunks:
        toks, pos, _ = pack_chunk([np.asarray(prompt[:done + n])], [done], 1, n)
        logits, state = run_step(model, state, toks, pos)
        done += n
    return np.asarray(logits), state


def test_v4_restored_state_gives_the_from_scratch_logits(v4):
    prompt = PREFIX + SUFFIXES[0]
    scratch, _ = _prefill(v4, v4.init_state(1, MAX_LEN), prompt, [256, 256, 9])
    _, state = _prefill(v4, v4.init_state(1, MAX_LEN), prompt, [128, 128, 256])     # the cache's chunking
    zero = v4.put(np.int32(0))
    cache = PrefixCache(1 << 30, MAX_LEN)
    snap, nbytes = take_snapshot(cache, state, zero, 512, v4.put)
    assert len(snap.blocks) == 512 // cache.block
    fresh = restore_snapshot(cache, v4.init_state(1, MAX_LEN), snap, zero, v4.put)
    cached, _ = _prefill(v4, fresh, prompt, [9], start=512)
    np.testing.assert_array_equal(cached, scratch)
    assert nbytes == _snapshot_bytes(state, 512)


def _snapshot_bytes(state: dict, n_tokens: int) -> int:
    """One slot's bytes of every leaf [R, B, ...], the pools (one entry per m tokens) cut to n_tokens // m entries."""
    total = 0
    for d in [kind for seg in state["segments"] for kind in seg] + list(state["sources"].values()):
        for name, a in d.items():
            rows = a.shape[2] if name not in ("ckv", "ikeys") else n_tokens // (MAX_LEN // (a.shape[2] - 1))
            total += a.size // (a.shape[1] * a.shape[2]) * rows * a.dtype.itemsize
    return total


def test_v4_engine_serves_hits_exactly_and_evicts_under_a_tiny_budget(v4):
    prompts = [PREFIX + s for s in SUFFIXES[:2]] + [DIVERGED]
    scratch = _serve(_engine(v4, 0), prompts)              # one slot: each request alone
    eng = _engine(v4, 1 << 30)
    assert _serve(eng, prompts) == scratch                 # tokens and logprobs, bit for bit
    st = eng.prefix_cache_stats
    assert (st.misses, st.hits, st.hit_tokens) == (1, 2, 512 + 256)
    held = eng.prefix_cache.prefixes()
    assert [p for p, _ in held] == [128, 512, 256]         # least recently used first (the 256 one was just hit)
    assert (st.inserts, st.entries, st.evictions, st.bytes) == (3, 3, 0, sum(b for _, b in held))

    # a budget that holds the 512-token snapshot alone: older ones are evicted, the newest is still served
    size = dict(held)[512]
    small = _engine(v4, size)
    assert _serve(small, prompts[:2]) == scratch[:2]
    st = small.prefix_cache_stats
    assert small.prefix_cache.prefixes() == [(512, size)] and st.bytes == size
    assert (st.hits, st.hit_tokens, st.inserts - st.evictions) == (1, 512, 1)


def test_v41_engram_requests_sharing_a_prefix_at_once(v41):
    """Two requests sharing the prefix prefill together (both miss: nothing is cached yet) and get the tokens and
    logprobs they get alone; a third is served from the snapshot they left (Engram history replayed), exactly.
    Engram models step the whole pool, so alone and together run the same two-row programs (128-token chunks: one
    prefill program fewer to compile)."""
    prompts = [PREFIX + s for s in SUFFIXES]
    ref = _engine(v41, 0, slots=2, chunk=128)
    scratch = [_serve(ref, [p])[0] for p in prompts]
    eng = _engine(v41, 1 << 30, slots=2, chunk=128)
    assert _serve(eng, prompts[:2]) == scratch[:2]
    st = eng.prefix_cache_stats
    assert (st.misses, st.hits, st.inserts) == (2, 0, 3)   # the second copy of each prefix is not kept
    assert _serve(eng, prompts[2:]) == scratch[2:]
    assert eng.prefix_cache_stats.hits == 1 and eng.prefix_cache_stats.hit_tokens == 512
