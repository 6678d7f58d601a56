"""Speculative decoding with the MTP drafter on the trained demo model (DeepSeek's quantized format): greedy tokens
equal plain greedy decoding token for token (k = 1, 2, 3, a batch of mixed prompt lengths, float activations and
DeepSeek's numerics) and the state at the end equals plain decoding's; sampled tokens have the target distribution;
the state undo log leaves exactly the state plain decoding has."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdeep
from conftest import assert_each_program_compiled_once_since, compiled_variants, golden_path
from jdeep import SamplingParams
from jdeep.model.scan import model_step
from jdeep.runtime.sampling import batch_params
from jdeep.speculative import undo
from jdeep.speculative.acceptance import accept
from jdeep.runtime.steps import run_step
from jdeep.speculative import generate as spec_generate

DEMO = pathlib.Path(jdeep.__file__).parent / "demo_model"


@pytest.fixture(scope="module")
def models():
    return {q: jdeep.load(DEMO, mtp=True, quantize_activations=q) for q in (False, True)}


def _prompts(model, lengths=(7, 30, 3, 18)):
    text = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 3
    ids = model.tokenizer.encode(text)
    return [np.asarray(ids[i:i + n], np.int32) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("quantized,ks", [(False, (1, 3)), pytest.param(True, (2,), marks=pytest.mark.full)],
                         ids=["float", "deepseek"])
def test_greedy_speculation_equals_plain_greedy(models, quantized, ks):
    """k = 1 and 3 here (one iteration per program call), k = 2 below through jdeep.generate (blocks of iterations on
    the device, stop ids and EOS, texts). DeepSeek's numerics: the [deepseek] case (k = 2) is in the full tier, as is
    the check of speculation on DeepSeek's own outputs with the v4-tiny-q golden below.

    Full tier ([deepseek]): tests/speculative/test_mtp_decode.py::test_greedy_speculation_equals_plain_greedy[float]
    covers the same code path (spec_generate.run, mtp_decode.ScanPrograms.iterations: draft, verify, accept, undo
    restore) in the default run, on float activations."""
    model = models[quantized]
    prompts = _prompts(model)
    max_new = [24, 17, 24, 9]
    plain = jdeep.generate(model, [p.tolist() for p in prompts], max_new_tokens=24, ignore_eos=True)
    want = [plain.tokens[b, :max_new[b]].tolist() for b in range(len(prompts))]
    for k in ks:
        got, stats, (state, _, _), _ = spec_generate.run(model, prompts,
                                                      [SamplingParams(max_new_tokens=m) for m in max_new],
                                                      [()] * len(prompts), "mtp", k=k, block_iterations=1)
        assert [got[b, :max_new[b]].tolist() for b in range(len(prompts))] == want, k
        assert (got[1, max_new[1]:] == -1).all() and (got[3, max_new[3]:] == -1).all()
        assert stats["drafted"] > 0 and 0 <= stats["accepted"] <= stats["drafted"]
        # the iterations saved over plain decoding are the accepted drafts
        assert stats["accepted"] > 0, stats
        if k == ks[-1] and not quantized:      # (fp8 KV codes may round differently in a 4-token chunk)
            _assert_state_is_plain(model, state, prompts, got, max_new, k)
    if quantized:
        return
    # the notebook entry point: the same tokens (and texts), with EOS handling and per-request lengths
    sp = [SamplingParams(max_new_tokens=m) for m in max_new]
    plain = jdeep.generate(model, [p.tolist() for p in prompts], sampling=sp)
    before = compiled_variants()
    spec = jdeep.generate(model, [p.tolist() for p in prompts], sampling=sp,
                          speculative={"method": "mtp", "num_speculative_tokens": 2})
    assert_each_program_compiled_once_since(before)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    assert spec.texts == plain.texts and spec.lengths.tolist() == plain.lengths.tolist()


@pytest.mark.full
def test_greedy_speculation_matches_deepseek_on_the_golden():
    """v4-tiny-q (DeepSeek's own outputs, random weights incl. its MTP block), float numerics, k = 2: speculative greedy
    decoding gives the reference's greedy tokens (a divergence is allowed only at a reference near-tie, where the
    reference's second choice is taken, as the plain-decoding golden test allows).

    Full tier: tests/speculative/test_mtp_decode.py::test_greedy_speculation_equals_plain_greedy[float] covers
    spec_generate.run with method "mtp" (mtp_decode.ScanPrograms.iterations(1): draft, verify, accept, undo restore)
    in the default run, on the same code path with the demo model (greedy speculation equals plain greedy, which the
    plain-decoding golden tests compare with the references)."""
    folder = golden_path("v4-tiny-q")
    model, ref = jdeep.load(folder, mtp=True, quantize_activations=False), np.load(folder / "reference_noquant.npz")
    n = len([f for f in ref.files if f.startswith("prompt_")])
    prompts = [ref[f"prompt_{i}"].astype(np.int32) for i in range(n)]
    got, stats, _, _ = spec_generate.run(model, prompts, [SamplingParams(max_new_tokens=16)] * n, [()] * n, "mtp",
                                         k=2, block_iterations=1)
    assert stats["iterations"] > 0
    for i in range(n):
        want = ref[f"greedy_{i}"]
        diverged = np.nonzero(got[i] != want)[0]
        if len(diverged):
            j = diverged[0]
            assert ref[f"margin_{i}"][j] < 0.05 and got[i, j] == np.argsort(ref[f"logits_{i}"][j])[-2], (i, j)


def test_speculative_requests_that_cannot_run_fail_clearly(models):
    model, prompt = models[False], [[0, 5, 9]]
    for spec, what in [({"method": "dspark"}, "DeepSeek-V4 checkpoints draft with method 'mtp'"),
                       ({"method": "eagle"}, "method must be one of"),
                       ({"method": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "mtp", "k": 2}, "unknown speculative field"), ("mtp", "must be a dict")]:
        with pytest.raises(ValueError, match=what):
            jdeep.generate(model, prompt, speculative=spec)
    with pytest.raises(ValueError, match="drafter=True"):
        jdeep.generate(jdeep.load(DEMO), prompt, speculative={"method": "mtp"})


def test_speculative_generate_returns_logits(models):
    """return_logits with speculation: the target's logits at each emitted token (row 0 the last prompt position's),
    as plain decoding returns them, NaN after a request ends."""
    model, prompts = models[False], [[0, 5, 9], [7, 8, 9, 10, 11]]
    sp = [SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=4)]
    plain = jdeep.generate(model, prompts, sampling=sp, return_logits=True, ignore_eos=True)
    spec = jdeep.generate(model, prompts, sampling=sp, return_logits=True, ignore_eos=True,
                          speculative={"method": "mtp", "num_speculative_tokens": 2})
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    assert np.isnan(spec.logits[1, 4:]).all() and not np.isnan(spec.logits[0]).any()
    np.testing.assert_allclose(spec.logits, plain.logits, atol=1e-4)


@pytest.mark.full
def test_undo_log_leaves_the_plain_state(models):
    """A verify step over 4 positions of which 2 are accepted, then restored, equals a plain step over those 2.

    Full tier: tests/speculative/test_mtp_decode.py::test_greedy_speculation_equals_plain_greedy[float] covers
    undo.entry_index / undo.save / undo.restore (mtp_iteration.draft saves, mtp_iteration.finish restores the rejected
    positions of 4-position verify chunks, k = 3, across the ratio-4 compression groups of four prompts) in the
    default run, and its _assert_state_is_plain checks the state afterwards equals plain decoding's."""
    model = models[False]
    cfg, plan, num = model.config, model.plan, model.numerics
    step = jax.jit(lambda p, s, t, q: model_step(p, s, t, q, config=cfg, plan=plan, numerics=num)[1])
    prompt = _prompts(model, (40,))[0]
    rng = np.random.default_rng(0)
    for start in (40, 41, 43, 127):        # crossing compression-group boundaries (ratio 4) at different offsets
        base = model.init_state(1, 256)
        ids = np.concatenate([prompt, rng.integers(3, cfg.vocab_size, size=136 - len(prompt))]).astype(np.int32)
        base = step(model.params, base, ids[None, :128], np.where(np.arange(128) < start, np.arange(128), -1
                                                                  ).astype(np.int32)[None])
        keep = jax.tree_util.tree_map(jnp.copy, base)
        pos = np.arange(start, start + 4, dtype=np.int32)[None]
        index = undo.entry_index(base, plan, jnp.asarray(pos))
        saved = undo.save(base, index)
        spec = step(model.params, base, ids[None, start:start + 4], pos)
        spec = undo.restore(spec, saved, index, jnp.asarray(np.arange(4)[None] >= 2))
        plain_pos = np.where(np.arange(4) < 2, pos, -1).astype(np.int32)
        plain = step(model.params, keep, ids[None, start:start + 4], plain_pos)
        for a, b in zip(jax.tree_util.tree_leaves(plain), jax.tree_util.tree_leaves(spec)):
            np.testing.assert_array_equal(np.asarray(a)[:, :, :-1], np.asarray(b)[:, :, :-1])   # scratch rows aside


def _assert_state_is_plain(model, state, prompts, tokens, max_new, k):
    """The backbone state after speculative decoding equals the state of plain one-token decoding of the same tokens
    (each prompt, then every emitted token but the last): rejected drafts left no trace."""
    B, rows = len(prompts), jax.tree_util.tree_leaves(state)[0].shape[1]
    plain = model.init_state(rows, spec_generate.state_len([len(p) for p in prompts], max_new, k))
    seqs = [np.concatenate([p, tokens[b, :max_new[b] - 1]]) for b, p in enumerate(prompts)]
    longest = max(len(p) for p in prompts)
    toks = np.zeros((rows, longest), np.int32)
    pos = np.full((rows, longest), -1, np.int32)
    for b, p in enumerate(prompts):
        toks[b, :len(p)], pos[b, :len(p)] = p, np.arange(len(p))
    _, plain = run_step(model, plain, toks, pos)
    for t in range(min(len(p) for p in prompts), max(len(s) for s in seqs)):
        toks = np.zeros((rows, 1), np.int32)
        pos = np.full((rows, 1), -1, np.int32)
        for b, s in enumerate(seqs):
            if len(prompts[b]) <= t < len(s):
                toks[b, 0], pos[b, 0] = s[t], t
        _, plain = run_step(model, plain, toks, pos)
    for a, b in zip(jax.tree_util.tree_leaves(plain), jax.tree_util.tree_leaves(state)):
        a, b = np.asarray(a, np.float32)[:, :B, :-1], np.asarray(b, np.float32)[:, :B, :-1]   # scratch rows aside
        assert ((a == 0) == (b == 0)).all()                   # the same entries written
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)



def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    x2 = float(np.sum((counts[keep] - expected) ** 2 / expected))
    return float(jax.scipy.special.gammaincc((keep.sum() - 1) / 2, x2 / 2))     # chi-square survival function


def test_acceptance_rule_keeps_the_target_distribution():
    """The rule on random target / draft distributions over 5 tokens, 2 drafts, 40000 trials: the first emitted token
    follows the target p0, and, where the first draft was accepted, the second follows the target given the first
    (p1 depends on the token before it, as a model's would)."""
    rng = np.random.default_rng(0)
    V, k, N = 5, 2, 40000
    p0 = rng.dirichlet(np.ones(V))
    p1 = rng.dirichlet(np.ones(V), size=V)            # p1[t]: the target after token t
    q0 = rng.dirichlet(np.ones(V))
    q1 = rng.dirichlet(np.ones(V), size=V)
    d1 = np.array([rng.choice(V, p=q0) for _ in range(N)])
    d2 = np.array([rng.choice(V, p=q1[t]) for t in d1])
    q = np.stack([np.broadcast_to(q0, (N, V)), q1[d1]], axis=1)
    p = np.stack([np.broadcast_to(p0, (N, V)), p1[d1], np.full((N, V), 1 / V)], axis=1)
    sb = batch_params([SamplingParams(temperature=1.0, seed=i) for i in range(N)])
    tokens, a = jax.jit(accept, static_argnums=5)(jnp.asarray(np.stack([d1, d2], 1), jnp.int32),
                                                  jnp.asarray(q, jnp.float32), jnp.asarray(p, jnp.float32), sb,
                                                  jnp.zeros(N, jnp.int32), 7)
    tokens, a = np.asarray(tokens), np.asarray(a)
    assert 0 < (a == 0).sum() < N and (a == 2).sum() > 0
    assert _chi2_pvalue(np.bincount(tokens[:, 0], minlength=V), p0) > 1e-3
    for t in range(V):
        rows = (a >= 1) & (tokens[:, 0] == t)
        if rows.sum() > 200:
            assert _chi2_pvalue(np.bincount(tokens[rows, 1], minlength=V), p1[t]) > 1e-3, t
    # greedy rows (one-hot distributions) accept exactly the drafts equal to the target's argmax
    g = jax.nn.one_hot(jnp.asarray([[2, 4, 1]]), V)
    for drafts, want_a, want in [([2, 4], 2, [2, 4, 1]), ([2, 3], 1, [2, 4]), ([0, 4], 0, [2])]:
        tok, acc = accept(jnp.asarray([drafts], jnp.int32), jax.nn.one_hot(jnp.asarray([drafts]), V), g,
                          batch_params([SamplingParams()]), jnp.zeros(1, jnp.int32), 7)
        assert int(acc[0]) == want_a and np.asarray(tok)[0, :want_a + 1].tolist() == want


@pytest.mark.full
def test_sampled_speculation_has_the_target_distribution(models):
    """Sampled decoding with k = 2 MTP drafts: the first two tokens of 512 seeded requests (top-k 3, temperature 1)
    follow the model's own distribution, computed exactly from its logits.

    Full tier: tests/speculative/test_mtp_decode.py::test_acceptance_rule_keeps_the_target_distribution covers the
    distribution property of acceptance.accept (sampled rows) in the default run, and
    tests/speculative/test_spec_engine.py::test_speculative_engine_gives_the_plain_engines_tokens runs the sampled
    MTP iteration (mtp_iteration.draft / finish with greedy=False) with a sampled request."""
    model = models[False]
    prompt = _prompts(model, (12,))[0]
    sp = lambda seed: SamplingParams(temperature=1.0, top_k=3, seed=seed, max_new_tokens=2)

    def top3(logits):
        top = np.argsort(-logits)[:3]
        w = np.exp(logits[top] - logits[top].max())
        return dict(zip(top.tolist(), (w / w.sum()).tolist()))

    first = top3(jdeep.forward(model, prompt.tolist())[-1])
    joint = {(t1, t2): p1 * p2 for t1, p1 in first.items()
             for t2, p2 in top3(jdeep.forward(model, prompt.tolist() + [t1])[-1]).items()}
    N = 512
    out = jdeep.generate(model, [prompt.tolist()] * N, sampling=[sp(1000 + i) for i in range(N)], ignore_eos=True,
                         speculative={"method": "mtp", "num_speculative_tokens": 2})
    cells = list(joint)
    seen = [tuple(row[:2]) for row in out.tokens.tolist()]
    assert all(c in joint for c in seen), "a token outside the top 3 was emitted"
    counts = np.array([seen.count(c) for c in cells])
    assert _chi2_pvalue(counts, np.array([joint[c] for c in cells])) > 1e-3


def test_regions_mode_speculation_equals_the_scan_mode(models):
    """The regions compile mode (the draft and finish programs around the regions step, as on Neuron): k = 2, the
    same tokens, acceptance and state at the end as the scan mode (whose program jdeep.generate's k = 2 run above
    compiled: the same batch and blocks of 8). Greedy: the sampled path is the same draft / finish functions."""
    scan = models[False]
    regions = jdeep.load(DEMO, mtp=True, quantize_activations=False, compile_mode="regions")
    prompts = _prompts(scan)
    sp = [SamplingParams(max_new_tokens=m) for m in (12, 9, 12, 5)]
    runs = [spec_generate.run(m, prompts, sp, [()] * len(prompts), "mtp", k=2) for m in (scan, regions)]
    (tok_s, stats_s, (state_s, _, _), _), (tok_r, stats_r, (state_r, _, _), _) = runs
    np.testing.assert_array_equal(tok_r, tok_s)
    assert stats_r == stats_s and stats_s["accepted"] > 0
    for a, b in zip(jax.tree_util.tree_leaves(state_s), jax.tree_util.tree_leaves(state_r)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-5)
