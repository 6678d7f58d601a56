"""vLLM-level sampling features through the official `openai` client against `jdeep serve` (v4-tiny-hf golden, a
word-level tokenizer): logprobs in both APIs (against a log-softmax of jdeep.forward's logits, computed apart),
echo with prompt logprobs, n = 3 and best_of (equal to jdeep.generate with the seeds the server gives each
sample), penalties / logit_bias / min_tokens (equal to jdeep.generate with the same SamplingParams), and a
prefix-cache hit counted in /metrics."""

from __future__ import annotations

import urllib.request
from types import SimpleNamespace

import numpy as np
import openai
import pytest
from conftest import golden_path

import jdeep
from jdeep import SamplingParams
from jdeep.io.tokenizer import Tokenizer
from jdeep.runtime.engine import Engine
from jdeep.serve.server import ServerSettings, background_server
from jdeep.tools.testing.random_weights import write_word_tokenizer

PROMPT = [0, 5, 9, 17, 33, 2, 8]
SHARED = [0] + list(range(40, 300))              # 261 tokens: a 256-token boundary is shared


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    model = jdeep.load(golden_path("v4-tiny-hf"))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    write_word_tokenizer(str(path), model.config.vocab_size, chat_markers=True)
    tok = Tokenizer(path)
    engine = Engine(model, max_num_seqs=2, max_len=512, prefill_chunk=128, tokenizer=tok,
                    prefix_cache_bytes=256 << 20)
    with background_server(engine, ServerSettings("tiny")) as (url, _):
        yield SimpleNamespace(url=url, model=model, tok=tok, engine=engine,
                              client=openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=300))


def _lsm(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _forward_lp(model, ids):
    return _lsm(jdeep.forward(model, ids, pad_to=512))


def test_completion_logprobs_and_echo(srv):
    r = srv.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                      echo=True, extra_body={"return_token_ids": True})
    ch = r.choices[0]
    gen = ch.token_ids
    assert gen == jdeep.generate(srv.model, [PROMPT], max_new_tokens=6).tokens[0, :len(gen)].tolist()
    lp = _forward_lp(srv.model, PROMPT + gen)
    want = [None] + [lp[i - 1, t] for i, t in enumerate(PROMPT + gen) if i > 0]
    got = ch.logprobs.token_logprobs
    assert len(got) == len(PROMPT) + len(gen) and got[0] is None
    np.testing.assert_allclose(got[1:], want[1:], atol=2e-4)
    assert ch.text.startswith(srv.tok.decode(PROMPT, skip_special_tokens=False))
    for i, top in enumerate(ch.logprobs.top_logprobs[1:], start=1):          # the 3 most likely, by the oracle
        assert sorted(top.values(), reverse=True) == pytest.approx(np.sort(lp[i - 1])[::-1][:3], abs=2e-4)
    assert ch.logprobs.text_offset[0] == 0 and ch.logprobs.text_offset == sorted(ch.logprobs.text_offset)


def test_chat_logprobs(srv):
    msgs = [{"role": "user", "content": "tok7 tok8 tok9"}]
    r = srv.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                           top_logprobs=2, extra_body={"return_token_ids": True})
    ch = r.choices[0]
    prompt = srv.tok.chat(msgs)
    lp = _forward_lp(srv.model, prompt + ch.token_ids)
    entries = ch.logprobs.content
    assert len(entries) == len(ch.token_ids) and all(len(e.top_logprobs) == 2 for e in entries)
    np.testing.assert_allclose([e.logprob for e in entries],
                               [lp[len(prompt) + j - 1, t] for j, t in enumerate(ch.token_ids)], atol=2e-4)
    assert entries[0].top_logprobs[0].logprob >= entries[0].top_logprobs[1].logprob
    streamed = [c for c in srv.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5,
                                                              temperature=0, logprobs=True, stream=True) if c.choices]
    got = [e.logprob for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    np.testing.assert_allclose(got, [e.logprob for e in entries], atol=1e-6)


def test_n_and_best_of(srv):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=5, temperature=1.0, seed=11,
              extra_body={"return_token_ids": True})
    r = srv.client.completions.create(n=3, logprobs=0, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for j, c in enumerate(r.choices):                    # sample j is seeded seed + j
        alone = jdeep.generate(srv.model, [PROMPT], sampling=SamplingParams(temperature=1.0, seed=11 + j,
                                                                            max_new_tokens=5))
        assert c.token_ids == alone.tokens[0, :alone.lengths[0]].tolist()
    assert len({tuple(c.token_ids) for c in r.choices}) > 1
    best = max(r.choices, key=lambda c: sum(c.logprobs.token_logprobs))
    b = srv.client.completions.create(n=1, best_of=3, **kw)
    assert len(b.choices) == 1 and b.choices[0].token_ids == best.token_ids
    assert b.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices)      # all three were generated
    chat = srv.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "tok5"}], n=2,
                                              max_tokens=3, temperature=1.0, seed=3)
    assert [c.index for c in chat.choices] == [0, 1]


@pytest.mark.full
def test_penalties_bias_and_min_tokens_equal_generate(srv):
    """Full tier: tests/serve/test_openai_protocol.py::test_completion_choices_logprobs_penalties covers the API's
    penalties, logit_bias and min_tokens becoming the request's SamplingParams in the default run, and
    tests/runtime/test_logprobs_penalties.py::test_engine_equals_generate_whatever_the_company the engine giving
    jdeep.generate's tokens for them (test_adjustments_equal_the_oracle the adjustments themselves)."""
    eos = srv.model.config.eos_token_id
    cases = [({"frequency_penalty": -1.5, "presence_penalty": -0.5}, {"frequency_penalty": -1.5,
                                                                      "presence_penalty": -0.5}),
             ({"extra_body": {"repetition_penalty": 0.3}}, {"repetition_penalty": 0.3}),
             ({"logit_bias": {"17": 6.0, str(eos): -100}, "extra_body": {"min_tokens": 4}},
              {"logit_bias": ((17, 6.0), (eos, -100.0)), "min_tokens": 4})]
    plain = jdeep.generate(srv.model, [PROMPT], max_new_tokens=8)
    for api, params in cases:
        r = srv.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                          **{"extra_body": {"return_token_ids": True, **api.pop("extra_body", {})},
                                             **api})
        alone = jdeep.generate(srv.model, [PROMPT], sampling=SamplingParams(max_new_tokens=8, **params))
        assert r.choices[0].token_ids == alone.tokens[0, :alone.lengths[0]].tolist(), params
        assert r.choices[0].token_ids != plain.tokens[0, :plain.lengths[0]].tolist(), params    # they bite
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        srv.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, presence_penalty=3)


def _metric(srv, name: str) -> float:
    with urllib.request.urlopen(srv.url.removesuffix("/v1") + "/metrics") as f:
        text = f.read().decode()
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + " "))


def test_prefix_cache_hit(srv):
    hits = _metric(srv, "jdeep_prefix_cache_hits_total")
    outs = []
    for suffix in ([7, 8, 9], [10, 11]):
        r = srv.client.completions.create(model="tiny", prompt=SHARED + suffix, max_tokens=4, temperature=0,
                                          extra_body={"return_token_ids": True})
        outs.append(r.choices[0].token_ids)
        alone = jdeep.generate(srv.model, [SHARED + suffix], max_new_tokens=4, prefill_chunk=128)
        assert outs[-1] == alone.tokens[0, :alone.lengths[0]].tolist()
    assert _metric(srv, "jdeep_prefix_cache_hits_total") >= hits + 1
    assert _metric(srv, "jdeep_prefix_cache_hit_tokens_total") >= 256
    assert _metric(srv, "jdeep_prefix_cache_bytes") > 0
