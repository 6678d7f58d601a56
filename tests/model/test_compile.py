"""The compiled decode program does not grow with depth, and repeated calls do not recompile."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdeep
from jdeep.config import ModelConfig
from jdeep.model import model_step
from jdeep.model.cache import PROGRAMS
from jdeep.param_spec import abstract_params
from jdeep.plan import build_plan
from jdeep.config.small_models import TINY_CONFIG, deep_tiny_config
from jdeep.state import init_state
from jdeep.tools.testing.random_weights import random_checkpoint


def _config(n_repeats: int) -> ModelConfig:
    return ModelConfig.from_dict(deep_tiny_config(n_repeats))


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
    jdeep.generate(tiny_model, [[0, 5, 9], [0, 7]], max_new_tokens=4, ignore_eos=True)
    before = PROGRAMS.n_compiled()
    step_before = tiny_model.step_fn(all_logits=False)._cache_size()
    out = jdeep.generate(tiny_model, [[0, 1, 2, 3], [0, 8]], max_new_tokens=4, ignore_eos=True)
    assert PROGRAMS.n_compiled() == before
    assert tiny_model.step_fn(all_logits=False)._cache_size() == step_before
    assert out.tokens.shape == (2, 4)


# ------------------------------------------------------------------------------------------ V4.1
def _v41_config(pairs: int) -> ModelConfig:
    """tiny_v41_config's first 5 layers (sliding, Engram, ratio-2 source, reuse, own index + Engram), then
    `pairs` x (reuse, own index) at ratio 2, a ratio-1 candidate source, `pairs` x (reuse, restricted index)."""
    from jdeep.config.small_models import tiny_v41_config

    raw = tiny_v41_config()
    r1 = 5 + 2 * pairs
    n = r1 + 1 + 2 * pairs
    raw["text_config"].update(
        num_hidden_layers=n, compress_ratios=[0, 0] + [2] * (r1 - 2) + [1] * (n - r1), kv_source_layer_ids=[2, r1],
        index_source_layer_ids=[2, 4] + list(range(6, r1, 2)) + [r1] + list(range(r1 + 2, n, 2)),
        candidate_source_layer_id=r1)
    return ModelConfig.from_dict(raw)


def _lower_v41_decode(config: ModelConfig, batch: int = 2, max_len: int = 256):
    plan = build_plan(config)
    params = abstract_params(config, plan, jnp.float32)
    state = jax.eval_shape(lambda: init_state(config, plan, batch, max_len, jnp.float32))
    tok = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    e = config.engram
    rows = (len(e.layer_ids), batch, 1, e.rows_per_token)
    engram = (jax.ShapeDtypeStruct(rows + (e.head_dim,), jnp.uint8),
              jax.ShapeDtypeStruct(rows + (e.head_dim // 32,), jnp.uint8))
    from jdeep.numerics import Numerics

    fn = jax.jit(functools.partial(model_step, config=config, plan=plan, numerics=Numerics.for_config(config)),
                 donate_argnums=(1,))
    return fn.lower(params, state, tok, tok, engram), state


def test_v41_decode_program_size_independent_of_depth():
    small, big = _v41_config(2), _v41_config(12)
    assert big.n_layers >= 3 * small.n_layers
    assert [len(s.pattern) for s in build_plan(small).segments] == [len(s.pattern) for s in build_plan(big).segments]
    (lo_small, _), (lo_big, _) = _lower_v41_decode(small), _lower_v41_decode(big)
    ops_small, ops_big = _count_stablehlo_ops(lo_small.as_text()), _count_stablehlo_ops(lo_big.as_text())
    assert ops_big <= 1.05 * ops_small, (ops_small, ops_big)


def test_v41_decode_program_is_neuron_shaped():
    """Donated state (only owned caches), no sort / conditional / bitcast / fp8 types / int64 tensors."""
    lowered, state = _lower_v41_decode(_v41_config(2))
    text = lowered.as_text()
    main = text[text.index("func.func public @main"):].split("\n", 1)[0]
    assert main.count("tf.aliasing_output") == len(jax.tree_util.tree_leaves(state))
    for banned in ("stablehlo.sort", "stablehlo.case", "stablehlo.if", "bitcast_convert", "f8E", "xi64>"):
        assert banned not in text, banned
