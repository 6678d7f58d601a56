"""Continuous batching: 64 requests through 8 slots finish, each with exactly the tokens it gets alone
(in the engine and from jdeep.generate); bad requests fail alone with a clear message."""

from __future__ import annotations

import numpy as np
import pytest

import jdeep
from jdeep.random_weights import TINY_CONFIG, random_checkpoint
from jdeep.serve import SamplingParams
from jdeep.serve.engine import Engine


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    random_checkpoint(TINY_CONFIG, str(folder), seed=31)
    return jdeep.load(folder)


def _requests(n=64, seed=0):
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        prompt = [0] + rng.integers(2, 512, size=int(rng.integers(2, 40))).tolist()
        if i % 4 == 3:
            p = SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_new_tokens=int(rng.integers(1, 10)))
        else:
            p = SamplingParams(max_new_tokens=int(rng.integers(1, 10)))
        reqs.append((prompt, p))
    return reqs


def _run(model, reqs, **kw):
    eng = Engine(model, **kw)
    ids = [eng.add_request(p, s) for p, s in reqs]
    outs = eng.run()
    return [outs[i] for i in ids]


def test_64_requests_in_8_slots_equal_their_solo_runs(model):
    reqs = _requests()
    together = _run(model, reqs, max_num_seqs=8, max_len=64, prefill_chunk=16)
    assert all(o.finished and o.finish_reason in ("stop", "length") for o in together)
    for (prompt, p), o in zip(reqs, together):
        assert 1 <= len(o.tokens) <= p.max_new_tokens
        assert o.finish_reason == "stop" or len(o.tokens) == p.max_new_tokens
        alone = _run(model, [(prompt, p)], max_num_seqs=8, max_len=64, prefill_chunk=16)[0]
        assert alone.tokens == o.tokens
    for (prompt, p), o in list(zip(reqs, together))[:8]:        # and the notebook API agrees
        g = jdeep.generate(model, [prompt], sampling=p)
        assert g.tokens[0, :g.lengths[0]].tolist() == o.tokens


def test_bad_requests_fail_alone(model):
    good = [([0, 5, 9], SamplingParams(max_new_tokens=4)), ([0, 7], SamplingParams(max_new_tokens=3))]
    eng = Engine(model, max_num_seqs=2, max_len=32, prefill_chunk=16)
    a = eng.add_request(*good[0])
    bad = {eng.add_request([0, 5], SamplingParams(top_p=0.0)): "top_p",
           eng.add_request([0, 10**6], SamplingParams()): "outside the vocabulary",
           eng.add_request(list(range(40)), SamplingParams()): "max_len",
           eng.add_request([], SamplingParams()): "non-empty"}
    b = eng.add_request(*good[1])
    outs = eng.run()
    for rid, what in bad.items():
        assert outs[rid].finish_reason == "error" and what in outs[rid].error, outs[rid]
    assert outs[a].finished and len(outs[a].tokens) >= 1 and outs[a].error is None
    assert outs[b].finished and len(outs[b].tokens) >= 1 and outs[b].error is None
