"""jdeep.generate with per-request sampling: stop tokens and EOS end a request (kept, then -1), per-request
max_new_tokens, streaming between device blocks, the same output alone or in a batch, reproducible seeds."""

from __future__ import annotations

import numpy as np
import pytest

import jdeep
from jdeep import SamplingParams
from jdeep.config.small_models import one_layer_config
from jdeep.tools.testing.random_weights import random_checkpoint

PROMPTS = [[0, 5, 9], [0, 7, 7, 7, 100, 3], [0, 42]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    random_checkpoint(one_layer_config(), str(folder), seed=21)   # sampling and streaming logic: cheap compiles
    return jdeep.load(folder)


def test_stop_token_ends_request_and_is_kept(model):
    free = jdeep.generate(model, PROMPTS, max_new_tokens=12, ignore_eos=True)
    stop_at = int(free.tokens[1, 4])
    first = int(np.nonzero(free.tokens[1] == stop_at)[0][0])
    out = jdeep.generate(model, PROMPTS, sampling=[SamplingParams(max_new_tokens=12, stop_token_ids=(stop_at,))
                                                  for _ in PROMPTS], ignore_eos=True)
    np.testing.assert_array_equal(out.tokens[1, :first + 1], free.tokens[1, :first + 1])
    assert (out.tokens[1, first + 1:] == -1).all() and out.lengths[1] == first + 1
    for b in (0, 2):   # the others run on unless they meet the same token
        k = np.nonzero(free.tokens[b] == stop_at)[0]
        n = k[0] + 1 if len(k) else 12
        np.testing.assert_array_equal(out.tokens[b, :n], free.tokens[b, :n])


def test_per_request_lengths_and_alone_equals_batch(model):
    ps = [SamplingParams(max_new_tokens=3), SamplingParams(temperature=0.9, top_p=0.9, seed=4, max_new_tokens=10),
          SamplingParams(temperature=1.2, top_k=20, min_p=0.05, seed=5, max_new_tokens=7)]
    batch = jdeep.generate(model, PROMPTS, sampling=ps, ignore_eos=True, return_logits=True)
    assert batch.tokens.shape == (3, 10) and list(batch.lengths) == [3, 10, 7]
    assert (batch.tokens[0, 3:] == -1).all() and np.isnan(batch.logits[0, 3:]).all()
    for b, (prompt, p) in enumerate(zip(PROMPTS, ps)):       # blocks of 2 steps: one decode program for all three
        alone = jdeep.generate(model, [prompt], sampling=p, ignore_eos=True, stream_every=2)
        np.testing.assert_array_equal(alone.tokens[0, :p.max_new_tokens], batch.tokens[b, :p.max_new_tokens])
    again = jdeep.generate(model, PROMPTS, sampling=ps, ignore_eos=True, return_logits=True)
    np.testing.assert_array_equal(again.tokens, batch.tokens)


def test_streaming_delivers_every_token_in_order(model):
    got = [[] for _ in PROMPTS]

    def on_tokens(new):
        for b, toks in enumerate(new):
            got[b].extend(toks)

    out = jdeep.generate(model, PROMPTS, max_new_tokens=11, ignore_eos=True, stream=on_tokens, stream_every=4)
    for b in range(len(PROMPTS)):
        assert got[b] == [int(t) for t in out.tokens[b] if t >= 0]


def test_bad_sampling_values_are_named(model):
    with pytest.raises(ValueError, match="top_p"):
        jdeep.generate(model, PROMPTS[:1], sampling=SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="stop_token_ids"):
        jdeep.generate(model, PROMPTS[:1], sampling=SamplingParams(stop_token_ids=(10**6,)))
    with pytest.raises(ValueError, match="one per prompt"):
        jdeep.generate(model, PROMPTS, sampling=[SamplingParams()])
    with pytest.raises(ValueError, match="tokenizer"):
        jdeep.generate(model, PROMPTS[:1], sampling=SamplingParams(stop=("\n",)))


def test_logits_of_requests_that_all_end_early_are_padded_with_nan(model):
    """Every request stops at its first token: tokens and logits still span max_new_tokens, -1 / NaN after it."""
    free = jdeep.generate(model, PROMPTS, max_new_tokens=1, ignore_eos=True)
    ps = [SamplingParams(max_new_tokens=40, stop_token_ids=(int(t),)) for t in free.tokens[:, 0]]
    out = jdeep.generate(model, PROMPTS, sampling=ps, ignore_eos=True, return_logits=True, stream_every=4)
    V = model.config.vocab_size
    assert out.tokens.shape == (3, 40) and out.logits.shape == (3, 40, V)
    np.testing.assert_array_equal(out.tokens[:, 0], free.tokens[:, 0])
    assert (out.tokens[:, 1:] == -1).all() and np.isnan(out.logits[:, 1:]).all() and np.isfinite(out.logits[:, 0]).all()


def test_the_decode_block_compiled_beside_the_prefill_is_the_one_that_runs(model):
    """jdeep.generate compiles the decode block on a thread of its own while the prefill compiles
    (generate._compile_block_early); the abstract arguments it compiles for must be the call's, else the call would
    compile the block a second time through jax.jit."""
    from jdeep.runtime.steps import _device_block_program

    n = 9                                         # blocks of min(stream_every 16, 8 tokens after the first) = 8
    params = [SamplingParams(max_new_tokens=n, temperature=0.8, presence_penalty=0.3, seed=2)]
    out = jdeep.generate(model, [[0, 5, 9, 17]], sampling=params)
    block = _device_block_program(model, 8, False, False)
    assert block.executables and block.jitted._cache_size() == 0      # run from the installed executable
    assert out.lengths[0] == n
