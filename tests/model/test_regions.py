"""The regions compile mode (and the host-resident embedding) compute what the scan mode computes, on the
goldens through the real loader, and its compiled set does not grow with depth."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import golden_path

import jdeep
from jdeep.config import ModelConfig
from jdeep.model.regions import n_compiled
from jdeep.config.small_models import TINY_CONFIG, deep_tiny_config
from jdeep.tools.testing.random_weights import random_checkpoint

TOL = 1e-5


def _prompt(path, length: int) -> list[int]:
    ref = np.load(path / "reference.npz")
    ids = [int(t) for t in ref["prompt_0"]] if "prompt_0" in ref.files else []
    vocab = ModelConfig.from_file(path).vocab_size
    rng = np.random.default_rng(0)
    return (ids + rng.integers(0, vocab, length).tolist())[:length]


def _run(model, ids: list[int], n_decode: int):
    """A prefill step (logits at every position) and n_decode greedy decode steps through model.step_fn:
    (prefill logits [T, V], decode logits [n_decode, V], greedy tokens [n_decode + 1])."""
    import jax.numpy as jnp

    T, S = len(ids), 64
    state = model.init_state(1, 128)
    toks = np.zeros((1, S), np.int32)
    pos = np.full((1, S), -1, np.int32)
    toks[0, :T], pos[0, :T] = ids, np.arange(T)
    history = model.new_history(1)
    logits, state = model.step_fn(all_logits=True)(model.params, state, jnp.asarray(toks), jnp.asarray(pos),
                                                   model.engram_inputs(history, toks, pos))
    prefill = np.asarray(logits[0, :T])
    greedy, decoded = [int(np.argmax(prefill[-1]))], []
    step = model.step_fn(all_logits=False)
    for i in range(n_decode):
        tok, p = np.array([[greedy[-1]]], np.int32), np.array([[T + i]], np.int32)
        logits, state = step(model.params, state, jnp.asarray(tok), jnp.asarray(p), model.engram_inputs(history, tok, p))
        decoded.append(np.asarray(logits[0]))
        greedy.append(int(np.argmax(decoded[-1])))
    return prefill, np.stack(decoded), greedy


@pytest.mark.parametrize("name", ["v4-tiny-hf", pytest.param("v4-tiny-q", marks=pytest.mark.full), "v41-tiny-q"])
def test_regions_equal_scan_on_golden(name):
    """Regions and scan mode on each golden: the same prefill and decode logits (to 1e-5) and greedy tokens. v4-tiny-hf
    and v41-tiny-q both stay in the default run because their region programs differ: V4's attention kinds (sliding,
    ratio-4 CSA with indexer, ratio-16 HCA) against V4.1's (KV-source rows of shared caches, Engram rows, the embed
    program's first pre-mix and the FFN's delayed pre-mix). v4-tiny-q is in the full tier.

    Full tier: tests/model/test_regions.py::test_regions_equal_scan_on_golden[v4-tiny-hf] covers the V4 layer kinds'
    region programs and [v41-tiny-q] the quantized weights and DeepSeek numerics in the regions mode, in the default
    run."""
    path = golden_path(name)
    scan = jdeep.load(path, compile_mode="scan")
    regions = jdeep.load(path, compile_mode="regions")
    assert (scan.compile_mode, regions.compile_mode) == ("scan", "regions") and regions.host_loop
    ids = _prompt(path, 40)
    pa, da, ga = _run(scan, ids, 3)
    pb, db, gb = _run(regions, ids, 3)
    np.testing.assert_allclose(pb, pa, atol=TOL, rtol=0)
    np.testing.assert_allclose(db, da, atol=TOL, rtol=0)
    assert gb == ga


def test_host_embedding_equal_device_embedding():
    """Prefill and greedy decode steps with the embedding gathered on the host equal the device lookup (the
    device model's programs are those of the v4-tiny-hf test above)."""
    path = golden_path("v4-tiny-hf")
    device = jdeep.load(path)
    host = jdeep.load(path, host_embedding=True)
    assert "embed" not in host.params and host.host_embed.shape == (device.config.vocab_size, device.config.dim)
    assert host.host_loop and not device.host_loop
    ids = _prompt(path, 40)
    for a, b in zip(_run(device, ids, 3), _run(host, ids, 3)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_regions_compiled_set_independent_of_depth(tmp_path):
    counts = []
    for n_repeats, folder in ((1, tmp_path / "small"), (7, tmp_path / "deep")):
        random_checkpoint(deep_tiny_config(n_repeats), str(folder), seed=1)
        model = jdeep.load(folder, compile_mode="regions")
        before = n_compiled(model.config, model.numerics)
        jdeep.generate(model, [[1, 2, 3, 4, 5], [6, 7]], max_new_tokens=3, ignore_eos=True)
        counts.append((model.config.n_layers, n_compiled(model.config, model.numerics) - before))
    (small_layers, small), (deep_layers, deep) = counts
    assert deep_layers == 4 * small_layers
    assert small == deep, counts
    # embed + head + 4 attention kinds + 2 MoE kinds, each for a prefill and a decode shape
    assert small == 2 * (2 + 4 + 2), counts


_SPLIT_SAMPLER = """
import dataclasses, sys
import jax, jdeep
from jdeep import SamplingParams
from jdeep import Engine

assert len(jax.devices()) == 2
model = jdeep.load(sys.argv[1], compile_mode="regions")
split = dataclasses.replace(model, sampler_device=jax.devices()[1])
assert model.sampler_device is None and split.host_loop
prompts = [[1, 2, 3, 4, 5], [7, 8]]
sp = [SamplingParams(temperature=0.8, seed=3, max_new_tokens=4), SamplingParams(max_new_tokens=4)]
a = jdeep.generate(model, prompts, sampling=sp)
b = jdeep.generate(split, prompts, sampling=sp)
assert (a.tokens == b.tokens).all(), (a.tokens, b.tokens)
engine = Engine(split, max_num_seqs=4, max_len=64)   # 2 requests: the bucket of the first 2 slots
ids = [engine.add_request(p, s) for p, s in zip(prompts, sp)]
outs = engine.run()
assert [list(outs[i].tokens) for i in ids] == [a.tokens[k, :a.lengths[k]].tolist() for k in range(2)]
assert set(engine.steps_per_bucket) == {2}, engine.steps_per_bucket
print("same tokens")
"""


def test_sampler_on_another_device(tmp_path):
    """On Neuron the sampler runs on the host CPU backend (Model.sampler_device). With two CPU devices the same
    plumbing runs the model on one and the sampler on the other: generate and the engine give the tokens of a
    single-device run. (This is also the test of the engine in the regions mode: its batch-size buckets step
    through region programs.)"""
    import os
    import subprocess
    import sys

    raw = dict(TINY_CONFIG, layer_types=["sliding_attention", "compressed_sparse_attention"], num_hidden_layers=2,
               num_hash_layers=1)
    random_checkpoint(raw, str(tmp_path), seed=2)
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", _SPLIT_SAMPLER, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0 and "same tokens" in run.stdout, run.stderr[-3000:]
