"""Greedy speculative decoding with the MTP drafter: the tokens equal plain greedy decoding token for token, for
k = 1, 2, 3 and a batch of mixed prompt lengths, on the trained demo model (DeepSeek's quantized format) in float
activations and in DeepSeek's numerics; the state undo log leaves exactly the state plain decoding has."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdeep
from jdeep import SamplingParams
from jdeep.model.scan import model_step
from jdeep.speculative import undo
from jdeep.speculative.mtp_decode import mtp_greedy_generate

DEMO = pathlib.Path(jdeep.__file__).parent / "demo_model"


@pytest.fixture(scope="module")
def models():
    return {q: jdeep.load(DEMO, mtp=True, quantize_activations=q) for q in (False, True)}


def _prompts(model, lengths=(7, 30, 3, 18)):
    text = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 3
    ids = model.tokenizer.encode(text)
    return [np.asarray(ids[i:i + n], np.int32) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("quantized,ks", [(False, (1, 2, 3)), (True, (2,))], ids=["float", "deepseek"])
def test_greedy_speculation_equals_plain_greedy(models, quantized, ks):
    model = models[quantized]
    prompts = _prompts(model)
    max_new = [24, 17, 24, 9]
    plain = jdeep.generate(model, [p.tolist() for p in prompts], max_new_tokens=24, ignore_eos=True)
    want = [plain.tokens[b, :max_new[b]].tolist() for b in range(len(prompts))]
    for k in ks:
        got, stats = mtp_greedy_generate(model, prompts, max_new, [()] * len(prompts), k=k)
        assert [got[b, :max_new[b]].tolist() for b in range(len(prompts))] == want, k
        assert (got[1, max_new[1]:] == -1).all() and (got[3, max_new[3]:] == -1).all()
        assert stats["drafted"] > 0 and 0 <= stats["accepted"] <= stats["drafted"]
        # the iterations saved over plain decoding are the accepted drafts
        assert stats["accepted"] > 0, stats
    # the notebook entry point: the same tokens (and texts), with EOS handling and per-request lengths
    sp = [SamplingParams(max_new_tokens=m) for m in max_new]
    plain = jdeep.generate(model, [p.tolist() for p in prompts], sampling=sp)
    spec = jdeep.generate(model, [p.tolist() for p in prompts], sampling=sp,
                          speculative={"method": "mtp", "num_speculative_tokens": ks[-1]})
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    assert spec.texts == plain.texts and spec.lengths.tolist() == plain.lengths.tolist()


def test_speculative_requests_that_cannot_run_fail_clearly(models):
    model, prompt = models[False], [[0, 5, 9]]
    for spec, what in [({"method": "dspark"}, "not built yet"), ({"method": "eagle"}, "method must be one of"),
                       ({"method": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "mtp", "k": 2}, "unknown speculative field"), ("mtp", "must be a dict")]:
        with pytest.raises(ValueError, match=what):
            jdeep.generate(model, prompt, speculative=spec)
    with pytest.raises(ValueError, match="greedy only"):
        jdeep.generate(model, prompt, temperature=0.7, speculative={"method": "mtp"})
    with pytest.raises(ValueError, match="mtp=True"):
        jdeep.generate(jdeep.load(DEMO), prompt, speculative={"method": "mtp"})


def test_undo_log_leaves_the_plain_state(models):
    """A verify step over 4 positions of which 2 are accepted, then restored, equals a plain step over those 2."""
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
