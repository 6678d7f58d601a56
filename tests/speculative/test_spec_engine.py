"""Speculative decoding in the engine and the server (MTP, k = 2, the trained demo model in float numerics): requests
joining and leaving a 2-slot pool get the tokens the plain engine gives them (greedy; stop ids and max_new_tokens cut
accepted drafts short), sampled requests run beside them, warm-up compiles every program serving reaches, and the
OpenAI server built with --speculative-config answers as jdeep.generate does."""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import openai
import pytest

import jdeep
from jdeep import SamplingParams
from jdeep.cli import build_parser
from jdeep.runtime.engine import Engine
from jdeep.serve.server import ServerSettings, background_server
from jdeep.speculative.engine import SpeculativeEngine, make_engine

DEMO = pathlib.Path(jdeep.__file__).parent / "demo_model"
SPEC = {"method": "mtp", "num_speculative_tokens": 2}
ENGINE = dict(max_num_seqs=2, max_len=96, prefill_chunk=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return jdeep.load(DEMO, drafter=True, quantize_activations=False)


def _requests(model):
    text = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 3
    ids = model.tokenizer.encode(text)
    lengths, max_new = (7, 30, 3, 18, 40, 5), (20, 9, 24, 13, 6, 30)
    return [(ids[i:i + n], SamplingParams(max_new_tokens=m)) for i, (n, m) in enumerate(zip(lengths, max_new))]


def _serve(engine, requests, join_after: int = 3):
    """The first three requests, `join_after` steps, then the rest; tokens in request order."""
    rids = [engine.add_request(p, s) for p, s in requests[:3]]
    for _ in range(join_after):
        engine.step()
    rids += [engine.add_request(p, s) for p, s in requests[3:]]
    outs = engine.run()
    return [outs[r] for r in rids]


def test_speculative_engine_gives_the_plain_engines_tokens(model):
    from jax._src.dispatch import BACKEND_COMPILE_EVENT

    requests = _requests(model)
    plain = _serve(Engine(model, **ENGINE), requests)
    # a stop id inside what the drafts would accept: the request ends there, as plainly
    stop = plain[0].tokens[5]
    requests[0] = (requests[0][0], SamplingParams(max_new_tokens=20, stop_token_ids=(stop,)))
    plain[0].tokens = plain[0].tokens[:plain[0].tokens.index(stop) + 1]
    sampled = (requests[1][0], SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3))

    eng = SpeculativeEngine(model, SPEC, **ENGINE)
    state = [np.asarray(a).copy() for a in jax.tree_util.tree_leaves(eng.state)]
    # windows 1, 2 x (decode, prefill 16) x (greedy, sampled), the target's and the drafter's slot resets, the move
    # of both states: the engine's inventory
    assert eng.warmup() == len(eng.programs()) == 2 * 2 * 2 + 3
    assert eng.runner.precompiled.programs and not eng.runner.precompiled.failed     # compiled ahead, in parallel
    for before, after in zip(state, jax.tree_util.tree_leaves(eng.state)):
        np.testing.assert_array_equal(before, np.asarray(after))
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event) if event == BACKEND_COMPILE_EVENT else None)
    spec = _serve(eng, requests + [sampled])
    assert compiles == []
    assert [o.tokens for o in spec[:len(plain)]] == [o.tokens for o in plain]
    assert [o.finish_reason for o in spec[:len(plain)]] == ["stop"] + ["length"] * (len(plain) - 1)
    assert len(spec[-1].tokens) == 12 and spec[-1].finish_reason == "length"
    s = eng.spec_stats.as_dict()
    assert s["accepted"] > 0 and s["iterations"] > 0 and len(s["acceptance_per_position"]) == 2


def test_server_with_speculative_config(model):
    args = build_parser().parse_args(["serve", "--model", str(DEMO), "--speculative-config", '{"method": "mtp"}'])
    assert args.speculative_config == {"method": "mtp"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", str(DEMO), "--speculative-config", '{"method": "eagle"}'])
    engine = make_engine(model, SPEC, **ENGINE)
    prompt = _requests(model)[1][0]
    want = jdeep.generate(model, [prompt], max_new_tokens=10, ignore_eos=True).tokens[0].tolist()
    with background_server(engine, ServerSettings("demo")) as (url, _):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
        r = client.completions.create(model="demo", prompt=prompt, max_tokens=10, temperature=0)
    assert r.choices[0].text == model.tokenizer.decode(want)


def test_regions_mode_engine_gives_the_plain_engines_tokens(model):
    """The regions compile mode (draft program, regions step over the slot window, finish program; as on Neuron):
    the same greedy tokens as the plain engine, with requests joining and leaving."""
    requests = _requests(model)[:5]
    plain = _serve(Engine(model, **ENGINE), requests)
    regions = jdeep.load(DEMO, mtp=True, quantize_activations=False, compile_mode="regions")
    eng = SpeculativeEngine(regions, SPEC, **ENGINE)
    spec = _serve(eng, requests)
    assert [o.tokens for o in spec] == [o.tokens for o in plain]
    assert eng.spec_stats.as_dict()["accepted"] > 0


def test_logit_bias_and_min_tokens_with_speculation(model):
    """logit_bias and min_tokens apply at every verified position (acceptance.adjusted, the count + j-th token's
    values): through the OpenAI client, the MTP server's greedy completions equal plain decoding's for requests that
    set them, and the settings change the tokens."""
    prompt = _requests(model)[1][0]
    free = jdeep.generate(model, [prompt], max_new_tokens=12, ignore_eos=True).tokens[0].tolist()
    stop = free[2]
    asks = [({"logit_bias": {str(free[0]): -100, str(free[4]): 4}}, SamplingParams(
                max_new_tokens=12, logit_bias=((free[0], -100.0), (free[4], 4.0)))),
            ({"extra_body": {"min_tokens": 6, "stop_token_ids": [stop], "return_token_ids": True}}, SamplingParams(
                max_new_tokens=12, min_tokens=6, stop_token_ids=(stop,)))]
    engine = make_engine(model, SPEC, **ENGINE)
    with background_server(engine, ServerSettings("demo")) as (url, _):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
        for body, sp in asks:
            want = jdeep.generate(model, [prompt], sampling=sp, ignore_eos=True)
            want = want.tokens[0, :want.lengths[0]].tolist()
            r = client.completions.create(model="demo", prompt=prompt, max_tokens=12, temperature=0,
                                          extra_body={"return_token_ids": True, **body.get("extra_body", {})},
                                          **{k: v for k, v in body.items() if k != "extra_body"})
            assert r.choices[0].token_ids == want
            assert want != free[:len(want)]
    assert stop in free[:3] and stop not in want[:6]           # held back until the request has min_tokens


def _assert_same_logprobs(got, want):
    """Entries (token, logprob, [(id, logprob)] top) equal but for float rounding: the verify step scores k + 1
    positions in one chunk where plain decoding scores one."""
    assert [e[0] for e in got] == [e[0] for e in want]
    np.testing.assert_allclose([e[1] for e in got], [e[1] for e in want], atol=1e-4)
    for g, w in zip(got, want):
        np.testing.assert_allclose([v for _, v in g[2]], [v for _, v in w[2]], atol=1e-4)
        assert [i for i, _ in g[2]] == [i for i, _ in w[2]]


@pytest.mark.full
def test_logprobs_with_speculation(model):
    """logprobs / top_logprobs come from the target's logits at each emitted position (acceptance.Emitted): the MTP
    engine, jdeep.generate's speculative path and the server (through the OpenAI client) report plain decoding's.

    Full tier: tests/speculative/test_dspark_engine.py::test_dspark_engine_reports_logprobs covers the speculative
    engine's logprobs (SpeculativeRunner._logprobs over acceptance.Emitted's logprob fields, against the plain
    engine's) in the default run; tests/speculative/test_mtp_decode.py::test_speculative_generate_returns_logits
    covers speculative.generate._take_block copying the Emitted fields of a speculative jdeep.generate run."""
    requests = [(p, SamplingParams(max_new_tokens=10, logprobs=3)) for p, _ in _requests(model)[:3]]
    plain = _serve(Engine(model, **ENGINE), requests)
    spec = _serve(make_engine(model, SPEC, **ENGINE), requests)
    for s, p in zip(spec, plain):
        assert s.tokens == p.tokens and len(s.logprobs) == len(s.tokens)
        _assert_same_logprobs(s.logprobs, p.logprobs)
    out = jdeep.generate(model, [p for p, _ in requests], sampling=[s for _, s in requests], ignore_eos=True,
                         speculative=SPEC)
    for b, p in enumerate(plain):
        _assert_same_logprobs(out.logprobs[b], p.logprobs)
    with background_server(make_engine(model, SPEC, **ENGINE), ServerSettings("demo")) as (url, _):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
        r = client.completions.create(model="demo", prompt=requests[0][0], max_tokens=10, temperature=0, logprobs=3,
                                      extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == plain[0].tokens
    np.testing.assert_allclose(r.choices[0].logprobs.token_logprobs, [e[1] for e in plain[0].logprobs], atol=1e-4)
    assert [len(t) for t in r.choices[0].logprobs.top_logprobs] == [3] * 10


def test_prefix_cache_with_speculation(model):
    """The prefix cache with MTP drafting: a request sharing a cached 128-token prefix restores the target's and the
    drafter's snapshot (a hit) and gets the plain engine's greedy tokens. The MTP window entry at a prefix's last
    position holds the token after it, so a prompt that shares the prefix but not that token misses (lookahead 1)
    and still gets plain decoding's tokens."""
    text = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 10
    ids = model.tokenizer.encode(text)
    other = next(t for t in range(5, model.config.vocab_size) if t != ids[128])
    prompts = [ids[:200], ids[:170], ids[:128] + [other] + ids[129:170]]
    kw = dict(max_num_seqs=2, max_len=512, prefill_chunk=128, ignore_eos=True)
    sp = SamplingParams(max_new_tokens=8)
    plain = Engine(model, **kw)
    want = []
    for p in prompts:
        rid = plain.add_request(p, sp)
        want.append(plain.run()[rid].tokens)
    eng = make_engine(model, SPEC, prefix_cache_bytes=64 << 20, **kw)
    got = []
    for p in prompts:
        rid = eng.add_request(p, sp)
        got.append(eng.run()[rid].tokens)
        eng.release(rid)
    stats = eng.prefix_cache_stats
    assert got == want and stats.inserts >= 1 and stats.hits == 1 and stats.misses == 2, stats
