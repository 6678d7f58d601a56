"""On the neuron path the hot ops lower to NKI custom calls: the model step of a quantized one-layer model, traced
with the dispatch answering as on Neuron and `nki.jit` standing in for the real lowering (tests/nki_emulation:
it emits NKI's custom call and records it; nothing is run), contains one `AwsNeuronCustomNativeKernel` call per
RMSNorm and per fp8 projection, with the uint8 codes passed to it undecoded; the same step traced for CPU has
none. (With the real `nki` package this needs its JAX lowering, so it only runs under the emulation.)"""

from __future__ import annotations

import functools
import re

import jax
import numpy as np
import pytest

import jdeep
import nki
from jdeep import kernels, model as jmodel
from jdeep.kernels import nki as nki_kernels
from jdeep.random_weights import one_layer_config, random_checkpoint

pytestmark = pytest.mark.skipif(not getattr(nki, "EMULATED", False), reason="the recording stand-in is the emulation's")

QUANT = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [32, 32],
         "expert_dtype": "fp4"}


def _lower(model) -> str:
    """The scan-mode step, jitted afresh (its own trace cache: the model's cached step program is not touched)."""
    step = jax.jit(functools.partial(jmodel.model_step, config=model.config, plan=model.plan, numerics=model.numerics,
                                     all_logits=False))
    state = model.init_state(1, 256)
    toks, pos = np.zeros((1, 16), np.int32), np.arange(16, dtype=np.int32)[None]
    return step.lower(model.params, state, toks, pos).as_text()


def test_neuron_dispatch_lowers_norms_and_fp8_gemms_to_nki_custom_calls(tmp_path, monkeypatch):
    random_checkpoint(one_layer_config(head_dim=128, qk_rope_head_dim=64, index_head_dim=64, quantization_config=QUANT),
                      str(tmp_path), seed=2)
    model = jdeep.load(tmp_path, dtype="bfloat16", fp8_max=240.0, compile_mode="scan")
    assert model.numerics.trn2_weights
    nki_kernels.register_all()
    monkeypatch.setattr(kernels, "_backend", lambda: "neuron")
    nki.RECORDED.clear()
    neuron = _lower(model)
    monkeypatch.undo()
    cpu = _lower(model)                      # after it: no neuron trace leaks into later programs
    assert nki.CUSTOM_CALL_TARGET not in cpu and "custom_call" not in cpu
    calls = re.findall(r'custom_call @AwsNeuronCustomNativeKernel\(([^)]*)\)', neuron)
    names = [r["kernel"] for r in nki.RECORDED]
    assert len(calls) == len(names) > 0
    assert {"rmsnorm_kernel", "fp8_linear_kernel"} <= set(names)
    gemms = [r for r in nki.RECORDED if r["kernel"] == "fp8_linear_kernel"]
    assert all(r["inputs"][1][1] == "uint8" and r["inputs"][2][1] == "uint8" for r in gemms)   # codes, scales as is
    assert all(r["inputs"][0][1] == "bfloat16" for r in gemms)
    # every quantized dense projection of the layer is one of them: as many as the fp8 weights outside the MoE
    # (whose experts, shared one included, go through the MoE ops)
    fp8_weights = [p for p in jax.tree_util.tree_leaves_with_path(model.params)
                   if "codes" in jax.tree_util.keystr(p[0]) and "['ffn']" not in jax.tree_util.keystr(p[0])]
    assert len(gemms) == len(fp8_weights), (len(gemms), [jax.tree_util.keystr(p[0]) for p in fp8_weights])
