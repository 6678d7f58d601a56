"""Training with jdeep's forward: finite gradients through model_step, a few optax steps lower the next-token, MTP
and indexer objectives on a tiny config, the indexer learns from its own objective only (and nothing else does),
and the leaves the gradient does not train (hash tables, routing biases) stay as they were."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import jdeep
from jdeep.config.small_models import TINY_CONFIG
from jdeep.tools.testing.random_weights import random_checkpoint
from jdeep.tools.quality.train import lm_loss, make_train_step, merge, split_trainable, train_losses

optax = pytest.importorskip("optax", reason="training needs the optional 'train' extra (optax)")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    cfg = dict(TINY_CONFIG, num_hidden_layers=3, num_hash_layers=1, num_nextn_predict_layers=1,
               layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"])
    random_checkpoint(cfg, str(folder), seed=8)
    return jdeep.load(folder, mtp=True)


def _tokens():
    rng = np.random.default_rng(0)
    period = rng.integers(1, 512, 7)
    # rows of a repeating 7-token pattern from random offsets, longer than the window (16) and past compression
    tokens = np.stack([np.roll(np.tile(period, 10), -k)[:48] for k in rng.integers(0, 7, 4)]).astype(np.int32)
    return tokens, np.ones((4, 47), bool)


def test_a_few_steps_lower_every_objective(model):
    tokens, mask = _tokens()
    train, fixed = split_trainable(model.params)
    train = jax.tree_util.tree_map(lambda a: a.copy(), train)     # the step donates them
    optimizer = optax.adam(3e-3)
    opt_state = optimizer.init(train)
    step = make_train_step(model.config, model.plan, optimizer)
    first = float(jax.jit(functools.partial(lm_loss, config=model.config, plan=model.plan))(model.params, tokens, mask))
    history = []
    for _ in range(12):
        train, opt_state, losses = step(train, fixed, opt_state, tokens, mask)
        history.append({k: float(v) for k, v in losses.items()})
    assert all(np.isfinite(list(h.values())).all() for h in history)
    assert history[0]["lm"] == pytest.approx(first, rel=1e-5)
    assert history[0]["total"] == pytest.approx(history[0]["lm"] + 0.3 * history[0]["mtp"] + history[0]["index_kl"],
                                                rel=1e-6)
    for name in ("lm", "mtp", "index_kl"):
        assert history[-1][name] < 0.6 * history[0][name], (name, [h[name] for h in history])
    params = merge(train, fixed)
    for a, b in zip(jax.tree_util.tree_leaves(fixed), jax.tree_util.tree_leaves(split_trainable(params)[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(np.issubdtype(np.asarray(x).dtype, np.integer) for x in jax.tree_util.tree_leaves(fixed))


def test_the_indexer_learns_from_its_objective_only(model):
    tokens, mask = _tokens()
    train, fixed = split_trainable(model.params)

    @jax.jit
    def all_grads(train):
        def loss(t, name):
            return train_losses(merge(t, fixed), tokens, mask, config=model.config, plan=model.plan)[name]
        return {name: jax.grad(loss)(train, name) for name in ("lm", "index_kl", "mtp")}

    grads = all_grads(train)

    def by_part(g):
        out = {"indexer": 0.0, "rest": 0.0}
        for path, leaf in jax.tree_util.tree_flatten_with_path(g)[0]:
            part = "indexer" if any(getattr(k, "key", None) == "indexer" for k in path) else "rest"
            out[part] += float(np.abs(np.asarray(leaf)).sum())
        return out

    lm, kl, mtp = by_part(grads["lm"]), by_part(grads["index_kl"]), by_part(grads["mtp"])
    assert lm["indexer"] == 0 and mtp["indexer"] == 0 and kl["rest"] == 0
    assert kl["indexer"] > 0 and lm["rest"] > 0 and mtp["rest"] > 0
