"""Training with jdeep's forward: finite gradients through model_step, a few optax steps lower the next-token loss
on a tiny config, and the leaves the gradient does not train (hash tables, routing biases) stay as they were."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jdeep
from jdeep.presets import TINY_CONFIG
from jdeep.tools.random_weights import random_checkpoint
from jdeep.tools.train import lm_loss, make_train_step, merge, split_trainable

optax = pytest.importorskip("optax", reason="training needs the optional 'train' extra (optax)")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    cfg = dict(TINY_CONFIG, num_hidden_layers=3, num_hash_layers=1,
               layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"])
    random_checkpoint(cfg, str(folder), seed=8)
    return jdeep.load(folder)


def test_a_few_steps_lower_the_loss(model):
    rng = np.random.default_rng(0)
    period = rng.integers(1, 512, 7)
    # rows of a repeating 7-token pattern from random offsets, longer than the window (16) and past compression
    tokens = np.stack([np.roll(np.tile(period, 10), -k)[:48] for k in rng.integers(0, 7, 4)]).astype(np.int32)
    mask = np.ones((4, 47), bool)
    train, fixed = split_trainable(model.params)
    optimizer = optax.adam(3e-3)
    opt_state = optimizer.init(train)
    step = make_train_step(model.config, model.plan, optimizer)
    first = float(lm_loss(model.params, tokens, mask, config=model.config, plan=model.plan))
    losses = []
    for _ in range(12):
        train, opt_state, loss = step(train, fixed, opt_state, tokens, mask)
        losses.append(float(loss))
    assert np.isfinite(losses).all() and losses[0] == pytest.approx(first, rel=1e-5)
    assert losses[-1] < 0.6 * first, losses
    params = merge(train, fixed)
    for a, b in zip(jax.tree_util.tree_leaves(fixed), jax.tree_util.tree_leaves(split_trainable(params)[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(np.issubdtype(np.asarray(x).dtype, np.integer) for x in jax.tree_util.tree_leaves(fixed))
