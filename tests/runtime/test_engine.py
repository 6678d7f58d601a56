"""Continuous batching: 64 requests through 8 slots finish, each with exactly the tokens it gets alone
(in the engine and from jdeep.generate), with steps run at batch-size buckets; bad requests fail alone with a
clear message; text prompts and stop strings (word-level tokenizer: id i <-> "tok<i>")."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jdeep
from jdeep import SamplingParams
from jdeep.config.small_models import TINY_CONFIG, one_layer_config
from jdeep.runtime.engine import Engine
from jdeep.tools.testing.random_weights import random_checkpoint, write_word_tokenizer


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    random_checkpoint(one_layer_config(), str(folder), seed=31)   # the engine's logic, not the layer kinds: cheap compiles
    write_word_tokenizer(str(folder / "tokenizer.json"), TINY_CONFIG["vocab_size"])
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


def _run(model, reqs, engine=None, **kw):
    eng = engine or Engine(model, **kw)
    ids = [eng.add_request(p, s) for p, s in reqs]
    outs = eng.run()
    return [outs[i] for i in ids]


def test_warmup_compiles_every_program_serving_reaches(model):
    """First in the module: the programs it compiles are the ones the 64-request test below runs."""
    from jax._src.dispatch import BACKEND_COMPILE_EVENT

    jax.clear_caches()                                    # whatever ran before in this process
    eng = Engine(model, max_num_seqs=8, max_len=64, prefill_chunk=16)
    state = [np.asarray(a).copy() for a in jax.tree_util.tree_leaves(eng.state)]
    # windows 1, 2, 4, 8 x (decode, prefill 16, the sampler: one program whatever the rows ask, logprobs, penalties
    # or bias), slot reset and move: the inventory, each entry one program, is what warm-up runs; the prompt-logprob
    # variants and the penalty rows' reset and move compile on first use (tests/runtime/test_logprobs_penalties.py)
    programs = [p for p in eng.programs() if not p.first_use]
    assert len({p.name for p in programs}) == len(programs) and all(p.programs == 1 for p in programs)
    assert {p.kind for p in eng.programs() if p.first_use} == {"step", "prompt_logprobs", "penalties"}
    # warm-up compiles them all ahead of running (in parallel), then runs each without compiling again
    compiles, precompiled = [], []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event) if event == BACKEND_COMPILE_EVENT else None)
    progress = lambda done, total, secs: precompiled.append(len(compiles)) if done == total else None
    assert eng.warmup(progress=progress) == len(programs) == 4 * (2 + 1) + 2
    assert eng.runner.precompiled.programs == len(programs) and not eng.runner.precompiled.failed
    assert precompiled == [len(compiles)]
    for before, after in zip(state, jax.tree_util.tree_leaves(eng.state)):
        np.testing.assert_array_equal(before, np.asarray(after))     # rows at position -1 write nothing
    assert eng.steps_per_bucket == {}
    compiles.clear()
    rng = np.random.default_rng(5)
    for n in (1, 3, 8, 2, 5):
        for _ in range(n):
            eng.add_request([0] + rng.integers(2, 500, size=int(rng.integers(2, 40))).tolist(),
                            SamplingParams(max_new_tokens=3, temperature=0.5 * (n % 2)))
        eng.run()
    assert set(eng.steps_per_bucket) == {1, 2, 4, 8}
    assert compiles == []


def test_64_requests_in_8_slots_equal_their_solo_runs(model):
    reqs = _requests()
    eng = Engine(model, max_num_seqs=8, max_len=64, prefill_chunk=16)
    together = _run(model, reqs, eng)
    assert all(o.finished and o.finish_reason in ("stop", "length") for o in together)
    assert eng.steps_per_bucket[8] > 0 and min(eng.steps_per_bucket) < 8   # full pool, and smaller buckets at the end
    for (prompt, p), o in zip(reqs, together):
        assert 1 <= len(o.tokens) <= p.max_new_tokens
        assert o.finish_reason == "stop" or len(o.tokens) == p.max_new_tokens
    # every 4th request alone (a quarter: greedy and sampled ones, admitted early and late) gets the same tokens
    for (prompt, p), o in list(zip(reqs, together))[1::4] + list(zip(reqs, together))[3::8]:
        solo = Engine(model, max_num_seqs=8, max_len=64, prefill_chunk=16)
        alone = _run(model, [(prompt, p)], solo)[0]
        assert alone.tokens == o.tokens
        assert set(solo.steps_per_bucket) == {1}        # a lone request steps a 1-row bucket of the 8-slot pool
    for (prompt, p), o in list(zip(reqs, together))[2:4]:       # and the notebook API agrees (greedy, sampled)
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


def test_bucket_step_leaves_other_slots_untouched(model):
    """A request decoding in slot 0 (bucket 1) while slot 1 waits mid-prefill does not change slot 1's state."""
    eng = Engine(model, max_num_seqs=2, max_len=64, prefill_chunk=16)
    eng.add_request([0, 5, 9], SamplingParams(max_new_tokens=6))
    eng.step()                                          # prefill slot 0 (bucket 1)
    before = [np.asarray(a)[:, 1].copy() for a in jax.tree_util.tree_leaves(eng.state)]
    eng.step()                                          # decode slot 0 only
    assert eng.steps_per_bucket == {1: 2}
    after = [np.asarray(a)[:, 1] for a in jax.tree_util.tree_leaves(eng.state)]
    for x, y in zip(before, after):
        np.testing.assert_array_equal(x, y)


def test_text_prompts_and_stop_strings(model):
    tok = model.tokenizer
    assert tok is not None                              # the folder's tokenizer.json was picked up by jdeep.load
    prompt = [0, 5, 9, 33]
    base = jdeep.generate(model, [prompt], max_new_tokens=8)
    toks = base.tokens[0, :base.lengths[0]].tolist()
    assert len(toks) >= 4, toks                         # (a random model that stops early would not test this)
    assert base.texts == [tok.decode(toks)]
    text_prompt = jdeep.generate(model, [" ".join(f"tok{i}" for i in prompt)], max_new_tokens=8)
    np.testing.assert_array_equal(text_prompt.tokens, base.tokens)
    # a stop string spanning the 2nd and 3rd generated tokens: the request ends at the 3rd, text before the stop
    w1, w2 = tok.decode([toks[1]]), tok.decode([toks[2]])
    stop = w1[-2:] + " " + w2[:3]
    full = tok.decode(toks[:3])
    want_text = full[:full.index(stop)]
    sp = SamplingParams(max_new_tokens=8, stop=("never-there", stop))
    streamed = []
    g = jdeep.generate(model, [prompt], sampling=sp, stream=lambda new: streamed.append(new[0]), stream_every=2)
    assert g.tokens[0].tolist() == toks[:3] + [-1] * 5 and g.texts == [want_text]
    assert sum(streamed, []) == toks[:3]                # nothing after the stop is streamed
    eng = Engine(model, max_num_seqs=4, max_len=64)
    rid = eng.add_request(" ".join(f"tok{i}" for i in prompt), sp)
    other = eng.add_request(prompt, SamplingParams(max_new_tokens=8))
    outs = eng.run()
    assert outs[rid].tokens == toks[:3] and outs[rid].finish_reason == "stop" and outs[rid].text == want_text
    assert outs[other].tokens == toks and outs[other].text == tok.decode(toks)
    no_tok = Engine(model, max_num_seqs=1, max_len=64)
    no_tok.tokenizer = None
    r = no_tok.add_request(prompt, sp)
    assert no_tok.outputs[r].finish_reason == "error" and "tokenizer" in no_tok.outputs[r].error

