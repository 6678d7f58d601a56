"""End-to-end parity with ../shared/golden/v4-tiny-hf (transformers 5.23 DeepseekV4ForCausalLM, fp32),
loaded through the real loader. Criteria of the core issue: greedy tokens equal, every step's logits
and the no-cache forward within 1e-3; ragged batch == one by one; chunked prefill == one shot. The default run
keeps the comparisons against the reference (no-cache forward, greedy tokens and step logits); the batch and
chunking variants are in the full tier (`pytest -m full`), their docstrings name the default-run tests of their
paths."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import golden_path

import jdeep

TOL = 1e-3


@pytest.fixture(scope="module")
def golden():
    path = golden_path("v4-tiny-hf")
    ref = np.load(path / "reference.npz")
    n = len([k for k in ref.files if k.startswith("prompt_")])
    return jdeep.load(path, dtype="float32"), ref, n


def test_forward_matches_full_logits(golden):
    model, ref, n = golden
    for i in range(n):
        logits = jdeep.forward(model, ref[f"prompt_{i}"])
        assert logits.shape == ref[f"full_logits_{i}"].shape and logits.dtype == np.float32
        np.testing.assert_allclose(logits, ref[f"full_logits_{i}"], atol=TOL, rtol=0, err_msg=f"prompt {i}")


@pytest.fixture(scope="module")
def solo_runs(golden):
    model, ref, n = golden
    return [jdeep.generate(model, [ref[f"prompt_{i}"]], max_new_tokens=16, temperature=0.0, return_logits=True)
            for i in range(n)]


def test_greedy_and_step_logits_one_by_one(golden, solo_runs):
    model, ref, n = golden
    for i, out in enumerate(solo_runs):
        assert out.tokens.shape == (1, 16) and out.tokens.dtype == np.int32
        assert out.logits.shape == (1, 16, model.config.vocab_size) and out.logits.dtype == np.float32
        np.testing.assert_array_equal(out.tokens[0], ref[f"greedy_{i}"], err_msg=f"prompt {i}")
        np.testing.assert_allclose(out.logits[0], ref[f"logits_{i}"], atol=TOL, rtol=0, err_msg=f"prompt {i}")


@pytest.mark.full
def test_ragged_batch_equals_one_by_one(golden, solo_runs):
    """The three prompts as one ragged batch give the one-by-one runs' tokens and logits (and the reference's tokens).

    Full tier: tests/runtime/test_generate.py::test_per_request_lengths_and_alone_equals_batch covers jdeep.generate's
    ragged batch equal to each request alone, tests/model/test_model.py::test_decode_and_chunked_prefill_equal_forward
    a V4 ragged batch's cached logits equal to a no-cache forward, and
    tests/test_golden_v4_hf.py::test_greedy_and_step_logits_one_by_one v4-tiny-hf's generate against the reference,
    in the default run."""
    model, ref, n = golden
    out = jdeep.generate(model, [ref[f"prompt_{i}"] for i in range(n)], max_new_tokens=16, return_logits=True)
    for i in range(n):
        np.testing.assert_array_equal(out.tokens[i], solo_runs[i].tokens[0])
        np.testing.assert_allclose(out.logits[i], solo_runs[i].logits[0], atol=1e-5, rtol=0)
        np.testing.assert_array_equal(out.tokens[i], ref[f"greedy_{i}"])


@pytest.mark.full
def test_chunked_prefill_equals_one_shot(golden, solo_runs):
    """Prefill in three chunks gives the one-shot prefill's tokens and logits.

    Full tier: tests/model/test_model.py::test_decode_and_chunked_prefill_equal_forward covers chunked prefill (chunks
    of 8) and decode of a V4 model with compressed layers equal to a no-cache forward, and
    tests/test_golden_v4_hf.py::test_greedy_and_step_logits_one_by_one v4-tiny-hf's prefill and decode against the
    reference, in the default run."""
    model, ref, n = golden
    for i in range(n):
        prompt = ref[f"prompt_{i}"]
        chunk = -(-len(prompt) // 3)          # three chunks: chunk, chunk, rest
        out = jdeep.generate(model, [prompt], max_new_tokens=16, return_logits=True, prefill_chunk=chunk)
        np.testing.assert_array_equal(out.tokens[0], solo_runs[i].tokens[0], err_msg=f"prompt {i}")
        np.testing.assert_allclose(out.logits[0], solo_runs[i].logits[0], atol=1e-5, rtol=0, err_msg=f"prompt {i}")
