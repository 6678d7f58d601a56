"""The compiled decode program does not grow with depth, and repeated calls do not recompile."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdeep
from jdeep.checkpoint import abstract_params
from jdeep.config import ModelConfig
from jdeep.model import model_step
from jdeep.plan import build_plan
from jdeep.random_weights import TINY_CONFIG, random_checkpoint
from jdeep.state import init_state


def _config(n_repeats: int) -> ModelConfig:
    """Sliding/hash, CSA/hash, then (HCA, CSA) repeated: same kinds, depth 2 + 2*n_repeats."""
    raw = dict(TINY_CONFIG)
    raw["layer_types"] = ["sliding_attention", "compressed_sparse_attention"] + \
        ["heavily_compressed_attention", "compressed_sparse_attention"] * n_repeats
    raw["num_hidden_layers"] = len(raw["layer_types"])
    return ModelConfig.from_dict(raw)


def _lower_decode(config: ModelConfig, batch: int = 2, max_len: int = 256):
    plan = build_plan(config)
    params = abstract_params(config, plan, jnp.float32)
    state = jax.eval_shape(lambda: init_state(config, plan, batch, max_len, jnp.float32))
    tok = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    fn = jax.jit(functools.partial(model_step, config=config, plan=plan), donate_argnums=(1,))
    return fn.lower(params, state, tok, tok)


def _count_stablehlo_ops(text: str) -> int:
    return len(re.findall(r"\b(?:stablehlo|chlo|func)\.[a-z_]+", text))


def _count_hlo_instructions(text: str) -> int:
    return sum(1 for line in text.splitlines() if re.match(r"\s*(ROOT\s+)?%?[\w.\-]+ = ", line))


def test_decode_program_size_independent_of_depth():
    small, big = _config(1), _config(7)
    assert big.n_layers == 4 * small.n_layers
    lo_small, lo_big = _lower_decode(small), _lower_decode(big)
    ops_small = _count_stablehlo_ops(lo_small.as_text())
    ops_big = _count_stablehlo_ops(lo_big.as_text())
    assert ops_big <= 1.15 * ops_small, (ops_small, ops_big)
    hlo_small = _count_hlo_instructions(lo_small.compile().as_text())
    hlo_big = _count_hlo_instructions(lo_big.compile().as_text())
    assert hlo_big <= 1.15 * hlo_small, (hlo_small, hlo_big)
    # The layers really are under a loop: the big program has a while loop over the 7 repetitions.
    assert "stablehlo.while" in lo_big.as_text()


def test_decode_state_is_donated():
    text = _lower_decode(_config(1)).as_text()
    main = text[text.index("func.func public @main"):].split("\n", 1)[0]
    n_state = len(jax.tree_util.tree_leaves(jax.eval_shape(
        lambda: init_state(_config(1), build_plan(_config(1)), 2, 256, jnp.float32))))
    assert main.count("tf.aliasing_output") == n_state


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    random_checkpoint(TINY_CONFIG, str(folder), seed=3)
    return jdeep.load(folder)


def test_repeated_decode_does_not_recompile(tiny_model):
    model = tiny_model
    step = model.step_fn(all_logits=False)
    state = init_state(model.config, model.plan, 2, 256, model.dtype)
    toks = jnp.asarray([[3], [4]], jnp.int32)
    logits, state = step(model.params, state, toks, jnp.asarray([[0], [0]], jnp.int32))
    compiled = step._cache_size()
    for t in range(1, 4):
        pos = jnp.asarray([[t], [t]], jnp.int32)
        logits, state = step(model.params, state, toks, pos)
    assert step._cache_size() == compiled
    assert np.isfinite(np.asarray(logits)).all()


def test_repeated_generate_does_not_recompile(tiny_model):
    from jdeep.generate import _decode_loop

    jdeep.generate(tiny_model, [[0, 5, 9], [0, 7]], max_new_tokens=4)
    before = _decode_loop._cache_size()
    step_before = tiny_model.step_fn(all_logits=False)._cache_size()
    out = jdeep.generate(tiny_model, [[0, 1, 2, 3], [0, 8]], max_new_tokens=4)
    assert _decode_loop._cache_size() == before
    assert tiny_model.step_fn(all_logits=False)._cache_size() == step_before
    assert out.tokens.shape == (2, 4)
