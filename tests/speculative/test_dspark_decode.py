"""Speculative decoding with DeepSeek-V4.1's DSpark drafter on the v41-dspark-tiny golden (float numerics; Engram
layers 1 and 4, compress ratios 2 and 1, DSpark block 5): greedy tokens equal plain greedy decoding token for token
(a batch of the golden's three prompts, 8 / 40 / 150 tokens, with max_new_tokens and a stop id cutting rows short),
and the target state, the drafter's windows and the Engram histories at the end equal those of plain decoding
replayed one token at a time; jdeep.generate(speculative={"method": "dspark"}) with greedy and sampled requests in
one batch; clear errors.

k = 3 runs the verify as two target steps (the ratio-2 compressor ring holds 2 positions: dspark_decode.py), k = 1
as one. The random-weight drafter is accepted about once in 40 iterations (the golden's own drafts match the
target's next token 1 time in 33), so equality checks the verify/undo path far more than the acceptance path.
"""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest

import jdeep
from conftest import assert_each_program_compiled_once_since, compiled_variants, golden_path
from jdeep import SamplingParams
from jdeep.model.dspark import empty_dspark_state
from jdeep.runtime.steps import batch_bucket, length_bucket
from jdeep.speculative import dspark_drafter
from jdeep.speculative import generate as spec_generate
from jdeep.speculative.dspark_trace import _programs
from jdeep.speculative.generate import state_len

GOLDEN = "v41-dspark-tiny"
DEMO = pathlib.Path(jdeep.__file__).parent / "demo_model"
N_NEW = 16


@pytest.fixture(scope="module")
def folder():
    return golden_path(GOLDEN)


@pytest.fixture(scope="module")
def model(folder):
    return jdeep.load(folder, mtp=True, quantize_activations=False)


@pytest.fixture(scope="module")
def prompts(folder):
    ref = np.load(folder / "dspark_noquant.npz")
    return [ref[f"prompt_{i}"].astype(np.int32) for i in range(3)]


@pytest.fixture(scope="module")
def plain(model, prompts):
    return jdeep.generate(model, [p.tolist() for p in prompts], max_new_tokens=N_NEW, ignore_eos=True).tokens


def test_greedy_speculation_equals_plain_greedy_and_leaves_the_plain_state(model, prompts, plain, monkeypatch):
    """k = 3 with the DSpark drafter, then with an oracle drafter (plain greedy's own continuation, wrong from a draft
    that varies with the row and position), so that every accepted length 0..3, cut by the stop id and
    max_new_tokens, goes through the verify / restore / append path."""
    k = 3
    max_new = [N_NEW, 11, N_NEW]
    stop = int(plain[2, 6])                          # row 2 ends at the first occurrence of this id (kept)
    first = 1 + int(np.nonzero(plain[2, 1:] == stop)[0][0]) if plain[2, 0] != stop else 0
    want = [plain[0].tolist(), plain[1, :11].tolist(), plain[2, :first + 1].tolist()]
    args = (model, prompts, [SamplingParams(max_new_tokens=m) for m in max_new], [(), (), (stop,)])
    got, stats, final, _ = spec_generate.run(*args, "dspark", k=k)
    print("dspark drafter, k=3:", stats)
    assert [got[b][got[b] >= 0].tolist() for b in range(3)] == want
    assert all((got[b, len(want[b]):] == -1).all() for b in range(3))
    assert stats["iterations"] > 0 and 0 <= stats["accepted"] <= stats["drafted"] == 3 * stats["iterations"]
    _assert_plain_replay(model, final, prompts, [np.asarray(w, np.int32) for w in want], max_new, k)

    block, V = model.config.dspark.block_size, model.config.vocab_size
    seqs = [np.concatenate([p, plain[b], np.zeros(2 * block, np.int32)]) for b, p in enumerate(prompts)]

    def oracle(params, dstate, carry, sb):
        p = np.asarray(carry.p)
        drafts = np.zeros((len(p), block), np.int32)
        for b in range(len(prompts)):
            right = seqs[b][p[b] + 1:p[b] + 1 + block]
            wrong_from = (p[b] + 2 * b) % (k + 1)
            drafts[b] = np.where(np.arange(block) < wrong_from, right, (right + 1) % V)
        return jax.numpy.asarray(drafts), None

    monkeypatch.setattr(dspark_drafter, "draft_program", lambda model, greedy: oracle)
    got, stats, final, _ = spec_generate.run(*args, "dspark", k=k)
    print("oracle drafter, k=3:", stats)
    assert [got[b][got[b] >= 0].tolist() for b in range(3)] == want
    assert stats["acceptance_per_position"][k - 1] > 0.1 and stats["mean_accepted_length"] > 2
    _assert_plain_replay(model, final, prompts, [np.asarray(w, np.int32) for w in want], max_new, k)


def _assert_plain_replay(model, final, prompts, tokens, max_new, k):
    """Plain one-token decoding of each prompt and its emitted tokens but the last (the target with the DSpark taps,
    each position appended to the drafter's windows, the Engram rows from the histories) ends in the state, windows
    and histories the speculative run left: rejected drafts left no trace anywhere."""
    step, append, _ = _programs(model)
    B, rows = len(prompts), batch_bucket(len(prompts))
    max_len = state_len([len(p) for p in prompts], max_new, k)
    state = model.init_state(rows, max_len)
    dstate = jax.device_put(empty_dspark_state(model.config, model.plan, rows, max_len, model.dtype, model.numerics),
                            jax.devices()[0])
    history = model.new_history(rows)
    seqs = [np.concatenate([p, t[:-1]]) for p, t in zip(prompts, tokens)]
    S = length_bucket(max(len(p) for p in prompts))
    toks = np.zeros((rows, S), np.int32)
    pos = np.full((rows, S), -1, np.int32)
    for b, p in enumerate(prompts):
        toks[b, :len(p)], pos[b, :len(p)] = p, np.arange(len(p))
    chunks = [(toks, pos)]
    for j in range(max(len(s) - len(p) for s, p in zip(seqs, prompts))):      # then one token per row and step
        toks = np.zeros((rows, 1), np.int32)
        pos = np.full((rows, 1), -1, np.int32)
        for b, s in enumerate(seqs):
            t = len(prompts[b]) + j
            if t < len(s):
                toks[b, 0], pos[b, 0] = s[t], t
        chunks.append((toks, pos))
    for toks, pos in chunks:
        out = step(model.params, state, toks, pos, model.engram_inputs(history, toks, pos))
        state, taps = out.state, out.taps
        dstate = append(model.params, dstate, taps, pos)
    for want, got in [(state, final.state), (dstate, final.dstate)]:
        for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
            a, b = np.asarray(a, np.float32)[:, :B, :-1], np.asarray(b, np.float32)[:, :B, :-1]   # scratch rows aside
            assert ((a == 0) == (b == 0)).all()                 # the same entries written
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(final.history.classes[:B], history.classes[:B])
    np.testing.assert_array_equal(final.history.dead[:B], history.dead[:B])


def test_generate_with_dspark_greedy_and_sampled_requests(model, prompts, plain):
    """k = 1 through jdeep.generate, a sampled request in the batch (one program variant for all three rows: greedy
    rows' distributions are one-hot, so they still get plain greedy's tokens); streaming gets every token."""
    sp = [SamplingParams(max_new_tokens=N_NEW), SamplingParams(temperature=1.0, top_k=8, seed=3, max_new_tokens=N_NEW),
          SamplingParams(max_new_tokens=N_NEW)]
    streamed = [[], [], []]

    def stream(chunks):
        for b, c in enumerate(chunks):
            streamed[b] += c

    before = compiled_variants()
    out = jdeep.generate(model, [p.tolist() for p in prompts], sampling=sp, ignore_eos=True, stream=stream,
                         speculative={"method": "dspark", "num_speculative_tokens": 1})
    assert_each_program_compiled_once_since(before)
    np.testing.assert_array_equal(out.tokens[[0, 2]], plain[[0, 2]])
    assert out.lengths.tolist() == [N_NEW] * 3 and streamed == out.tokens.tolist()
    assert ((out.tokens[1] >= 0) & (out.tokens[1] < model.config.vocab_size)).all()


def test_dspark_requests_that_cannot_run_fail_clearly(model, folder):
    prompt = [[0, 5, 9]]
    with pytest.raises(ValueError, match=r"\[1, 5\].*dspark_block_size"):
        jdeep.generate(model, prompt, speculative={"method": "dspark", "num_speculative_tokens": 6})
    with pytest.raises(ValueError, match="'method': 'dspark'"):
        jdeep.generate(model, prompt, speculative={"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match=r"drafter=True"):
        jdeep.generate(jdeep.load(folder, quantize_activations=False), prompt, speculative={"method": "dspark"})
    with pytest.raises(ValueError, match="DeepSeek-V4 checkpoints draft with method 'mtp'"):
        jdeep.generate(jdeep.load(DEMO, mtp=True), prompt, speculative={"method": "dspark"})


@pytest.mark.full
def test_regions_mode_speculation_equals_the_scan_mode(model, folder, prompts):
    """The regions compile mode (Neuron's mode for deep models: the draft program, per target step an undo-log program
    and the regions step with the DSpark taps, the finish program; dspark_regions.py): the same tokens, acceptance,
    target state, drafter windows and Engram histories as the scan mode, greedy and sampled rows in one batch (k = 3:
    two target steps per verify, the golden's ratio-2 ring).

    Full tier: tests/speculative/test_dspark_engine.py::test_dspark_engine_in_the_regions_mode covers the same
    regions-mode path in the default run: DSparkDrafter.prefill's regions branch and DSparkDrafter._host_iteration
    with dspark_regions.RegionsPrograms (drafts, per target step the undo log and the regions step, the finish, the
    Engram rows gathered per slice), which DSparkDrafter.block (jdeep.generate) and DSparkDrafter.decode (the engine)
    both call, on the same golden at k = 3."""
    regions = jdeep.load(folder, mtp=True, quantize_activations=False, compile_mode="regions")
    sp = [SamplingParams(max_new_tokens=10), SamplingParams(temperature=1.0, top_k=8, seed=3, max_new_tokens=10),
          SamplingParams(max_new_tokens=10)]
    runs = [spec_generate.run(m, prompts, sp, [(), (), ()], "dspark", k=3) for m in (model, regions)]
    (scan_out, scan_stats, scan_final, _), (reg_out, reg_stats, reg_final, _) = runs
    np.testing.assert_array_equal(reg_out, scan_out)
    assert reg_stats == scan_stats
    for a, b in zip(jax.tree_util.tree_leaves((scan_final.state, scan_final.dstate)),
                    jax.tree_util.tree_leaves((reg_final.state, reg_final.dstate))):
        np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(reg_final.history.classes, scan_final.history.classes)
