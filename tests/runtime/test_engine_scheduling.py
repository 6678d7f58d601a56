"""The engine's iterations (scheduler.py): a long prompt arriving while streams decode never costs them an iteration
without a token, it prefills within the token budget, slots are compacted when requests leave, and every request
gets exactly the tokens it gets alone — in the scan mode, on an Engram model (whole-pool windows) and in the regions
mode."""

from __future__ import annotations

import numpy as np
import pytest

import jdeep
from jdeep import SamplingParams
from jdeep.config.small_models import one_layer_config, tiny_v41_config
from jdeep.runtime.engine import Engine
from jdeep.tools.testing.random_weights import random_checkpoint, write_word_tokenizer


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("one-layer")
    random_checkpoint(one_layer_config(), str(folder), seed=7)
    return jdeep.load(folder)


def _alone(model, prompt, params, **kw):
    eng = Engine(model, **kw)
    rid = eng.add_request(prompt, params)
    return eng.run()[rid].tokens


def _streams_then_long_prompt(model, long_len=300, n_streams=4, max_new=24, **kw):
    """n_streams short requests decode; then a long prompt arrives. Returns (engine, stream ids, long id, per-step
    token gains of the unfinished streams while the long prompt prefills, iteration stats)."""
    rng = np.random.default_rng(3)
    eng = Engine(model, **kw)
    stats = []
    eng.on_iteration = stats.append
    streams = [eng.add_request([0] + rng.integers(2, 500, size=5 + 3 * i).tolist(),
                               SamplingParams(max_new_tokens=max_new, seed=i, temperature=0.7 * (i % 2)))
               for i in range(n_streams)]
    while any(not eng.outputs[r].tokens for r in streams):
        eng.step()
    long_prompt = [0] + rng.integers(2, 500, size=long_len - 1).tolist()
    long_id = eng.add_request(long_prompt, SamplingParams(max_new_tokens=5))
    gains, first = [], len(stats)
    while not eng.outputs[long_id].tokens:
        before = {r: len(eng.outputs[r].tokens) for r in streams if not eng.outputs[r].finished}
        eng.step()
        gains.append({r: len(eng.outputs[r].tokens) - n for r, n in before.items()})
    eng.run()
    return eng, streams, long_id, long_prompt, gains, stats[first:first + len(gains)]


def test_streams_get_a_token_every_iteration_while_a_long_prompt_prefills(model):
    kw = dict(max_num_seqs=8, max_len=512, prefill_chunk=32)
    eng, streams, long_id, long_prompt, gains, stats = _streams_then_long_prompt(model, max_new=16, **kw)
    assert eng.max_num_batched_tokens == 8 + 32                 # the default: a full decode window and one chunk
    assert len(gains) == -(-300 // 32)                          # 32-token chunks, one per iteration
    assert all(set(g.values()) == {1} for g in gains), gains    # no running stream skipped an iteration
    assert all(s.prefill_tokens == 32 for s in stats[:-1]) and stats[-1].prefill_tokens == 300 % 32
    assert all(s.decode_tokens == len(g) and s.cost <= eng.max_num_batched_tokens for s, g in zip(stats, gains))
    assert eng.totals["prefill_tokens"] >= 300 and eng.totals["decode_tokens"] > 4 * len(gains)
    # every request's tokens are those it gets alone (greedy and sampled streams, and the long prompt)
    for rid in streams + [long_id]:
        out = eng.outputs[rid]
        params = SamplingParams(max_new_tokens=16, seed=streams.index(rid),
                                temperature=0.7 * (streams.index(rid) % 2)) if rid in streams else \
            SamplingParams(max_new_tokens=5)
        assert out.tokens == _alone(model, out.prompt, params, **kw), rid
    assert all(eng.outputs[r].queue_time is not None and eng.outputs[r].queue_time >= 0 for r in streams)


def test_a_small_budget_trades_the_long_prompt_for_the_streams(model):
    # budget 8 + 16: the long prompt gets 16-token chunks next to the decode window; the streams still never wait
    eng, streams, long_id, long_prompt, gains, stats = _streams_then_long_prompt(
        model, max_num_seqs=8, max_len=512, prefill_chunk=64, max_num_batched_tokens=24)
    assert len(gains) == -(-300 // 16) and all(set(g.values()) == {1} for g in gains)
    assert all(s.cost <= 24 for s in stats)
    assert eng.outputs[long_id].tokens == _alone(model, long_prompt, SamplingParams(max_new_tokens=5),
                                                 max_num_seqs=8, max_len=512, prefill_chunk=64)


def test_slots_compact_when_requests_leave(model):
    rng = np.random.default_rng(4)
    eng = Engine(model, max_num_seqs=8, max_len=128, prefill_chunk=32)
    reqs = [([0] + rng.integers(2, 500, size=6).tolist(), SamplingParams(max_new_tokens=2 if i < 7 else 24))
            for i in range(8)]
    ids = [eng.add_request(p, s) for p, s in reqs]
    while not all(eng.outputs[r].finished for r in ids[:7]):
        eng.step()
    assert not eng.outputs[ids[7]].finished
    eng.step()                                          # the survivor (admitted into slot 7) moves down to slot 0
    assert eng.totals["slot_moves"] >= 1 and eng.slots[0].out.request_id == ids[7]
    assert all(s is None for s in eng.slots[1:])
    before = dict(eng.steps_per_bucket)
    eng.run()
    assert set(eng.steps_per_bucket) - set(before) <= {1} and eng.steps_per_bucket[1] > before.get(1, 0)
    for (p, s), rid in zip(reqs, ids):
        assert eng.outputs[rid].tokens == _alone(model, p, s, max_num_seqs=8, max_len=128, prefill_chunk=32)


@pytest.mark.full
def test_engram_model_steps_the_whole_pool_with_the_same_tokens(tmp_path):
    """Full tier: tests/runtime/test_scheduler.py::test_random_pools_serve_everyone_within_the_compiled_set[pool-None]
    covers the whole-pool windows in the default run (every decode row in the decode window of every iteration while
    the oldest prompt prefills within the budget), and
    tests/runtime/test_prefix_cache.py::test_v41_engram_requests_sharing_a_prefix_at_once the Engine stepping an Engram
    model's whole pool, requests prefilling together getting the tokens they get alone."""
    folder = tmp_path / "v41"
    random_checkpoint(tiny_v41_config(), str(folder), seed=5)
    write_word_tokenizer(str(folder / "tokenizer.json"), 512)
    model = jdeep.load(folder)
    kw = dict(max_num_seqs=4, max_len=256, prefill_chunk=16)
    eng, streams, long_id, long_prompt, gains, stats = _streams_then_long_prompt(model, long_len=70, n_streams=2,
                                                                                 max_new=8, **kw)
    assert eng.scheduler.window_mode == "pool" and set(eng.steps_per_bucket) == {4}
    assert all(set(g.values()) == {1} for g in gains) and len(gains) == -(-70 // 16)
    assert eng.outputs[long_id].tokens == _alone(model, long_prompt, SamplingParams(max_new_tokens=5), **kw)
