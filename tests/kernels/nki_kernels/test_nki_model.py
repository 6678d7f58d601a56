"""The model on the neuron path, every hot op an NKI kernel, equals the jnp path: the goldens' quantized checkpoints
(fp4 experts, fp8 projections, trn2 codes) run a prefill chunk and two decode steps through model_step with the
dispatch answering as on Neuron and each kernel executed on the host by the NKI emulation (`nki.host_execution`), and
through the CPU references; the logits agree at every step.

The numerics are the ones a Neuron deployment runs: DeepSeek's (activation fp8 act-quant, KV and indexer QAT) with
float32 activations. Both paths compute the same values in another fp32 order (per-tile and per-block partial sums,
reciprocals for divisions); the logits agree to 2e-5 of the row's max |logit| (measured: at most 3.5e-7 over the two
goldens' three steps, the quantisation grids absorbing most last-bit differences). A last-bit difference can flip an
fp8/fp4 rounding, which moves a logit by far more: if this test fails by a wide margin, check for such a flip (the
kernels' quantized paths are bounded one by one in test_nki_moe.py and test_nki_indexer.py) before suspecting a
kernel.

The emulation's model of the Scalar Engine's approximate activations is switched off here (ACTIVATION_REL_ERROR = 0;
every other hardware rule of the emulation stays on: the subset check, the LNC=2 launches, fp32 PSUM, 32-bit lanes,
capacity). With it on, the logits move by a few percent of the row maximum (measured on v4-tiny-q: 3-4 %), and
not because a kernel is wrong: these random-weight quantized models are chaotic (a single fp32 ulp of activation
error alone moved a decode step's logits by 1.4 %: it flips an fp8 act-quant rounding). What this test checks is
that every kernel composes with the layers exactly; each kernel's activation term is bounded in its own test."""

from __future__ import annotations

import functools

import jax
import nki
import numpy as np
import pytest
from conftest import golden_path

import jdeep
from jdeep.kernels import nki as nki_kernels
from jdeep.kernels import registry
from jdeep.model import model_step

pytestmark = pytest.mark.skipif(not getattr(nki, "EMULATED", False), reason="host execution is the emulation's")


def _steps(model, toks: np.ndarray, pos: np.ndarray) -> list[np.ndarray]:
    """Logits of a prefill chunk (all positions) and of two decode steps feeding the argmax back, with a fresh jit
    (the model's cached programs are not touched)."""
    step = jax.jit(functools.partial(model_step, config=model.config, plan=model.plan, numerics=model.numerics,
                                     all_logits=True))
    state = model.init_state(1, 64)
    history = model.new_history(1)
    out = []
    for _ in range(3):
        logits, state = step(model.params, state, toks, pos, model.engram_inputs(history, toks, pos))[:2]
        logits = np.asarray(logits)[0]
        T = int((pos[0] >= 0).sum())
        out.append(logits[:T])
        nxt = int(np.argmax(logits[T - 1]))
        toks, pos = np.array([[nxt]], np.int32), np.array([[int(pos[0, T - 1]) + 1]], np.int32)
    return out


@pytest.mark.parametrize("golden", [pytest.param("v4-tiny-q", marks=pytest.mark.full), "v41-tiny-q"])
def test_neuron_path_with_emulated_kernels_equals_the_references(monkeypatch, golden):
    """v4-tiny-q is in the full tier: traced on the neuron path, both goldens' scan-mode prefill and decode steps call
    the same 13 kernels (sparse_attention, sparse_attention_shared, index_scores, topk, expert_gate_up, expert_down,
    fp8_linear, rmsnorm, hc_mix_logits, hc_sinkhorn, hc_collapse, hc_expand, softmax_pool), and v41-tiny-q's layers
    (KV sources, shared top-k, candidate blocks, Engram) are the richer composition.

    Full tier: tests/kernels/nki_kernels/test_nki_model.py::test_neuron_path_with_emulated_kernels_equals_the_references[v41-tiny-q]
    covers model_step's neuron dispatch of every model kernel under nki.host_execution in the default run."""
    model = jdeep.load(golden_path(golden), dtype="float32", fp8_max=240.0, compile_mode="scan", weights="codes")
    assert model.numerics.quantize_activations and model.numerics.trn2_weights
    prompt = np.load(golden_path(golden) / "reference.npz")["prompt_0"][:12]
    toks = np.zeros((1, 16), np.int32)
    pos = np.full((1, 16), -1, np.int32)
    toks[0, :len(prompt)], pos[0, :len(prompt)] = prompt, np.arange(len(prompt))
    want = _steps(model, toks, pos)

    nki_kernels.register_all()
    monkeypatch.setattr(registry, "_backend", lambda: "neuron")
    monkeypatch.setattr(nki.isa, "ACTIVATION_REL_ERROR", 0.0)
    nki.RECORDED.clear()
    with nki.host_execution():
        got = _steps(model, toks, pos)
    names = {r["kernel"] for r in nki.RECORDED}
    assert {"sparse_attention_kernel", "index_scores_kernel", "topk_kernel", "expert_gate_up_kernel",
            "fp8_linear_kernel", "hc_mix_logits_kernel", "softmax_pool_kernel"} <= names
    for g, w in zip(got, want):
        assert g.shape == w.shape
        scale = np.abs(w).max(axis=-1, keepdims=True)
        assert (np.abs(g - w) <= 2e-5 * scale).all(), float(np.max(np.abs(g - w) / scale))
