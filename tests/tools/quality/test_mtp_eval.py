"""The MTP accuracy of `jdeep eval --mtp` and the demo model card: per window, MTP's top-1 for token t+2 and the
backbone's top-1 at t and t+1, counted against the text — here recomputed from the backbone's recorded streams
(model_step's layer-by-layer output), the engine's no-cache forward and a direct MTP step."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdeep
from jdeep.model.mtp import empty_mtp_state, mtp_step
from jdeep.model.scan import model_step
from jdeep.config.small_models import TINY_CONFIG
from jdeep.state import empty_state
from jdeep.tools.quality.mtp_eval import mtp_accuracy
from jdeep.tools.testing.random_weights import random_checkpoint

CFG = dict(TINY_CONFIG, num_hidden_layers=2, num_hash_layers=1, num_nextn_predict_layers=1,
           layer_types=["sliding_attention", "compressed_sparse_attention"])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mtp-eval")
    random_checkpoint(CFG, str(folder), seed=4)
    return folder


@functools.partial(jax.jit, static_argnames=("config", "plan"))
def _mtp_logits(params, tokens, positions, nxt, pos, *, config, plan):
    """MTP logits [1, T, V] from the backbone's last recorded block output (model_step's layer-by-layer streams)."""
    T = tokens.shape[1]
    rec = model_step(params, empty_state(config, plan, 1, T, jnp.float32), tokens, positions, config=config,
                     plan=plan, all_logits=True, streams=True).streams
    logits, _, _ = mtp_step(params, empty_mtp_state(config, plan, 1, T, jnp.float32), rec["block_out"][-1], nxt, pos,
                            config=config, plan=plan)
    return logits


def _counts(model, w):
    """(MTP hits vs the text, MTP = backbone top-1 at t+1, backbone hits) of one window run from position 0."""
    T = len(w)
    tokens, positions = jnp.asarray(w[None]), jnp.arange(T, dtype=jnp.int32)[None]
    main = np.argmax(jdeep.forward(model, w), -1)
    nxt = np.zeros((1, T), np.int32)
    nxt[0, :-1] = w[1:]
    pos = np.where(np.arange(T) < T - 1, np.arange(T), -1).astype(np.int32)[None]
    logits = _mtp_logits(model.params, tokens, positions, nxt, pos, config=model.config, plan=model.plan)
    mtp = np.argmax(np.asarray(logits)[0], -1)
    return (int(np.sum(mtp[:T - 2] == w[2:])), int(np.sum(mtp[:T - 2] == main[1:T - 1])),
            int(np.sum(main[:T - 2] == w[1:T - 1])))


def test_accuracy_equals_a_direct_count(folder):
    model = jdeep.load(folder, mtp=True)
    rng = np.random.default_rng(1)
    texts = [rng.integers(0, 512, 45).astype(np.int32), rng.integers(0, 512, 12).astype(np.int32)]
    context = 20
    got = mtp_accuracy(model, texts, context)
    windows = [t[s:s + context] for t in texts for s in range(0, len(t) - 2, context)]
    windows = [w for w in windows if len(w) >= 3]
    counts = np.sum([_counts(model, w) for w in windows], axis=0)
    n = sum(len(w) - 2 for w in windows)
    assert got["positions"] == n == 18 + 18 + 3 + 10
    assert got["mtp_top1"] == counts[0] / n and got["agreement"] == counts[1] / n and got["main_top1"] == counts[2] / n


def test_needs_the_mtp_block(folder):
    with pytest.raises(ValueError, match="drafter=True"):
        mtp_accuracy(jdeep.load(folder), [np.arange(10, dtype=np.int32)])
