"""The iteration scheduler on its own (no model): every decoding slot is served each iteration, prefill chunks go
oldest first within the token budget, no prompt starves, and every plan is one of the programs warm-up compiles."""

from __future__ import annotations

import numpy as np
import pytest

from jdeep.runtime.buckets import default_ladders
from jdeep.runtime.scheduler import Scheduler, Window, covering_window, serving_scheduler


def test_covering_windows():
    assert covering_window([5], 8) == Window(5, 1)
    assert covering_window([4, 5], 8) == Window(4, 2)
    assert covering_window([3, 4], 8) == Window(0, 8)          # aligned blocks: 3 and 4 meet only in [0, 8)
    assert covering_window([2, 3, 1], 8) == Window(0, 4)
    assert covering_window([5], 8, "prefix") == Window(0, 8)
    assert covering_window([2], 8, "prefix") == Window(0, 4)
    assert covering_window([1], 8, "pool") == Window(0, 8)


def test_decode_rows_first_then_oldest_prompt_gets_the_rest():
    sch = Scheduler(8, max_batched_tokens=8 + 256, max_chunk=256)
    it = sch.schedule([0, 0, 4000, 0, 0, None, None, None])
    assert it.decode == [0, 1, 3, 4] and it.decode_window == Window(0, 8)
    assert it.prefill == {2: 256} and it.prefill_window == Window(2, 1) and it.chunk == 256
    assert it.cost == 8 + 256
    # a tighter budget: the chunk shrinks to the largest power of two that fits beside the decode window
    it = Scheduler(8, max_batched_tokens=200, max_chunk=256).schedule([0, 0, 4000, 0, 0, None, None, None])
    assert it.chunk == 128 and it.prefill == {2: 128} and it.cost <= 200


def test_oldest_prompt_first_and_short_prompts_share_its_chunk():
    sch = Scheduler(8, max_batched_tokens=512, max_chunk=512)
    # slot 3 arrived first (order 0) with 20 tokens left; slots 0-2 later
    it = sch.schedule([30, 500, 12, 20, None, None, None, None], order=[1, 2, 3, 0, 0, 0, 0, 0])
    assert it.chunk == 32 and it.prefill[3] == 20
    assert it.prefill == {3: 20, 0: 30, 1: 32, 2: 12} and it.prefill_window == Window(0, 4)
    assert it.prefill_window.rows * it.chunk <= 512


def test_the_oldest_prompt_always_progresses():
    # a budget the decode window alone uses up: the oldest prompt still takes one minimum chunk
    it = Scheduler(8, max_batched_tokens=16, max_chunk=256).schedule([0] * 7 + [100])
    assert it.decode == list(range(7)) and it.prefill == {7: 16}
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(8, max_batched_tokens=8, max_chunk=256)


@pytest.mark.parametrize("mode,ladders", [("aligned", None), ("prefix", None), ("pool", None),
                                          ("aligned", ((1, 8), (16, 64, 256))), ("prefix", ((2,), (64, 512))),
                                          ("aligned", ((1, 2, 8), (16, 64, 256), (1, 2))),
                                          ("aligned", ((1, 8), (64, 256), (8,)))])
def test_random_pools_serve_everyone_within_the_compiled_set(mode, ladders):
    """Every power of two as buckets, or declared ladders (buckets.py): the plans stay within the programs listed."""
    rng = np.random.default_rng(0)
    for budget, chunk in [(24, 16), (264, 256), (100, 64), (4096, 512)]:
        if ladders is None:
            sch = Scheduler(8, budget, chunk, mode)
        else:
            sch = Scheduler(8, budget, chunk, mode, batch_buckets=ladders[0],
                            chunk_buckets=[S for S in ladders[1] if S <= chunk] or None,
                            prefill_batch_buckets=ladders[2] if len(ladders) > 2 else None)
        programs = set(sch.prefill_programs())
        decode_programs = set(sch.decode_programs())
        for _ in range(300):
            remaining = [None if rng.random() < 0.3 else 0 if rng.random() < 0.5 else int(rng.integers(1, 3000))
                         for _ in range(8)]
            order = rng.permutation(8).tolist()
            it = sch.schedule(remaining, order)
            assert it.decode == [i for i, r in enumerate(remaining) if r == 0]
            assert all(i in it.decode_window for i in it.decode)
            if it.decode:
                assert it.decode_window.rows in decode_programs
            waiting = [i for i, r in enumerate(remaining) if r]
            if not waiting:
                assert not it.prefill
                continue
            oldest = min(waiting, key=lambda i: order[i])
            smallest = sch.chunk_buckets[0]
            assert oldest in it.prefill and it.prefill[oldest] >= min(remaining[oldest], smallest)
            assert all(0 < n <= min(remaining[i], it.chunk) for i, n in it.prefill.items())
            assert all(i in it.prefill_window for i in it.prefill)
            assert (it.prefill_window.rows, it.chunk) in programs
            w = it.prefill_window
            assert w.start % w.rows == 0 and w.start + w.rows <= 8
            # within the budget, unless the oldest prompt alone takes the one minimum chunk it is always owed
            assert it.cost <= budget or (it.chunk == smallest and list(it.prefill) == [oldest])


def test_declared_ladders_pick_the_smallest_bucket_that_holds_the_work():
    sch = Scheduler(8, 8 + 256, 256, batch_buckets=[1, 4], chunk_buckets=[16, 64, 256])
    assert sch.batch_buckets == (1, 4, 8) and sch.decode_programs() == [1, 4, 8]     # the pool's size is always one
    it = sch.schedule([0, 0, None, None, None, 30, None, None])
    assert it.decode_window == Window(0, 4)                  # 2 rows needed: widened to the 4-row bucket
    assert it.prefill_window == Window(5, 1) and it.chunk == 64 and it.prefill == {5: 30}
    assert sch.prefill_programs() == [(1, 16), (1, 64), (1, 256), (4, 16), (4, 64), (8, 16)]
    for bad, what in [(dict(batch_buckets=[3]), "power of two"), (dict(batch_buckets=[16]), "exceeds"),
                      (dict(chunk_buckets=[8]), "at least 16"), (dict(chunk_buckets=[512]), "exceeds")]:
        with pytest.raises(ValueError, match=what):
            Scheduler(8, 264, 256, **bad)


def test_prefill_windows_come_from_their_own_ladder():
    """Prefill batch buckets (a subset of the batch buckets) bound the prefill windows, not the decode ones: two
    young prompts that would share a 2-row window prefill one per iteration under a 1-row prefill ladder."""
    sch = Scheduler(8, 8 + 256, 256, batch_buckets=[1, 2, 8], prefill_batch_buckets=[1])
    assert sch.decode_programs() == [1, 2, 8] and sch.prefill_programs() == [(1, 16), (1, 32), (1, 64), (1, 128),
                                                                          (1, 256)]
    it = sch.schedule([0, 0, None, None, 20, 20, None, None])
    assert it.decode_window == Window(0, 2) and it.prefill_window == Window(4, 1) and it.prefill == {4: 20}
    wide = Scheduler(8, 8 + 256, 256, batch_buckets=[1, 2, 8])
    assert wide.schedule([0, 0, None, None, 20, 20, None, None]).prefill == {4: 20, 5: 20}
    with pytest.raises(ValueError, match="not one of the batch buckets"):
        Scheduler(8, 264, 256, batch_buckets=[1, 8], prefill_batch_buckets=[2])
    # a mesh's windows start at slot 0 and an Engram model's take the pool: their prefill uses the batch ladder
    assert Scheduler(8, 264, 256, "pool", prefill_batch_buckets=[1]).prefill_programs()[0][0] == 8


def test_platform_default_ladders():
    """CPU and GPU: every power of two (None); Neuron: powers of eight and the pool, prefill windows up to 8 rows."""
    assert default_ladders(8, "cpu") == (None, None) and default_ladders(64, "gpu") == (None, None)
    assert default_ladders(64, "neuron") == ((1, 8, 64), (1, 8))
    assert default_ladders(128, "neuron") == ((1, 8, 64, 128), (1, 8))
    assert default_ladders(4, "neuron") == ((1, 4), (1, 4)) and default_ladders(1, "neuron") == ((1,), (1,))
    sch = serving_scheduler(64, 64 + 256, 256, platform="neuron")
    assert sch.decode_programs() == [1, 8, 64] and {n for n, _ in sch.prefill_programs()} == {1, 8}
    cpu = serving_scheduler(64, 64 + 256, 256, platform="cpu")
    assert cpu.decode_programs() == [1, 2, 4, 8, 16, 32, 64]
    declared = serving_scheduler(64, 64 + 256, 256, batch_buckets=[1, 4], platform="neuron")
    assert declared.batch_buckets == (1, 4, 64) and declared.prefill_buckets == (1, 4, 64)
