"""logit_bias, presence / frequency / repetition penalties, min_tokens and logprobs (drawn token and top-N, and
prompt logprobs): the sampler against float64 numpy oracles of their definitions, then jdeep.generate against a host
loop that recomputes every step's logits from scratch (jdeep.forward) and applies the oracle, and the Engine against
jdeep.generate: a penalised request gets the same tokens whatever its batch and slot, and nothing compiles after
Engine.warmup. Speculative decoding and validation refuse what they must by the field's name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdeep
from jdeep import SamplingParams
from jdeep.config.small_models import one_layer_config
from jdeep.runtime.engine import Engine
from jdeep.runtime.requests import RequestError, check_request
from jdeep.runtime.sampling import PenaltyState, adjusted_logits, batch_params, sample, token_logprobs
from jdeep.tools.testing.random_weights import random_checkpoint

V = 512


def _oracle(logits, p: SamplingParams, generated: list[int], prompt: list[int], stop_ids=(), step=None) -> np.ndarray:
    """The definitions, in float64: bias, repetition (CTRL), presence / frequency (OpenAI), min_tokens (step: the
    tokens generated so far, by default len(generated))."""
    x = np.asarray(logits, np.float64).copy()
    for t, b in p.logit_bias:
        x[t] += b
    counts = np.bincount(np.asarray(generated, int), minlength=len(x)) if generated else np.zeros(len(x))
    seen = counts > 0
    seen[list(prompt)] = True
    r = p.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    if (len(generated) if step is None else step) < p.min_tokens:
        x[list(stop_ids)] = -np.inf
    return x


def test_adjustments_equal_the_oracle():
    rng = np.random.default_rng(0)
    B = 4
    logits = rng.normal(0, 3, (B, V)).astype(np.float32)
    ps = [SamplingParams(presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.3, max_new_tokens=8),
          SamplingParams(logit_bias=((5, 100.0), (9, -100.0), (11, 2.5)), max_new_tokens=8),
          SamplingParams(min_tokens=3, max_new_tokens=8, repetition_penalty=0.8),
          SamplingParams(max_new_tokens=8)]
    generated = [rng.integers(0, V, 6).tolist() for _ in range(B)]
    prompts = [rng.integers(0, V, 5).tolist() for _ in range(B)]
    stops = [(1, 7)] * B
    counts = np.stack([np.bincount(g, minlength=V) for g in generated]).astype(np.int32)
    seen = np.zeros((B, V), bool)
    for b, pr in enumerate(prompts):
        seen[b, pr] = True
    sb = batch_params(ps, stop_ids=stops)
    steps = np.array([6, 6, 2, 6], np.int32)
    got = np.asarray(adjusted_logits(jnp.asarray(logits), sb, jnp.asarray(steps), PenaltyState(counts, seen)))
    for b in range(B):
        want = _oracle(logits[b], ps[b], generated[b], prompts[b], stops[b], step=steps[b])
        np.testing.assert_allclose(got[b], want, rtol=1e-6, atol=1e-5)
    assert np.isneginf(got[2, [1, 7]]).all()                                          # min_tokens holds EOS back
    np.testing.assert_array_equal(got[3], logits[3])                                   # off: untouched, bit for bit
    tok = np.asarray(sample(jnp.asarray(logits), sb, jnp.asarray(steps), PenaltyState(counts, seen)))
    assert tok[1] == 5                                                                  # a +100 bias wins greedy


def test_logprobs_and_ties():
    logits = np.array([[0.0, 2.0, 2.0, -1.0, 2.0, 1.0]], np.float32)
    chosen, ids, vals = (np.asarray(a) for a in token_logprobs(jnp.asarray(logits), jnp.asarray([5])))
    lp = logits[0].astype(np.float64) - np.log(np.exp(logits[0].astype(np.float64)).sum())
    np.testing.assert_allclose(chosen[0], lp[5], rtol=1e-6)
    assert ids[0, :4].tolist() == [1, 2, 4, 5]                       # ties: lowest id first
    np.testing.assert_allclose(vals[0, :6], np.sort(lp)[::-1], rtol=1e-6)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("one-layer")
    random_checkpoint(one_layer_config(), str(folder), seed=31)
    return jdeep.load(folder)


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - (np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) + x.max(-1, keepdims=True))


def _reference(model, prompt, p: SamplingParams, eos: int):
    """Greedy decoding recomputed from scratch every step (jdeep.forward), with the oracle's adjustments."""
    seq, out, lps = list(prompt), [], []
    for _ in range(p.max_new_tokens):
        raw = jdeep.forward(model, seq, pad_to=64)[-1]
        x = _oracle(raw, p, out, prompt, tuple(p.stop_token_ids) + (eos,))
        t = int(np.argmax(x))
        lps.append(_log_softmax(raw)[t])
        out.append(t)
        seq.append(t)
        if t == eos or t in p.stop_token_ids:
            break
    return out, lps


PROMPT = [0, 17, 33, 17, 91, 5, 17, 200]
LONG = PROMPT + [7, 17, 300, 41, 5, 17, 99, 12, 17, 64, 3, 250]       # 20 tokens: more than one prefill chunk
EOS = one_layer_config()["eos_token_id"]
# negative penalties / a repetition penalty < 1 favour repeats, which greedy decoding of random weights then makes;
# (prompt, params, greedy: checked against the oracle)
FEATURES = [
    (PROMPT, SamplingParams(max_new_tokens=10, frequency_penalty=-1.5, presence_penalty=-0.5, logprobs=3), True),
    (PROMPT[2:], SamplingParams(max_new_tokens=10, repetition_penalty=0.3), True),
    (PROMPT, SamplingParams(max_new_tokens=6, logit_bias=((17, 8.0),), min_tokens=6, logprobs=0), True),
    # EOS forced by its bias, held back by min_tokens; prompt logprobs across prefill chunks
    (LONG, SamplingParams(max_new_tokens=8, logit_bias=((EOS, 100.0),), min_tokens=3, repetition_penalty=1.5,
                          prompt_logprobs=2), True),
    (LONG, SamplingParams(max_new_tokens=9, temperature=0.8, top_p=0.9, seed=7, frequency_penalty=1.0,
                          repetition_penalty=1.2, logprobs=2), False)]
PLAIN = [(PROMPT[:3], SamplingParams(max_new_tokens=2)), (PROMPT[:5], SamplingParams(max_new_tokens=1))]
ENGINE = dict(max_num_seqs=2, max_len=64, prefill_chunk=16)


@pytest.fixture(scope="module")
def generated(model):
    """FEATURES through one jdeep.generate batch, prefilled in chunks of 4 tokens."""
    return jdeep.generate(model, [pr for pr, _, _ in FEATURES], sampling=[p for _, p, _ in FEATURES], prefill_chunk=4)


def _tokens(out, b):
    return out.tokens[b, :out.lengths[b]].tolist()


def test_generate_equals_the_recomputed_oracle(model, generated):
    for b, (prompt, p, greedy) in enumerate(FEATURES):
        got = _tokens(generated, b)
        if greedy:
            want, want_lp = _reference(model, prompt, p, EOS)
            assert got == want, (b, got, want)
        if p.logprobs is not None:
            entries = generated.logprobs[b]
            assert [e[0] for e in entries] == got and all(len(e[2]) == p.logprobs for e in entries)
            if greedy:
                np.testing.assert_allclose([e[1] for e in entries], want_lp, atol=2e-4)
        else:
            assert generated.logprobs[b] is None
    assert _tokens(generated, 3)[:3].count(EOS) == 0 and _tokens(generated, 3)[3:] == [EOS]    # min_tokens, then EOS
    base, _ = _reference(model, PROMPT, SamplingParams(max_new_tokens=10), EOS)       # the adjustments change tokens
    assert all(base != _tokens(generated, b) for b in range(2))
    assert 17 in _tokens(generated, 2) and 17 not in base


def test_prompt_logprobs_equal_forward(model, generated):
    lp = _log_softmax(jdeep.forward(model, LONG, pad_to=64))
    for b, (_, p, _) in enumerate(FEATURES):
        if p.prompt_logprobs is None:
            assert generated.prompt_logprobs[b] is None
    entries = generated.prompt_logprobs[3]
    assert entries[0] is None and len(entries) == len(LONG)
    for i in range(1, len(LONG)):
        t, v, top = entries[i]
        assert t == LONG[i]
        np.testing.assert_allclose(v, lp[i - 1, t], atol=2e-4)
        assert [a for a, _ in top] == np.argsort(-lp[i - 1], kind="stable")[:2].tolist()
        np.testing.assert_allclose([v for _, v in top], np.sort(lp[i - 1])[::-1][:2], atol=2e-4)


@pytest.fixture(scope="module")
def served(model, generated):
    """FEATURES and plain requests through a 2-slot Engine, warmed up first with its first-use programs (the prompt
    logprob variants; from cleared caches): (engine, outputs in request order, programs compiled after warmup, the
    penalty rows' slot moves)."""
    from jax._src.dispatch import BACKEND_COMPILE_EVENT

    jax.clear_caches()
    eng = Engine(model, **ENGINE)
    eng.warmup(first_use=True)
    compiles, recording = [], [True]
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event) if recording[0] and event == BACKEND_COMPILE_EVENT else None)
    moves, move = [], eng.pool.penalties.move
    eng.pool.penalties.move = lambda src, dst: (moves.append((src, dst)), move(src, dst))
    reqs = [PLAIN[0], FEATURES[0][:2], PLAIN[1]] + [f[:2] for f in FEATURES[1:]]
    ids = [eng.add_request(pr, p) for pr, p in reqs]
    outs = eng.run()
    recording[0] = False
    return eng, [outs[i] for i in ids], compiles, moves


def test_warmup_reaches_every_sampling_program(served):
    """Penalties, logit_bias, min_tokens, logprobs and prompt logprobs, a penalised request's slot move: nothing
    compiles after Engine.warmup(first_use=True)."""
    eng, outs, compiles, moves = served
    assert all(o.finished and o.error is None for o in outs)
    assert set(eng.steps_per_bucket) == {1, 2} and moves
    assert compiles == []


def test_engine_equals_generate_whatever_the_company(model, served, generated):
    """The feature requests next to plain ones, queued for 2 slots and moved between them: each gets what it gets in
    jdeep.generate's batch."""
    _, outs, _, moves = served
    assert moves                                          # a penalised request changed slots on the way
    for o, (prompt, p) in zip((outs[0], outs[2]), PLAIN):          # and the plain requests next to them
        assert o.tokens == _reference(model, prompt, p, EOS)[0]
    for b, ((prompt, p, _), o) in enumerate(zip(FEATURES, [outs[1]] + outs[3:])):
        assert o.tokens == _tokens(generated, b), (b, o.tokens)
        if p.logprobs is not None:
            assert [e[0] for e in o.logprobs] == o.tokens
            np.testing.assert_allclose([e[1] for e in o.logprobs], [e[1] for e in generated.logprobs[b]], atol=1e-5)
            assert [[i for i, _ in e[2]] for e in o.logprobs] == [[i for i, _ in e[2]] for e in generated.logprobs[b]]
        else:
            assert o.logprobs is None
        if p.prompt_logprobs is not None:
            assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(prompt)
            np.testing.assert_allclose([e[1] for e in o.prompt_logprobs[1:]],
                                       [e[1] for e in generated.prompt_logprobs[b][1:]], atol=1e-5)
        else:
            assert o.prompt_logprobs is None


def test_validation_names_the_field(model):
    for kw, name in [({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": float("nan")},
                     "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
                     ({"logit_bias": ((V, 1.0),)}, "logit_bias"), ({"logit_bias": ((3, 101),)}, "logit_bias"),
                     ({"logit_bias": ((3, 1.0),) * 301}, "logit_bias"), ({"logit_bias": ((3,),)}, "logit_bias"),
                     ({"min_tokens": 20}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
                     ({"logprobs": 21}, "logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs")]:
        p = SamplingParams(max_new_tokens=8, **kw)
        with pytest.raises(ValueError, match=name):
            p.validate(V)
        with pytest.raises(RequestError, match=name) as e:           # as the Engine checks it: OpenAI's param
            check_request(PROMPT, p, vocab_size=V, max_len=64)
        assert e.value.param == name
    for name, value in [("presence_penalty", 0.5), ("repetition_penalty", 1.1), ("prompt_logprobs", 1)]:
        with pytest.raises(RequestError, match=name) as e:           # speculative decoding refuses them by name
            jdeep.generate(model, [PROMPT], sampling=SamplingParams(max_new_tokens=4, **{name: value}),
                           speculative={"method": "mtp", "num_speculative_tokens": 1})
        assert e.value.param == name
