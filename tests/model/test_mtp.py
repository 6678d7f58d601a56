"""DeepSeek-V4's MTP blocks (model-spec.md §4.7): the plan and param tree hold them only when asked, the golden
quantized checkpoint's `mtp.0.*` tensors load, the backbone is unchanged by them, and one MTP step equals a float64
numpy oracle of its input combination (enorm/e_proj on the next token's embedding + hnorm/h_proj on the streams)
and of its head (own hc_head mixer and norm, the backbone's vocabulary head) around jdeep's block."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import golden_path

import jdeep
from jdeep.config import ModelConfig
from jdeep.arenas import split_experts
from jdeep.layers.block import Streams, block
from jdeep.layers.chunk import make_chunk
from jdeep.layers.rope import inv_freq
from jdeep.model.mtp import empty_mtp_state, mtp_step
from jdeep.numerics import Numerics
from jdeep.param_spec import leaf_plan
from jdeep.plan import build_plan
from jdeep.config.presets import preset
from jdeep.config.small_models import TINY_CONFIG
from jdeep.tools.testing.random_weights import random_checkpoint

CFG = dict(TINY_CONFIG, num_hidden_layers=2, num_hash_layers=1, num_nextn_predict_layers=1,
           layer_types=["sliding_attention", "compressed_sparse_attention"])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mtp")
    random_checkpoint(CFG, str(folder), seed=3)
    return jdeep.load(folder, mtp=True)


def test_plan_and_tree(model):
    config, plan = model.config, model.plan
    assert build_plan(config).mtp is None and plan.segments == build_plan(config).segments
    assert plan.mtp.first_layer == config.n_layers and plan.mtp.reps == 1
    kind = plan.mtp.pattern[0]
    assert kind.attn.ratio == 0 and not kind.hash_moe
    for key, (shape, _) in leaf_plan(config, plan).items():
        if key[0] == "drafter":
            leaf = model.params["drafter"]
            for k in key[1:]:
                leaf = leaf[k]
            assert leaf.shape == shape, key
    assert model.params["drafter"]["e_proj"].shape == (1, config.dim, config.dim)
    assert "bias" in model.params["drafter"]["ffn"]["gate"] and "tid2eid" not in model.params["drafter"]["ffn"]["gate"]


def test_models_without_mtp_blocks_say_so_and_v41_plans_its_dspark_stages():
    with pytest.raises(ValueError, match="no MTP block"):
        build_plan(ModelConfig.from_dict(dict(CFG, num_nextn_predict_layers=0)), mtp=True)
    assert build_plan(preset("v41-flash"), mtp=True).dspark.reps == 3      # V4.1 drafts with its DSpark stages


def test_golden_checkpoint_loads_its_mtp_block_and_the_backbone_is_unchanged():
    folder = golden_path("v4-tiny-q")
    with_mtp, without = jdeep.load(folder, mtp=True, weights="codes"), jdeep.load(folder, weights="codes")
    e_proj = with_mtp.params["drafter"]["e_proj"]
    assert e_proj["codes"].dtype == np.uint8 and e_proj["scale"].dtype == np.uint8
    assert with_mtp.params["drafter"]["ffn"]["w1"]["packed"].dtype == np.uint8          # fp4 routed experts
    assert "drafter" not in without.params
    prompt = [0, 5, 9, 17, 33, 65, 12, 7]
    np.testing.assert_array_equal(jdeep.forward(with_mtp, prompt), jdeep.forward(without, prompt))


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def test_mtp_step_matches_numpy_wiring(model):
    config, plan = model.config, model.plan
    n, d, eps, B, S = config.hc_mult, config.dim, config.norm_eps, 2, 6
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(B, S, n, d)).astype(np.float32)
    next_tokens = rng.integers(0, config.vocab_size, (B, S)).astype(np.int32)
    positions = np.tile(np.arange(S, dtype=np.int32), (B, 1))
    f64 = {k: np.asarray(v, np.float64) for k, v in model.params["drafter"].items() if not isinstance(v, dict)}
    p = {k: v[0] for k, v in f64.items()}
    embed, head = np.asarray(model.params["embed"], np.float64), np.asarray(model.params["head"], np.float64)

    e = _rms(embed[next_tokens], p["enorm"], eps)
    x_in = (e @ p["e_proj"].T)[:, :, None, :] + _rms(hidden.astype(np.float64), p["hnorm"], eps) @ p["h_proj"].T
    per_layer, experts = split_experts(model.params["drafter"])
    kind = plan.mtp.pattern[0]
    streams, _, _ = block(_first(per_layer), experts,
                          empty_mtp_state(config, plan, B, S, jnp.float32), {}, jnp.int32(0), None,
                          Streams(jnp.asarray(x_in, jnp.float32)), None, make_chunk(next_tokens, positions, config.vocab_size),
                          config=config, numerics=Numerics(), kind=kind,
                          freqs=inv_freq(config.rope_for(kind.attn), config.rope_head_dim))
    X = np.asarray(streams.X, np.float64)
    flat = X.reshape(B, S, n * d)
    mu = (flat @ p["hc_head_fn"].T) / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + eps)
    pre = 1 / (1 + np.exp(-(mu * p["hc_head_scale"][0] + p["hc_head_base"]))) + config.hc_eps
    expected = _rms(np.einsum("bsn,bsnd->bsd", pre, X), p["norm"], eps) @ head

    logits, out, state = mtp_step(model.params, empty_mtp_state(config, plan, B, S, jnp.float32), jnp.asarray(hidden),
                                  next_tokens, positions, config=config, plan=plan)
    np.testing.assert_allclose(np.asarray(logits), expected, rtol=2e-4, atol=2e-4 * np.abs(expected).max())
    assert out.shape == (B, S, n, d)
    assert np.asarray(state["window"][0, :, :S]).any()          # the block's window took the chunk's K=V
    last, _, _ = mtp_step(model.params, empty_mtp_state(config, plan, B, S, jnp.float32), jnp.asarray(hidden),
                          next_tokens, positions, config=config, plan=plan, all_logits=False)
    np.testing.assert_allclose(np.asarray(last), np.asarray(logits)[:, -1], rtol=1e-6, atol=1e-6)


def _first(tree):
    """Depth 0 of a stacked MTP tree."""
    if isinstance(tree, dict):
        return {k: _first(v) for k, v in tree.items()}
    return tree[0]
