"""Speculative decoding with DeepSeek-V4.1's DSpark drafter in the engine and the server (k = 3 and 2, float
numerics): requests joining and leaving a 2-slot pool get the tokens the plain engine gives them (greedy; stop ids and
max_new_tokens cut accepted drafts short), sampled requests run beside them, warm-up compiles every program serving
reaches and leaves the state untouched.

Two models: the v41-dspark-tiny golden (Engram layers: the whole pool steps, the draft and the verify are two
programs with the host's Engram gather between them) with an oracle drafter, so that accepted drafts go through
the engine; and a random V4.1 model with a DSpark drafter and no Engram layers (one program per window of slots,
compaction moving the drafter's windows with the state)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import jdeep
from conftest import golden_path
from jdeep import SamplingParams
from jdeep.cli import build_parser
from jdeep.config.small_models import tiny_v41_config
from jdeep.runtime.engine import Engine
from jdeep.runtime.inventory import total_programs
from jdeep.speculative import dspark_decode, dspark_drafter
from jdeep.speculative.dspark_drafter import DSparkDrafter
from jdeep.speculative.engine import SpeculativeEngine, make_engine
from jdeep.tools.testing.random_weights import random_checkpoint

ENGINE = dict(max_num_seqs=2, max_len=96, prefill_chunk=16, ignore_eos=True)


@pytest.fixture(scope="module")
def golden():
    return jdeep.load(golden_path("v41-dspark-tiny"), mtp=True, quantize_activations=False)


def _requests(vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths, max_new = (7, 30, 3, 18, 40), (20, 9, 24, 13, 6)
    return [(rng.integers(3, vocab, n).tolist(), SamplingParams(max_new_tokens=m)) for n, m in zip(lengths, max_new)]


def _serve(engine, requests, join_after: int = 3):
    """The first three requests, `join_after` steps, then the rest; outputs in request order."""
    rids = [engine.add_request(p, s) for p, s in requests[:3]]
    for _ in range(join_after):
        engine.step()
    rids += [engine.add_request(p, s) for p, s in requests[3:]]
    outs = engine.run()
    return [outs[r] for r in rids]


@pytest.mark.full
def test_dspark_engine_with_engram_gives_the_plain_engines_tokens(golden, monkeypatch):
    """The Engram golden in the engine (the whole pool steps; draft and verify programs with the host's Engram gather
    between them), warm-up, an oracle drafter so that accepted drafts go through the engine.

    Full tier: tests/speculative/test_dspark_engine.py::test_dspark_engine_windows_give_the_plain_engines_tokens
    covers the DSpark speculative engine (SpeculativeRunner, DraftingSlotPool with the DSpark windows) and
    tests/speculative/test_dspark_engine.py::test_dspark_engine_in_the_regions_mode its pool window mode on this
    Engram golden in the default run; tests/speculative/test_dspark_decode.py::
    test_greedy_speculation_equals_plain_greedy_and_leaves_the_plain_state covers DSparkDrafter._host_iteration's
    scan-mode Engram branch (draft_program, Engram gather, verify_program, history advance) with an oracle drafter's
    accepted drafts and a stop id; tests/speculative/test_spec_engine.py::
    test_speculative_engine_gives_the_plain_engines_tokens covers SpeculativeEngine.warmup (SpeculativeRunner.warm,
    precompiled inventory, no compile while serving)."""
    from jax._src.dispatch import BACKEND_COMPILE_EVENT

    k, V = 3, golden.config.vocab_size
    requests = _requests(V)
    plain = _serve(Engine(golden, **ENGINE), requests)
    stop = plain[0].tokens[5]            # a stop id inside what the drafts would accept: the request ends there
    requests[0] = (requests[0][0], SamplingParams(max_new_tokens=20, stop_token_ids=(stop,)))
    plain[0].tokens = plain[0].tokens[:plain[0].tokens.index(stop) + 1]
    sampled = (requests[1][0], SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3))

    eng = SpeculativeEngine(golden, {"method": "dspark", "num_speculative_tokens": k}, **ENGINE)
    state = [np.asarray(a).copy() for a in jax.tree_util.tree_leaves((eng.state, eng.dstate))]
    # the pool: (draft + verify, prefill 16) x (greedy, sampled), the target's and the drafter's slot resets: the
    # engine's inventory
    assert eng.warmup() == total_programs(eng.programs()) == 2 * 2 + 2 + 2
    assert eng.runner.precompiled.programs and not eng.runner.precompiled.failed     # compiled ahead, in parallel
    for before, after in zip(state, jax.tree_util.tree_leaves((eng.state, eng.dstate))):
        np.testing.assert_array_equal(before, np.asarray(after))

    # the oracle drafter: each slot's plain continuation, wrong from a draft that varies with the slot and position
    block = golden.config.dspark.block_size
    seqs = {o.request_id: np.array(p + o.tokens + [0] * (2 * block), np.int32)
            for o, (p, _) in zip(plain, requests)}

    def oracle(params, dstate, carry, sb):
        p = np.asarray(carry.p)
        drafts = np.zeros((len(p), block), np.int32)
        for i, s in enumerate(eng.slots):
            if s is not None and s.out.request_id in seqs:
                right = seqs[s.out.request_id][p[i] + 1:p[i] + 1 + block]
                drafts[i] = np.where(np.arange(block) < (p[i] + i) % (k + 1), right, (right + 1) % V)
        return jax.device_put(drafts, jax.devices()[0]), None    # committed, as the draft program's output

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event) if event == BACKEND_COMPILE_EVENT else None)
    real = dspark_decode.draft_program
    monkeypatch.setattr(dspark_drafter, "draft_program",
                        lambda model, greedy: oracle if greedy else real(model, greedy))
    spec = _serve(eng, requests + [sampled])
    assert compiles == []
    assert [o.tokens for o in spec[:len(plain)]] == [o.tokens for o in plain]
    assert [o.finish_reason for o in spec[:len(plain)]] == ["stop"] + ["length"] * (len(plain) - 1)
    assert len(spec[-1].tokens) == 12 and spec[-1].finish_reason == "length"
    s = eng.spec_stats.as_dict()
    assert s["acceptance_per_position"][k - 1] > 0.1 and s["mean_accepted_length"] > 1.5, s


@pytest.fixture(scope="module")
def no_engram(tmp_path_factory):
    """A random V4.1 model with a 2-stage DSpark drafter and no Engram layers."""
    raw = tiny_v41_config(quantized=False)
    text = raw["text_config"]
    for key in [k for k in text if k.startswith("engram_")]:
        del text[key]
    text.update(num_nextn_predict_layers=2, dspark_block_size=4, dspark_noise_token_id=509, dspark_markov_rank=16,
                dspark_target_layer_ids=[5, 7], dspark_n_routed_experts=4, dspark_num_experts_per_tok=2)
    folder = tmp_path_factory.mktemp("dspark-no-engram")
    random_checkpoint(raw, str(folder), seed=5)
    return jdeep.load(folder, mtp=True)


def test_dspark_engine_windows_give_the_plain_engines_tokens(no_engram):
    """Without Engram: one draft+verify program per slot window; requests join, leave and move down (compaction)."""
    requests = _requests(no_engram.config.vocab_size, seed=1)
    plain = _serve(Engine(no_engram, **ENGINE), requests)
    eng = make_engine(no_engram, {"method": "dspark", "num_speculative_tokens": 2}, **ENGINE)
    assert isinstance(eng.drafter, DSparkDrafter) and eng.scheduler.window_mode != "pool"
    spec = _serve(eng, requests)
    assert [o.tokens for o in spec] == [o.tokens for o in plain]
    assert eng.spec_stats.as_dict()["iterations"] > 0
    # slot 0 ends first: the request in slot 1 moves down (state and drafter windows) and goes on as plainly
    pair = [requests[1], (requests[4][0], SamplingParams(max_new_tokens=24))]
    plain = _serve(Engine(no_engram, **ENGINE), pair, join_after=0)
    moves = eng.totals["slot_moves"]
    assert [o.tokens for o in _serve(eng, pair, join_after=0)] == [o.tokens for o in plain]
    assert eng.totals["slot_moves"] > moves


def test_dspark_engine_errors(golden):
    args = build_parser().parse_args(["serve", "--model", "m", "--speculative-config", '{"method": "dspark"}'])
    assert args.speculative_config == {"method": "dspark"}
    with pytest.raises(ValueError, match=r"\[1, 5\].*dspark_block_size"):
        make_engine(golden, {"method": "dspark", "num_speculative_tokens": 6}, **ENGINE)
    with pytest.raises(ValueError, match="'method': 'dspark'"):
        make_engine(golden, {"method": "mtp"}, **ENGINE)
    with pytest.raises(ValueError, match="on a mesh"):
        make_engine(dataclasses.replace(golden, layout=object()), {"method": "dspark"}, **ENGINE)


def test_dspark_engine_in_the_regions_mode(golden):
    """The regions compile mode (Neuron's: the whole pool steps through dspark_regions' programs, the Engram rows of
    each target step gathered between them): the plain engine's greedy tokens, k = 3 (two target steps per verify)."""
    requests = _requests(golden.config.vocab_size, seed=2)[:4]
    plain = _serve(Engine(golden, **ENGINE), requests)
    regions = jdeep.load(golden_path("v41-dspark-tiny"), mtp=True, quantize_activations=False, compile_mode="regions")
    eng = make_engine(regions, {"method": "dspark", "num_speculative_tokens": 3}, **ENGINE)
    assert eng.scheduler.window_mode == "pool"
    assert [o.tokens for o in _serve(eng, requests)] == [o.tokens for o in plain]
    assert eng.spec_stats.as_dict()["iterations"] > 0


@pytest.mark.full
def test_dspark_engine_applies_logit_bias_and_min_tokens(no_engram):
    """logit_bias and min_tokens at every verified position (acceptance.adjusted): greedy requests that set them get
    the plain engine's tokens with DSpark drafting (windows), and the settings change the tokens; jdeep.generate's
    speculative path gives them too.

    Full tier: tests/speculative/test_spec_engine.py::test_logit_bias_and_min_tokens_with_speculation covers
    logit_bias and min_tokens at every verified position (acceptance.adjusted) in the speculative engine in the
    default run; tests/speculative/test_dspark_engine.py::test_dspark_engine_windows_give_the_plain_engines_tokens
    covers the DSpark windows iteration (dspark_iteration.iteration, which dspark_iteration.iterations scans for
    jdeep.generate); tests/speculative/test_mtp_decode.py::test_speculative_generate_returns_logits covers
    return_logits with speculation (keep_logits, generate._take_block's logits)."""
    V = no_engram.config.vocab_size
    prompt = _requests(V, seed=3)[1][0]
    free = jdeep.generate(no_engram, [prompt], max_new_tokens=10, ignore_eos=True).tokens[0].tolist()
    asks = [(prompt, SamplingParams(max_new_tokens=10, logit_bias=((free[0], -100.0), (free[3], 5.0)))),
            (prompt, SamplingParams(max_new_tokens=10, min_tokens=5, stop_token_ids=(free[1],)))]
    spec = {"method": "dspark", "num_speculative_tokens": 2}
    plain = _serve(Engine(no_engram, **ENGINE), asks, join_after=0)
    got = _serve(make_engine(no_engram, spec, **ENGINE), asks, join_after=0)
    assert [o.tokens for o in got] == [o.tokens for o in plain]
    assert all(o.tokens != free[:len(o.tokens)] for o in plain)
    generated = jdeep.generate(no_engram, [p for p, _ in asks], sampling=[s for _, s in asks], ignore_eos=True,
                               speculative=spec, return_logits=True)
    assert [generated.tokens[b, :generated.lengths[b]].tolist() for b in range(2)] == [o.tokens for o in plain]
    plain_logits = jdeep.generate(no_engram, [p for p, _ in asks], sampling=[s for _, s in asks], ignore_eos=True,
                                  return_logits=True).logits
    np.testing.assert_allclose(generated.logits, plain_logits, atol=1e-4)     # the target's, NaN after the end


def test_dspark_engine_reports_logprobs(no_engram):
    """logprobs from the target's logits at each emitted position, as the plain engine reports them."""
    requests = [(p, SamplingParams(max_new_tokens=8, logprobs=2)) for p, _ in _requests(no_engram.config.vocab_size,
                                                                                         seed=4)[:2]]
    plain = _serve(Engine(no_engram, **ENGINE), requests, join_after=0)
    got = _serve(make_engine(no_engram, {"method": "dspark", "num_speculative_tokens": 2}, **ENGINE), requests,
                 join_after=0)
    for g, p in zip(got, plain):
        assert g.tokens == p.tokens and [e[0] for e in g.logprobs] == p.tokens
        np.testing.assert_allclose([e[1] for e in g.logprobs], [e[1] for e in p.logprobs], atol=1e-4)
        assert [[i for i, _ in e[2]] for e in g.logprobs] == [[i for i, _ in e[2]] for e in p.logprobs]


@pytest.mark.full
def test_dspark_engine_with_the_prefix_cache(no_engram):
    """The prefix cache with DSpark drafting: requests sharing a cached 128-token prefix restore the target's and the
    drafter windows' snapshot and get the plain engine's greedy tokens; the windows hold the target's taps of each
    position and nothing after it, so a prompt that differs right after the prefix hits too (lookahead 0).

    Full tier: tests/speculative/test_spec_engine.py::test_prefix_cache_with_speculation covers the prefix cache with
    a drafter in the default run: DraftingSlotPool.snapshot / restore (the target's snapshot with the drafter's,
    Drafter.snapshot / restore slot programs) through snapshot_prefills, a hit and a miss with the drafter's
    snapshot_lookahead in the key, the plain engine's tokens."""
    rng = np.random.default_rng(7)
    ids = rng.integers(3, no_engram.config.vocab_size, 200).tolist()
    other = (ids[128] + 1) % no_engram.config.vocab_size
    prompts = [ids, ids[:170], ids[:128] + [other] + ids[129:170]]
    kw = dict(max_num_seqs=2, max_len=512, prefill_chunk=128, ignore_eos=True)
    sp = SamplingParams(max_new_tokens=8)
    engines = [Engine(no_engram, **kw), make_engine(no_engram, {"method": "dspark", "num_speculative_tokens": 2},
                                                    prefix_cache_bytes=64 << 20, **kw)]
    outs = [[], []]
    for p in prompts:
        for eng, out in zip(engines, outs):
            rid = eng.add_request(p, sp)
            out.append(eng.run()[rid].tokens)
            eng.release(rid)
    stats = engines[1].prefix_cache_stats
    assert outs[1] == outs[0] and stats.hits == 2 and stats.misses == 1, stats
